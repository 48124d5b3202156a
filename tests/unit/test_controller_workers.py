"""ProcessWorkerGroup: one call on every rank, torchrun variables, failures named by rank, a rank killed
while its forked child runs takes the child with it; RayWorkerGroup: the driver's variables a rank is
given, a rank killed while its forked child runs seen at once."""

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from entr_megatron.controller.ranks.workers import ProcessWorkerGroup, WorkerError, WorkerGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workers_fixture import EchoWorker, make_broken, make_echo  # noqa: E402


def _kill_rank_while_its_child_runs(group, tmp_path: Path):
    """Rank 0 forks a child that lives on while the rank does (checked), then forks one for 120 s
    (a checkpoint writer mid-save) and is SIGKILLed; returns (the pending call, the child)."""
    assert group.call(EchoWorker.fork_and_wait, 0.2, str(tmp_path / "a")) == [0]  # a live rank's child lives on
    [pid] = group.call(EchoWorker.pid)
    pending = group.call_async(EchoWorker.fork_and_wait, 120, str(tmp_path / "b"))
    while not (tmp_path / "b").exists() or not (tmp_path / "b").read_text():
        time.sleep(0.05)
    child = psutil.Process(int((tmp_path / "b").read_text()))
    os.kill(pid, signal.SIGKILL)
    return pending, child


@pytest.fixture
def group():
    g = ProcessWorkerGroup(3, make_echo, ("t",), threads_per_rank=1, startup_timeout_s=120)
    yield g
    g.shutdown()


def test_every_rank_answers_in_rank_order_with_torchrun_env(group):
    assert isinstance(group, WorkerGroup)
    envs = group.call(EchoWorker.whoami)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and all(e["WORLD_SIZE"] == "3" for e in envs)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert group.call(EchoWorker.add, 10, y=5) == [("t", 0, 15), ("t", 1, 16), ("t", 2, 17)]
    pending = group.call_async(EchoWorker.add, 1)
    with pytest.raises(RuntimeError, match="still in flight"):
        group.call_async(EchoWorker.add, 2)
    assert pending.result() == [("t", 0, 1), ("t", 1, 2), ("t", 2, 3)]


def test_a_failing_rank_is_reported_with_its_traceback(group):
    with pytest.raises(WorkerError, match=r"(?s)rank 1 failed in EchoWorker.fail_on.*ValueError: rank 1 refuses"):
        group.call(EchoWorker.fail_on, 1)


def test_a_dead_rank_is_reported_without_waiting_for_its_peers(group):
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 2 died during EchoWorker.die_on \(exit code 3"):
        group.call(EchoWorker.die_on, 2)
    assert time.monotonic() - t0 < 20  # peers sleep 30 s


def test_a_local_rank_killed_while_its_forked_child_runs_takes_the_child_with_it(tmp_path):
    """A checkpoint writer Megatron forks from a rank holds the rank's pipes, the job's stdout and
    stderr among them: one that outlived a rank killed during a save kept a finished job's output
    open (seen in the fault e2e test). Killed with its rank now; a live rank's child lives on."""
    group = ProcessWorkerGroup(1, make_echo, ("t",), threads_per_rank=1, startup_timeout_s=120)
    try:
        pending, child = _kill_rank_while_its_child_runs(group, tmp_path)
        with pytest.raises(WorkerError, match="rank 0 died during EchoWorker.fork_and_wait"):
            pending.result(timeout=60)
        child.wait(10)  # gone with the rank (psutil.TimeoutExpired if it lives on)
    finally:
        group.shutdown()


def test_a_push_broken_by_a_dead_rank_is_the_learners_failure(group):
    """A learner rank killed mid-push breaks the engines' side of the broadcast first: the push
    then raises the rank's WorkerError (the job relaunches the learner), not EnginePushError
    (which, with every engine healthy, ended the job: seen in the fault e2e test). With the ranks
    alive the engines' error stands."""
    from entr_megatron.controller.ranks.remote import EnginePushError, RemotePush, RemotePusher

    class BrokenUpdate:  # an engine's side of the push that saw its broadcast peer go away
        error = RuntimeError("gloo: Connection reset by peer")

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return False

    pusher = RemotePusher(group, push_timeout_s=5.0)
    with pytest.raises(EnginePushError, match="version 7 did not reach every engine: gloo: Connection reset"):
        RemotePush(pusher, 7, [BrokenUpdate()], 0.0).wait()
    [pid, *_] = group.call(EchoWorker.pid)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"rank 0 died during the push of weight version 8 \(exit code -9"):
        RemotePush(pusher, 8, [BrokenUpdate()], 0.0).wait()


