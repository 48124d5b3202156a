"""tools/paired_differences.py and tools/countdown_tables.py on the committed countdown reports
(docs/studies/countdown/*/cells.csv): the docs' cross-study tables stay what the reports give."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from helpers import load_tool as _tool

ROOT = Path(__file__).resolve().parents[2]
COUNTDOWN = ROOT / "docs/studies/countdown"


def test_paired_differences_reads_a_reports_cells_csv(capsys):
    tool = _tool("paired_differences")
    assert tool.main([str(COUNTDOWN / "main_slice"), str(COUNTDOWN / "key_seeds" / "cells.csv"),
                      "--where", "inter_lag=32", "--reference", "method=entr"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| method=none |"))
    assert "+0.003 (seed 0), +0.008 (seed 1), -0.029 (seed 2), -0.003 (seed 3), +0.009 (seed 4)" in row


def test_the_committed_tables_are_what_the_reports_give():
    tables = _tool("countdown_tables")
    cells = tables.load()
    for name, fresh in (("paired", tables.paired(cells)), ("accuracy", tables.accuracy(cells)),
                        ("masks", tables.masks(cells))):
        committed = pd.read_csv(COUNTDOWN / f"{name}.csv")
        assert list(fresh.columns) == list(committed.columns), name
        for column in fresh:
            if pd.api.types.is_numeric_dtype(committed[column]):
                assert fresh[column].to_numpy(float) == pytest.approx(committed[column].to_numpy(float), rel=1e-5,
                                                                      nan_ok=True), (name, column)
            else:
                assert fresh[column].astype(str).tolist() == committed[column].astype(str).tolist(), (name, column)
