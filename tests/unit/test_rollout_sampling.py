"""sampling.py against a float64 reference written from the definition, and the rollout records."""

import math

import pytest
import torch

from entr_megatron.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from entr_megatron.rollout.sampling import row_params, sample_tokens, sampling_logprobs
from entr_megatron.types import Sample, TrainBatch

VOCAB = 50
CASES = [  # (temperature, top_p, top_k)
    (1.0, 1.0, 0), (0.7, 1.0, 0), (1.6, 1.0, 0), (1.0, 0.9, 0), (0.7, 0.9, 0), (1.0, 0.5, 0),
    (1.0, 1.0, 5), (0.7, 0.9, 8), (1.3, 0.3, 3), (1.0, 1.0, 1), (1.0, 1e-6, 0), (1.0, 1.0, VOCAB),
    (0.0, 1.0, 0), (0.0, 0.5, 3),
]


def reference_log_q(logits_V, temperature, top_p, top_k):
    """log q in float64, one row, by the definition in sampling.py (loops, no shared code)."""
    z = [float(v) for v in logits_V.double()]
    if temperature == 0:  # greedy rows report the model's T=1 distribution, untruncated
        temperature, top_p, top_k = 1.0, 1.0, 0
    x = [v / temperature for v in z]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    kept = set(order)
    if top_k >= 1:
        kth = x[order[min(top_k, len(x)) - 1]]
        kept = {i for i in order if x[i] >= kth}
    if top_p < 1.0:
        m = max(x[i] for i in kept)
        norm = sum(math.exp(x[i] - m) for i in kept)
        mass, nucleus = 0.0, set()
        for i in (i for i in order if i in kept):
            if mass < top_p or not nucleus:
                nucleus.add(i)
            mass += math.exp(x[i] - m) / norm
        kept = nucleus
    m = max(x[i] for i in kept)
    log_norm = m + math.log(sum(math.exp(x[i] - m) for i in kept))
    return [x[i] - log_norm if i in kept else -math.inf for i in range(len(x))]


def make_logits(seed, rows=6, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * scale


def params_rows(case, rows):
    t, p, k = case
    return row_params([SamplingParams(temperature=t, top_p=p, top_k=k)] * rows)


@pytest.mark.parametrize("case", CASES)
def test_logprobs_and_entropy_are_those_of_the_sampled_distribution(case):
    logits = make_logits(hash(case) % 1000)
    t_B, p_B, k_B = params_rows(case, logits.shape[0])
    gens = [torch.Generator().manual_seed(i) for i in range(logits.shape[0])]
    out = sample_tokens(logits, t_B, p_B, k_B, gens, raw_logprobs=True)
    full = sampling_logprobs(logits, t_B, p_B, k_B)
    for b in range(logits.shape[0]):
        ref = torch.tensor(reference_log_q(logits[b], *case), dtype=torch.float64)
        support = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(full[b]), support), f"support differs, row {b} {case}"
        torch.testing.assert_close(full[b][support].double(), ref[support], atol=1e-5, rtol=0)
        token = int(out.tokens_B[b])
        assert support[token], f"sampled token {token} outside the support {case}"
        assert abs(float(out.logprobs_B[b]) - float(ref[token])) < 1e-5
        q = ref[support].exp()
        assert abs(float(out.entropy_B[b]) - float(-(q * ref[support]).sum())) < 1e-5
        raw = torch.log_softmax(logits[b].double(), -1)[token]
        assert abs(float(out.raw_logprobs_B[b]) - float(raw)) < 1e-5
    assert out.tokens_B.dtype == torch.long and out.logprobs_B.dtype == out.entropy_B.dtype == torch.float32


def test_draws_follow_q():
    """Empirical frequencies of 40k draws match q (T=0.8, top-p 0.9, top-k 12) within 5 sigma."""
    row = make_logits(7, rows=1, scale=1.5)
    n = 40_000
    logits = row.expand(n, VOCAB)
    t_B, p_B, k_B = row_params([SamplingParams(temperature=0.8, top_p=0.9, top_k=12)] * n)
    out = sample_tokens(logits, t_B, p_B, k_B, torch.Generator().manual_seed(0))
    q = torch.tensor(reference_log_q(row[0], 0.8, 0.9, 12), dtype=torch.float64).exp()
    freq = torch.bincount(out.tokens_B, minlength=VOCAB).double() / n
    sigma = (q * (1 - q) / n).sqrt()
    assert ((freq - q).abs() <= 5 * sigma + 1e-12).all(), (freq, q)
    assert (freq[q == 0] == 0).all()


def test_greedy_takes_the_argmax():
    logits = make_logits(3)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the lower id wins, as torch.argmax
    t_B, p_B, k_B = row_params([SamplingParams(temperature=0.0, top_p=0.5, top_k=3)] * logits.shape[0])
    out = sample_tokens(logits, t_B, p_B, k_B, [None] * logits.shape[0], raw_logprobs=True)
    assert torch.equal(out.tokens_B, logits.argmax(-1)) and int(out.tokens_B[2]) == 7
    raw = torch.log_softmax(logits, -1).gather(-1, out.tokens_B[:, None]).squeeze(-1)
    torch.testing.assert_close(out.raw_logprobs_B, raw)
    torch.testing.assert_close(out.logprobs_B, raw)
    full = sampling_logprobs(logits, t_B, p_B, k_B)
    assert torch.isfinite(full).all() and torch.equal(full.argmax(-1), out.tokens_B)


