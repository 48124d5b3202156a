"""The controller's three modes against a deterministic in-process fake engine on a fake clock.

Time is ticks: the engine decodes one token per running sample per tick, the learner's train
call lasts `train_ticks`, a weight push lands `push_ticks` after it starts, and a poll that
finds nothing finished waits one tick. So overlap of generation and training is simulated
exactly and every run is reproducible.
"""

import copy
import json

import pytest
import torch

from entr_megatron.algorithm.advantages import grpo_advantages
from entr_megatron.config import ControllerConfig, RolloutConfig, SamplingConfig
from entr_megatron.controller.rl.loop import Controller, ControllerHooks

from controller_fakes import ClockedEngine, DeliveredPush, FakeClock

P, N = 3, 4


class FakePusher:
    def __init__(self, clock, engine, push_ticks=0):
        self.clock, self.engine, self.push_ticks, self.pending = clock, engine, push_ticks, []
        clock.listeners.insert(0, self)  # weights swap between two decode steps
        self.pushed = []

    def push(self, version):
        self.pushed.append(version)
        handle = {"version": version, "due": self.clock.tick + self.push_ticks, "done": False}
        self.pending.append(handle)
        if self.push_ticks == 0:
            self.on_tick()
        pusher = self

        class Handle(DeliveredPush):
            def wait(self):
                while not handle["done"]:
                    pusher.clock.advance(1)

        return Handle()

    def on_tick(self):
        for h in [h for h in self.pending if h["due"] <= self.clock.tick]:
            self.engine.update_weights(None, h["version"])
            h["done"] = True
            self.pending.remove(h)


class FakeLearner:
    def __init__(self, clock, train_ticks=3):
        self.clock, self.train_ticks, self.records = clock, train_ticks, []

    def train(self, batch, current_version):
        self.records.append((batch, current_version))
        self.clock.advance(self.train_ticks)
        return {"learner/loss": 0.0}


class FakeTask:
    """Reference r; reward is constant 1 when r % 4 == 0 (a zero-variance group), else parity."""

    name = "fake"

    def prompts(self, split, n, seed):
        return [([1 + (seed * n + j) % 97, 2, 3], seed * n + j) for j in range(n)]

    def reward(self, sample, reference):
        return 1.0 if reference % 4 == 0 else float(sum(sample.response_ids) % 2)


def make(mode, lag, stale="regenerate", base_len=4, jitter=4, train_ticks=3, push_ticks=0, hooks=None, **kw):
    clock = FakeClock()
    engine = ClockedEngine(clock, base_len, jitter)
    pusher = FakePusher(clock, engine, push_ticks)
    learner = FakeLearner(clock, train_ticks)
    rollout = RolloutConfig(prompts_per_step=P, sampling=SamplingConfig(n=N, max_new_tokens=64),
                            dynamic_filtering=kw.pop("dynamic_filtering", False))
    controller = ControllerConfig(mode=mode, max_policy_lag=lag, stale_policy=stale, **kw)
    return Controller(engine, learner, pusher, FakeTask(), controller, rollout, "grpo", hooks), learner


def check_bound(learner, lag):
    """Every policy token of every batch is within `lag` versions of the version it trains at."""
    for batch, v in learner.records:
        versions = batch.versions_T[batch.loss_mask_T]
        assert versions.numel() > 0
        assert int(versions.min()) >= v - lag, (v, versions.tolist())
        assert int(versions.max()) <= v


def seq_versions(batch):
    cu = batch.cu_seqlens.tolist()
    return [batch.versions_T[a:b][batch.loss_mask_T[a:b]].tolist() for a, b in zip(cu[:-1], cu[1:])]


