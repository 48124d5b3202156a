"""A failed engine replaced mid-run: the controller over an EngineSet of fake engines and a fake
recovery (the real one starts processes: tests/e2e/test_faults.py), and the restart budget of the
real `EngineRecovery`; engines as Ray actors (`RayEngine` over a fake `ray`) replaced by the real
`EngineRecovery` (a real cluster: tests/e2e/test_train.py's Ray test)."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
import traceback
from contextlib import ExitStack

import pytest

from entr_megatron.config import ControllerConfig, RolloutConfig, SamplingConfig
from entr_megatron.config.loader import load_config
from entr_megatron.controller.job.wiring import EngineRecovery
from entr_megatron.controller.rl.engines import EngineSet, RestartsExhausted
from entr_megatron.controller.rl.loop import Controller
from entr_megatron.rollout.engine import EngineError

from controller_fakes import Engine, Learner, Pusher, Recovery

P, N = 2, 2


class Task:
    name = "fake"

    def prompts(self, split, n, seed):
        return [([1 + j % 50, 2, 3], j) for j in range(n)]

    def reward(self, sample, reference):
        return float(sample.response_ids[0] % 2)


def make(mode="fully_async", engines=2, limit=3, on_train=None, **rollout):
    engine = EngineSet([Engine() for _ in range(engines)])
    recovery = Recovery(engine, Engine, limit)
    learner = Learner(on_train)
    rollout = RolloutConfig(prompts_per_step=P, sampling=SamplingConfig(n=N, max_new_tokens=8), **rollout)
    controller = ControllerConfig(mode=mode, max_policy_lag=2)
    return Controller(engine, learner, Pusher(engine), Task(), controller, rollout, "grpo",
                      recovery=recovery), engine, learner, recovery


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_a_dead_engine_is_replaced_and_training_goes_on(mode):
    ctrl, engine, learner, recovery = make(mode, on_train=lambda n: n == 3 and engine.engines[1].die())
    history = ctrl.run(8)
    assert [m["step"] for m in history] == list(range(8))
    restarts = [m["engines/restarts"] for m in history]
    assert restarts[:2] == [0, 0] and restarts[-1] == 1 and restarts == sorted(restarts)
    assert recovery.replaced == [3] and recovery.restarts == 1  # at the learner's version then
    assert all(b.num_seqs == P * N for b in learner.batches)
    assert engine.engines[1].version == engine.engines[0].version and not engine.failed  # it follows the pushes


def test_no_group_is_trained_twice_and_none_is_lost():
    ctrl, engine, learner, recovery = make(on_train=lambda n: n in (2, 5) and engine.engines[n % 2].die())
    trained = []
    train = ctrl._train
    ctrl._train = lambda groups: trained.extend(g.prompt_index for g in groups) or train(groups)
    ctrl.run(8)
    assert recovery.restarts == 2 and ctrl.buffer.dropped == 0
    assert len(trained) == len(set(trained)) == 8 * P
    state = ctrl.state_dict()
    held = [r["prompt_index"] for r in state["inflight"]] + [g["prompt_index"] for g in state["buffer"]["groups"]] \
        + [r["prompt_index"] for r in state["buffer"]["regenerate"]]
    assert sorted(trained + held) == list(range(ctrl.prompts.next_index))


def test_a_silent_engine_is_killed_and_replaced_after_poll_timeout():
    ctrl, engine, learner, recovery = make("sync", engines=1, poll_timeout_s=0.05,
                                           on_train=lambda n: n == 2 and engine.engines[0].hang())
    hung = engine.engines[0]
    history = ctrl.run(4)
    assert [m["engines/restarts"] for m in history] == [0, 0, 1, 1]
    assert hung.killed and recovery.replaced == [2]


def test_past_the_budget_the_error_names_the_count_and_the_last_error():
    ctrl, engine, _, _ = make("sync", engines=1, limit=1, on_train=lambda n: n in (1, 3) and engine.engines[0].die())
    with pytest.raises(RestartsExhausted, match=r"1 replaced; the engine process exited \(exit code -9\)"):
        ctrl.run(6)
    assert ctrl.step == 3


def test_engine_recovery_refuses_past_max_engine_restarts():
    cfg = load_config(None, ["rollout.max_engine_restarts=2"])
    engines = EngineSet([Engine()])
    recovery = EngineRecovery(cfg, None, ExitStack(), engines, pusher=None, address="127.0.0.1")
    recovery.restarts = 2
    engines.engines[0].die()
    failed = recovery.failed()
    assert failed == [(0, "the engine process exited (exit code -9)")] and engines.engines[0].killed
    with pytest.raises(RestartsExhausted) as e:
        recovery.replace(failed, version=5)
    assert "embedded engine 0 failed, and 2 engine(s) were already replaced in this job " \
           "(rollout.max_engine_restarts=2)" in str(e.value)
    assert "exit code -9" in str(e.value)


@pytest.mark.parametrize("field,value", [("rollout.max_engine_restarts", -1), ("rollout.push_timeout_s", 0),
                                         ("rollout.poll_timeout_s", ".inf"), ("rollout.embedded.health_timeout_s", -5)])
def test_the_new_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=field.rsplit(".", 1)[-1]):
        load_config(None, [f"{field}={value}"])


def test_engine_set_keeps_the_live_engines_results_and_replace_names_the_lost_requests():
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams

    engines = EngineSet([Engine(), Engine()])
    ids = engines.submit([GenerateRequest([1, 2], SamplingParams(n=N), request_id=f"q{i}") for i in range(4)])
    assert engines.live_samples() == [2 * N, 2 * N]
    engines.engines[1].die()
    got = engines.poll(timeout=0.1)  # engine 0's samples; engine 1's failure is kept, not raised yet
    assert {r.request_id for r in got} == {"q0"} and 1 in engines.failed
    engines.submit([GenerateRequest([1, 2], SamplingParams(n=N), request_id="q9")])  # not on the failed one
    assert engines.live_samples()[0] == 2 * N
    lost = engines.replace(1, Engine(3))
    assert sorted(lost) == ["q1", "q3"] and not engines.failed and engines.live_samples() == [2 * N, 0]
    assert engines.is_live("q2") and not engines.is_live("q1") and ids == ["q0", "q1", "q2", "q3"]
    engines.engines[0].die()
    engines.engines[1].die()
    with pytest.raises(EngineError, match="exit code -9"):
        while True:
            engines.poll(timeout=0.1)


class Group:
    """A learner worker group, faked: records calls and whether it was shut down."""

    def __init__(self, name):
        self.name, self.calls, self.down = name, [], False

    def wait_ready(self):
        return self

    def call(self, method, *args, **kwargs):
        self.calls.append((method, args))
        return [("127.0.0.1", 29500)] if method.__name__ == "meeting_point" else [True]

    def raise_if_dead(self, what, grace_s=1.0):
        pass  # its ranks never die

    def shutdown(self, timeout_s=60.0):
        self.down = True


def test_relaunched_learner_ranks_get_the_running_engines_and_may_push_an_older_version(monkeypatch):
    from entr_megatron.controller.job import wiring
    from entr_megatron.controller.ranks.remote import RemotePusher

    forgotten = []

    class Forgetful(Engine):
        def forget_version(self):
            forgotten.append(self)

    cfg = load_config(None, [])
    engines = EngineSet([Forgetful(version=9), Forgetful(version=9)])
    old = RemotePusher(Group("old"))
    old.engines = list(engines.engines)
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)  # engine 1 still receiving the dead learner's version
    stuck.engine = engines.engines[1]
    stuck.start()
    old.last_updates = [stuck]
    monkeypatch.setattr(wiring, "ABANDON_TIMEOUT_S", 0.2)
    recovery = Recovery(engines, Engine)
    old.recovery = recovery
    monkeypatch.setattr(wiring, "learner_group", lambda cfg, model_dir, phase: Group("new"))
    with ExitStack() as stack:
        learner, pusher = wiring.relaunch_learner(cfg, "model", stack, engines, old)
        assert old.group.down and not pusher.group.down
        assert learner.group is pusher.group and pusher.group.name == "new"
        assert engines.engines[1].killed and not engines.engines[0].killed  # replaced at the first push
        release.set()
        assert forgotten == engines.engines  # the checkpoint's version goes over their 9
        assert pusher.engines == engines.engines and len(pusher.receivers) == 2
        method, args = pusher.group.calls[-1]
        assert method.__name__ == "connect_weight_sync" and args[2] == (1, 1)  # one receiving rank per engine
        assert pusher.recovery is recovery and recovery.pusher is pusher
    assert pusher.group.down  # stopped with the job


# --- engines as Ray actors (launcher.kind ray), over a fake `ray` ------------------------------


class FakeRay:
    """The parts of `ray` that RayEngine uses, without a cluster: each actor runs its calls on
    threads of its own; `kill_process(actor)` fails them as Ray does when the process dies
    (ActorDiedError), `stall(actor)` holds them like a SIGSTOPped process; Ray's real exceptions."""

    def __init__(self):
        self.exceptions = pytest.importorskip("ray.exceptions")
        self.actors, self.killed = [], []
        self.on_describe = None  # called inside each actor's start call (describe), when set

    def remote(self, cls):
        ray = self

        class Options:
            def options(self, **options):
                return self

            def remote(self, config):
                actor = FakeActor(ray, Engine(config.initial_version))
                ray.actors.append(actor)
                return actor

        return Options()

    def get(self, ref, timeout=None):
        try:
            return ref.result(timeout)
        except concurrent.futures.TimeoutError:
            raise self.exceptions.GetTimeoutError(f"Get timed out: some object(s) not ready within {timeout} s")

    def wait(self, refs, timeout=None):
        done, _ = concurrent.futures.wait(refs, timeout)
        return [r for r in refs if r in done], [r for r in refs if r not in done]

    def kill(self, actor, no_restart=True):
        assert no_restart
        self.killed.append(actor)
        self.kill_process(actor)

    def kill_process(self, actor):
        actor.dead = True
        actor.running.set()  # a stopped process dies too; its calls fail

    def stall(self, actor):
        actor.running.clear()


