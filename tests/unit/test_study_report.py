"""`study report` on synthetic study directories: tables, collapse rule, ScaleRL fit, speedup, report.md.

Every expectation is computed here by hand (explicit loops, closed forms), not with the
module's own helpers.
"""

import json
import math
import re
import warnings

import numpy as np
import pandas as pd
import pytest

from entr_megatron.study.fits import fit_sigmoid, sigmoid_curve
from entr_megatron.study.report import (ACCURACY_DROP, DEFINITIONS, detect_collapse, final_accuracy_stats,
                                        final_accuracy_table, load_cells, load_results, read_study, speedup_table,
                                        write_report)
from entr_megatron.study.results import done_cells

BINS = ("0-0.001", "0.001-0.01", "0.01-0.1", "0.1-1", "1-10", "10-inf")
STEPS = 20
METHOD, LAG, SEED = "algorithm.correction", "controller.inter_lag", "controller.seed"


def _cell_id(method, lag, seed):
    return f"correction={method},inter_lag={lag},seed={seed}"


def _write_cell(root, cell_id, axes, state="done", rows=None, evals=None, error=None):
    cell = root / "cells" / cell_id
    cell.mkdir(parents=True)
    (cell / "cell.json").write_text(json.dumps({"id": cell_id, "axes": axes}))
    (cell / "status.json").write_text(json.dumps({"state": state, "error": error, "wall_s": 12.5, "attempts": 1}))
    if rows is not None:
        # As MetricsLogger writes them: NaN and inf become null.
        lines = [json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()})
                 for r in rows]
        (cell / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if evals is not None:
        (cell / "eval.json").write_text(json.dumps(evals))


def _write_study(root, name="toy", axes=(METHOD, LAG, SEED), reference=None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "study.json").write_text(json.dumps({
        "name": name, "axes": list(axes), "report": {"method": METHOD, "lag": LAG, "reference": reference}}))


def _row(method, step, reward, seed):
    row = {"step": step, "policy_version": step, "reward/mean": reward, "loss": 0.5 - 0.01 * step,
           "optim/grad_norm": 1.0 + 0.05 * step, "mismatch/k3": 1e-3 * (1 + step), "mismatch/mean_abs_delta": 0.01,
           "policy/entropy_mean": 0.8 - 0.01 * step, "policy_lag/mean": 1.0, "policy_lag/max": 2.0,
           "timing/step_s": 1.0 + 0.1 * seed + 0.01 * step, "rollout/tokens": 1000 + 10 * step}
    for i, b in enumerate(BINS):
        row.update({f"entropy_bin/{b}/count": 100.0 * (i + 1), f"entropy_bin/{b}/mean_abs_delta": 1e-3 * 3 ** i,
                    f"entropy_bin/{b}/mean_score": 0.1, f"entropy_bin/{b}/low_prob_share": 0.01})
        if method == "entr":
            row[f"entropy_bin/{b}/mask_fraction"] = 0.02 * i
    if method == "entr":
        row.update({"is/ess": 0.9, "mask/fraction": 0.05, "entr/mask_fraction": 0.05})
    if step in (9, 19):
        row.update({"eval/accuracy": 0.3 + 0.01 * step, "eval/sampled_accuracy": 0.28 + 0.01 * step})
    return row


FAILED = _cell_id("entr", 4, 1)
COLLAPSING = _cell_id("none", 4, 0)
NAN_LOSS = _cell_id("none", 4, 1)


def _after(method, lag, seed):
    return 0.4 + 0.125 * (method == "entr") + 0.03125 * seed - 0.0078125 * lag


@pytest.fixture
def study(tmp_path):
    """2 methods x 2 lags x 2 seeds, 20 steps; one failed cell without metrics, one whose
    reward collapses, one with a NaN loss at step 12. Returns (dir, {cell id: rows})."""
    root = tmp_path / "study"
    _write_study(root)
    written = {}
    for method in ("none", "entr"):
        for lag in (0, 4):
            for seed in (0, 1):
                cid, axes = _cell_id(method, lag, seed), {METHOD: method, LAG: lag, SEED: seed}
                if cid == FAILED:
                    _write_cell(root, cid, axes, state="failed", error="exit 1: CUDA error")
                    continue
                rewards = [0.2 + 0.5 * (1 - math.exp(-t / 5)) + 0.01 * seed for t in range(STEPS)]
                if cid == COLLAPSING:
                    rewards = [0.2 + 0.07 * t if t <= 8 else max(0.1, 0.76 - 0.1 * (t - 8)) for t in range(STEPS)]
                rows = [_row(method, t, r, seed) for t, r in enumerate(rewards)]
                if cid == NAN_LOSS:
                    rows[12]["loss"] = math.nan
                evals = {"before_rl": {"eval/accuracy": 0.3, "eval/sampled_accuracy": 0.28, "eval/num_problems": 64.0},
                         "after_rl": {"eval/accuracy": 0.45, "eval/sampled_accuracy": _after(method, lag, seed),
                                      "eval/num_problems": 64.0}}
                _write_cell(root, cid, axes, rows=rows, evals=evals)
                written[cid] = rows
    return root, written


def test_cells_with_different_metrics_load_as_one_unfragmented_frame(tmp_path):
    # Four cells, each without every fourth of 150 metric keys (as corrections log keys of their
    # own between the shared ones): the frame has every key, NaN where a cell did not log it, and
    # adding a column does not warn of a fragmented frame (the concatenation left ~120 blocks,
    # and every study report printed the warning).
    root = tmp_path / "study"
    _write_study(root)
    for i in range(4):
        rows = [{"step": t, "timing/step_s": 1.0, **{f"k/{k:03d}": k + 0.5 * t for k in range(150) if k % 4 != i}}
                for t in range(3)]
        _write_cell(root, _cell_id(f"m{i}", 0, 0), {METHOD: f"m{i}", LAG: 0, SEED: 0}, rows=rows)
    df = load_results(root)
    cell = {i: df[df["cell"] == _cell_id(f"m{i}", 0, 0)].set_index("step") for i in range(4)}
    assert cell[0].loc[2, "k/007"] == 7 + 0.5 * 2 and cell[3].loc[1, "k/149"] == 149 + 0.5
    assert cell[3]["k/007"].isna().all() and cell[0]["k/148"].isna().all()
    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.PerformanceWarning)
        df.assign(**{f"new/{i}": 1.0 for i in range(3)})


