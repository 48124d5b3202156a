"""Engine replacement outside the main loop's groups, and a learner that fails: fixed_lag's
generate-ahead and the held-out evaluations generate their round again on a new engine with the
same seeds (controller/rl/replacing.py), so their results equal an undisturbed run's; a failed
learner's groups in flight are aborted (`Controller.abandon`) and never reach the controller that
takes over; an EngineSet engine can be parked (out of service) and taken back.

The engines are fakes whose samples are a function of (seed, sample, position, weight version)
only, so "the same as undisturbed" is checked against a run without any failure."""

from __future__ import annotations

import pytest

from entr_megatron.config import ControllerConfig, RolloutConfig, SamplingConfig
from entr_megatron.controller.job.evaluation import evaluate
from entr_megatron.controller.rl.engines import EngineSet, RestartsExhausted
from entr_megatron.controller.rl.loop import Controller
from entr_megatron.controller.rl.replacing import generate_replacing
from entr_megatron.rollout.engine import EngineError, GenerateRequest, SamplingParams

from controller_fakes import Engine, Learner, Pusher, Recovery

P, N = 2, 3


class Task:
    name = "fake"

    def prompts(self, split, n, seed):
        return [([1 + (seed * n + j) % 97, 2, 3], j % 2) for j in range(n)]

    def reward(self, sample, reference):
        return float(sum(sample.response_ids) % 2 == reference)


def batch_tensors(batch):
    return (batch.tokens_T.tolist(), batch.behaviour_logprobs_T.tolist(), batch.versions_T.tolist(),
            batch.advantages_B.tolist())


def make(mode="fixed_lag", engines=1, on_train=None, **controller):
    engine = EngineSet([Engine() for _ in range(engines)])
    recovery = Recovery(engine, Engine)
    learner = Learner(on_train)
    rollout = RolloutConfig(prompts_per_step=P, poll_timeout_s=0.05, sampling=SamplingConfig(n=N, max_new_tokens=6))
    options = dict(inter_lag=1, intra_lag=1, intra_lag_stride=3) if mode == "fixed_lag" else {}
    ctl = Controller(engine, learner, Pusher(engine), Task(), ControllerConfig(mode=mode, **{**options, **controller}),
                     rollout, "grpo", recovery=recovery)
    return ctl, engine, learner, recovery


def requests(n=4):
    return [GenerateRequest([5 + i, 2, 3], SamplingParams(n=N, max_new_tokens=4, seed=100 + i), group_id=i)
            for i in range(n)]


def as_tuples(results):
    return [(r.sample_index, r.output_ids, r.logprobs, r.versions) for r in results]


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_an_interrupted_round_is_generated_again_with_the_same_seeds(fault):
    reference = as_tuples(generate_replacing(EngineSet([Engine(), Engine()]), requests(), lambda e: False, 60))
    engines = EngineSet([Engine(every=3), Engine(**{"fail_after" if fault == "dies" else "hang_after": 0})])
    recovery = Recovery(engines, Engine)

    def recover(error):
        failed = recovery.failed()
        if not failed:
            if error is not None:
                raise error
            return False
        recovery.replace(failed, 0)
        return True

    got = generate_replacing(engines, requests(), recover, timeout_s=60, idle_timeout_s=0.05)
    assert as_tuples(got) == reference and recovery.restarts == 1
    if fault == "dies":  # raised while the slow survivor still ran its part: aborted, generated again
        assert len(engines.engines[0].aborted) == 2


def test_a_failure_nothing_explains_is_raised():
    engines = EngineSet([Engine(fail_after=1)])

    def recover(error):
        raise error

    with pytest.raises(EngineError, match="exit code -9"):
        generate_replacing(engines, requests(), recover, timeout_s=60)