class FakeActor:
    def __init__(self, ray, engine):
        from entr_megatron.controller.ranks.ray_engine import ACTOR_CONCURRENCY, _EngineActor

        self.ray, self.engine, self.dead, self.running = ray, engine, False, threading.Event()
        self.running.set()
        self.target = _EngineActor.__new__(_EngineActor)  # its forwarding, around a fake engine
        self.target.engine = engine

        def describe():
            if ray.on_describe is not None:
                ray.on_describe()
            return engine.weight_version, "10.0.0.7", 4242

        self.target.describe = describe
        self.pool = concurrent.futures.ThreadPoolExecutor(ACTOR_CONCURRENCY)

    def __getattr__(self, name):
        actor = self

        class Method:
            def remote(self, *args):
                return actor.pool.submit(actor.run, name, args)

        return Method()

    def run(self, name, args):
        self.running.wait()
        if self.dead:
            raise self.ray.exceptions.ActorDiedError()
        if name == "poll" and not self.engine.live:
            time.sleep(min(args[0] or 0.0, 0.005))  # as a real poll waits
        try:
            return getattr(self.target, name)(*args)
        except Exception as e:  # noqa: BLE001 - what ray.get raises for an actor method's error
            raise self.ray.exceptions.RayTaskError(name, traceback.format_exc(), e).as_instanceof_cause() from None


