"""EpisodeEngine: multi-turn episodes behind the RolloutEngine interface (rollout/episodes.py).

The inner engine is a scripted policy: each episode has a fixed script of policy tokens, and a
request continues it from however many policy tokens its prompt already holds (observation ids
are recognised and skipped), so an episode's tokens do not depend on how it was cut into calls.
Weight versions go up every `switch_every` generated tokens, as if updates arrived mid-turn.
"""

import math
import threading
import time

import pytest
import torch

from entr_megatron.algorithm import compute_policy_loss
from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.rollout.engine import EngineHealth, GenerateRequest, GenerateResult, SamplingParams, generate
from entr_megatron.rollout.episodes import RESUME, EpisodeBudgets, EpisodeEngine, episode_metrics
from entr_megatron.tasks.environment import Step
from entr_megatron.types import TrainBatch

from controller_fakes import DeliveredPush

CALL, EOS, OBS = 3, 2, (7, 8)
PROMPT = [1, 20, 21]
SCRIPT = [10, 11, CALL, 12, 13, 14, CALL, 15, EOS]  # two tool calls, then the answer


class ToyEnv:
    """A tool call is a turn ending in CALL; its observation is OBS. Anything else ends the episode."""

    stop_token_ids = (CALL,)

    def __init__(self, raise_on_call=False, delay_s=0.0):
        self.raise_on_call, self.delay_s = raise_on_call, delay_s

    def reset(self, prompt_ids, reference):
        return list(prompt_ids)

    def step(self, generated_ids):
        time.sleep(self.delay_s)
        if generated_ids[-1] == CALL:
            if self.raise_on_call:
                raise RuntimeError("the tool crashed")
            return Step(list(OBS), False, 0.0, ())
        return Step([], True, 1.0, ())


class ScriptedPolicy:
    def __init__(self, script=SCRIPT, switch_every=4, routes=False):
        self.script, self.switch_every, self.routes = script, switch_every, routes
        self.version, self.emitted, self.queue, self.requests, self.aborted = 0, 0, [], [], []
        self.live = set()

    def submit(self, requests):
        for req in requests:
            self.requests.append(req)
            self.live.add(req.request_id)
            done = [t for t in req.prompt_ids[len(PROMPT):] if t not in OBS]
            out, versions = [], []
            for t in self.script[len(done):]:
                if len(out) == req.params.max_new_tokens:
                    break
                out.append(t)
                versions.append(self.version)
                self.emitted += 1
                if self.emitted % self.switch_every == 0:
                    self.version += 1
                if t in req.params.stop_token_ids or t == EOS:
                    break
            reason = "stop" if out and (out[-1] in req.params.stop_token_ids or out[-1] == EOS) else "length"
            fed = len(req.prompt_ids) + len(out) - 1
            routes = torch.arange(fed, dtype=torch.int16).view(fed, 1, 1) + 100 * len(self.requests) if self.routes else None
            self.queue.append(GenerateResult(
                request_id=req.request_id, sample_index=0, prompt_ids=req.prompt_ids, output_ids=out,
                logprobs=[-0.1 - 0.01 * t for t in out], versions=versions, finish_reason=reason,
                entropy=[0.5] * len(out), group_id=req.group_id, routed_experts=routes))
        return [r.request_id for r in requests]

    def poll(self, timeout=0.0):
        out, self.queue = self.queue, []
        for r in out:
            self.live.discard(r.request_id)
        return out

    def is_live(self, rid):
        return rid in self.live

    def abort(self, ids):
        self.aborted += list(ids)

    def health(self):
        return EngineHealth(alive=True, weight_version=self.version)

    @property
    def weight_version(self):
        return self.version

    def pause(self): ...
    def resume(self): ...
    def update_weights(self, weights, version): raise NotImplementedError
    def shutdown(self): ...


def run(engine, n=1, max_new_tokens=64, metadata=None, seed=5):
    req = GenerateRequest(PROMPT, SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed), group_id=4,
                          metadata=dict(metadata or {}))
    return generate(engine, [req], timeout_s=10)


def expected_episode():
    t1, t2, t3 = SCRIPT[:3], SCRIPT[3:7], SCRIPT[7:]
    return t1 + list(OBS) + t2 + list(OBS) + t3, [True] * 3 + [False] * 2 + [True] * 4 + [False] * 2 + [True] * 2