def test_greedy_rows_report_the_t1_log_softmax_in_a_mixed_batch():
    """Greedy rows (with top-k/top-p set, which they ignore) next to sampled rows: log-prob and
    entropy of the untruncated T = 1 softmax (float64 reference), as SGLang reports; the point
    mass would give 0 and 0. Sampled rows keep those of their own q."""
    logits = make_logits(21, rows=6)
    params = [
        SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.0, top_p=0.3, top_k=2), SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.0, top_k=1), SamplingParams(),
    ]
    greedy = [b for b, p in enumerate(params) if p.greedy]
    gens = [None if p.greedy else torch.Generator().manual_seed(b) for b, p in enumerate(params)]
    rows = row_params(params)
    out = sample_tokens(logits, *rows, gens)
    full = sampling_logprobs(logits, *rows)
    logp_BV = torch.log_softmax(logits.double(), -1)
    for b, p in enumerate(params):
        token = int(out.tokens_B[b])
        if p.greedy:
            assert token == int(logits[b].argmax())
            ref_lp, ref_ent = logp_BV[b, token], -(logp_BV[b].exp() * logp_BV[b]).sum()
            assert float(ref_lp) < -1e-3 and float(ref_ent) > 1e-3  # not the point mass's 0
        else:
            ref = torch.tensor(reference_log_q(logits[b], p.temperature, p.top_p, max(p.top_k, 0)),
                               dtype=torch.float64)
            support = torch.isfinite(ref)
            ref_lp, ref_ent = ref[token], -(ref[support].exp() * ref[support]).sum()
        assert abs(float(out.logprobs_B[b]) - float(ref_lp)) < 1e-6, (b, p)
        assert abs(float(out.entropy_B[b]) - float(ref_ent)) < 1e-6, (b, p)
        # sampling_logprobs is the same q: its value at the token agrees with sample_tokens.
        assert float(full[b, token]) == float(out.logprobs_B[b]), (b, p)
    torch.testing.assert_close(full[greedy].double(), logp_BV[greedy], atol=1e-6, rtol=0)


def test_rows_are_independent_of_the_batch():
    """A row's draw depends only on its logits, parameters and generator (mixed batch, other order)."""
    logits = make_logits(11, rows=4)
    params = [
        SamplingParams(temperature=0.9), SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.8), SamplingParams(top_k=4),
    ]
    gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(4)]  # noqa: E731
    batch = sample_tokens(logits, *row_params(params), gens())
    for b in range(4):
        alone = sample_tokens(logits[b:b + 1], *row_params(params[b:b + 1]), [gens()[b]])
        assert int(alone.tokens_B[0]) == int(batch.tokens_B[b])
        assert float(alone.logprobs_B[0]) == float(batch.logprobs_B[b])
    again = sample_tokens(logits, *row_params(params), gens())
    assert torch.equal(again.tokens_B, batch.tokens_B)


def test_bfloat16_logits_are_sampled_in_float32():
    logits = make_logits(5).bfloat16()
    t_B, p_B, k_B = params_rows((0.7, 0.9, 0), logits.shape[0])
    out = sample_tokens(logits, t_B, p_B, k_B, torch.Generator().manual_seed(0))
    for b in range(logits.shape[0]):
        ref = reference_log_q(logits[b].float(), 0.7, 0.9, 0)
        assert abs(float(out.logprobs_B[b]) - ref[int(out.tokens_B[b])]) < 1e-5


def test_tokens_outside_top_k_and_top_p_are_never_drawn():
    logits = make_logits(9, rows=2000, scale=0.5)  # flat rows: many tokens near the cut
    t_B, p_B, k_B = params_rows((1.0, 0.6, 10), logits.shape[0])
    out = sample_tokens(logits, t_B, p_B, k_B, torch.Generator().manual_seed(1))
    full = sampling_logprobs(logits, t_B, p_B, k_B)
    assert torch.isfinite(full.gather(-1, out.tokens_B[:, None])).all()
    assert (torch.isfinite(full).sum(-1) <= 10).all()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(n=0), "n"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_request_and_result_records():
    with pytest.raises(ValueError, match="prompt_ids"):
        GenerateRequest([])
    with pytest.raises(ValueError, match="finish_reason"):
        GenerateResult("r", 0, [1], [2], [-0.5], [0], "eos")
    r = GenerateResult(
        "r", 1, [1, 2, 3], [4, 5], [-0.5, -1.0], [3, 4], "stop", entropy=[0.9, 1.1], group_id=7,
    )
    s = r.to_sample(reward=1.0)
    assert isinstance(s, Sample)
    assert (s.response_ids, s.behaviour_logprobs) == ([4, 5], [-0.5, -1.0])
    assert (s.versions, s.rollout_entropy) == ([3, 4], [0.9, 1.1])
    assert (s.reward, s.group_id, s.finish_reason) == (1.0, 7, "stop")
    batch = TrainBatch.from_samples([s], torch.zeros(1))
    assert batch.versions_T.tolist() == [0, 0, 3, 4, 0]