def test_fixed_lag_with_an_engine_killed_in_generate_ahead_trains_the_undisturbed_batches():
    undisturbed, _, reference, _ = make()
    undisturbed.run(6)
    ctl, engine, learner, recovery = make()
    killed = []

    def kill_during_generate_ahead(n):
        if n == 3:  # the engine dies a poll into the next round of segments
            engine.engines[0].fail_after = engine.engines[0].polls + 1
            killed.append(engine.engines[0])

    learner.on_train = kill_during_generate_ahead
    history = ctl.run(6)
    assert killed and killed[0].killed and recovery.restarts == 1 and recovery.replaced == [3]
    assert [m["engines/restarts"] for m in history] == [0, 0, 1, 1, 1, 1]
    assert [batch_tensors(b) for b in learner.batches] == [batch_tensors(b) for b in reference.batches]


def test_fixed_lag_past_the_restart_budget_stops_with_the_engine_error():
    ctl, engine, learner, recovery = make()
    recovery.limit = 0
    learner.on_train = lambda n: n == 2 and setattr(engine.engines[0], "fail_after", engine.engines[0].polls)
    with pytest.raises(RestartsExhausted, match=r"0 replaced; the engine process exited \(exit code -9\)"):
        ctl.run(5)


def test_an_evaluation_survives_an_engine_killed_mid_pass():
    sampling = SamplingConfig(n=N, max_new_tokens=4)
    reference = evaluate(EngineSet([Engine()]), Task(), 6, sampling, seed=3)
    ctl, engine, _, recovery = make("sync")
    engine.engines[0].fail_after = 2
    got = evaluate(engine, Task(), 6, sampling, seed=3, idle_timeout_s=0.05, recover=ctl.recover)
    assert got == reference and recovery.restarts == 1
    with pytest.raises(EngineError, match="exit code -9"):  # without a recovery it ends the evaluation
        evaluate(EngineSet([Engine(fail_after=2)]), Task(), 6, sampling, seed=3)


def test_a_failed_learners_groups_are_aborted_and_never_reach_the_next_controller():
    ctl, engine, _, _ = make("fully_async", engines=2, max_policy_lag=2)
    ctl.run(2)
    inflight = set(ctl._inflight.groups)
    assert inflight
    ctl.abandon(timeout_s=0)  # nothing waited for: their aborted samples are still on the engines
    assert not ctl._inflight
    assert set(sum((e.aborted for e in engine.engines), [])) == inflight
    learner = Learner()
    nxt = Controller(engine, learner, Pusher(engine), Task(), ctl.opt, ctl.rollout, "grpo")
    nxt.run(3)
    assert not any(engine.is_live(rid) for rid in inflight)  # they came back, and were thrown away
    for batch in learner.batches:  # aborted samples have no token: none was trained
        cu = batch.cu_seqlens.tolist()
        assert [int(batch.loss_mask_T[a:b].sum()) for a, b in zip(cu[:-1], cu[1:])] == [6] * (P * N)

    ctl, engine, _, _ = make("fully_async", engines=2, max_policy_lag=2)
    ctl.run(2)
    ctl.abandon(timeout_s=5)  # waited for: the engines are idle afterwards
    assert not ctl._inflight.ignored and not any(e.live for e in engine.engines)


def test_a_parked_engine_gets_no_calls_and_counts_for_nothing_until_replaced():
    engines = EngineSet([Engine(version=4), Engine(version=2)])
    ids = engines.submit(requests(2))
    lost = engines.park(1)
    assert lost == [ids[1]] and engines.in_service() == [0] and not engines.is_live(ids[1])
    assert engines.weight_version == 4 and engines.health().alive
    engines.engines[1].error = "gone"  # never asked: no error from it
    more = engines.submit(requests(3)[2:])
    assert engines.live_samples() == [2 * N, 0] and more
    assert {r.request_id for r in engines.poll(timeout=0.1) + engines.poll(timeout=0.1)} == {ids[0], more[0]}
    engines.replace(1, Engine(version=4))
    assert engines.in_service() == [0, 1] and engines.weight_version == 4
    engines.park(0)
    engines.park(1)
    assert not engines.health().alive
    with pytest.raises(EngineError, match="out of service"):
        engines.submit(requests(1))