def test_load_results_has_a_row_per_cell_and_step(study):
    root, written = study
    df = load_results(root)
    assert len(df) == len(written) * STEPS == 7 * 20
    assert set(df["cell"]) == set(written) and FAILED not in set(df["cell"])
    for cid, rows in written.items():
        part = df[df["cell"] == cid].sort_values("step")
        method, lag, seed = re.match(r"correction=(\w+),inter_lag=(\d+),seed=(\d+)", cid).groups()
        assert (part[METHOD] == method).all() and (part[LAG] == int(lag)).all() and (part[SEED] == int(seed)).all()
        assert list(part["step"]) == list(range(STEPS))
        wall, tokens = 0.0, 0.0
        for got_wall, got_tokens, row in zip(part["wall_s"], part["tokens_cum"], rows):
            wall += row["timing/step_s"]
            tokens += row["rollout/tokens"]
            assert got_wall == pytest.approx(wall) and got_tokens == pytest.approx(tokens)
    nan_cell = df[df["cell"] == NAN_LOSS].set_index("step")
    assert math.isnan(nan_cell.loc[12, "loss"]) and bool(nan_cell.loc[12, "loss:nonfinite"])
    assert not nan_cell.drop(index=12)["loss:nonfinite"].any()
    # Keys a method does not log are NaN for it, not an error.
    assert df.loc[df[METHOD] == "none", "mask/fraction"].isna().all()
    assert df.loc[df[METHOD] == "entr", "mask/fraction"].eq(0.05).all()