def test_episode_interleaves_turns_and_observations_and_spans_weight_updates():
    inner = ScriptedPolicy(switch_every=4)
    results = run(EpisodeEngine(inner, ToyEnv), n=2)
    response, mask = expected_episode()
    for i, r in enumerate(results):
        assert r.sample_index == i and r.output_ids == response and r.loss_mask == mask and r.finish_reason == "stop"
        assert r.prompt_ids == PROMPT and r.group_id == 4
        for lp, h, m, t in zip(r.logprobs, r.entropy, mask, response):
            assert (lp, h) == ((-0.1 - 0.01 * t, 0.5) if m else (0.0, 0.0))
        # observations carry the version of the policy token before them
        for k, m in enumerate(mask):
            if not m:
                assert r.versions[k] == r.versions[k - 1]
        assert r.episode == {"turns": 3, "tool_calls": {}, "tool_errors": {}, "env_reward": 1.0, "ended": True,
                             "turn_tokens": 0}
    # the engine switched weights every 4 generated tokens: each episode spans several versions,
    # inside a turn too (turn 2 of sample 0 holds tokens 4..7 of the stream: versions 0 and 1)
    s0 = results[0].to_sample()
    policy_versions = [v for v, m in zip(s0.versions, s0.loss_mask) if m]
    assert policy_versions == sorted(policy_versions) and len(set(policy_versions)) >= 2
    metrics = episode_metrics([r.to_sample() for r in results])
    assert metrics["agent/turns_mean"] == 3.0
    assert metrics["agent/observation_token_frac"] == pytest.approx(4 / 13)
    assert metrics["agent/versions_spanned_max"] == max(len({v for v, m in zip(r.versions, mask) if m}) for r in results)
    # every turn was a request with the whole history as its prompt, n=1, the env's stop token
    turn_prompts = [q.prompt_ids for q in inner.requests]
    assert PROMPT + SCRIPT[:3] + list(OBS) in turn_prompts
    assert all(q.params.n == 1 and CALL in q.params.stop_token_ids for q in inner.requests)
    assert len({q.params.seed for q in inner.requests}) == len(inner.requests)  # a seed per episode and turn


