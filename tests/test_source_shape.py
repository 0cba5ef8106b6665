"""The house rules a reader relies on: small modules (no source file over 500 lines), lines within 120 characters."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE = sorted((REPO / "batchgen").rglob("*.py"))
MAX_LINES, MAX_WIDTH = 500, 120


@pytest.mark.parametrize("path", SOURCE, ids=lambda p: str(p.relative_to(REPO)))
def test_source_file_is_small_and_narrow(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"{path}: {len(lines)} lines (split it along one of its jobs)"
    wide = [i + 1 for i, line in enumerate(lines) if len(line) > MAX_WIDTH]
    assert not wide, f"{path}: lines {wide} are wider than {MAX_WIDTH} characters"


def test_the_package_was_found():
    assert len(SOURCE) > 100


def _unit(module: str) -> str:
    """The part of the architecture a module belongs to: its subpackage of batchgen, or itself at the top."""
    return ".".join(module.split(".")[:2])


def _imports_between_units() -> dict[str, set[str]]:
    """{unit: units it imports}, counting every import of a batchgen module, in a function or not."""
    import ast

    graph: dict[str, set[str]] = {}
    for path in SOURCE:
        parts = path.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                if name.startswith("batchgen.") and _unit(name) != _unit(module):
                    graph.setdefault(_unit(module), set()).add(_unit(name))
    return graph


def test_no_import_cycle_between_the_packages_even_through_function_level_imports():
    """A function-level import can hide a cycle that a module-level one would fail on: each subpackage (or top-level
    module) of batchgen imports only ones below it."""
    graph = _imports_between_units()
    assert "batchgen.engine" in graph and "batchgen.core" in graph["batchgen.engine"]  # the walk found imports
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        path = path + [unit]
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path)
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [])