def test_load_cells_lists_every_cell_with_its_collapse(study):
    root, _ = study
    cells = load_cells(root).set_index("cell")
    assert len(cells) == 8
    assert cells.loc[FAILED, "state"] == "failed" and cells.loc[FAILED, "steps"] == 0
    assert "CUDA" in cells.loc[FAILED, "error"] and not cells.loc[FAILED, "collapsed"]
    assert cells.loc[COLLAPSING, "collapsed"] and "reward" in cells.loc[COLLAPSING, "collapse_reason"]
    assert cells.loc[NAN_LOSS, "collapsed"]
    assert cells.loc[NAN_LOSS, "collapse_reason"] == "non-finite loss at step 12"
    others = cells.drop(index=[FAILED, COLLAPSING, NAN_LOSS])
    assert not others["collapsed"].any()
    cid = _cell_id("entr", 0, 1)
    assert cells.loc[cid, "eval_after_sampled"] == _after("entr", 0, 1)
    assert cells.loc[cid, "eval_before_greedy"] == 0.3
    # Final reward: mean of the last w = max(3, 20 // 10) = 3 rewards.
    last = [0.2 + 0.5 * (1 - math.exp(-t / 5)) + 0.01 for t in (17, 18, 19)]
    assert cells.loc[cid, "final_reward"] == pytest.approx(sum(last) / 3)


def _curve(rewards, loss=None):
    frame = pd.DataFrame({"step": range(len(rewards)), "reward/mean": rewards})
    if loss is not None:
        frame["loss"] = loss
    return frame


def test_detect_collapse_on_hand_built_curves():
    rise = [0.2 + 0.02 * t for t in range(30)] + [0.8] * 10
    assert detect_collapse(_curve(rise)) == (False, "")
    fall = rise + [0.3] * 10  # 50 steps, w = 5: the last 5 smoothed values are all 0.3
    collapsed, reason = detect_collapse(_curve(fall))
    assert collapsed and "reward" in reason

    loss = [1.0] * 30
    loss[7] = math.nan
    assert detect_collapse(_curve(rise[:30], loss)) == (True, "non-finite loss at step 7")
    grad = _curve(rise[:30]).assign(**{"optim/grad_norm": [1.0] * 29 + [math.inf]})
    assert detect_collapse(grad) == (True, "non-finite optim/grad_norm at step 29")
    # load_results' flag tells a missing key (NaN, flag False) from a null value.
    missing = _curve(rise[:30], loss).assign(**{"loss:nonfinite": False})
    assert detect_collapse(missing) == (False, "")

    flat = _curve([0.5] * 30)
    drop = {"before_rl": {"eval/sampled_accuracy": 0.5}, "after_rl": {"eval/sampled_accuracy": 0.375}}
    collapsed, reason = detect_collapse(flat, drop)
    assert collapsed and "accuracy" in reason
    small = {"before_rl": {"eval/sampled_accuracy": 0.5}, "after_rl": {"eval/sampled_accuracy": 0.4375}}
    assert detect_collapse(flat, small) == (False, "")


def test_detect_collapse_boundaries():
    # 30 steps, w = 3; piecewise-constant, so each smoothed value is exact: S = 0.25, M = 0.75,
    # gain = 0.5 and the threshold S + gain / 2 = 0.5. Ending exactly on it is not a collapse.
    assert detect_collapse(_curve([0.25] * 10 + [0.75] * 10 + [0.5] * 10)) == (False, "")
    assert detect_collapse(_curve([0.25] * 10 + [0.75] * 10 + [0.4375] * 10))[0]
    # A gain under 0.05 cannot collapse, one above it can.
    assert detect_collapse(_curve([0.25] * 10 + [0.296875] * 10 + [0.25] * 10)) == (False, "")
    assert detect_collapse(_curve([0.25] * 10 + [0.3125] * 10 + [0.25] * 10))[0]
    # One value recovering above the threshold in the last w smoothed values is no collapse.
    assert not detect_collapse(_curve([0.25] * 10 + [0.75] * 10 + [0.25] * 9 + [1.0]))[0]


