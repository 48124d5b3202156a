"""The policy loss fused into the output layer (parallel/fused_output_loss.py via learner/fused_output.py):
the learner's micro-batch loss (numerator, count, metrics, LossReport) and both gradients (hidden and
output weight) equal the unfused path's (the output matmul, then the vocab-parallel op and the loss on
its log-probs) at TP 1, 2 and 4, with sequence parallelism, a tied embedding and a padded vocabulary,
for ENTR, PPO-vs-mu (correction none), TIS, IcePop and DPPO-TV, in fp32 within 1e-5; and the op's
Triton kernels (run on CPU by Triton's interpreter) equal its PyTorch path."""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from common import INTERPRETER, close

from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.learner import LearnerConfig
from entr_megatron.utils.spawn import run_gloo

VOCAB = 96  # divisible by 1, 2, 4
HIDDEN = 16
PAD_MULTIPLE = 4  # sequence parallelism splits the packed tokens over up to 4 ranks

# Thresholds scaled to this case (|log pi - log mu| ~ 0.3 .. 1) so every mask drops some tokens.
ALGORITHMS = {
    "entr": dict(correction="entr", tau=0.5),
    "entr-rollout-seqmean": dict(correction="entr", tau=0.5, entropy_source="rollout",
                                 loss_agg_mode="seq-mean-token-mean"),
    "none": dict(correction="none"),
    "tis-sumnorm": dict(correction="tis", loss_agg_mode="seq-mean-token-sum-norm", loss_norm_tokens=16),
    "icepop": dict(correction="icepop"),
    "dppo_tv": dict(correction="none", policy_loss="dppo_tv", eps_clip_low=0.05, eps_clip_high=0.05),
}


def make_batch(seed, real_vocab):
    """Variable-length samples with tool tokens (loss mask off), one empty response, behaviour
    log-probs near the random model's, rollout entropy and versions."""
    from entr_megatron.types import Sample, TrainBatch

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(5):
        p, r = int(torch.randint(1, 5, (1,), generator=g)), 0 if i == 3 else int(torch.randint(2, 9, (1,), generator=g))
        samples.append(Sample(
            prompt_ids=torch.randint(0, real_vocab, (p,), generator=g).tolist(),
            response_ids=torch.randint(0, real_vocab, (r,), generator=g).tolist(),
            behaviour_logprobs=(-math.log(real_vocab) - 2.0 + 1.0 * torch.randn(r, generator=g)).tolist(),
            versions=[3] * r,
            rollout_entropy=(3.5 + 0.3 * torch.randn(r, generator=g)).tolist(),
            loss_mask=(torch.rand(r, generator=g) > 0.2).tolist(),
        ))
    return TrainBatch.from_samples(samples, torch.randn(5, generator=g))


