"""EngineSet: placement by live samples, request id translation, abort routing, fair polling."""

import time

import pytest

from entr_megatron.controller.rl.engines import EngineSet
from entr_megatron.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams, WeightUpdateReport

from controller_fakes import ManualEngine


def _req(n, group_id=0, request_id=None):
    return GenerateRequest([1, 2, 3], SamplingParams(n=n), group_id=group_id, request_id=request_id)


def test_is_a_rollout_engine_and_needs_engines():
    assert isinstance(EngineSet([ManualEngine()]), RolloutEngine)
    with pytest.raises(ValueError, match="at least one engine"):
        EngineSet([])


def test_requests_go_to_the_engine_with_fewest_live_samples():
    fakes = [ManualEngine(), ManualEngine(), ManualEngine()]
    engines = EngineSet(fakes)
    # Live samples before each placement (ties to the lowest index):
    # A n=4: [0,0,0] -> e0 | B n=1: [4,0,0] -> e1 | C n=1: [4,1,0] -> e2
    # D n=2: [4,1,1] -> e1 | E n=1: [4,3,1] -> e2 | live after: [4,3,2]
    engines.submit([_req(4, 0), _req(1, 1), _req(1, 2), _req(2, 3), _req(1, 4)])
    placed = [[r.group_id for r in f.live.values()] for f in fakes]
    assert placed == [[0], [1, 3], [2, 4]]
    assert engines.live_samples() == [4, 3, 2]
    # e0's four samples come back: it is the emptiest engine again.
    fakes[0].finish()
    assert len(engines.poll(timeout=0)) == 4
    assert engines.live_samples() == [0, 3, 2]
    engines.submit([_req(1, 5)])
    assert [r.group_id for r in fakes[0].live.values()] == [5]


def test_request_ids_are_unique_across_engines_and_translated_back():
    fakes = [ManualEngine(), ManualEngine()]
    engines = EngineSet(fakes)
    ids = engines.submit([_req(1, 0), _req(2, 1), _req(1, 2, request_id="mine")])
    assert ids[2] == "mine" and len(set(ids)) == 3
    assert set(fakes[0].live) == {"r0", "r1"} and set(fakes[1].live) == {"r0"}  # the engines' own ids collide
    fakes[0].finish()
    fakes[1].finish()
    results = engines.poll(timeout=0)
    got = sorted((r.request_id, r.sample_index, r.group_id) for r in results)
    assert got == sorted([(ids[0], 0, 0), (ids[1], 0, 1), (ids[1], 1, 1), ("mine", 0, 2)])
    assert engines.live_samples() == [0, 0]
    # Once finished, an id may be used again; while live it may not.
    engines.submit([_req(1, request_id="mine")])
    with pytest.raises(ValueError, match="already in flight"):
        engines.submit([_req(1, request_id="mine")])
    with pytest.raises(ValueError, match="already in flight"):
        engines.submit([_req(1, request_id="x"), _req(1, request_id="x")])


def test_a_request_stays_live_until_all_its_samples_returned():
    fake = ManualEngine()
    engines = EngineSet([fake])
    (rid,) = engines.submit([_req(3)])
    fake.ready = fake._results("r0", "stop")
    first, rest = fake.ready[:1], fake.ready[1:]
    fake.ready = first
    assert [r.request_id for r in engines.poll(timeout=0)] == [rid]
    assert engines.live_samples() == [2]
    fake.ready = rest
    assert [r.request_id for r in engines.poll(timeout=0)] == [rid, rid]
    assert engines.live_samples() == [0]


def test_abort_is_routed_to_the_owning_engine():
    fakes = [ManualEngine(), ManualEngine()]
    engines = EngineSet(fakes)
    a, b, c = engines.submit([_req(2), _req(1), _req(1)])  # a -> e0 (r0), b -> e1 (r0), c -> e1 (r1)
    engines.abort([c, "unknown", a])
    assert fakes[0].aborted == [["r0"]] and fakes[1].aborted == [["r1"]]
    results = engines.poll(timeout=0)
    got = sorted((r.request_id, r.finish_reason) for r in results)
    assert got == sorted([(a, "abort"), (a, "abort"), (c, "abort")])
    assert engines.live_samples() == [0, 1]
    engines.abort([a])  # already returned: nothing to route
    assert fakes[0].aborted == [["r0"]]


def test_poll_returns_every_engines_ready_results_together():
    fakes = [ManualEngine(), ManualEngine(), ManualEngine()]
    engines = EngineSet(fakes)
    ids = engines.submit([_req(1), _req(1), _req(1)])
    fakes[1].finish()
    fakes[2].finish()
    assert sorted(r.request_id for r in engines.poll(timeout=5.0)) == sorted(ids[1:])
    assert all(f.poll_timeouts == [0.0] for f in fakes)  # nobody waited while results were ready


