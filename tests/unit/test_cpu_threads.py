"""Where a CPU job's cores go (controller/wiring.cpu_threads), by hand for each kind of phase."""

from __future__ import annotations

import pytest

from entr_megatron.config.loader import load_config
from entr_megatron.controller.job import wiring


def config(*overrides: str):
    return load_config("examples/cpu_demo.yaml", ["launcher.cpu_threads_per_rank=null",
                                                  "rollout.embedded.num_threads=null", *overrides])


@pytest.mark.parametrize("cores, ranks, engines, mode, expected", [
    (2, 1, 1, "sync", (2, 2)),             # they take turns: each may use both cores
    (2, 1, 1, "fixed_lag", (2, 2)),
    (2, 1, 1, "fully_async", (1, 1)),      # both work at once: one core each
    (2, 1, 1, "one_step_off", (1, 1)),
    (16, 2, 2, "sync", (8, 8)),            # a side's cores are shared by its processes
    (16, 2, 2, "fully_async", (4, 4)),
    (16, 3, 1, "fully_async", (4, 4)),     # 4 shares of 4; the learner ranks get the rest
    (10, 2, 1, "fully_async", (3, 3)),     # (10 - 3) // 2 = 3
    (1, 2, 1, "fully_async", (1, 1)),      # never below one thread
])
def test_unset_threads_follow_the_work(monkeypatch, cores, ranks, engines, mode, expected):
    monkeypatch.setattr(wiring, "available_cores", lambda: cores)
    cfg = config(f"controller.mode={mode}", f"launcher.nproc_per_node={ranks}", f"rollout.num_engines={engines}")
    assert tuple(wiring.cpu_threads(cfg, "rl")) == expected


def test_set_threads_win_except_in_the_warm_up(monkeypatch):
    monkeypatch.setattr(wiring, "available_cores", lambda: 8)
    cfg = config("controller.mode=sync", "launcher.cpu_threads_per_rank=3", "rollout.embedded.num_threads=1")
    assert tuple(wiring.cpu_threads(cfg, "rl")) == (3, 1)
    assert wiring.cpu_threads(cfg, "sft").learner == 8  # no engine beside the warm-up
    half = config("controller.mode=fully_async", "launcher.cpu_threads_per_rank=2")
    assert tuple(wiring.cpu_threads(half, "rl")) == (2, 4)  # only the unset engine side is derived


def test_gpu_and_ray_jobs_keep_what_is_set(monkeypatch):
    monkeypatch.setattr(wiring, "available_cores", lambda: 8)
    assert tuple(wiring.cpu_threads(config("launcher.device=cuda", "launcher.gpus_per_node=1"), "rl")) == (None, None)
    assert tuple(wiring.cpu_threads(config("launcher.kind=ray"), "rl")) == (None, None)