class PushGroup(Group):
    """Learner ranks that send every push at once (the engines' side is RemotePusher's own)."""

    def call(self, method, *args, **kwargs):
        answer = super().call(method, *args)
        return [0.0] if method.__name__ == "push" else [{}] if method.__name__ == "wait_push" else answer

    def call_async(self, method, *args):
        answer = self.call(method, *args)

        class Pending:
            def result(self, timeout=None):
                return answer

        return Pending()


def ray_run(monkeypatch, engines=2, **rollout):
    """A controller over RayEngines (fake Ray) with the real EngineRecovery of launcher.kind ray
    and the real RemotePusher (push_timeout_s 1 s) over fake learner ranks."""
    from entr_megatron.controller.job import wiring
    from entr_megatron.controller.ranks import ray_engine
    from entr_megatron.controller.ranks.remote import RemotePusher

    fake = FakeRay()
    monkeypatch.setattr(ray_engine, "RayEngine", functools.partial(ray_engine.RayEngine, ray_module=fake))
    cfg = load_config(None, ["launcher.kind=ray", "rollout.embedded.health_timeout_s=0.5"])
    engine_set = EngineSet([wiring.embedded_engine(cfg, "model", i) for i in range(engines)])
    pusher = RemotePusher(PushGroup("learner"), push_timeout_s=1.0)
    wiring._connect_weights(cfg, pusher, "127.0.0.1", 29000, engine_set.engines)
    recovery = EngineRecovery(cfg, "model", ExitStack(), engine_set, pusher, "127.0.0.1")
    learner = Learner()
    rollout = RolloutConfig(prompts_per_step=P, sampling=SamplingConfig(n=N, max_new_tokens=8), **rollout)
    ctrl = Controller(engine_set, learner, pusher, Task(), ControllerConfig(mode="fully_async", max_policy_lag=2),
                      rollout, "grpo", recovery=recovery)
    return ctrl, engine_set, learner, fake


