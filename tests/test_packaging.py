"""The repository's layout never hides another distribution, and tq's own data ships.

Python puts the working directory first on sys.path for `python -m pytest` and
`python -m tq_cli...`, so a top-level package in the repository root would shadow an
installed distribution of the same name (it did: `kernels/` shadowed Hugging Face's
`kernels`, which transformers imports).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = {"tq_cli", "tq_kernels"}


def _root_module_names() -> dict[str, bool]:
    """Names importable from the repository root -> whether they are regular modules.

    A folder with __init__.py or a .py file is a regular module and wins over anything
    later on sys.path; a plain folder is only a namespace portion, which an installed
    regular package of the same name still wins over.
    """
    names: dict[str, bool] = {}
    for p in ROOT.iterdir():
        if p.is_dir() and p.name.isidentifier():
            names[p.name] = (p / "__init__.py").exists()
        elif p.suffix == ".py" and p.stem.isidentifier():
            names[p.stem] = True
    return names


def _installed_top_level() -> set[str]:
    return {name for name in importlib.metadata.packages_distributions() if name not in OWN}


def test_no_regular_package_in_root_collides_with_an_installed_distribution() -> None:
    regular = {n for n, is_regular in _root_module_names().items() if is_regular}
    assert not regular & _installed_top_level(), (
        f"repository root shadows installed modules: {sorted(regular & _installed_top_level())}")


def test_installed_names_resolve_outside_the_repository_from_its_root() -> None:
    # The behaviour itself: from the root, as `python -m pytest` runs, every installed
    # top-level name that also stands in the root resolves to the installed one.
    clashing = sorted(set(_root_module_names()) & _installed_top_level())
    code = (
        "import importlib.util, json, sys\n"
        "out = {}\n"
        "for n in sys.argv[1:]:\n"
        "    s = importlib.util.find_spec(n)\n"
        "    out[n] = [str(p) for p in (s.submodule_search_locations or [s.origin])]\n"
        "print(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", code, *clashing], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    for name, locations in json.loads(res.stdout).items():
        prefix = Path(sys.prefix).resolve()  # a venv inside the checkout is not the repo
        inside = [p for p in locations if Path(p).resolve().is_relative_to(ROOT)
                  and not Path(p).resolve().is_relative_to(prefix)]
        assert not inside, f"'{name}' resolves into the repository: {inside}"


def test_kernels_folder_is_not_a_package() -> None:
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "kernels" / "tq_kernels" / "__init__.py").exists()


def test_every_subpackage_is_discovered_for_the_wheel() -> None:
    # setuptools' own discovery, with pyproject's settings, finds every folder that
    # holds Python code under tq_cli and tq_kernels.
    from setuptools import find_packages

    found = set(find_packages(where=str(ROOT), include=["tq_cli", "tq_cli.*"]))
    found |= set(find_packages(where=str(ROOT / "kernels"), include=["tq_kernels*"]))
    on_disk = {
        ".".join(p.parent.relative_to(base).parts)
        for base, top in ((ROOT, "tq_cli"), (ROOT / "kernels", "tq_kernels"))
        for p in (base / top).rglob("*.py") if "__pycache__" not in p.parts
    }
    assert on_disk <= found, f"not packaged: {sorted(on_disk - found)}"


def test_builtin_recipes_are_package_data() -> None:
    from importlib.resources import files

    names = {p.name for p in files("tq_cli").joinpath("recipes").iterdir()}
    assert {"llama.toml", "bert.toml", "generic.toml"} <= names