def test_fit_sigmoid_recovers_known_parameters():
    rng = np.random.default_rng(0)
    C = np.geomspace(1e5, 1e8, 60)
    A, B, C_mid, R0 = 0.8, 1.5, 5e6, 0.2
    # The formula written out here, not through sigmoid_curve.
    y = np.array([R0 + (A - R0) / (1 + (C_mid / c) ** B) for c in C]) + rng.normal(0, 0.005, C.size)
    fit = fit_sigmoid(C, y, r0=R0)
    assert fit.ok, fit.message
    assert fit.A == pytest.approx(A, rel=0.03) and fit.B == pytest.approx(B, rel=0.05)
    assert fit.C_mid == pytest.approx(C_mid, rel=0.05) and fit.r2 > 0.99 and fit.n == 60
    assert sigmoid_curve(C_mid, A, B, C_mid, R0) == pytest.approx((A + R0) / 2)
    free = fit_sigmoid(C, y)  # R0 estimated from the lowest-compute points
    assert free.ok and free.A == pytest.approx(A, rel=0.03)

    few = fit_sigmoid(C[:3], y[:3])
    assert not few.ok and "too few" in few.message and math.isnan(few.A)
    assert not fit_sigmoid(C, np.full(C.size, 0.3)).ok  # no gain
    junk = fit_sigmoid([1, 2, math.nan, -1, 3], [0.1, math.nan, 0.2, 0.3, 0.4])
    assert not junk.ok and junk.n == 2


def _png_links(text):
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)


def test_write_report_writes_tables_figures_and_markdown(study, tmp_path):
    root, written = study
    md_path = write_report(root)
    out = root / "report"
    assert md_path == out / "report.md"
    text = md_path.read_text()
    assert text.startswith("# Study report: toy\n")
    summary = text.split("\n\n")[1]
    assert "8 cells (7 done, 1 failed, 0 running, 0 pending)" in summary and "2 cell(s) collapsed" in summary
    assert "How to read" in text and "## Definitions" in text and "non-finite loss at step 12" in text

    results = load_results(root)
    back = pd.read_parquet(out / "results.parquet")  # the key columns (table="key", the default)
    assert len(back) == len(results) and set(back.columns) < set(results.columns)
    assert {"cell", "state", "step", "reward/mean", "wall_s", "tokens_cum", *read_study(root).axes} <= set(back.columns)
    assert not any(c.startswith("entropy_bin/") and c.endswith("/mean_score") for c in back.columns)
    assert back["reward/mean"].tolist() == pytest.approx(results["reward/mean"].tolist(), nan_ok=True)
    assert pd.read_csv(out / "results.csv").shape == back.shape
    write_report(root, tmp_path / "all", table="all")
    full = pd.read_parquet(tmp_path / "all" / "results.parquet")
    assert full.shape == results.shape and list(full.columns) == list(results.columns)
    assert len(pd.read_csv(out / "cells.csv")) == 8

    links = _png_links(text)
    assert {"reward_vs_step.png", "reward_vs_wall.png", "heldout_accuracy.png", "final_accuracy_vs_lag.png",
            "mask_fraction.png", "mask_by_entropy_bin.png", "delta_by_entropy_bin.png", "diagnostics.png",
            "sigmoid_fits.png"} <= set(links)
    for link in links:
        assert (out / link).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", link
    # No reference in study.json: the speedup section says why it is skipped.
    assert "no report.reference" in text

    # Final accuracy of (entr, lag 0) over its two seeds, by hand.
    vals = [_after("entr", 0, s) for s in (0, 1)]
    stats = final_accuracy_stats(load_cells(root), read_study(root)).set_index(["method", "lag"])
    row = stats.loc[("entr", "0")]
    assert row["mean"] == pytest.approx(sum(vals) / 2) and row["min"] == min(vals) and row["max"] == max(vals)
    assert row["n"] == 2 and stats.loc[("entr", "4"), "n"] == 1  # the failed seed has no eval.json
    table = final_accuracy_table(stats.reset_index()).set_index("method")
    assert list(table.columns) == ["0", "4"]
    expected = f"{sum(vals) / 2:.3f} [{min(vals):.3f}, {max(vals):.3f}] (2 seeds)"
    assert table.loc["entr", "0"] == expected and expected in text

    # Another output folder, and a study where nothing has metrics yet.
    bare = tmp_path / "bare"
    _write_study(bare)
    _write_cell(bare, "a", {METHOD: "none", LAG: 0, SEED: 0}, state="pending")
    text = write_report(bare, tmp_path / "bare_out").read_text()
    assert "1 pending" in text and "Not drawn" in text and not _png_links(text)
    assert "_No cell has finished yet._" in text.split("## Collapses")[1]  # no verdict for a cell never run