@pytest.mark.parametrize("fault", ["kill_process", "stall"])
def test_a_ray_engine_actor_that_dies_or_stalls_is_killed_and_replaced_by_a_new_actor(monkeypatch, fault):
    ctrl, engines, learner, fake = ray_run(monkeypatch, poll_timeout_s=0.3)
    victim = fake.actors[1]
    learner.on_train = lambda n: n == 3 and getattr(fake, fault)(victim)
    trained = []
    train = ctrl._train
    ctrl._train = lambda groups: trained.extend(g.prompt_index for g in groups) or train(groups)
    history = ctrl.run(8)
    assert [m["engines/restarts"] for m in history][-1] == 1 and ctrl.recovery.restarts == 1
    assert fake.killed[0] is victim and len(fake.actors) == 3  # Ray's kill, then one new actor
    assert type(engines.engines[1]).__name__ == "RayEngine" and engines.engines[1]._actor is fake.actors[2]
    assert len(trained) == len(set(trained)) == 8 * P  # none trained twice
    state = ctrl.state_dict()
    held = [r["prompt_index"] for r in state["inflight"]] + [g["prompt_index"] for g in state["buffer"]["groups"]] \
        + [r["prompt_index"] for r in state["buffer"]["regenerate"]]  # aborted over the lag bound: to be generated again
    assert sorted(trained + held) == list(range(ctrl.prompts.next_index))  # none lost
    ctrl.drain()
    assert engines.engines[1].weight_version == engines.engines[0].weight_version == 8  # it follows the pushes


def test_ray_engines_load_at_the_same_time(monkeypatch):
    """make_engines starts every actor before waiting for any: each start call here returns
    only once all three actors are loading (a barrier), which one-after-another starts never
    reach (shown below: one engine alone waiting for a second that is not started)."""
    from entr_megatron.controller.job import wiring
    from entr_megatron.controller.ranks import ray_engine
    from entr_megatron.rollout.embedded_protocol import EmbeddedEngineConfig

    fake = FakeRay()
    monkeypatch.setattr(ray_engine, "RayEngine", functools.partial(ray_engine.RayEngine, ray_module=fake))
    monkeypatch.setattr(wiring, "connect_ray", lambda address: None)
    fake.on_describe = threading.Barrier(3, timeout=10).wait
    cfg = load_config(None, ["launcher.kind=ray", "rollout.num_engines=3"])
    with ExitStack() as stack:
        engines = wiring.make_engines(cfg, "model", stack)
        assert len(engines) == len(fake.actors) == 3
        assert all("pid 4242 on 10.0.0.7" in repr(e) and e.weight_version == 0 for e in engines)
    assert set(fake.killed) == set(fake.actors)  # shut down with the stack

    fake.on_describe = threading.Barrier(2, timeout=0.3).wait
    with pytest.raises(threading.BrokenBarrierError):
        ray_engine.RayEngine(EmbeddedEngineConfig(model_dir="model"))  # waits: the second never starts
    assert fake.killed[-1] is fake.actors[-1]  # a start that failed kills its actor


def test_ray_engine_calls_fail_like_a_local_engines_and_a_slow_poll_loses_nothing():
    from entr_megatron.controller.ranks.ray_engine import RayEngine
    from entr_megatron.rollout.embedded_protocol import EmbeddedEngineConfig
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams

    fake = FakeRay()
    engine = RayEngine(EmbeddedEngineConfig(model_dir="model"), answer_timeout_s=0.5, ray_module=fake)
    actor = fake.actors[0]
    assert "pid 4242 on 10.0.0.7" in repr(engine) and engine.health().alive
    engine.submit([GenerateRequest([1, 2], SamplingParams(n=N), request_id="q0")])
    fake.stall(actor)
    t0 = time.monotonic()
    assert engine.poll(timeout=0.2) == [] and engine.poll(timeout=0.1) == []  # nothing yet, no error
    health = engine.health(timeout_s=0.3)
    assert not health.alive and "did not answer a health check within 0.3 s" in health.error
    assert time.monotonic() - t0 < 1.5  # each call within its deadline
    with pytest.raises(EngineError, match="did not answer submit"):
        engine.submit([])
    actor.running.set()  # it answers again: the stalled poll's samples come with the next poll
    got = engine.poll(timeout=1.0)
    assert [(r.request_id, r.sample_index) for r in got] == [("q0", 0), ("q0", 1)]
    actor.engine.error = "the engine process exited (exit code -9)"  # inside the actor: an EngineError
    with pytest.raises(EngineError, match="exit code -9"):
        engine.poll(timeout=0.5)
    assert engine.update_weights(None, 3).version == 3 and engine.weight_version == 3
    actor.engine.cancel_weight_update = lambda: cancels.append(True)
    cancels = []
    engine.cancel_weight_update()  # forwarded to the actor's engine
    assert cancels == [True]
    fake.kill_process(actor)  # the actor's process killed
    engine.cancel_weight_update()  # a dead actor: nothing to cancel, no error
    with pytest.raises(EngineError, match=r"actor \(pid 4242 on 10.0.0.7\) died \(poll: ActorDiedError\)"):
        engine.poll(timeout=0.5)
    assert not engine.health().alive
    engine.shutdown()
    assert fake.killed == [actor]
