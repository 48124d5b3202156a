"""tools/mask_by_entropy_table.py against a hand-computed case: two done cells of one method, one
cell not done, the bins' shares and mask fractions averaged over steps, ranges over seeds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import mask_by_entropy_table as tool  # noqa: E402


def cell(root: Path, name: str, seed: int, steps: list[dict], state: str = "done", method: str = "entr") -> None:
    d = root / "cells" / name
    d.mkdir(parents=True)
    (d / "status.json").write_text(json.dumps({"state": state}))
    (d / "cell.json").write_text(json.dumps({"axes": {"controller.inter_lag": 32, "method": method,
                                                      "controller.seed": seed}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **s}) + "\n" for i, s in enumerate(steps)))


def step(low: float, high: float, masked_low: float, masked_high: float, mask: float, effective: float) -> dict:
    return {"entropy_bin_mu/0.01-0.1/count": low, "entropy_bin_mu/1-10/count": high,
            "entropy_bin_mu/0.01-0.1/mask_fraction": masked_low, "entropy_bin_mu/1-10/mask_fraction": masked_high,
            "mask/fraction": mask, "mask/effective_fraction": effective}


def test_shares_and_masks_by_bin(tmp_path, capsys):
    # seed 0: shares 0.75 / 0.25 then 0.5 / 0.5 -> 0.625 / 0.375; masked low 0.0 and 0.02 -> 0.01
    cell(tmp_path, "a", 0, [step(30, 10, 0.0, 0.1, 0.02, 0.001), step(20, 20, 0.02, 0.3, 0.04, 0.003)])
    # seed 1: shares 0.8 / 0.2; masked low 0.04
    cell(tmp_path, "b", 1, [step(40, 10, 0.04, 0.2, 0.05, 0.004)])
    cell(tmp_path, "c", 2, [step(1, 1, 0.9, 0.9, 0.9, 0.9)], state="running")  # not done: left out
    assert tool.main([str(tmp_path), "--where", "inter_lag=32"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| entr |"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    assert cols[:4] == ["entr", "2", "3.00%-5.00%", "0.20%-0.40%"]
    assert cols[4] == "62.5%-80.0% / 1.00%-4.00%"   # H(mu) 0.01-0.1
    assert cols[5] == "20.0%-37.5% / 20.00%"        # H(mu) 1-10: 0.2 in both seeds
    assert len(cols) == 6  # bins with no tokens are left out


def test_dppo_trust_region_drops_have_a_column_of_their_own(tmp_path, capsys):
    """DPPO drops tokens inside its loss (dppo_tv/mask_fraction): 0.03 and 0.05 -> 4.00% for seed 0;
    its applied mask stays 0 and ENTR's row has no value in the new column."""
    dppo_step = lambda frac: {**step(30, 10, 0.0, 0.0, 0.0, 0.0), "dppo_tv/mask_fraction": frac}  # noqa: E731
    cell(tmp_path, "d0", 0, [dppo_step(0.03), dppo_step(0.05)], method="dppo")
    cell(tmp_path, "d1", 1, [dppo_step(0.06)], method="dppo")
    cell(tmp_path, "e0", 0, [step(30, 10, 0.0, 0.1, 0.02, 0.001)])
    assert tool.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in next(x for x in lines if x.startswith("| method")).strip("|").split("|")]
    assert header[4] == "dropped by the loss's trust region"
    dppo = [c.strip() for c in next(x for x in lines if x.startswith("| dppo |")).strip("|").split("|")]
    entr = [c.strip() for c in next(x for x in lines if x.startswith("| entr |")).strip("|").split("|")]
    assert dppo[2:5] == ["0.00%", "0.00%", "4.00%-6.00%"]
    assert entr[2:5] == ["2.00%", "0.10%", ""]


def test_bin_columns_keep_the_entropy_order_when_a_later_method_adds_a_bin(tmp_path, capsys):
    """Method rows add columns as met: "entr" (sorted first) has tokens at 0.01-0.1 and 1-10 only, "naive"
    adds H(mu) 0-0.001, whose column must still come before the others (it came last before the fix)."""
    cell(tmp_path, "e0", 0, [step(30, 10, 0.0, 0.1, 0.02, 0.001)])
    cell(tmp_path, "n0", 0, [{**step(20, 10, 0.0, 0.0, 0.0, 0.0), "entropy_bin_mu/0-0.001/count": 10,
                              "entropy_bin_mu/0-0.001/mask_fraction": 0.0}], method="naive")
    assert tool.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in next(x for x in lines if x.startswith("| method")).strip("|").split("|")]
    assert header[4:] == ["H(mu) 0-0.001: share / masked", "H(mu) 0.01-0.1: share / masked",
                          "H(mu) 1-10: share / masked"]
    naive = [c.strip() for c in next(x for x in lines if x.startswith("| naive |")).strip("|").split("|")]
    assert naive[4:] == ["25.0% / 0.00%", "50.0% / 0.00%", "25.0% / 0.00%"]  # 10, 20, 10 of its 40 tokens
    entr = [c.strip() for c in next(x for x in lines if x.startswith("| entr |")).strip("|").split("|")]
    assert entr[4:] == ["", "75.0% / 0.00%", "25.0% / 10.00%"]
