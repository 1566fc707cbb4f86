"""The house rules that keep tq readable, checked on the source (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tq_cli"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = p
    return out


def _imports(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules() -> None:
    mods = _modules()
    # The package's __init__ re-exports the public API; importing it is not a cycle.
    graph = {m: {n for n in _imports(p) if n in mods and n != "tq_cli" and n != m}
             for m, p in mods.items()}
    assert _cycles(graph) == []


def test_the_library_never_imports_the_cli_stack() -> None:
    # Typer and Rich belong to tq_cli/commands and tq_cli/app.py only.
    offenders = {}
    for name, path in _modules().items():
        if name.startswith("tq_cli.commands") or name == "tq_cli.app":
            continue
        bad = {n for n in _imports(path) if n.split(".")[0] in ("typer", "rich")}
        if bad:
            offenders[name] = sorted(bad)
    assert offenders == {}


def test_no_reference_to_files_outside_the_repository() -> None:
    # The design lives in docs/design.md; nothing may cite a document that is not here.
    offenders = []
    for p in [*ROOT.glob("tq_cli/**/*.py"), *ROOT.glob("kernels/**/*.py"),
              *ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("scripts/*")]:
        text = p.read_text(encoding="utf-8", errors="replace")
        if "DESIGN.md" in text or "../shared" in text or "STYLE.md" in text:
            offenders.append(str(p.relative_to(ROOT)))
    assert offenders == []


def test_modules_stay_small() -> None:
    big = {str(p.relative_to(ROOT)): n for p in [*PACKAGE.rglob("*.py"),
                                                 *(ROOT / "kernels").rglob("*.py")]
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert big == {}