MODES = ["sync", "one_step_off", "fully_async"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lag", [1, 4, 64])
def test_lag_bound_is_never_exceeded(mode, lag):
    ctrl, learner = make(mode, lag, base_len=3, jitter=9, train_ticks=2, push_ticks=1)
    history = ctrl.run(8)
    assert [m["step"] for m in history] == list(range(8))
    assert [v for _, v in learner.records] == list(range(8)) == [m["policy_version"] for m in history]
    assert all(b.num_seqs == P * N for b, _ in learner.records)
    check_bound(learner, lag)
    assert max(m["policy_lag/max"] for m in history) <= lag
    for key in ("reward/mean", "policy_lag/min", "policy_lag/mean", "buffer/dropped", "buffer/regenerated",
                "timing/step_s", "timing/train_s", "timing/wait_rollout_s", "learner/loss"):
        assert key in history[-1]


def test_sync_is_on_policy():
    ctrl, learner = make("sync", 0, push_ticks=2)
    history = ctrl.run(5)
    check_bound(learner, 0)
    assert all(m["policy_lag/max"] == 0 for m in history)
    assert ctrl.pusher.pushed == [1, 2, 3, 4, 5]


def test_one_step_off_trains_one_version_behind_without_mid_sequence_updates():
    ctrl, learner = make("one_step_off", 1, base_len=6, train_ticks=10)
    history = ctrl.run(6)
    check_bound(learner, 1)
    assert [m["policy_lag/max"] for m in history] == [0, 1, 1, 1, 1, 1]
    assert all(len(set(vs)) == 1 for b, _ in learner.records for vs in seq_versions(b))


@pytest.mark.parametrize("lag", [2, 4])
def test_fully_async_updates_weights_mid_sequence_within_bound(lag):
    ctrl, learner = make("fully_async", lag, base_len=8, jitter=8, train_ticks=2, push_ticks=1)
    history = ctrl.run(10)
    check_bound(learner, lag)
    spans = [vs for b, _ in learner.records for vs in seq_versions(b)]
    assert any(len(set(vs)) > 1 for vs in spans), "no sequence crossed a weight update"
    assert max(m["policy_lag/spread_max"] for m in history) >= 1
    assert max(m["policy_lag/max"] for m in history) >= 1


@pytest.mark.parametrize("stale", ["drop", "regenerate"])
def test_fully_async_stale_groups_are_counted(stale):
    ctrl, learner = make("fully_async", 1, stale=stale, base_len=2, jitter=12, train_ticks=1,
                         max_inflight_groups=4 * P)
    history = ctrl.run(12)
    check_bound(learner, 1)
    last = history[-1]
    lost = last["buffer/dropped"] if stale == "drop" else last["buffer/regenerated"]
    assert lost > 0
    other = "buffer/regenerated" if stale == "drop" else "buffer/dropped"
    assert last[other] == 0 or stale == "regenerate"  # regenerate may give up after MAX_REGENERATIONS
    assert last["controller/aborted"] <= lost


def test_without_aborts_stale_groups_are_evicted_at_take_time():
    ctrl, learner = make("fully_async", 1, stale="drop", base_len=2, jitter=12, train_ticks=1,
                         max_inflight_groups=4 * P, abort_doomed=False)
    history = ctrl.run(12)
    check_bound(learner, 1)
    assert history[-1]["controller/aborted"] == 0 and history[-1]["buffer/dropped"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_filtering_removes_zero_variance_groups(mode):
    ctrl, learner = make(mode, 2, dynamic_filtering=True)
    history = ctrl.run(6)
    assert history[-1]["buffer/filtered"] > 0
    for batch, _ in learner.records:
        assert batch.num_seqs == P * N
        # a group with all-equal rewards would have all-zero GRPO advantages
        assert (batch.advantages_B.view(P, N).abs().sum(1) > 0).all()
    ctrl2, learner2 = make(mode, 2, dynamic_filtering=False)
    ctrl2.run(6)
    assert any((b.advantages_B.view(P, N).abs().sum(1) == 0).any() for b, _ in learner2.records)


@pytest.mark.parametrize("mode", MODES)
def test_groups_have_n_samples_sharing_a_prompt(mode):
    ctrl, learner = make(mode, 2)
    ctrl.run(4)
    for batch, _ in learner.records:
        firsts = batch.tokens_T[batch.cu_seqlens[:-1]].view(P, N)  # first prompt token of each sequence
        assert (firsts == firsts[:, :1]).all()
    assert all(len(g.samples) == N and {s.group_id for s in g.samples} == {g.group_id} for g in ctrl.buffer._groups)


def test_group_ids_and_advantages_of_trained_samples():
    recorded = []
    ctrl, learner = make("fully_async", 2)
    orig = ctrl._train

    def spy(groups):
        recorded.append(groups)
        return orig(groups)

    ctrl._train = spy
    ctrl.run(4)
    all_ids = []
    for groups, (batch, _) in zip(recorded, learner.records):
        assert len(groups) == P
        rewards, gids = [], []
        for g in groups:
            assert len(g.samples) == N and {s.group_id for s in g.samples} == {g.group_id}
            rewards += [s.reward for s in g.samples]
            gids += [s.group_id for s in g.samples]
            all_ids.append(g.group_id)
        expected = grpo_advantages(torch.tensor(rewards), torch.tensor(gids))
        torch.testing.assert_close(batch.advantages_B, expected)
    assert len(all_ids) == len(set(all_ids))


def _batches_equal(a, b):
    for x, y in zip(a, b):
        assert x[1] == y[1]
        for name in ("tokens_T", "cu_seqlens", "versions_T", "loss_mask_T", "advantages_B", "behaviour_logprobs_T"):
            assert torch.equal(getattr(x[0], name), getattr(y[0], name)), name


@pytest.mark.parametrize("mode", MODES)
def test_resume_from_state_dict_gives_the_same_batches(mode):
    saved = {}
    hooks = ControllerHooks(checkpoint_interval=3,
                            on_checkpoint=lambda c: saved.setdefault(c.step, json.loads(json.dumps(c.state_dict()))))
    kw = dict(base_len=3, jitter=9, train_ticks=2, push_ticks=1, dynamic_filtering=True)
    ctrl, learner = make(mode, 2, hooks=hooks, **kw)
    full = ctrl.run(7)
    assert set(saved) == {3, 6}
    assert saved[3]["inflight"] == []  # drained at the checkpoint

    # the resumed run checkpoints (and so drains) at the same steps, like the same config would
    hooks2 = ControllerHooks(checkpoint_interval=3, on_checkpoint=lambda c: None)
    resumed, learner2 = make(mode, 2, hooks=hooks2, **kw)
    resumed.load_state_dict(copy.deepcopy(saved[3]))
    rest = resumed.run(4)
    assert [m["step"] for m in rest] == [3, 4, 5, 6]
    _batches_equal(learner.records[3:], learner2.records)
    for a, b in zip(full[3:], rest):
        for key in ("reward/mean", "policy_lag/max", "policy_lag/mean", "buffer/dropped", "buffer/filtered"):
            assert a[key] == b[key], key


def test_resume_without_drain_resubmits_inflight_groups():
    ctrl, learner = make("fully_async", 2, base_len=12, jitter=5, max_inflight_groups=3 * P, drain_on_checkpoint=False)
    ctrl.run(3)
    state = json.loads(json.dumps(ctrl.state_dict()))
    assert state["inflight"], "expected groups in flight"
    inflight_ids = {r["group_id"] for r in state["inflight"]}
    resumed, learner2 = make("fully_async", 2, base_len=12, jitter=5, max_inflight_groups=3 * P)
    resumed.load_state_dict(state)
    assert resumed.engine.weight_version == 0
    resumed.run(4)
    assert resumed.pusher.pushed[0] == 3  # fresh engine gets the saved version first
    check_bound(learner2, 2)
    trained = {int(b.tokens_T[0]) for b, _ in learner2.records}
    assert trained and inflight_ids
    assert resumed.state_dict()["next_group_id"] > max(inflight_ids)


def test_bad_mode_and_lag_are_value_errors():
    with pytest.raises(ValueError, match="controller.mode"):
        ControllerConfig(mode="async")
    with pytest.raises(ValueError, match="controller.max_policy_lag"):
        ControllerConfig(mode="fully_async", max_policy_lag=0)


def test_should_stop_checkpoints_drained_and_ends_the_run():
    """Ctrl-C path: after the step in which should_stop turns true, a checkpoint of a drained
    controller is taken (off the interval) and run returns early."""
    saved = []
    stop_after = 3

    def on_checkpoint(ctl):
        saved.append((ctl.step, len(ctl._inflight), ctl.engine.weight_version, ctl.version))

    hooks = ControllerHooks(checkpoint_interval=100, on_checkpoint=on_checkpoint)
    ctrl, learner = make("fully_async", 2, hooks=hooks)
    hooks.should_stop = lambda: ctrl.step >= stop_after
    history = ctrl.run(10)
    assert len(history) == stop_after and len(learner.records) == stop_after
    assert saved == [(stop_after, 0, stop_after, stop_after)]  # drained; engines at the learner's version


def test_eval_hook_runs_drained_at_its_interval_and_joins_the_metrics():
    seen = []

    def on_eval(ctl):
        seen.append((ctl.step, len(ctl._inflight), ctl.engine.weight_version))
        return {"eval/accuracy": 0.25 * ctl.step}

    ctrl, _ = make("fully_async", 2, hooks=ControllerHooks(eval_interval=2, on_eval=on_eval))
    history = ctrl.run(5)
    assert seen == [(2, 0, 2), (4, 0, 4)]
    assert [h.get("eval/accuracy") for h in history] == [None, 0.5, None, 1.0, None]


def test_throughput_is_batch_tokens_over_step_time():
    ctrl, learner = make("sync", 0)
    for h, (batch, _) in zip(ctrl.run(3), learner.records):
        assert h["rollout/tokens"] == float(batch.cu_seqlens[-1]) > 0
        assert h["throughput/tokens_per_s"] == pytest.approx(h["rollout/tokens"] / h["timing/step_s"])


@pytest.mark.parametrize("mode", MODES)
def test_step_timings_name_where_the_controllers_time_went(mode):
    """timing/reward_s, push_s, batch_s and train_overhead_s measure their parts: a reward that
    sleeps 2 ms a sample, a push whose wait sleeps 20 ms, a train call that sleeps 30 ms of which
    the ranks report 10 ms (the rest is the call's way there and back)."""
    import time

    ctrl, learner = make(mode, 4, base_len=3, jitter=2, train_ticks=1)
    reward, train, push = ctrl.task.reward, learner.train, ctrl.pusher.push

    def slow_reward(sample, reference):
        time.sleep(0.002)
        return reward(sample, reference)

    def slow_train(batch, version):
        time.sleep(0.03)
        return {**train(batch, version), "timing/learner_step_s": 0.01}

    def slow_push(version):
        handle = push(version)
        wait = handle.wait

        class Slow(DeliveredPush):
            def wait(self):
                time.sleep(0.02)
                return wait()

        return Slow()

    ctrl.task.reward, learner.train, ctrl.pusher.push = slow_reward, slow_train, slow_push
    history = ctrl.run(3)
    for m in history[1:]:  # step 0 of the overlapped modes may take its first samples' rewards early
        assert m["timing/train_overhead_s"] == pytest.approx(m["timing/train_s"] - 0.01)
        assert 0.02 <= m["timing/train_overhead_s"] < m["timing/step_s"]
        assert 0.02 <= m["timing/push_s"] < m["timing/step_s"]
        assert 0 <= m["timing/batch_s"] < m["timing/train_s"] < m["timing/step_s"]
    assert sum(m["timing/reward_s"] for m in history) >= 3 * P * N * 0.002  # every sample trained on got one
