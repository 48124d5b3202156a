"""vocab_parallel_logprobs_entropy on 1, 2 and 4 gloo ranks against float64 single-rank math."""

import itertools

import pytest
import torch
import torch.distributed as dist

from entr_megatron.parallel import vocab_parallel_logprobs_entropy
from entr_megatron.utils.spawn import run_gloo

VOCAB = 96  # divisible by 1, 2, 4
TEMPERATURES = (1.0, 0.6, 1.7)
CHUNKS = (None, 1, 5)
DTYPES = (torch.float32, torch.bfloat16)


def reference_f64(full_logits, targets, g_lp, g_h, temperature):
    """float64 log-softmax on the full vocabulary: values and d(g_lp.lp + g_h.H)/d logits."""
    x = full_logits.detach().double().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * g_lp.double() + ent * g_h.double()).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def make_case(seed, dtype, shape=(3, 7), offset=0.0):
    g = torch.Generator().manual_seed(seed)
    # Wide logits (std 4: peaked and flat rows both occur) exercise every shard's max-shift.
    logits = (torch.randn(*shape, VOCAB, generator=g) * 4 + offset).to(dtype)
    targets = torch.randint(0, VOCAB, shape, generator=g)
    # Shard boundaries are where off-by-one errors live.
    targets.view(-1)[: 8] = torch.tensor([0, VOCAB - 1, VOCAB // 2 - 1, VOCAB // 2, VOCAB // 4 - 1, VOCAB // 4, 3 * VOCAB // 4, 1])
    return logits, targets, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def check_all_cases(rank, world, group):
    shard = VOCAB // world
    for i, (dtype, temp, chunk) in enumerate(itertools.product(DTYPES, TEMPERATURES, CHUNKS)):
        logits, targets, g_lp, g_h = make_case(i, dtype)
        ref_lp, ref_h, ref_grad = reference_f64(logits, targets, g_lp, g_h, temp)
        local = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs_entropy(local, targets, group=group, temperature=temp, chunk_size=chunk)
        assert lp.dtype == ent.dtype == torch.float32 and lp.shape == targets.shape
        (lp * g_lp + ent * g_h).sum().backward()
        want_grad = ref_grad[..., rank * shard:(rank + 1) * shard]
        where = f"rank {rank}/{world} dtype={dtype} T={temp} chunk={chunk}"
        # Values are computed in fp32 from the (possibly bf16) inputs: fp32 accuracy either way.
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0, msg=where)
        torch.testing.assert_close(ent.double(), ref_h, atol=1e-5, rtol=0, msg=where)
        assert local.grad.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(local.grad.double(), want_grad, atol=1e-5, rtol=0, msg=where)
        else:  # the gradient is stored in bf16: 8 bits of mantissa
            torch.testing.assert_close(local.grad.double(), want_grad, atol=1e-3, rtol=8e-3, msg=where)


def check_only_one_output_used(rank, world, group):
    shard = VOCAB // world
    logits, targets, g_lp, g_h = make_case(99, torch.float32)
    for use_lp in (True, False):
        local = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs_entropy(local, targets, group=group)
        ((lp * g_lp).sum() if use_lp else (ent * g_h).sum()).backward()
        zero = torch.zeros_like(g_lp)
        _, _, ref_grad = reference_f64(logits, targets, g_lp if use_lp else zero, zero if use_lp else g_h, 1.0)
        torch.testing.assert_close(local.grad.double(), ref_grad[..., rank * shard:(rank + 1) * shard], atol=1e-5, rtol=0)


def check_padded_vocabulary(rank, world, group):
    """Megatron pads the vocabulary: columns >= vocab_size are no tokens at all."""
    shard = VOCAB // world
    # 13: the last shard is partly padding; 30 at 4 ranks: the last shard is all padding.
    for i, (real, dtype, temp, chunk) in enumerate(
        itertools.product((VOCAB - 13, VOCAB - 30), DTYPES, (1.0, 0.6), (None, 2))
    ):
        logits, targets, g_lp, g_h = make_case(100 + i, dtype)
        targets = targets % real
        ref_lp, ref_h, ref_grad = reference_f64(logits[..., :real], targets, g_lp, g_h, temp)
        ref_grad = torch.cat([ref_grad, torch.zeros(*ref_grad.shape[:-1], VOCAB - real, dtype=ref_grad.dtype)], -1)
        local = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs_entropy(
            local, targets, group=group, temperature=temp, chunk_size=chunk, vocab_size=real
        )
        (lp * g_lp + ent * g_h).sum().backward()
        where = f"rank {rank}/{world} vocab_size={real} dtype={dtype} T={temp} chunk={chunk}"
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0, msg=where)
        torch.testing.assert_close(ent.double(), ref_h, atol=1e-5, rtol=0, msg=where)
        tol = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=1e-3, rtol=8e-3)
        torch.testing.assert_close(local.grad.double(), ref_grad[..., rank * shard:(rank + 1) * shard], msg=where, **tol)


