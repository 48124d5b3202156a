"""StalenessBuffer: the hard lag bound at take time, stale policies, filtering, FIFO, resume."""

import json

import pytest

from entr_megatron.controller.rl.buffer import Group, StalenessBuffer, lag_metrics, oldest_version
from entr_megatron.types import Sample


def _sample(versions, reward=0.0, gid=0, mask=None):
    n = len(versions)
    return Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), behaviour_logprobs=[-1.0] * n,
                  versions=list(versions), reward=reward, group_id=gid, loss_mask=mask)


def _group(gid, versions, rewards=(0.0, 1.0)):
    return Group(gid, prompt_index=100 + gid, samples=[_sample(versions, r, gid) for r in rewards])


def test_take_is_fifo_and_waits_for_enough_groups():
    buf = StalenessBuffer(max_policy_lag=2)
    buf.put(_group(5, [3, 3]))
    assert buf.take(2, current_version=3) == [] and len(buf) == 1
    buf.put(_group(1, [3, 3]))
    buf.put(_group(9, [3, 3]))
    assert [g.group_id for g in buf.take(2, current_version=3)] == [5, 1]
    assert [g.group_id for g in buf.take(1, current_version=3)] == [9]


@pytest.mark.parametrize("lag", [0, 1, 4, 64])
def test_bound_is_on_the_oldest_token(lag):
    buf = StalenessBuffer(max_policy_lag=lag, stale_policy="drop")
    v = 100
    buf.put(_group(0, [v - lag, v]))  # exactly at the bound: allowed
    buf.put(_group(1, [v, v - lag - 1, v]))  # one token over the bound mid-sequence: stale
    buf.put(_group(2, [v - lag - 1]))
    got = buf.take(1, current_version=v)
    assert [g.group_id for g in got] == [0]
    assert buf.dropped == 2 and buf.regenerated == 0 and len(buf) == 0


def test_one_stale_sample_makes_the_group_stale_and_regenerates_its_prompt():
    buf = StalenessBuffer(max_policy_lag=1, stale_policy="regenerate")
    g = Group(4, 7, [_sample([5, 5], 0.0, 4), _sample([3, 5], 1.0, 4)])
    buf.put(g)
    assert buf.take(1, current_version=5) == []
    assert buf.regenerated == 1 and buf.dropped == 0
    (ref,) = buf.pop_regenerations()
    assert (ref.prompt_index, ref.attempt) == (7, 1)
    assert buf.pop_regenerations() == []


def test_regeneration_gives_up_after_max_regenerations():
    buf = StalenessBuffer(max_policy_lag=0, stale_policy="regenerate", max_regenerations=2)
    for attempt in range(3):
        buf.put(Group(attempt, 7, [_sample([0]), _sample([0], 1.0)], attempt=attempt))
        buf.take(1, current_version=1)
    assert buf.regenerated == 2 and buf.dropped == 1


def test_tool_tokens_do_not_count_for_staleness():
    s = _sample([0, 9, 9], mask=[False, True, True])
    assert oldest_version([s]) == 9
    buf = StalenessBuffer(max_policy_lag=1)
    buf.put(Group(0, 0, [s, s]))
    assert len(buf.take(1, current_version=10)) == 1


def test_dynamic_filtering_counts_zero_variance_groups():
    buf = StalenessBuffer(max_policy_lag=4, dynamic_filtering=True)
    assert not buf.put(_group(0, [1], rewards=(1.0, 1.0, 1.0)))
    assert buf.put(_group(1, [1], rewards=(1.0, 0.0, 1.0)))
    assert buf.filtered == 1 and len(buf) == 1
    assert StalenessBuffer(max_policy_lag=4).put(_group(0, [1], rewards=(1.0, 1.0)))


def test_lag_metrics():
    m = lag_metrics([_sample([8, 9, 10]), _sample([10, 10])], current_version=10)
    assert m["policy_lag/min"] == 0 and m["policy_lag/max"] == 2
    assert m["policy_lag/mean"] == pytest.approx(3 / 5)
    assert m["policy_lag/spread_max"] == 2 and m["policy_lag/spread_mean"] == 1


def test_state_dict_round_trip_is_json_and_exact():
    buf = StalenessBuffer(max_policy_lag=1, stale_policy="regenerate", dynamic_filtering=True)
    buf.put(_group(0, [0]))
    buf.put(_group(1, [2, 3]))
    buf.put(_group(2, [3], rewards=(1.0, 1.0)))
    buf.evict_stale(current_version=3)
    state = json.loads(json.dumps(buf.state_dict()))
    other = StalenessBuffer(max_policy_lag=1, stale_policy="regenerate", dynamic_filtering=True)
    other.load_state_dict(state)
    assert other.state_dict() == buf.state_dict()
    assert other.pop_regenerations() == buf.pop_regenerations()
    assert [s.versions for g in other.take(1, 3) for s in g.samples] == [[2, 3], [2, 3]]


def test_bad_policy_is_a_value_error():
    with pytest.raises(ValueError, match="stale_policy"):
        StalenessBuffer(max_policy_lag=1, stale_policy="keep")