class _CopyToTP(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _to_tp_region(x_local, group, sp):
    """The output layer's input mapping (learner/fused_output.py `_hidden_forward`)."""
    if sp:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        return gather_from_sequence_parallel_region(x_local, group=group)
    return _CopyToTP.apply(x_local, group)


def run_path(mb, algo, fused, rank, world, group, *, sp, tied, real_vocab, seed, temperature=0.8, backend="auto"):
    """One micro-batch's (numerator, count, report, grad of the layer input, grad of the weight shard)."""
    from entr_megatron.learner.loss import make_policy_loss_func

    g = torch.Generator().manual_seed(seed)
    n_tokens = mb.length
    hidden = torch.randn(n_tokens, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 2 / HIDDEN**0.5
    mix = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
    shard = VOCAB // world
    w = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()
    if tied:  # the shard is also the vocab-parallel embedding of the tokens: both uses' gradients add up
        ids = mb.tokens[0]
        local = ids - rank * shard
        owned = (local >= 0) & (local < shard)
        emb = w[torch.where(owned, local, 0)] * owned.unsqueeze(-1)
        if group is not None:  # reduce_from_tensor_model_parallel_region, forward only (identity backward)
            emb = emb + (_all_reduce_nograd(emb.detach(), group) - emb.detach())
        base = torch.tanh(emb @ mix) * 2
    else:
        base = hidden.clone().requires_grad_()
    lo, hi = (rank * n_tokens // world, (rank + 1) * n_tokens // world) if sp else (0, n_tokens)
    x_local = base[lo:hi]
    x = _to_tp_region(x_local, group, sp)
    learner = LearnerConfig(fused_output=True, fused_output_backend=backend)
    loss_func = make_policy_loss_func(mb, group, algo, learner, vocab_size=real_vocab, temperature=temperature)
    if fused:
        numerator, count, report = loss_func(x[None], output_weight=w)
    else:
        numerator, count, report = loss_func((x @ w.t())[None])
    numerator.backward()
    grad_in = w.grad if tied else base.grad  # tied: the weight's own gradient carries everything
    return numerator.detach(), count, report, None if tied else grad_in[lo:hi], w.grad


def _all_reduce_nograd(t, group):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def compare_reports(got, want, where):
    close(got.numerator, want.numerator, f"report numerator {where}")
    assert float(got.count) == float(want.count) and float(got.tokens) == float(want.tokens), where
    for name in ("weighted", "maxima"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.keys() == b.keys(), f"{name} keys {where}"
        for key in a:
            close(a[key], b[key], f"{name} {key} {where}", floor=1.0)
    for name in ("sums", "maxima", "minima"):
        a, b = getattr(got.mismatch, name), getattr(want.mismatch, name)
        assert a.keys() == b.keys(), f"mismatch {name} keys {where}"
        for key in a:
            close(a[key], b[key], f"mismatch {name} {key} {where}", floor=1.0)


def check_fused_equals_unfused(rank, world, group, names=tuple(ALGORITHMS), layouts=None, backend="auto"):
    from entr_megatron.learner.batching import pack_microbatches

    layouts = layouts or [dict(sp=False, tied=False, real_vocab=None), dict(sp=world > 1, tied=False, real_vocab=83),
                          dict(sp=False, tied=True, real_vocab=70)]
    for li, layout in enumerate(layouts):
        batch = make_batch(li, layout["real_vocab"] or VOCAB)
        mbs = pack_microbatches(batch, 24, PAD_MULTIPLE)
        assert len(mbs) >= 2
        for name in names:
            algo = AlgorithmConfig(**ALGORITHMS[name])
            for i, mb in enumerate(mbs):
                where = f"{name} rank {rank}/{world} {layout} micro-batch {i}"
                got = run_path(mb, algo, True, rank, world, group, seed=10 * li + i, backend=backend, **layout)
                want = run_path(mb, algo, False, rank, world, group, seed=10 * li + i, backend="torch", **layout)
                close(got[0], want[0], f"numerator {where}")
                assert torch.equal(got[1], want[1]) and got[1].dtype == torch.int, f"count {where}"
                compare_reports(got[2], want[2], where)
                if got[3] is not None:
                    close(got[3], want[3], f"grad hidden {where}")
                close(got[4], want[4], f"grad weight {where}")
                if i == 0 and name == "entr":  # (at TP 4 with vocab 70 the last rank holds only padding rows)
                    assert float(want[0]) != 0.0 and (rank > 0 or want[4].abs().sum() > 0), f"degenerate: {where}"


def _ranks_main(rank, world, backend="auto"):
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    torch.set_num_threads(1)
    names = tuple(ALGORITHMS) if world == 2 and backend == "auto" else ("entr", "dppo_tv")
    check_fused_equals_unfused(rank, world, dist.group.WORLD, names, backend=backend)


# The op's Triton kernels, run on CPU by Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
# without CUDA, before anything imports triton; spawned ranks inherit it).
needs_triton = pytest.mark.skipif(
    not INTERPRETER,
    reason="needs triton >= 3.9 (the dev extra installs it) and TRITON_INTERPRET=1 from the start (set without CUDA)",
)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_single_rank_fused_loss_equals_unfused():
    check_fused_equals_unfused(0, 1, None)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_fused_loss_equals_unfused(world):
    run_gloo(_ranks_main, world, timeout_s=300)


@needs_triton
def test_triton_fused_loss_in_the_learner_equals_unfused_at_tp2():
    """The learner's fused loss on the Triton kernels (SP, tied weights, a padded vocabulary, ENTR
    and DPPO) against the unfused PyTorch path, in fp32 within 1e-5."""
    run_gloo(_ranks_main, 2, "triton", timeout_s=300)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_op_triton_kernels_equal_the_torch_path(monkeypatch, dtype):
    """GEMM 1 with the statistics in its epilogue and the in-place gradient kernel against the
    PyTorch path: the same logits (16-bit: rounded alike), so the loss, log-probs and entropy agree
    to fp32 summation order, the gradients (the same cuBLAS/BLAS GEMMs on equal tiles) to 1e-5
    (fp32) or an ulp of the tile gradient's 16-bit rounding. 23 tokens in chunks of 8 (a partial
    chunk), 80 of 96 vocabulary rows real, temperature 0.7."""
    from entr_megatron.parallel import fused_output_triton
    from entr_megatron.parallel.fused_output_loss import vocab_parallel_linear_fused_loss

    calls = []
    for name in ("local_stats", "logits_grad_in_place"):
        real = getattr(fused_output_triton, name)
        monkeypatch.setattr(fused_output_triton, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k))
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(23, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g) / 2
    targets = torch.randint(0, 80, (23,), generator=g)
    adv = torch.randn(23, generator=g)

    def token_loss(s, e, lp, ent):
        ratio = torch.exp(lp - (lp.detach() - 0.1))
        return -torch.minimum(ratio * adv[s:e], ratio.clamp(0.9, 1.05) * adv[s:e]) * ent

    results = {}
    for backend in ("torch", "triton"):
        x, w = hidden.to(dtype).clone().requires_grad_(), weight.to(dtype).clone().requires_grad_()
        loss, lp, ent = vocab_parallel_linear_fused_loss(x, w, targets, token_loss, temperature=0.7, vocab_size=80,
                                                         chunk_tokens=8, backend=backend)
        (loss * 2.0).backward()
        results[backend] = (loss, lp, ent, x.grad, w.grad)
    assert calls == ["local_stats", "logits_grad_in_place"] * 3, calls  # 3 chunks, each on the kernels
    for name, got, want in zip(("loss", "logprob", "entropy"), results["triton"][:3], results["torch"][:3]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{dtype} {name}")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    close(results["triton"][3], results["torch"][3], f"{dtype} grad hidden", tol=tol)
    close(results["triton"][4], results["torch"][4], f"{dtype} grad weight", tol=tol)
    assert results["triton"][4].dtype == dtype and not results["triton"][4][80:].any()


def test_the_fused_loss_runs_only_for_token_local_losses(monkeypatch):
    """A sequence-level loss keeps the log-prob op (its backward recomputes the logits): the fused
    loss op is never called, and the result still equals the unfused path's."""
    from entr_megatron.learner import fused_output
    from entr_megatron.learner.batching import pack_microbatches

    calls = []
    real = fused_output.vocab_parallel_linear_fused_loss
    monkeypatch.setattr(fused_output, "vocab_parallel_linear_fused_loss",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    mb = pack_microbatches(make_batch(0, VOCAB), 10_000, PAD_MULTIPLE)[0]
    layout = dict(sp=False, tied=False, real_vocab=None)
    for algo, fused_loss in ((AlgorithmConfig(correction="entr"), True), (AlgorithmConfig(policy_loss="gspo"), False),
                             (AlgorithmConfig(correction="mis_token"), False)):
        calls.clear()
        got = run_path(mb, algo, True, 0, 1, None, seed=1, **layout)
        want = run_path(mb, algo, False, 0, 1, None, seed=1, **layout)
        assert bool(calls) == fused_loss, algo
        close(got[0], want[0], f"numerator {algo.correction} {algo.policy_loss}")
        close(got[3], want[3], f"grad hidden {algo.correction} {algo.policy_loss}")


@pytest.mark.parametrize("row_block", [None, 3])
def test_op_gradient_is_the_loss_gradient_times_the_incoming_scale(monkeypatch, row_block):
    """The op alone against float64 autograd of the same token-local loss; backward scales by the
    incoming gradient (Megatron multiplies by 1 / count later, or a caller may scale the loss).
    row_block 3: the work buffers hold 3 rows, so each 4-token chunk's tile is done in blocks of
    3 and 1 rows (the gradient written in place over the logits block by block)."""
    from entr_megatron.parallel import fused_output_loss
    from entr_megatron.parallel.fused_output_loss import GEMMS_PER_PASS, vocab_parallel_linear_fused_loss

    if row_block is not None:
        monkeypatch.setattr(fused_output_loss, "_ROW_BUFFER_ELEMENTS", row_block * 80)

    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 9, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g)
    targets = torch.randint(0, 80, (2, 9), generator=g)
    adv = torch.randn(18, generator=g)

    def token_loss(s, e, lp, ent):  # a clipped surrogate against the detached log-prob minus 0.1, times H
        ratio = torch.exp(lp - (lp.detach() - 0.1))
        return -torch.minimum(ratio * adv[s:e], ratio.clamp(0.9, 1.05) * adv[s:e]) * ent

    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, lp, ent = vocab_parallel_linear_fused_loss(x, w, targets, token_loss, temperature=0.7, vocab_size=80,
                                                     chunk_tokens=4)
    (loss * 2.5).backward()
    xr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = torch.log_softmax(xr @ wr[:80].t() / 0.7, dim=-1)
    lpr = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entr = -(logp.exp() * logp).sum(-1).detach()
    want = token_loss(0, 18, lpr.reshape(-1), entr.reshape(-1)).sum()
    (want * 2.5).backward()
    assert not lp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(lp.double(), lpr.detach(), atol=1e-5, rtol=0)
    close(loss, want.detach(), "loss")
    close(x.grad, xr.grad, "grad hidden")
    close(w.grad, wr.grad, "grad weight")
    assert w.grad[80:].abs().sum() == 0  # padding rows
    assert GEMMS_PER_PASS == 3


def test_op_bad_arguments_are_named():
    from entr_megatron.parallel.fused_output_loss import vocab_parallel_linear_fused_loss

    x, w, t = torch.zeros(3, 4), torch.zeros(8, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_linear_fused_loss(x, w, t, lambda s, e, lp, h: lp, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        vocab_parallel_linear_fused_loss(x, w, t, lambda s, e, lp, h: lp, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"weight must be the \[V/tp, h\]"):
        vocab_parallel_linear_fused_loss(x, torch.zeros(8, 5), t, lambda s, e, lp, h: lp)
    with pytest.raises(ValueError, match="targets must be token ids"):
        vocab_parallel_linear_fused_loss(x, w, t + 8, lambda s, e, lp, h: lp)


def test_replace_keeps_the_config_valid():
    """The per-token rows run with mask_diagnostics off (metrics only): replace must accept every case here."""
    for overrides in ALGORITHMS.values():
        assert not dataclasses.replace(AlgorithmConfig(**overrides), mask_diagnostics=False).mask_diagnostics


@pytest.mark.parametrize("row_block", [None, 4])
def test_op_in_bf16_is_close_to_float64(monkeypatch, row_block):
    """bf16 inputs: the logits tile and its gradient rounded to bf16 for the GEMMs (as the unfused
    output layer's are), the gradients summed in fp32 and returned in bf16 (row_block: as above)."""
    from entr_megatron.parallel import fused_output_loss
    from entr_megatron.parallel.fused_output_loss import vocab_parallel_linear_fused_loss

    if row_block is not None:
        monkeypatch.setattr(fused_output_loss, "_ROW_BUFFER_ELEMENTS", row_block * VOCAB)

    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(20, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g) / 2
    targets = torch.randint(0, VOCAB, (20,), generator=g)
    adv = torch.randn(20, generator=g)

    def token_loss(s, e, lp, ent):
        return -torch.exp(lp - lp.detach()).clamp(max=1.2) * adv[s:e]

    x, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    loss, lp, _ = vocab_parallel_linear_fused_loss(x, w, targets, token_loss, chunk_tokens=6)
    loss.backward()
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16 and lp.dtype == torch.float32
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lpr = torch.log_softmax(xr @ wr.t(), dim=-1).gather(-1, targets[:, None])[:, 0]
    token_loss(0, 20, lpr, None).sum().backward()
    close(lp, lpr.detach(), "logprob bf16", tol=0.02)
    close(x.grad, xr.grad, "grad hidden bf16", tol=0.02)
    close(w.grad, wr.grad, "grad weight bf16", tol=0.02)