def test_speedup_ratio_matches_a_hand_computation(tmp_path):
    root = tmp_path / "speed"
    _write_study(root, reference={LAG: 0})
    step_s = {(0, 0): 2.0, (0, 1): 2.2, (2, 0): 1.0, (2, 1): 1.2}
    for (lag, seed), dt in step_s.items():
        # Rewards in eighths and quarters, so every moving average is exact.
        reward = [min(0.75, t / 8) if lag == 0 else min(1.0, t / 4) for t in range(STEPS)]
        rows = [{"step": t, "reward/mean": r, "timing/step_s": dt} for t, r in enumerate(reward)]
        _write_cell(root, _cell_id("entr", lag, seed), {METHOD: "entr", LAG: lag, SEED: seed}, rows=rows)
    table, note = speedup_table(read_study(root))
    assert note == "" and len(table) == 1
    row = table.iloc[0]
    assert (row["method"], row["lag"]) == ("entr", "2")
    # w = 3. Final smoothed rewards: 0.75 (reference), 1.0 (lag 2): target = 0.9 * 0.75 = 0.675.
    # Reference: smoothed at step 6 = (0.5 + 0.625 + 0.75) / 3 = 0.625, at step 7 = 0.7083: step 7,
    # after 8 steps: wall = mean(8 * 2.0, 8 * 2.2) = 16.8 s.
    # Lag 2: smoothed at step 3 = (0.25 + 0.5 + 0.75) / 3 = 0.5, at step 4 = 0.75: step 4, after
    # 5 steps: wall = mean(5 * 1.0, 5 * 1.2) = 5.5 s.
    assert row["target"] == pytest.approx(0.675)
    assert row["reference_time_s"] == pytest.approx(16.8) and row["time_s"] == pytest.approx(5.5)
    assert row["speedup"] == pytest.approx(16.8 / 5.5)
    assert row["seeds"] == 2 and row["reference_seeds"] == 2
    text = write_report(root).read_text()
    assert "## Speedup at matched reward" in text and f"{16.8 / 5.5:.4g}" in text


