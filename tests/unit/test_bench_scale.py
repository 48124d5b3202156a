"""tools/bench_vs_trl.py --scale's summary of one size, on hand-made runs: steps/s against TRL and
the overlap ceiling (gen_2 + learn_2) / max(gen_1, learn_1) computed by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    sys.path.insert(0, str(ROOT / "tools"))  # the tool imports its neighbour compare_modes
    try:
        spec = importlib.util.spec_from_file_location("tool_bench_vs_trl", ROOT / "tools" / "bench_vs_trl.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return module


def _run(steps, rl_s, gen=0.0, learn=0.0, greedy=0.5):
    return {"steps": steps, "rl_s": rl_s, "startup_s": 5.0,
            "timing": {"step_s": gen + learn, "wait_rollout_s": gen, "learner_step_s": learn, "push_s": 0.01},
            "before": {"eval/accuracy": 0.4, "eval/sampled_accuracy": 0.2},
            "after": {"eval/accuracy": greedy, "eval/sampled_accuracy": greedy / 2}}


def test_ratios_and_overlap_ceiling_by_hand(tool):
    runs = {
        "trl": [_run(10, 2.0), _run(10, 2.5), _run(10, 1.6)],  # 5.0, 4.0, 6.25 steps/s: median 5.0
        # two threads a side: gen 0.10 / 0.12 / 0.14 s (median 0.12), learn 0.30 / 0.28 / 0.32 (0.30)
        "sync": [_run(10, 2.5, 0.10, 0.30), _run(10, 2.4, 0.12, 0.28), _run(10, 2.6, 0.14, 0.32)],
        # one thread a side: gen 0.15 (median), learn 0.50 (median)
        "sync_1thread": [_run(10, 4.0, 0.15, 0.50), _run(10, 4.1, 0.16, 0.49), _run(10, 3.9, 0.14, 0.52)],
        "fully_async": [_run(10, 2.0, greedy=0.6), _run(10, 2.2, greedy=0.7), _run(10, 1.9, greedy=0.4)],
    }
    rows = {r["system"]: r for r in tool.scale_rows("3M", 3_000_000, runs, {"ours_s": 0.6, "hf_s": 0.5})}
    assert rows["trl"]["vs_trl"] == pytest.approx(1.0)
    assert rows["sync"]["steps_per_s"] == pytest.approx(10 / 2.5)
    assert rows["sync"]["vs_trl"] == pytest.approx((10 / 2.5) / 5.0)
    assert rows["fully_async"]["vs_trl"] == pytest.approx((10 / 2.0) / 5.0)
    assert (rows["fully_async"]["steps_per_s_min"], rows["fully_async"]["steps_per_s_max"]) == \
        pytest.approx((10 / 2.2, 10 / 1.9))
    # sequential on both cores 0.12 + 0.30 = 0.42 s; overlapped on one core each max(0.15, 0.50) = 0.50 s
    assert rows["sync"]["overlap_ceiling"] == pytest.approx(0.42 / 0.50)
    assert [r["overlap_ceiling"] for r in rows.values()] == pytest.approx([0.84] * 4)
    assert rows["fully_async"]["greedy_after"] == 0.6
    assert (rows["fully_async"]["greedy_after_min"], rows["fully_async"]["greedy_after_max"]) == (0.4, 0.7)
    assert rows["sync"]["learner_vs_hf"] == pytest.approx(1.2)
    assert "step_s_median" not in rows["trl"] and rows["sync"]["learner_step_s_median"] == pytest.approx(0.30)


def test_no_ceiling_without_both_thread_counts(tool):
    runs = {"trl": [_run(10, 2.0)], "sync": [_run(10, 2.5, 0.1, 0.3)], "fully_async": [_run(10, 2.0)]}
    rows = tool.scale_rows("3M", 3_000_000, runs, {"ours_s": 0.6, "hf_s": 0.5})
    assert all(r["overlap_ceiling"] is None for r in rows)
