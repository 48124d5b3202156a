"""The controller's in-flight bookkeeping (controller/rl/inflight.py) on hand-built arrivals: a group
leaves flight when its n-th sample arrives, in any order; samples of a group given up on are
swallowed exactly as many times as they were still owed; lost groups are those no engine holds."""

from __future__ import annotations

from entr_megatron.controller.rl.buffer import GroupRef
from entr_megatron.controller.rl.inflight import InFlight
from entr_megatron.rollout.engine import GenerateResult


def result(rid, index):
    return GenerateResult(request_id=rid, sample_index=index, prompt_ids=[1], output_ids=[2], logprobs=[-0.1],
                          versions=[0], finish_reason="stop")


def test_a_group_is_returned_once_its_last_sample_arrives_in_any_order():
    f = InFlight(n=3)
    f.add("a", GroupRef(7, 70), "ref-a", engine_version=2)
    f.add("b", GroupRef(8, 80), "ref-b", engine_version=3)
    assert f.accept(result("a", 2)) is None and f.accept(result("a", 0)) is None
    group = f.accept(result("a", 1))
    assert group is not None and group.ref == GroupRef(7, 70) and group.reference == "ref-a"
    assert sorted(group.results) == [0, 1, 2] and len(f) == 1 and f.refs() == [GroupRef(8, 80)]
    assert f.accept(result("zzz", 0)) is None  # unknown (abandoned before): ignored


def test_given_up_groups_swallow_exactly_the_samples_still_owed():
    f = InFlight(n=4)
    f.add("old", GroupRef(1, 10), None, engine_version=0)
    f.add("new", GroupRef(2, 20), None, engine_version=5)
    f.accept(result("old", 0))
    doomed = f.give_up(lambda g: g.engine_version < 3)
    assert list(doomed) == ["old"] and f.ignored == {"old": 3} and len(f) == 1 and f.busy
    for i in (1, 2, 3):
        assert f.accept(result("old", i)) is None
    assert f.ignored == {}
    f.give_up()  # all
    assert len(f) == 0 and f.ignored == {"new": 4}
    for _ in range(4):
        f.swallow("new")
    assert not f.busy


def test_lost_groups_are_those_no_engine_holds_and_a_renumbered_request_keeps_its_group():
    f = InFlight(n=2)
    f.add("x", GroupRef(1, 1), None, engine_version=0)
    f.add("y", GroupRef(2, 2), None, engine_version=0)
    f.add("z", GroupRef(3, 3), None, engine_version=0)
    f.renumber("z", "engine-z")
    f.give_up(lambda g: g.ref.group_id == 2)  # y: 2 owed
    live = {"x"}
    assert f.lost(lambda rid: rid in live) == [GroupRef(3, 3)]
    assert f.refs() == [GroupRef(1, 1)] and f.ignored == {}  # y's engine is gone: nothing more will come