def test_a_report_of_a_partly_run_study_draws_without_warnings(tmp_path):
    # Lag 0 only listed (pending), lag 4 run: every figure is drawn, the empty panels say so, and
    # nothing warns (a legend without entries did, for each figure whose first panel was empty).
    root = tmp_path / "study"
    pending = [{"id": _cell_id(m, 0, 0), "axes": {METHOD: m, LAG: 0, SEED: 0}} for m in ("none", "entr")]
    (root / "cells").mkdir(parents=True)
    (root / "study.json").write_text(json.dumps({"name": "partial", "axes": [METHOD, LAG, SEED],
                                                 "report": {"method": METHOD, "lag": LAG}, "cells": pending}))
    for method in ("none", "entr"):
        rows = [_row(method, t, 0.2 + 0.02 * t, 0) for t in range(STEPS)]
        evals = {"before_rl": {"eval/accuracy": 0.3, "eval/sampled_accuracy": 0.28},
                 "after_rl": {"eval/accuracy": 0.45, "eval/sampled_accuracy": _after(method, 4, 0)}}
        _write_cell(root, _cell_id(method, 4, 0), {METHOD: method, LAG: 4, SEED: 0}, rows=rows, evals=evals)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = write_report(root, tmp_path / "out").read_text()
    assert "4 cells (2 done, 0 failed, 0 running, 2 pending)" in text
    for link in _png_links(text):
        assert (tmp_path / "out" / link).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", link
    assert {"reward_vs_step.png", "heldout_accuracy.png", "sigmoid_fits.png", "mask_fraction.png"} <= set(_png_links(text))


def test_a_peak_within_the_reward_noise_is_not_a_collapse():
    # 100 steps of a flat policy as a study step sees it: 8 prompts of different difficulty
    # (p ~ Beta(1, 2)), 8 samples each, so the per-step reward noise is about 0.1. Its smoothed
    # reward (w = 10) wanders, and with this seed an early chance peak (+0.098) followed by chance
    # lows is what the noise-blind rule (gain >= 0.05) called a collapse; the noise floor
    # (4 standard errors of a smoothed value) does not.
    rng = np.random.default_rng(1)
    flat = rng.binomial(8, rng.beta(1, 2, size=(100, 8))).mean(axis=1) / 8
    smooth = np.convolve(flat, np.ones(10) / 10, mode="valid")
    gain = smooth.max() - smooth[0]
    assert 0.05 <= gain and (smooth[-10:] < smooth[0] + gain / 2).all()  # the old rule fires here
    sigma = np.std(np.diff(flat), ddof=1) / math.sqrt(2)
    assert gain < 4 * sigma / math.sqrt(10)
    assert detect_collapse(_curve(list(flat))) == (False, "")
    # The same noise on a real rise by 0.25 over 40 steps and a fall back to the start: a collapse.
    shape = np.concatenate([np.linspace(0, 0.25, 40), np.full(20, 0.25), np.linspace(0.25, 0, 20), np.zeros(20)])
    collapsed, reason = detect_collapse(_curve(list(flat + shape)))
    assert collapsed and "reward collapse" in reason


def test_collapse_by_accuracy_has_one_definition_in_the_code_the_report_and_the_docs():
    """A drop of held-out sampled accuracy is a collapse when it is more than ACCURACY_DROP (0.1,
    absolute), not any drop below the start: the code, report.md's Definitions and both docs say so."""
    from pathlib import Path

    assert ACCURACY_DROP == 0.1
    flat = _curve([0.5] * 30)
    for after, collapsed in ((0.4375, False), (0.40625, False), (0.375, True)):  # drops 1/16, 3/32, 1/8
        evals = {"before_rl": {"eval/sampled_accuracy": 0.5}, "after_rl": {"eval/sampled_accuracy": after}}
        assert detect_collapse(flat, evals)[0] is collapsed, after
    def words(text):
        return " ".join(text.split())

    assert "more than 0.1 (absolute) below its value before RL" in words(DEFINITIONS)
    docs = Path(__file__).parents[2] / "docs"
    studies = words((docs / "studies" / "README.md").read_text())
    assert "more than 0.1 (absolute; `ACCURACY_DROP`) below its value before RL" in studies
    assert "below its start" not in studies
    assert "more than 0.1 (absolute) below before RL" in words((docs / "STUDIES.md").read_text())