def check_collision(rank, world, group):
    """collision = 1 - sum_j p_j^2 over the true vocabulary, in the same pass; lp/H/grads unchanged."""
    shard = VOCAB // world
    for i, (real, dtype, temp, chunk) in enumerate(
        itertools.product((VOCAB, VOCAB - 13, VOCAB - 30), DTYPES, (0.6, 1.7), (None, 5))
    ):
        logits, targets, g_lp, g_h = make_case(200 + i, dtype)
        targets = targets % real
        p = torch.softmax(logits[..., :real].double() / temp, dim=-1)
        ref_g = 1 - (p**2).sum(-1)
        local = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
        kwargs = dict(group=group, temperature=temp, chunk_size=chunk, vocab_size=real)
        lp, ent, coll = vocab_parallel_logprobs_entropy(local, targets, **kwargs, return_collision=True)
        where = f"rank {rank}/{world} vocab_size={real} dtype={dtype} T={temp} chunk={chunk}"
        assert coll.dtype == torch.float32 and coll.shape == targets.shape and not coll.requires_grad, where
        torch.testing.assert_close(coll.double(), ref_g, atol=1e-5, rtol=0, msg=where)
        (lp * g_lp + ent * g_h).sum().backward()
        plain = local.detach().clone().requires_grad_()
        lp0, ent0 = vocab_parallel_logprobs_entropy(plain, targets, **kwargs)
        (lp0 * g_lp + ent0 * g_h).sum().backward()
        for got, want in ((lp, lp0), (ent, ent0), (local.grad, plain.grad)):
            torch.testing.assert_close(got, want, atol=0, rtol=0, msg=where)


def check_collision_of_uniform_logits(rank, world, group):
    """Equal logits on V real columns: p = 1/V, G = 1 - 1/V; large padded logits must not count."""
    shard = VOCAB // world
    for real in (VOCAB, VOCAB - 13, VOCAB - 30):
        logits = torch.full((4, VOCAB), 3.0)
        logits[:, real:] = 50.0
        _, _, coll = vocab_parallel_logprobs_entropy(
            logits[:, rank * shard:(rank + 1) * shard], torch.zeros(4, dtype=torch.long), group=group,
            temperature=0.7, vocab_size=real, return_collision=True,
        )
        torch.testing.assert_close(coll.double(), torch.full((4,), 1 - 1 / real, dtype=torch.float64), atol=1e-6, rtol=0)


def _ranks_main(rank, world):
    group = dist.group.WORLD
    check_all_cases(rank, world, group)
    check_only_one_output_used(rank, world, group)
    check_padded_vocabulary(rank, world, group)
    check_collision(rank, world, group)
    check_collision_of_uniform_logits(rank, world, group)


def test_single_rank_matches_float64():
    check_all_cases(0, 1, None)
    check_only_one_output_used(0, 1, None)
    check_padded_vocabulary(0, 1, None)


def test_single_rank_collision_matches_float64():
    check_collision(0, 1, None)
    check_collision_of_uniform_logits(0, 1, None)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_float64(world):
    run_gloo(_ranks_main, world, timeout_s=300)


def test_large_logit_offset_is_stable():
    """A common offset of 1000 changes nothing but fp32 rounding of the shifted logits."""
    logits, targets, g_lp, g_h = make_case(7, torch.float32, offset=1000.0)
    ref_lp, ref_h, ref_grad = reference_f64(logits, targets, g_lp, g_h, 1.0)
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(x, targets, chunk_size=4)
    (lp * g_lp + ent * g_h).sum().backward()
    # Rounding of x - max at |x| ~ 1000 is ~1000 * 2**-24 = 6e-5 per logit.
    for got, want in ((lp, ref_lp), (ent, ref_h), (x.grad, ref_grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=3e-4, rtol=0)


def test_backward_saves_no_vocab_sized_copies():
    """Only the caller's logits and [N]-sized vectors may be kept for backward."""
    n, vocab = 64, 512
    logits = torch.randn(n, vocab, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = vocab_parallel_logprobs_entropy(logits, torch.randint(0, vocab, (n,)), chunk_size=8)
    vocab_sized = [t for t in saved if t.numel() >= n * vocab]
    assert len(vocab_sized) == 1 and vocab_sized[0].data_ptr() == logits.data_ptr()
    assert sum(t.numel() for t in saved if t.data_ptr() != logits.data_ptr()) <= 4 * n


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(chunk_size=0), "chunk_size must be"),
        (dict(vocab_size=9), r"vocab_size must be in \(0, 8\]"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs_entropy(torch.randn(2, 8), torch.tensor([1, 2]), **kwargs)


def test_out_of_range_targets_are_refused():
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 8\)"):
        vocab_parallel_logprobs_entropy(torch.randn(2, 8), torch.tensor([1, 8]))
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 6\)"):
        vocab_parallel_logprobs_entropy(torch.randn(2, 8), torch.tensor([1, 6]), vocab_size=6)
    with pytest.raises(ValueError, match="targets shape"):
        vocab_parallel_logprobs_entropy(torch.randn(2, 8), torch.tensor([1]))
