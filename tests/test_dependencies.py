"""pyproject.toml declares what the package imports.

A third-party package imported at module level (anywhere but inside a function) must be one of
`dependencies`: `pip install tokenmill` alone has to give a package whose every module imports.
A package imported inside a function only (an optional feature: the `peers` benchmark, the
`transformers` reference) must be declared too, in `dependencies` or an extra. And importing every
module of the package, in a fresh interpreter, must load no package that only an extra installs.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import tokenmill

tomllib = pytest.importorskip("tomllib")   # (Python 3.11+)

PACKAGE_DIR = Path(tokenmill.__file__).parent
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# Import names of distributions an ordinary test setup does not install (so their metadata cannot
# say which names they provide).
NOT_INSTALLED_IMPORT_NAMES = {"llama_cpp": "llama-cpp-python"}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them: `Jinja2` and `jinja2`, `llama_cpp-python`..."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """(the distributions in `dependencies`, {extra: its distributions})."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    def names(reqs: list[str]) -> set[str]:
        return {normalize(Requirement(r).name) for r in reqs}
    return names(project["dependencies"]), {extra: names(reqs) for extra, reqs in
                                            project.get("optional-dependencies", {}).items()}


def third_party_imports() -> dict[str, dict[str, list[str]]]:
    """{"module level" | "in functions": {top-level import name: ["file:line", ...]}} over the
    package's source, leaving out the standard library and tokenmill itself."""
    found: dict[str, dict[str, list[str]]] = {"module level": {}, "in functions": {}}

    def visit(node: ast.AST, where: str, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            tops = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops = [node.module.split(".")[0]]
        else:
            tops = []
        for top in tops:
            if top not in sys.stdlib_module_names and top != "tokenmill":
                kind = "in functions" if in_function else "module level"
                found[kind].setdefault(top, []).append(f"{where}:{node.lineno}")
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, where, inside)

    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(PACKAGE_DIR.parent)), False)
    return found


@functools.cache
def installed_import_names() -> dict[str, list[str]]:
    """{import name: the distributions that provide it}: read once (it scans every installed
    distribution's file list, torch's included)."""
    return importlib.metadata.packages_distributions()


def distributions_of(import_name: str) -> set[str]:
    dists = installed_import_names().get(import_name)
    if dists:
        return {normalize(d) for d in dists}
    return {normalize(NOT_INSTALLED_IMPORT_NAMES[import_name])} if import_name in NOT_INSTALLED_IMPORT_NAMES else set()


def test_every_module_level_import_is_a_dependency_and_every_other_one_declared():
    dependencies, extras = declared()
    everything = dependencies.union(*extras.values())
    imports = third_party_imports()
    assert "pydantic" in imports["module level"]       # (the scan sees the package's imports at all)
    problems = []
    for kind, allowed in (("module level", dependencies), ("in functions", everything)):
        for name, places in sorted(imports[kind].items()):
            dists = distributions_of(name)
            if not dists & allowed:
                problems.append(f"{name} ({', '.join(sorted(dists)) or 'no installed distribution'}), imported "
                                f"{kind} at {', '.join(places[:3])}, is not declared in "
                                f"{'dependencies' if kind == 'module level' else 'dependencies or an extra'}")
    assert not problems, "\n".join(problems)


def test_every_module_imports_without_loading_an_extra():
    """Each module of the package imported in turn in a fresh interpreter: none fails, and no
    package only an extra installs (pytest, transformers, llama_cpp, ...) is loaded by them."""
    dependencies, extras = declared()
    extra_only = set().union(*extras.values()) - dependencies
    modules = sorted(m.name for m in pkgutil.walk_packages(tokenmill.__path__, "tokenmill.")
                     if not m.name.endswith("__main__"))   # (__main__ would run the CLI)
    assert "tokenmill.server.protocol" in modules
    script = (
        "import importlib, json, sys, traceback\n"
        "failed = {}\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed[name] = traceback.format_exc(limit=-3)\n"
        "print(json.dumps({'failed': failed, 'loaded': sorted({m.split('.')[0] for m in sys.modules})}))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert not result["failed"], "\n".join(f"{name}:\n{tb}" for name, tb in result["failed"].items())
    loaded = {name: sorted(distributions_of(name) & extra_only) for name in result["loaded"]}
    assert not {name: dists for name, dists in loaded.items() if dists}, "importing the package loads extras"
