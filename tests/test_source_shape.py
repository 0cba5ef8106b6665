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
