"""The throughput planner against closed forms: a synchronous step is generation + training + push
(each hand-computed from the costs), one-step-off overlaps generation with training, fully-async
is learner-bound when engines are fast and keeps every token within the lag bound, its lags follow
the controller's receive cadence (derived by hand from the loop's logic); the line fit
of the run-directory calibration recovers a known line."""

from __future__ import annotations

import pytest

from entr_megatron.study.planner import Costs, Workload, fit_line, simulate

BASE = dict(decode_base_s=0.01, decode_per_seq_s=0.001, prefill_per_token_s=1e-4, train_per_token_s=1e-3,
            train_overhead_s=0.2, push_s=0.05, swap_s=0.01, prompt_len=10, response_median=20, max_new_tokens=64)
P, N = 4, 4


def hand(costs: Costs) -> tuple[float, float]:
    """(generation, training) seconds of one step of P x N sequences of constant length L on one engine."""
    b, L = P * N, costs.response_median
    gen = L * (costs.decode_base_s + costs.decode_per_seq_s * b) + costs.prefill_per_token_s * costs.prompt_len * b
    train = costs.train_overhead_s + costs.train_per_token_s * b * (L + costs.prompt_len)
    return gen, train


def test_sync_step_is_generation_plus_training_plus_push():
    costs = Costs(**BASE)
    gen, train = hand(costs)
    plan = simulate(costs, Workload(prompts_per_step=P, n=N, steps=5), "sync")
    assert plan.step_s[0] == pytest.approx(gen + train + costs.push_s + costs.swap_s)
    assert plan.mean_step_s == pytest.approx(gen + train + costs.push_s + costs.swap_s)
    assert plan.mean_lag == 0 and plan.response_tokens == 5 * P * N * 20
    assert plan.summary()["learner_idle"] == pytest.approx(1 - train / plan.step_s[0])


@pytest.mark.parametrize("train_per_token", [1e-3, 1e-5])  # learner-bound, then engine-bound
def test_one_step_off_overlaps_generation_with_training(train_per_token):
    costs = Costs(**{**BASE, "train_per_token_s": train_per_token})
    gen, train = hand(costs)
    plan = simulate(costs, Workload(prompts_per_step=P, n=N, steps=6), "one_step_off")
    steady = plan.step_s[2:]
    assert steady == pytest.approx([max(gen, train) + costs.push_s + costs.swap_s] * len(steady))
    assert plan.max_lag == 1


def test_fully_async_is_learner_bound_with_fast_engines_and_keeps_the_bound():
    costs = Costs(**{**BASE, "decode_base_s": 1e-4, "decode_per_seq_s": 1e-5, "response_sigma": 1.0})
    w = Workload(prompts_per_step=P, n=N, steps=40, max_policy_lag=2)
    plan = simulate(costs, w, "fully_async")
    tokens_per_step = plan.response_tokens / w.steps + P * N * costs.prompt_len
    train = costs.train_overhead_s + costs.train_per_token_s * tokens_per_step
    assert plan.mean_step_s == pytest.approx(train, rel=0.05)
    assert plan.max_lag <= 2 and plan.summary()["learner_idle"] < 0.05


def test_fully_async_lags_follow_the_controllers_receive_cadence():
    """The loop receives only while it collects, and counts groups it has not received as in flight
    (the engines get new work only then). With engines that finish 2P groups well within a training
    step and a bound of 4, by hand: step 0 receives 2P, submits 2P more and trains P (lag 0); step 1
    trains the other P (lag 1); step 2 receives the 2P submitted at version 0 (lag 2) and submits 2P;
    step 3 lag 3; from step 4 on, 2 and 3 alternate, plus 1/20: the push of the version just trained
    (push_s 0) lands after the first decode step of the new submission had started, so 1 of the 20
    tokens is one version older (weights swap between decode steps). Measured in the modes study:
    mean lag 2.56-2.66."""
    costs = Costs(**{**BASE, "decode_base_s": 1e-4, "decode_per_seq_s": 1e-5, "push_s": 0.0, "swap_s": 0.0})
    plan = simulate(costs, Workload(prompts_per_step=P, n=N, steps=12, max_policy_lag=4), "fully_async")
    assert plan.step_lag_mean == pytest.approx([0, 1, 2, 3] + [2.05, 3.05] * 4)
    assert plan.dropped == 0


def test_fully_async_beats_sync_on_a_long_tail():
    costs = Costs(**{**BASE, "response_sigma": 1.0, "max_new_tokens": 400, "train_per_token_s": 2e-4})
    w = Workload(prompts_per_step=P, n=N, steps=40, max_policy_lag=4)
    sync, fast = simulate(costs, w, "sync"), simulate(costs, w, "fully_async")
    assert fast.tokens_per_s > 1.2 * sync.tokens_per_s
    assert 0 < fast.mean_lag <= 4 and fast.max_lag <= 4


def test_fixed_lag_lags_are_prescribed():
    costs = Costs(**{**BASE, "max_new_tokens": 20})
    plan = simulate(costs, Workload(prompts_per_step=P, n=N, steps=12, inter_lag=3, intra_lag=1), "fixed_lag")
    # steps 4..11: 10 tokens at lag 4, 10 at lag 3; step 3: all 20 at lag 3 (clamped); x P*N sequences
    assert plan.lag_tokens[4] == 8 * 10 * P * N and plan.lag_tokens[3] == (20 + 8 * 10) * P * N


def test_fit_line_and_cost_errors():
    assert fit_line([1, 2, 3, 4], [2.5, 3.5, 4.5, 5.5]) == pytest.approx((1.5, 1.0))
    assert fit_line([1, 2], [-1.0, 0.5])[0] == 0.0  # never a negative intercept
    with pytest.raises(ValueError, match="costs.push_s"):
        Costs(**{**BASE, "push_s": -1})
    with pytest.raises(ValueError, match="unknown"):
        Costs.from_dict({**BASE, "gpu": 1})