def test_an_engine_that_fails_mid_push_cancels_the_others_at_once(group):
    """Engine 0's side of a push fails; engine 1's would wait for bytes engine 0 was to relay until
    rollout.push_timeout_s (60 s here): the push raises engine 0's error within seconds, having told
    engine 1 to give the version up (cancel_weight_update), and `abandon` then returns at once."""
    import threading

    from entr_megatron.controller.ranks.remote import EnginePushError, RemotePush, RemotePusher, _EngineUpdate

    class Lost:
        def update_weights(self, receiver, version):
            raise RuntimeError("the Ray engine actor died")

    class Waiting:  # a survivor: its receive ends only when cancelled
        def __init__(self):
            self.cancelled = threading.Event()

        def update_weights(self, receiver, version):
            if not self.cancelled.wait(60):
                raise AssertionError("never cancelled")
            raise ValueError("weight version cancelled")

        def cancel_weight_update(self):
            self.cancelled.set()

    survivor = Waiting()
    pusher = RemotePusher(group, push_timeout_s=60.0)
    updates = [_EngineUpdate(survivor, None, 3), _EngineUpdate(Lost(), None, 3)]  # the survivor waited first
    t0 = time.monotonic()
    with pytest.raises(EnginePushError, match="version 3 did not reach every engine: the Ray engine actor died"):
        RemotePush(pusher, 3, updates, 0.0).wait()
    assert survivor.cancelled.is_set() and time.monotonic() - t0 < 10.0
    RemotePush(pusher, 3, updates, 0.0).abandon(timeout_s=5.0)
    assert not any(u.is_alive() for u in updates) and time.monotonic() - t0 < 15.0


def test_construction_failure_names_the_rank():
    with pytest.raises(WorkerError, match=r"(?s)rank \d failed in startup.*cannot build x"):
        ProcessWorkerGroup(2, make_broken, ("x",), startup_timeout_s=120)


def test_ray_ranks_get_the_driver_variables_they_are_given_and_no_others(monkeypatch, tmp_path):
    """Ray actors inherit the environment of the cluster, not of the driver (here: a variable set
    after the local cluster started stands for one only the driver's shell has). And (the same
    cluster: it is slow to start) a rank killed while a child it forked runs (a checkpoint writer,
    which holds the rank's sockets) is seen dead by `raise_if_dead` and fails the call at once,
    and the child dies with it."""
    ray = pytest.importorskip("ray")
    from entr_megatron.controller.ranks.ray_workers import RayWorkerGroup

    here = str(Path(__file__).parent)  # the cluster's workers import workers_fixture from here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        monkeypatch.setenv("ENTR_TEST_API_KEY", "s3cret")
        monkeypatch.setenv("ENTR_TEST_OTHER", "not passed")
        group = RayWorkerGroup(1, make_echo, ("t",),
                               env_from_driver=("ENTR_TEST_API_KEY", "ENTR_TEST_UNSET"))
        try:
            assert isinstance(group, WorkerGroup)
            names = ["ENTR_TEST_API_KEY", "ENTR_TEST_OTHER", "ENTR_TEST_UNSET"]
            assert group.call(EchoWorker.getenv, names) == [{"ENTR_TEST_API_KEY": "s3cret", "ENTR_TEST_OTHER": None,
                                                   "ENTR_TEST_UNSET": None}]
            group.raise_if_dead("a push", grace_s=5.0)  # alive: returns
            pending, child = _kill_rank_while_its_child_runs(group, tmp_path)
            t0 = time.monotonic()
            with pytest.raises(WorkerError, match="rank 0 died during the push of weight version 8"):
                group.raise_if_dead("the push of weight version 8", grace_s=30.0)  # what RemotePush.wait asks
            assert time.monotonic() - t0 < 20  # seen dead, not the grace running out
            with pytest.raises(WorkerError, match="rank 0 failed in EchoWorker.fork_and_wait"):
                pending.result(timeout=60)
            assert time.monotonic() - t0 < 30  # not Ray's keepalive (minutes)
            child.wait(10)  # gone with the rank
        finally:
            group.shutdown()
    finally:
        ray.shutdown()


def test_a_call_names_the_method_object_not_a_string():
    group = ProcessWorkerGroup(1, make_echo, ("t",), wait=False)
    try:
        with pytest.raises(TypeError, match="method object"):
            group.call("add", 1)
        group.wait_ready()
        assert group.call(EchoWorker.add, 1) == [("t", 0, 1)]
    finally:
        group.shutdown()
