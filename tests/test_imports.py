"""The import graph: arrows point one way. quant/ imports nothing of ours, nothing imports the two
command lines (engine.py, bench.py), and no files import each other in a circle.

The graph is read from the source (every import statement, including those inside functions), so
a lazy import cannot hide an arrow; a fresh interpreter checks the same for quant/ at run time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = {"engine", "bench"}


def our_modules() -> dict[str, Path]:
    """Module name -> file, for the project's top-level files and packages (folders with an
    __init__.py, all the way down), tests/ aside."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        folders = [ROOT.joinpath(*rel.parts[:i]) for i in range(1, len(rel.parts))]
        if rel.parts[0] == "tests" or not all((f / "__init__.py").is_file() for f in folders):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([*anchor, *([base] if base else [])])
            # `from P import x` imports P, and P.x where x is a module
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # the longest prefix of the dotted name that is one of our modules
            parts = target.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n])
                if candidate in modules:
                    if candidate != name:
                        found.add(candidate)
                    break
    return found


def graph() -> dict[str, set[str]]:
    modules = our_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_graph_reads_real_imports():
    """The reader itself: arrows known to exist are found (so the checks below can fail)."""
    g = graph()
    assert "kvcache.cache" in g["llm"] or "kvcache" in g["llm"]
    assert "kernels" in g["model"] and "quant" in g["kernels.reference"]
    assert "kernels.reference" in g["kernels.attention"]  # a relative import
    assert "quant.layout" in g["quant.base"]


def test_quant_imports_nothing_of_ours():
    g = graph()
    outside = {m: sorted(t for t in deps if t.split(".")[0] != "quant") for m, deps in g.items() if m.split(".")[0] == "quant"}
    assert not any(outside.values()), outside
    # and at run time: importing every preset loads no other module of the project
    code = ("import sys, quant; quant.get_format('kvmix'); "
            f"ours = {sorted({m.split('.')[0] for m in g})!r}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ours and m.split('.')[0] != 'quant'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_nothing_imports_the_command_lines():
    g = graph()
    importers = {m: sorted(deps & ENTRY_POINTS) for m, deps in g.items() if deps & ENTRY_POINTS}
    assert not importers, importers


def test_no_import_circles():
    """Depth-first search for a back edge; a package counts as the files it imports (its
    __init__), so a submodule that imports its own package closes a circle too."""
    g = graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(g[m]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        path.pop()
        state[m] = 2
        return None

    for module in sorted(g):
        if module not in state:
            circle = visit(module)
            assert circle is None, " -> ".join(circle)
