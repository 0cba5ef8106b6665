"""Every package batchgen imports is declared in pyproject.toml, so that a plain `pip install batchgen` gives a
package that works: a module-level import is a dependency; an import inside a function is a dependency or an
extra's (an optional capability, which stops with one line naming what to install). And every module imports.

The imports are read from the source (ast), so an import that only runs on some path (scipy for latency=table,
PyYAML for the calibration) is found as well as one that runs on every import."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

import batchgen

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "batchgen"


def _name(requirement: str) -> str:
    """The distribution a requirement names, normalised as PEP 503 does ("PyYAML>=5.1" -> "pyyaml")."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement.strip()).group(0)).lower()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {extra: {_name(r) for r in reqs} for extra, reqs in project.get("optional-dependencies", {}).items()}
    return {_name(r) for r in project["dependencies"]}, extras


def third_party_imports() -> dict[str, dict[str, list[str]]]:
    """{top-level import name: {"module": [where...], "function": [where...]}} for every absolute import of a
    package outside the standard library and batchgen."""
    found: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        top_level = {id(node) for node in tree.body}
        for stmt in tree.body:  # imports under a module-level `if`/`try` still run on import
            if isinstance(stmt, (ast.If, ast.Try)):
                top_level |= {id(n) for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("batchgen", "__future__"):
                    continue
                where = "module" if id(node) in top_level else "function"
                found.setdefault(top, {"module": [], "function": []})[where].append(
                    f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


IMPORTS = third_party_imports()


def distributions_of(top: str) -> set[str]:
    dists = packages_distributions().get(top)
    assert dists, f"batchgen imports {top} ({IMPORTS[top]}), which no installed distribution provides"
    return {_name(d) for d in dists}


def test_the_scan_finds_the_imports_this_test_is_about():
    """Not vacuous: the path-only imports the issue found undeclared are seen, and where."""
    assert {"torch", "numpy", "scipy", "yaml", "omegaconf", "hydra", "matplotlib"} <= set(IMPORTS)
    assert IMPORTS["scipy"]["function"] or IMPORTS["scipy"]["module"]


@pytest.mark.parametrize("top", sorted(IMPORTS))
def test_every_import_is_declared(top):
    dependencies, extras = declared()
    dists = distributions_of(top)
    where = IMPORTS[top]
    if dists & dependencies:
        return
    assert not where["module"], (f"{top} is imported when {where['module'][0]} is imported, but none of "
                                 f"{sorted(dists)} is in pyproject.toml's dependencies: add it there")
    runtime_extras = [extra for extra, names in extras.items() if extra != "test" and dists & names]
    assert runtime_extras, (f"{top} (imported at {where['function'][0]}) is neither a dependency nor in an extra "
                            f"of pyproject.toml (the test extra is for the tests): declare {sorted(dists)[0]}")


def test_a_missing_extra_is_one_line_naming_what_to_install(monkeypatch, tmp_path):
    """The gguf extra (export_gguf_to_hf): without transformers, one line that names the extra."""
    from batchgen.exec.models.upcycle import export_gguf_to_hf

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(ModuleNotFoundError) as e:
        export_gguf_to_hf(tmp_path / "model.gguf", tmp_path / "out")
    assert 'pip install "batchgen[gguf]"' in str(e.value) and "\n" not in str(e.value)


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(batchgen.__path__, "batchgen.")]
    assert len(names) > 50 and "batchgen.results.plot" in names
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every failure is listed
            failed[name] = f"{type(e).__name__}: {e}"
    assert not failed, failed