def test_poll_waits_in_short_turns_and_wakes_for_any_engine():
    fakes = [ManualEngine(), ManualEngine(), ManualEngine()]
    engines = EngineSet(fakes, poll_slice_s=0.02)
    ids = engines.submit([_req(1), _req(1), _req(1)])
    start = time.monotonic()
    fakes[2].finish_at(start + 0.15)
    results = engines.poll(timeout=5.0)
    elapsed = time.monotonic() - start
    assert [r.request_id for r in results] == [ids[2]]
    assert 0.14 <= elapsed < 1.0  # woke for the last engine, nowhere near the timeout
    for fake in fakes:
        assert max(fake.poll_timeouts) <= 0.02 + 1e-9
        assert len(fake.poll_timeouts) >= 3  # each engine had several turns


def test_poll_timeout_is_the_total_wait_not_per_engine():
    fakes = [ManualEngine() for _ in range(8)]
    engines = EngineSet(fakes, poll_slice_s=0.05)
    start = time.monotonic()
    assert engines.poll(timeout=0.2) == []
    elapsed = time.monotonic() - start
    assert 0.19 <= elapsed < 0.8  # 8 engines x 0.2 s each would be 1.6 s
    assert engines.poll(timeout=0) == [] and all(f.poll_timeouts[-1] == 0.0 for f in fakes)


def test_the_first_engine_to_wait_rotates():
    fakes = [ManualEngine(), ManualEngine()]
    engines = EngineSet(fakes, poll_slice_s=0.01)
    firsts = []
    for _ in range(4):
        for fake in fakes:
            fake.poll_timeouts = []
        fakes[0].ready = fakes[1].ready = []
        engines.poll(timeout=0.005)  # time for one wait: the first engine of the round takes it
        firsts.append([i for i, f in enumerate(fakes) if any(t > 0 for t in f.poll_timeouts)])
    assert firsts == [[0], [1], [0], [1]]


def test_weight_version_is_the_minimum_and_update_weights_is_refused():
    fakes = [ManualEngine(version=5), ManualEngine(version=3), ManualEngine(version=4)]
    engines = EngineSet(fakes)
    assert engines.weight_version == 3
    fakes[1].version = 6
    assert engines.weight_version == 4
    with pytest.raises(NotImplementedError, match="weight pusher"):
        engines.update_weights({}, version=7)


def test_health_merges_the_engines():
    report = WeightUpdateReport(3, 1, 8, 0.1, 0.01, 0.0, 0.2, 1, 0)
    fakes = [ManualEngine(version=4, running=2), ManualEngine(version=3, running=1, update=report, paused=True)]
    engines = EngineSet(fakes)
    h = engines.health()
    assert (h.alive, h.weight_version, h.paused) == (True, 3, False)
    assert (h.num_running, h.steps, h.generated_tokens) == (3, 20, 200)
    assert h.last_update is report and h.error is None
    fakes[0].alive = False
    engines.pause()
    h = engines.health()
    assert not h.alive and h.paused and h.error == "engine 0: died"
    engines.resume()
    assert not any(f.paused for f in fakes)


def test_shutdown_reaches_every_engine_once():
    class Failing(ManualEngine):
        def shutdown(self):
            super().shutdown()
            raise RuntimeError("boom")

    fakes = [Failing(), ManualEngine()]
    engines = EngineSet(fakes)
    with pytest.raises(RuntimeError, match="boom"):
        engines.shutdown()
    engines.shutdown()
    assert [f.shutdowns for f in fakes] == [1, 1]


def test_generate_health_checks_a_silent_engine_and_fails_a_dead_one():
    from entr_megatron.rollout.engine import EngineError, generate

    slow = ManualEngine()
    checks = []
    slow.health = lambda real=slow.health: checks.append(1) or real()
    slow.finish_at(time.monotonic() + 0.35)  # silent past the idle timeout, but alive: it is waited for
    results = generate(slow, [_req(2)], timeout_s=10, idle_timeout_s=0.1)
    assert [r.sample_index for r in results] == [0, 1] and checks
    dead = ManualEngine()
    dead.finish_at(time.monotonic() + 0.3)  # would finish, but it no longer answers a health check
    dead.alive = False
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"no sample for 0 s \(0 of 3 done\) and the engine does not answer: died"):
        generate(dead, [_req(3)], timeout_s=10, idle_timeout_s=0.05)
    assert time.monotonic() - t0 < 2