def test_observation_tokens_get_zero_gradient_and_both_versions_are_trained():
    (r,) = run(EpisodeEngine(ScriptedPolicy(switch_every=3), ToyEnv))
    sample = r.to_sample()
    batch = TrainBatch.from_samples([sample], torch.tensor([1.0]))
    tokens, T = batch.tokens_T, batch.tokens_T.numel()
    logits = torch.randn(T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    targets = torch.cat([tokens[1:], tokens[:1]])
    logprobs = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    loss, _ = compute_policy_loss(logprobs[None], entropy[None].detach(), batch.behaviour_logprobs_T[None].double(),
                                  torch.tensor([1.0], dtype=torch.float64), batch.loss_mask_T[None],
                                  AlgorithmConfig(correction="none", policy_loss="reinforce"))
    loss.backward()
    grad_rows = logits.grad.abs().sum(-1)
    p = len(sample.prompt_ids)
    for k, m in enumerate(sample.loss_mask):
        j = p - 1 + k  # the target position of response token k
        assert (grad_rows[j] > 0) == m, (k, m)
    assert grad_rows[: p - 1].eq(0).all() and grad_rows[-1] == 0
    trained_versions = {int(batch.versions_T[j]) for j in range(T) if batch.loss_mask_T[j] and grad_rows[j] > 0}
    assert len(trained_versions) >= 2


@pytest.mark.parametrize("cut", [1, 2, 3, 4, 5, 6, 8])
def test_a_paused_episode_resumed_equals_the_uninterrupted_one(cut):
    """Segments of `cut` policy tokens (fixed_lag's intra-lag), mid-turn and at turn ends."""
    full = run(EpisodeEngine(ScriptedPolicy(), ToyEnv))[0]
    engine = EpisodeEngine(ScriptedPolicy(), ToyEnv)
    r = run(engine, max_new_tokens=cut)[0]
    segments = 1
    while not r.episode["ended"]:
        assert r.finish_reason == "length" and sum(r.loss_mask) == cut * segments
        r = run(engine, max_new_tokens=cut, metadata={RESUME: r.to_sample()})[0]
        segments += 1
    assert segments == math.ceil(sum(full.loss_mask) / cut)
    assert (r.output_ids, r.loss_mask, r.logprobs, r.finish_reason) == (full.output_ids, full.loss_mask, full.logprobs, "stop")
    assert r.episode["turns"] == 3 and r.episode["env_reward"] == 1.0


def test_budgets_cut_episodes_as_configured():
    call = SCRIPT[:3]
    # max_turns=2: the second turn's call is not run and the episode ends there
    (r,) = run(EpisodeEngine(ScriptedPolicy(), ToyEnv, EpisodeBudgets(max_turns=2)))
    assert r.output_ids == call + list(OBS) + SCRIPT[3:7] and r.finish_reason == "length" and r.episode["turns"] == 2
    # max_turn_tokens=2: the first turn stops after 2 tokens without a call: the env ends it
    (r,) = run(EpisodeEngine(ScriptedPolicy(), ToyEnv, EpisodeBudgets(max_turn_tokens=2)))
    assert r.output_ids == SCRIPT[:2] and r.finish_reason == "length" and r.episode["ended"]
    # max_response_tokens: room for turn 1 and its observation, not for the next observation
    (r,) = run(EpisodeEngine(ScriptedPolicy(), ToyEnv, EpisodeBudgets(max_response_tokens=10)))
    assert r.output_ids == call + list(OBS) + SCRIPT[3:7] and r.finish_reason == "length"
    # the request's max_new_tokens is the policy-token budget over all turns
    (r,) = run(EpisodeEngine(ScriptedPolicy(), ToyEnv), max_new_tokens=5)
    assert sum(r.loss_mask) == 5 and not r.episode["ended"]
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeBudgets(max_turns=0)


def test_a_crashing_environment_ends_the_episode_not_the_run():
    (r,) = run(EpisodeEngine(ScriptedPolicy(), lambda: ToyEnv(raise_on_call=True)))
    assert r.output_ids == SCRIPT[:3] and r.episode["tool_errors"] == {"environment": 1}
    assert "the tool crashed" in r.episode["env_error"]


def test_tools_run_off_the_polling_thread_and_abort_reaches_them():
    inner = ScriptedPolicy()
    engine = EpisodeEngine(inner, lambda: ToyEnv(delay_s=0.3), tool_workers=2)
    t0 = time.monotonic()
    (rid,) = engine.submit([GenerateRequest(PROMPT, SamplingParams(n=2, max_new_tokens=64))])
    assert engine.poll(timeout=0.0) == [] and time.monotonic() - t0 < 0.2  # the tool sleeps elsewhere
    assert threading.active_count() >= 2 and engine.is_live(rid)
    engine.abort([rid])
    deadline, out = time.monotonic() + 5, []
    while len(out) < 2 and time.monotonic() < deadline:
        out += engine.poll(timeout=0.1)
    assert sorted(r.sample_index for r in out) == [0, 1] and {r.finish_reason for r in out} == {"abort"}
    assert all(r.output_ids == SCRIPT[:3] for r in out) and not engine.is_live(rid)
    engine.close()


def test_a_request_with_a_lost_episode_is_dropped_whole():
    inner = ScriptedPolicy()
    engine = EpisodeEngine(inner, ToyEnv)
    (rid,) = engine.submit([GenerateRequest(PROMPT, SamplingParams(n=2, max_new_tokens=64))])
    lost = inner.requests[0].request_id
    inner.live.discard(lost)  # its engine was replaced: that turn's result will never come
    inner.queue = [q for q in inner.queue if q.request_id != lost]
    assert not engine.is_live(rid)
    assert inner.aborted == [inner.requests[1].request_id]  # the surviving episode is aborted
    assert engine.poll(timeout=0.0) == []  # and its late result is ignored


def test_routes_of_each_position_come_from_the_turn_that_first_fed_it():
    inner = ScriptedPolicy(routes=True)
    (r,) = run(EpisodeEngine(inner, ToyEnv))
    fed = len(PROMPT) + len(r.output_ids) - 1
    assert r.routed_experts.shape == (fed, 1, 1)
    # turn k (request k + 1) gives rows [where turn k - 1 stopped, its prompt + output - 1): the rows of
    # an observation come from the next turn's prefill, which fed it first
    ends = [len(q.prompt_ids) - len(OBS) for q in inner.requests[1:]] + [fed + 1]
    start = 0
    for k, end in enumerate(ends):
        rows = r.routed_experts[start:end - 1, 0, 0].tolist()
        assert rows == [row + 100 * (k + 1) for row in range(start, end - 1)]
        start = end - 1


class CountingEnv:
    """Two observations, then done: turns end by max_turn_tokens (the mock samples no stop token)."""

    stop_token_ids = ()

    def __init__(self):
        self.turns = 0

    def reset(self, prompt_ids, reference):
        return list(prompt_ids)

    def step(self, generated_ids):
        self.turns += 1
        return Step([5, 6], False, 0.0, ()) if self.turns < 3 else Step([], True, 0.0, ())


def test_episodes_over_the_sglang_client_continue_from_the_previous_turns_tokens():
    from sglang_mock import MockSGLangServer, engine_for, mock_logprob, mock_token

    with MockSGLangServer(vocab_size=1000) as server, engine_for(server) as sglang:
        engine = EpisodeEngine(sglang, CountingEnv, EpisodeBudgets(max_turns=3, max_turn_tokens=4))
        (r,) = generate(engine, [GenerateRequest([3, 1, 4], SamplingParams(temperature=0.7, max_new_tokens=12, seed=9))],
                        timeout_s=20)
        payloads = server.calls_to("/generate")
        assert len(payloads) == 3
        history, want_lp = [3, 1, 4], []
        for k, p in enumerate(payloads):
            assert p["input_ids"] == history  # each turn: the whole previous history as token ids
            seed = p["sampling_params"]["sampling_seed"]
            turn = [mock_token(history, seed, False, t, 1000) for t in range(4)]
            want_lp += [mock_logprob(t, 0.7) for t in turn] + ([0.0, 0.0] if k < 2 else [])
            history = history + turn + ([5, 6] if k < 2 else [])
        assert r.prompt_ids == [3, 1, 4] and r.output_ids == history[3:]
        assert r.logprobs == pytest.approx(want_lp) and r.loss_mask == ([True] * 4 + [False] * 2) * 2 + [True] * 4
        assert r.episode["turns"] == 3 and r.episode["ended"]


# ---- the controller drives episodes in every mode ---------------------------------------------------

class _Pusher:
    def __init__(self, engine):
        self.engine = engine

    def push(self, version):
        self.engine.version = version
        return DeliveredPush()


class _Learner:
    def __init__(self):
        self.records = []

    def train(self, batch, current_version):
        self.records.append((batch, current_version))
        return {}


class _Task:
    name = "toy"

    def prompts(self, split, n, seed):
        return [([1 + (seed * n + j) % 97, 2, 3], seed * n + j) for j in range(n)]

    def reward(self, sample, reference):
        return float((sum(sample.response_ids) + reference) % 2)


@pytest.mark.parametrize("mode, extra", [
    ("sync", {}), ("one_step_off", {}), ("fully_async", {}),
    ("fixed_lag", {"inter_lag": 1, "intra_lag": 1, "intra_lag_stride": 4}),
])
def test_the_controller_trains_whole_episodes_in_every_mode(mode, extra):
    from entr_megatron.config import ControllerConfig, RolloutConfig, SamplingConfig
    from entr_megatron.controller.rl.loop import Controller

    inner = ScriptedPolicy(switch_every=10**9)  # versions move only by pushes
    engine = EpisodeEngine(inner, ToyEnv)
    learner = _Learner()
    controller = ControllerConfig(mode=mode, max_policy_lag=2, **extra)
    rollout = RolloutConfig(prompts_per_step=2, sampling=SamplingConfig(n=2, max_new_tokens=16))
    history = Controller(engine, learner, _Pusher(inner), _Task(), controller, rollout, "grpo").run(5)
    response, mask = expected_episode()
    for (batch, v), m in zip(learner.records, history):
        cu = batch.cu_seqlens.tolist()
        assert batch.num_seqs == 4 and m["agent/turns_mean"] == 3.0
        for a, b in zip(cu[:-1], cu[1:]):
            assert batch.tokens_T[a + 3:b].tolist() == response  # whole episodes, observations in place
            assert batch.loss_mask_T[a + 2:b - 1].tolist() == mask
            versions = batch.versions_T[a:b][batch.loss_mask_T[a:b]].tolist()
            assert min(versions) >= v - 2  # the bound judges the oldest policy token
            if mode == "fixed_lag" and v >= 2:  # segments of 4 policy tokens: v - 2, then v - 1
                assert versions == [v - 2] * 4 + [v - 1] * 5
            if mode == "sync":
                assert versions == [v] * 9