def test_cells_differing_in_two_axes_are_two_methods_never_seeds_of_one(tmp_path):
    """A grid over policy_loss and correction, no report.method: the methods are the axes' value
    combinations; cells that differ only in the seed are the seeds of one."""
    root = tmp_path / "study"
    root.mkdir()
    loss, correction = "algorithm.policy_loss", "algorithm.correction"
    (root / "study.json").write_text(json.dumps({"name": "mix", "axes": [loss, correction, SEED]}))
    after = {("ppo_clip", "entr"): (0.5, 0.25), ("ppo_clip", "none"): (0.75, 0.125), ("sapo", "none"): (0.375, 0.625)}
    for (pl, corr), accuracies in after.items():
        for seed, accuracy in enumerate(accuracies):
            evals = {"before_rl": {"eval/accuracy": 0.3, "eval/sampled_accuracy": 0.2, "eval/num_problems": 8.0},
                     "after_rl": {"eval/accuracy": 0.3, "eval/sampled_accuracy": accuracy, "eval/num_problems": 8.0}}
            _write_cell(root, f"policy_loss={pl},correction={corr},seed={seed}", {loss: pl, correction: corr, SEED: seed},
                        rows=[_row(corr, t, 0.5, seed) for t in range(STEPS)], evals=evals)
    info = read_study(root)
    labels = sorted({c.axes[info.method] for c in info.cells})
    assert labels == ["policy_loss=ppo_clip,correction=entr", "policy_loss=ppo_clip,correction=none",
                      "policy_loss=sapo,correction=none"]
    table = final_accuracy_table(final_accuracy_stats(load_cells(root), info)).set_index("method").iloc[:, 0]
    assert len(table) == 3
    for (pl, corr), (a, b) in after.items():  # mean [min, max] of the two seeds, nothing else pooled in
        assert table[f"policy_loss={pl},correction={corr}"] == f"{(a + b) / 2:.3f} [{min(a, b):.3f}, {max(a, b):.3f}] (2 seeds)"


def test_mask_table_averages_each_rule_over_every_step_and_seed(tmp_path):
    from entr_megatron.study.report import mask_table
    from entr_megatron.study.results import _results, read_study

    root = tmp_path / "masks"
    _write_study(root)
    for seed in (0, 1):
        rows = [{**_row("entr", t, 0.5, seed), "counterfactual/icepop/mask_fraction": 0.001 * t + 0.01 * seed,
                 "mask/effective_fraction": 0.01} for t in range(STEPS)]
        _write_cell(root, _cell_id("entr", 4, seed), {METHOD: "entr", LAG: 4, SEED: seed}, rows=rows)
    info = read_study(root)
    table = mask_table(_results(info), info).set_index(["method", "lag"])
    row = table.loc[("entr", "4")]
    # icepop: mean over t of 0.001 t is 0.0095; over seeds 0 and 1 add 0.005
    assert row["cf/icepop"] == pytest.approx(0.0145) and row["mask/fraction"] == pytest.approx(0.05)
    assert row["mask/effective_fraction"] == pytest.approx(0.01)
    report = write_report(root, tmp_path / "out").read_text()
    assert "## What the rules masked" in report and "cf/icepop" in report


def test_done_cells_keeps_done_rows_whose_axes_carry_the_labels():
    cells = pd.DataFrame({"cell": list("abcd"), "state": ["done", "done", "running", "done"],
                          "controller.inter_lag": [32, 0, 32, 32], "method": ["entr", "entr", "none", "none"]})
    assert list(done_cells(cells, {"controller.inter_lag": 32})["cell"]) == ["a", "d"]
    assert list(done_cells(cells, {"controller.inter_lag": "32", "method": "none"})["cell"]) == ["d"]
    assert list(done_cells(cells)["cell"]) == ["a", "b", "d"]  # the running cell is left out
    assert list(done_cells(cells.drop(columns="state"))["cell"]) == ["a", "b", "c", "d"]  # no state: all done
