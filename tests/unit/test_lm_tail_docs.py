"""tools/lm_tail_docs.py's paired tables against hand-computed differences: a cells.csv of six methods
over two lags and two seeds, one cell not done, some methods run at one lag only."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import lm_tail_docs as tool  # noqa: E402

# (lag, method, seed) -> (sampled, greedy) after RL
ACC = {
    (32, "entr", 0): (0.10, 0.20), (32, "entr", 1): (0.20, 0.30),
    (32, "none", 0): (0.15, 0.10), (32, "none", 1): (0.10, 0.40),
    (32, "naive", 0): (0.01, 0.02), (32, "naive", 1): (0.03, 0.05),
    (32, "naive_entr", 0): (0.02, 0.02), (32, "naive_entr", 1): (0.00, 0.05),
    (32, "icepop", 0): (0.05, 0.10), (32, "icepop", 1): (0.02, 0.04),
    (0, "entr", 0): (0.30, 0.40), (0, "entr", 1): (0.25, 0.35),
    (0, "none", 0): (0.35, 0.40), (0, "none", 1): (0.40, 0.45),
    (0, "dppo", 0): (0.20, 0.30), (0, "dppo", 1): (0.30, 0.50),
    (0, "naive", 0): (0.25, 0.30), (0, "naive", 1): (0.20, 0.30),
    (0, "naive_entr", 0): (0.28, 0.30), (0, "naive_entr", 1): (0.19, 0.35),
}


def cells() -> pd.DataFrame:
    rows = [{"cell": f"{lag}-{m}-{s}", "state": "done", "controller.inter_lag": lag, "method": m,
             "controller.seed": s, "eval_after_sampled": a, "eval_after_greedy": g}
            for (lag, m, s), (a, g) in ACC.items()]
    rows.append({"cell": "32-dppo-0", "state": "running", "controller.inter_lag": 32, "method": "dppo",
                 "controller.seed": 0, "eval_after_sampled": None, "eval_after_greedy": None})
    return pd.DataFrame(rows)


def row(markdown: str, section: str, group: str) -> list[str]:
    """The cells of `group`'s row in the first table after the line that starts with `section`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(section))
    for line in lines[start + 1:]:
        if line.startswith(f"| {group} |"):
            return [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("#"):
            break
    raise AssertionError(f"no row {group!r} under {section!r}")


def test_k32_each_method_minus_entr_and_the_rescue_contrast(tmp_path):
    text = tool.paired_k32(cells(), tmp_path)
    none = row(text, "## Sampled", "method=none")
    assert none[1] == "2" and none[2] == "+0.050 (seed 0), -0.100 (seed 1)"
    assert float(none[3]) == round((0.05 - 0.10) / 2, 4)
    greedy = row(text, "## Greedy", "method=none")
    assert greedy[2] == "-0.100 (seed 0), +0.100 (seed 1)"
    assert "| method=dppo |" not in text  # its only K = 32 cell is not done
    rescue = row(text, "## Does ENTR's mask", "method=naive_entr")
    assert rescue[2] == "+0.010 (seed 0), -0.030 (seed 1)"
    assert "| method=none |" not in text.split("## Does ENTR's mask")[1]
    assert row(text, "## Does ENTR's mask", "method=icepop")[2] == "+0.040 (seed 0), -0.010 (seed 1)"
    two_masks = [line.split("|")[3].strip() for line in text.split("## Two masks")[1].splitlines()
                 if line.startswith("| method=naive_entr |")]
    assert two_masks == ["-0.030 (seed 0), -0.020 (seed 1)", "-0.080 (seed 0), +0.010 (seed 1)"]  # sampled, greedy
    assert (tmp_path / "k32_paired_vs_entr.png").stat().st_size > 0


def test_k0_contrasts_and_the_cost_of_staleness_for_methods_run_at_both_lags():
    text = tool.paired_k0(cells())
    dppo = row(text, "## K = 0: each method minus ENTR", "method=dppo")
    assert dppo[2] == "-0.100 (seed 0), +0.050 (seed 1)"
    versus_none = row(text, "## K = 0: each method minus none", "method=dppo")
    assert versus_none[2] == "-0.150 (seed 0), -0.100 (seed 1)"
    assert versus_none[9:11] == ["0", "2"]  # better, worse
    assert row(text, "## K = 0: each method minus none", "method=entr")[2] == "-0.050 (seed 0), -0.150 (seed 1)"
    rescue = row(text, "## K = 0: naive + ENTR's mask", "method=naive_entr")
    assert rescue[2] == "+0.030 (seed 0), -0.010 (seed 1)"
    assert "| method=dppo |" not in text.split("## K = 0: naive + ENTR's mask")[1].split("##")[0]
    cost = row(text, "### method=none, sampled", "inter_lag=32")
    assert cost[2] == "-0.200 (seed 0), -0.300 (seed 1)"
    assert "### method=entr, greedy" in text
    assert row(text, "### method=naive, sampled", "inter_lag=32")[2] == "-0.240 (seed 0), -0.170 (seed 1)"
    assert "### method=dppo" not in text and "### method=icepop" not in text  # one lag only


def test_mask_tables_for_a_lag_with_no_done_cell_say_so(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(tool.mask_by_entropy_table, "main", lambda argv: calls.append(argv))
    only_stale = cells()[lambda f: f["controller.inter_lag"] == 32]
    tool.mask_tables(tmp_path / "study", only_stale, tmp_path)
    assert calls == [[str(tmp_path / "study"), "--where", "inter_lag=32",
                      "--out", str(tmp_path / "masks_by_entropy.md")]]
    assert "No cell at K = 0 has run" in (tmp_path / "masks_by_entropy_k0.md").read_text()
    assert not (tmp_path / "masks_by_entropy.md").exists()  # written by the (replaced) table tool


def test_k32_each_method_minus_none(tmp_path):
    section = "## Each method minus none"
    text = tool.paired_k32(cells(), tmp_path)
    entr = row(text, section, "method=entr")
    assert entr[2] == "-0.050 (seed 0), +0.100 (seed 1)"
    assert row(text, section, "method=naive")[2] == "-0.140 (seed 0), -0.070 (seed 1)"
    assert "| method=none |" not in text.split(section)[1].split("## Does")[0]


def test_paired_only_rewrites_the_paired_tables_from_the_committed_cells(tmp_path, capsys):
    cells().to_csv(tmp_path / "cells.csv", index=False)
    (tmp_path / "paired.md").write_text("stale\n")
    assert tool.main(["--out", str(tmp_path), "--paired-only"]) == 0
    assert "k32_paired_vs_entr.png" in capsys.readouterr().out and (tmp_path / "k32_paired_vs_entr.png").is_file()
    no_entr = tmp_path / "no_entr"
    no_entr.mkdir()
    cells().query("method != 'entr'").to_csv(no_entr / "cells.csv", index=False)
    assert tool.main(["--out", str(no_entr), "--paired-only"]) == 0
    assert "png" not in capsys.readouterr().out           # no K = 32 pair with ENTR: no plot, and none claimed
    assert row((tmp_path / "paired.md").read_text(), "## Sampled", "method=none")[2] == \
        "+0.050 (seed 0), -0.100 (seed 1)"
    assert "## K = 0: each method minus none" in (tmp_path / "paired_k0.md").read_text()
    missing = tmp_path / "empty"
    missing.mkdir()
    with pytest.raises(SystemExit, match="cells.csv: no such file"):
        tool.main(["--out", str(missing), "--paired-only"])
    with pytest.raises(SystemExit):  # a study directory with --paired-only is refused, not ignored
        tool.main([str(tmp_path), "--out", str(tmp_path), "--paired-only"])


def test_the_random_mask_control_joins_from_another_cells_csv(tmp_path):
    """New cells (naive + a random mask of ENTR's size) in a folder of their own, paired with the
    committed cells of another, or of two (--with-cells, repeatable); a cell done in two files is refused."""
    new = tmp_path / "control"
    new.mkdir()
    pd.DataFrame([{"cell": f"32-naive_random-{s}", "state": "done", "controller.inter_lag": 32,
                   "method": "naive_random", "controller.seed": s, "eval_after_sampled": a, "eval_after_greedy": g}
                  for s, (a, g) in enumerate([(0.05, 0.01), (0.01, 0.09)])]
                 + [{"cell": "32-naive-0", "state": "pending", "controller.inter_lag": 32, "method": "naive",
                     "controller.seed": 0}]).to_csv(new / "cells.csv", index=False)  # a report lists cells not run
    committed = tmp_path / "cells.csv"
    cells().to_csv(committed, index=False)
    merged = tool.with_cells(pd.read_csv(new / "cells.csv"), [committed])
    halves = [tmp_path / "first.csv", tmp_path / "second.csv"]  # the same cells from two committed files
    cells().iloc[::2].to_csv(halves[0], index=False)
    cells().iloc[1::2].to_csv(halves[1], index=False)
    from_two = tool.with_cells(pd.read_csv(new / "cells.csv"), halves).set_index("cell").sort_index()
    pd.testing.assert_frame_equal(from_two, merged.set_index("cell").sort_index(), check_like=True)
    assert merged["cell"].is_unique and len(merged) == len(cells()) + 2  # the pending row gave way to the done one
    assert merged.set_index("cell").loc["32-naive-0", "state"] == "done"
    assert tool.main(["--out", str(new), "--paired-only", "--with-cells", str(committed)]) == 0
    text = (new / "paired.md").read_text()
    # naive_random - naive: 0.05 - 0.01, 0.01 - 0.03; naive_entr - naive_random: 0.02 - 0.05, 0.00 - 0.01
    assert row(text, "## Does ENTR's mask", "method=naive_random")[2] == "+0.040 (seed 0), -0.020 (seed 1)"
    which = [line.split("|")[3].strip() for line in text.split("## Which tokens")[1].splitlines()
             if line.startswith("| method=naive_entr |")]
    assert which == ["-0.030 (seed 0), -0.010 (seed 1)", "+0.010 (seed 0), -0.040 (seed 1)"]  # sampled, greedy
    assert "## Which tokens" not in tool.paired_k32(cells(), tmp_path)  # no control ran: no section
    with pytest.raises(SystemExit, match="done in it and before it"):
        tool.main(["--out", str(tmp_path), "--paired-only", "--with-cells", str(committed)])
    with pytest.raises(SystemExit, match="done in it and before it"):
        tool.main(["--out", str(new), "--paired-only", "--with-cells", str(committed), "--with-cells", str(halves[0])])
    with pytest.raises(SystemExit, match="no such file"):
        tool.main(["--out", str(new), "--paired-only", "--with-cells", str(tmp_path / "none.csv")])


def test_k0_tables_pair_every_stale_lag_with_k0():
    """K = 64 cells (none only) beside K = 32: the staleness section names both lags and pairs each with K = 0."""
    k64 = pd.DataFrame([{"cell": f"64-none-{s}", "state": "done", "controller.inter_lag": 64, "method": "none",
                         "controller.seed": s, "eval_after_sampled": a, "eval_after_greedy": 0.3}
                        for s, a in enumerate([0.30, 0.45])])
    text = tool.paired_k0(pd.concat([cells(), k64], ignore_index=True))
    assert "## What 32 or 64 versions of staleness cost: K = 32, 64 minus K = 0" in text
    assert row(text, "### method=none, sampled", "inter_lag=64")[2] == "-0.050 (seed 0), +0.050 (seed 1)"
    assert row(text, "### method=none, sampled", "inter_lag=32")[2] == "-0.200 (seed 0), -0.300 (seed 1)"
