"""The house rules that keep tq readable, checked on the source (docs/design.md, "The
rules"): packages by workflow whose imports run one way, no cycles (through the package
faces too), the CLI stack out of the library, and small modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tq_cli"

# Modules every part of the library may import; they import only each other.
FOUNDATION = {"tq_cli.errors", "tq_cli.version", "tq_cli._lazy", "tq_cli.device",
              "tq_cli.parallel"}
# Top-level modules besides the foundation: the face, the CLI and the demo's model.
TOP = {"tq_cli.__main__", "tq_cli.app", "tq_cli.demo_model"}
# What each package may import besides itself and the foundation: commands -> workflows
# -> runtime / planning -> io -> quant (the math) -> tq_kernels.
ALLOWED: dict[str, set[str]] = {
    "quant": set(),
    "io": {"quant"},
    "planning": {"runtime", "io", "quant"},
    "kvcache": {"quant"},
    "runtime": {"io", "quant", "kvcache"},
    "vllm_plugin": {"runtime", "io", "quant"},
    "calibration": {"planning", "runtime", "io", "quant"},
    "seedsearch": {"planning", "io", "quant"},
    "conversion": {"calibration", "planning", "runtime", "io", "quant"},
    "evaluation": {"conversion", "calibration", "runtime", "kvcache", "planning", "io",
                   "quant"},
    "bench": {"conversion", "evaluation", "runtime", "kvcache", "planning", "io", "quant"},
    "demo_model": set(),
    **{m.split(".")[1]: set() for m in FOUNDATION},
}
# The packages that call the kernels (tq_kernels itself never imports tq_cli).
KERNEL_USERS = {"quant", "io", "kvcache", "runtime", "vllm_plugin", "bench"}
# The lazy API functions of the package face: a subpackage named like one would hide it.
API = {"convert", "load", "quantize", "dequantize", "kv_cache"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = p
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Every module a file imports, lazy imports included: import statements (relative
    ones resolved), `importlib.import_module("...")` and the tables of `lazy_face`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
                node.func, "id", "")
            args = node.args
            if fn == "import_module" and args and isinstance(args[0], ast.Constant):
                names.add(str(args[0].value))
            elif fn.endswith("lazy_face") and len(args) == 2 and isinstance(args[1], ast.Dict):
                names.update(f"{package}.{v.value}" for v in args[1].values
                             if isinstance(v, ast.Constant))
    return names


def _graph() -> dict[str, set[str]]:
    """Module -> the tq_cli modules it imports, the package faces included."""
    mods = _modules()
    return {m: {n for n in _imports(p, m) if n in mods and n != m} for m, p in mods.items()}


def _package(module: str) -> str:
    """The first-level part of tq_cli a module belongs to ('' for the package face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


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


def test_no_import_cycles_even_through_the_package_faces() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_check_sees_a_cycle_through_a_face() -> None:
    graph = {"tq_cli": {"tq_cli.quant.grouped"}, "tq_cli.quant.grouped": {"tq_cli"}}
    assert _cycles(graph) == [["tq_cli", "tq_cli.quant.grouped"]]


def test_imports_run_one_way_between_packages() -> None:
    offenders = []
    for module, deps in _graph().items():
        pkg = _package(module)
        if pkg not in ALLOWED:
            continue  # the face, the CLI (app, commands), the foundation, demo_model
        for dep in deps:
            target = _package(dep)
            if dep in FOUNDATION or target == pkg or target in ALLOWED[pkg]:
                continue
            offenders.append(f"{module} -> {dep}")
    assert offenders == []


def test_only_the_kernel_users_import_tq_kernels() -> None:
    offenders = sorted(m for m, p in _modules().items()
                       if _package(m) in ALLOWED and _package(m) not in KERNEL_USERS
                       and any(n.split(".")[0] == "tq_kernels" for n in _imports(p, m)))
    assert offenders == []
    kernels = ROOT / "kernels" / "tq_kernels"
    assert [p.name for p in kernels.rglob("*.py")
            if any(n.split(".")[0] == "tq_cli" for n in _imports(p, "tq_kernels.x"))] == []


def test_the_import_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from ..conversion import flags\nfrom . import codebook\n"
                   "import importlib\nimportlib.import_module('tq_cli.bench.kv')\n"
                   "lazy_face(__name__, {'Plan': 'plan'})\n")
    assert _imports(src, "tq_cli.quant.m") >= {
        "tq_cli.conversion.flags", "tq_cli.quant.codebook", "tq_cli.bench.kv",
        "tq_cli.quant.plan"}


def test_the_library_imports_no_package_face() -> None:
    # Faces are for users; a module that imports one depends on everything it names.
    faces = {m for m, p in _modules().items() if p.name == "__init__.py"}
    offenders = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps if d in faces
                 and not m.startswith(("tq_cli.commands", "tq_cli.app"))
                 and _modules()[m].name != "__init__.py"]
    assert offenders == []


def test_every_module_belongs_to_a_package_or_the_short_top_level_list() -> None:
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    top = {m for m in _modules() if m.count(".") == 1 and _package(m) not in packages}
    assert top == FOUNDATION | TOP


def test_no_subpackage_is_named_like_a_lazy_api_function() -> None:
    subpackages = {p.parent.name for p in PACKAGE.rglob("__init__.py")}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert (subpackages | modules) & API == set()


def test_the_library_never_imports_the_cli_stack() -> None:
    # Typer and Rich belong to tq_cli/commands and tq_cli/app.py only.
    offenders = {}
    for name, path in _modules().items():
        if name.startswith("tq_cli.commands") or name == "tq_cli.app":
            continue
        bad = {n for n in _imports(path, name) if n.split(".")[0] in ("typer", "rich")}
        if bad:
            offenders[name] = sorted(bad)
    assert offenders == {}


def test_no_reference_to_files_outside_the_repository() -> None:
    # The design lives in docs/design.md; nothing may cite a document that is not here.
    offenders = []
    for p in [*ROOT.glob("tq_cli/**/*.py"), *ROOT.glob("kernels/**/*.py"),
              *ROOT.glob("tests/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md",
              *ROOT.glob("scripts/*")]:
        if p == Path(__file__):
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        if any(s in text for s in ("DESIGN.md", "../shared", "STYLE.md", "MODELS.md")):
            offenders.append(str(p.relative_to(ROOT)))
    assert offenders == []


def test_modules_stay_small() -> None:
    big = {str(p.relative_to(ROOT)): n for p in [*PACKAGE.rglob("*.py"),
                                                 *(ROOT / "kernels").rglob("*.py")]
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert big == {}


def test_every_name_a_package_face_offers_resolves() -> None:
    import importlib

    for p in sorted(PACKAGE.rglob("__init__.py")):
        name = ".".join(p.relative_to(ROOT).parent.parts)
        face = importlib.import_module(name)
        for attr in getattr(face, "__all__", []):
            assert getattr(face, attr) is not None, f"{name}.{attr}"
