"""Modules stay small (docs/CONTRIBUTING.md; issue 32: none over 450 lines): split one by what it holds."""

from __future__ import annotations

import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "entr_megatron"
MAX_LINES = 450


def test_no_module_is_over_the_limit():
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert len(sizes) > 100 and sizes["parallel/cpu_compat.py"] > 100  # the scan saw the package
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
