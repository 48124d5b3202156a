"""vocab_parallel_linear_logprobs_entropy on 1, 2 and 4 gloo ranks against float64 single-rank math
and against the unfused path (output matmul + vocab_parallel_logprobs_entropy), on both backends:
the chunked PyTorch path and the Triton kernels (run here by Triton's CPU interpreter), which are
also compiled for sm_90 and checked for pipelining and register spills."""

import itertools
import os

import pytest
import torch
import torch.distributed as dist
from common import INTERPRETER, close

from entr_megatron.parallel import vocab_parallel_linear_logprobs_entropy, vocab_parallel_logprobs_entropy
from entr_megatron.parallel.triton_env import triton_available, uses_triton
from entr_megatron.utils.spawn import run_gloo

VOCAB = 96  # divisible by 1, 2, 4
HIDDEN = 24
TEMPERATURES = (1.0, 0.6)  # taken in turn over the cases below
# (chunk_tokens, chunk_vocab): the defaults (one tile), and tiles with ragged last
# chunks along both axes (21 tokens; shards of 96, 48, 24 columns, some padded).
TILES = ((None, None), (4, 5), (5, 7))
# 13: the last shard is partly padding; 30 at 4 ranks: the last shard is all padding.
VOCAB_SIZES = (None, VOCAB - 13, VOCAB - 30)
FP32 = dict(atol=1e-5, rtol=0)
"""Values (log-probs, entropies, collisions: O(1)) to 1e-5; gradients (O(10)) are held to
1e-5 of their largest entry (``common.close``): fp32 rounding of sums over the vocabulary."""


@pytest.fixture(autouse=True)
def one_thread():
    """Tiles of a few elements: on a loaded machine OpenMP's barriers, not the math, would
    dominate every tiny GEMM (spawned ranks get one thread each already)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_f64(hidden, weight, targets, g_lp, g_h, temperature, vocab_size=None):
    """float64 full-vocabulary math: (lp, H, collision, d loss/d hidden, d loss/d weight)."""
    real = vocab_size or weight.shape[0]
    x = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logp = torch.log_softmax((x @ w[:real].t()) / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    coll = 1 - logp.exp().square().sum(-1)
    (lp * g_lp.double() + ent * g_h.double()).sum().backward()
    return lp.detach(), ent.detach(), coll.detach(), x.grad, w.grad


def make_case(seed, dtype=torch.float32, shape=(3, 7), vocab_size=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, HIDDEN, generator=g).to(dtype)
    # Logits of std ~4: peaked and flat rows both occur, every tile's max-shift matters.
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 4 / HIDDEN**0.5).to(dtype)
    real = vocab_size or VOCAB
    targets = torch.randint(0, real, shape, generator=g)
    # Shard and tile boundaries are where off-by-one errors live.
    edges = torch.tensor([0, VOCAB - 1, VOCAB // 2 - 1, VOCAB // 2, VOCAB // 4 - 1, VOCAB // 4, 4, 5, 7])
    targets.view(-1)[: edges.numel()] = edges % real
    return hidden, weight, targets, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def shard_of(weight, rank, world):
    shard = weight.shape[0] // world
    return weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()


def summed_over_ranks(t, group):
    """The caller's all-reduce of the partial hidden gradient (Megatron's ColumnParallelLinear backward)."""
    t = t.clone()
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def unfused(hidden, weight_shard, targets, group, **kw):
    """The path the fused op replaces: materialise this rank's logits, then the sharded op."""
    return vocab_parallel_logprobs_entropy(hidden @ weight_shard.t(), targets, group=group, **kw)


def check_matches_float64_and_unfused(rank, world, group, backend="torch"):
    shard = VOCAB // world
    for i, ((ct, cv), real) in enumerate(itertools.product(TILES, VOCAB_SIZES)):
        temp = TEMPERATURES[i % len(TEMPERATURES)]
        hidden, weight, targets, g_lp, g_h = make_case(i, vocab_size=real)
        ref_lp, ref_h, ref_g, ref_dx, ref_dw = reference_f64(hidden, weight, targets, g_lp, g_h, temp, real)
        x, w = hidden.clone().requires_grad_(), shard_of(weight, rank, world)
        lp, ent, coll = vocab_parallel_linear_logprobs_entropy(
            x, w, targets, group=group, temperature=temp, vocab_size=real, chunk_tokens=ct, chunk_vocab=cv,
            return_collision=True, backend=backend,
        )
        where = f"{backend} rank {rank}/{world} T={temp} tile={ct}x{cv} vocab_size={real}"
        assert lp.dtype == ent.dtype == coll.dtype == torch.float32 and lp.shape == targets.shape, where
        assert not coll.requires_grad, where
        (lp * g_lp + ent * g_h).sum().backward()
        for got, want in ((lp, ref_lp), (ent, ref_h), (coll, ref_g)):
            torch.testing.assert_close(got.double(), want, **FP32, msg=where)
        close(w.grad, ref_dw[rank * shard:(rank + 1) * shard], f"grad weight {where}")
        close(summed_over_ranks(x.grad, group), ref_dx, f"summed grad hidden {where}")

        x0, w0 = hidden.clone().requires_grad_(), shard_of(weight, rank, world)
        lp0, ent0 = unfused(x0, w0, targets, group, temperature=temp, vocab_size=real)
        (lp0 * g_lp + ent0 * g_h).sum().backward()
        for got, want in ((lp, lp0), (ent, ent0)):
            torch.testing.assert_close(got, want, **FP32, msg=f"vs unfused: {where}")
        close(x.grad, x0.grad, f"grad hidden vs unfused: {where}")
        close(w.grad, w0.grad, f"grad weight vs unfused: {where}")


def check_only_one_output_used(rank, world, group, backend="torch"):
    shard = VOCAB // world
    hidden, weight, targets, g_lp, g_h = make_case(99)
    zero = torch.zeros_like(g_lp)
    for use_lp in (True, False):
        x, w = hidden.clone().requires_grad_(), shard_of(weight, rank, world)
        lp, ent = vocab_parallel_linear_logprobs_entropy(
            x, w, targets, group=group, chunk_tokens=4, chunk_vocab=5, backend=backend
        )
        # The unused output gets no gradient at all (None in backward).
        ((lp * g_lp).sum() if use_lp else (ent * g_h).sum()).backward()
        *_, ref_dx, ref_dw = reference_f64(hidden, weight, targets, g_lp if use_lp else zero, zero if use_lp else g_h, 1.0)
        where = f"{backend} rank {rank}/{world} {'logprob' if use_lp else 'entropy'} only"
        close(w.grad, ref_dw[rank * shard:(rank + 1) * shard], f"grad weight {where}")
        close(summed_over_ranks(x.grad, group), ref_dx, f"summed grad hidden {where}")


def check_bf16(rank, world, group, backend="torch"):
    """bf16 inputs: logits rounded to bf16 as the unfused bf16 output layer's are."""
    shard = VOCAB // world
    for i, ((ct, cv), real) in enumerate(itertools.product(TILES[1:], (None, VOCAB - 30))):
        temp = TEMPERATURES[(i + 1) % len(TEMPERATURES)]
        hidden, weight, targets, g_lp, g_h = make_case(300 + i, torch.bfloat16, vocab_size=real)
        ref_lp, ref_h, _, ref_dx, ref_dw = reference_f64(hidden, weight, targets, g_lp, g_h, temp, real)
        x, w = hidden.clone().requires_grad_(), shard_of(weight, rank, world)
        lp, ent = vocab_parallel_linear_logprobs_entropy(
            x, w, targets, group=group, temperature=temp, vocab_size=real, chunk_tokens=ct, chunk_vocab=cv,
            backend=backend,
        )
        (lp * g_lp + ent * g_h).sum().backward()
        where = f"{backend} bf16 rank {rank}/{world} T={temp} tile={ct}x{cv} vocab_size={real}"
        assert x.grad.dtype == w.grad.dtype == torch.bfloat16, where
        # Logits of |z| ~ 10 rounded to bf16's 8 mantissa bits (~0.03 each), as in the unfused
        # path: a few percent on values and gradients against exact math.
        torch.testing.assert_close(lp.double(), ref_lp, atol=0.15, rtol=0, msg=where)
        torch.testing.assert_close(ent.double(), ref_h, atol=0.1, rtol=0, msg=where)
        close(w.grad, ref_dw[rank * shard:(rank + 1) * shard], f"grad weight {where}", tol=0.05)
        close(summed_over_ranks(x.grad.float(), group), ref_dx, f"summed grad hidden {where}", tol=0.05)

        x0, w0 = hidden.clone().requires_grad_(), shard_of(weight, rank, world)
        lp0, ent0 = unfused(x0, w0, targets, group, temperature=temp, vocab_size=real)
        (lp0 * g_lp + ent0 * g_h).sum().backward()
        # The same bf16 logits up to the GEMMs' blocking; gradients rounded to bf16 once
        # (fused: fp32 sums over tiles) or by the bf16 GEMM: an ulp of the largest entry.
        torch.testing.assert_close(lp, lp0, atol=0.02, rtol=0, msg=f"vs unfused: {where}")
        torch.testing.assert_close(ent, ent0, atol=0.02, rtol=0, msg=f"vs unfused: {where}")
        close(w.grad, w0.grad, f"grad weight vs unfused: {where}", tol=0.02)
        close(x.grad, x0.grad, f"grad hidden vs unfused: {where}", tol=0.02)


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's reduce_from_tensor_model_parallel_region: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        if group is not None:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return summed_over_ranks(grad, ctx.group), None


def check_tied_weights(rank, world, group, backend="torch"):
    """One shared [V/tp, h] parameter as vocab-parallel embedding and output layer: both gradients add up."""
    shard = VOCAB // world
    hidden, weight, targets, g_lp, g_h = make_case(500)
    ids = torch.randint(0, VOCAB, targets.shape, generator=torch.Generator().manual_seed(5))
    mix = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(6)) / HIDDEN**0.5

    w = shard_of(weight, rank, world)
    a = mix.clone().requires_grad_()
    local = ids - rank * shard
    owned = (local >= 0) & (local < shard)
    emb = _ReduceFromTP.apply(w[torch.where(owned, local, 0)] * owned.unsqueeze(-1), group)
    x = _CopyToTP.apply(torch.tanh(emb @ a) * 2, group)
    lp, ent = vocab_parallel_linear_logprobs_entropy(
        x, w, targets, group=group, temperature=0.8, chunk_tokens=4, chunk_vocab=5, backend=backend
    )
    (lp * g_lp + ent * g_h).sum().backward()

    w_ref, a_ref = weight.double().requires_grad_(), mix.double().requires_grad_()
    x_ref = torch.tanh(w_ref[ids] @ a_ref) * 2
    logp = torch.log_softmax(x_ref @ w_ref.t() / 0.8, dim=-1)
    lp_ref = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent_ref = -(logp.exp() * logp).sum(-1)
    (lp_ref * g_lp.double() + ent_ref * g_h.double()).sum().backward()
    where = f"{backend} tied rank {rank}/{world}"
    torch.testing.assert_close(lp.double(), lp_ref.detach(), **FP32, msg=where)
    close(w.grad, w_ref.grad[rank * shard:(rank + 1) * shard], f"grad of the shared weight {where}")
    close(a.grad, a_ref.grad, f"grad of the layer below {where}")


def _ranks_main(rank, world, backend="torch"):
    group = dist.group.WORLD
    check_matches_float64_and_unfused(rank, world, group, backend)
    check_only_one_output_used(rank, world, group, backend)
    check_bf16(rank, world, group, backend)
    check_tied_weights(rank, world, group, backend)


# Both implementations run every check: "torch" (the chunked reference path) and "triton",
# its kernels run on CPU by Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1
# without CUDA, before anything imports triton (spawned ranks inherit it).
needs_triton = pytest.mark.skipif(
    not INTERPRETER,
    reason="needs triton >= 3.9 (the dev extra installs it) and TRITON_INTERPRET=1 from the start (set without CUDA)",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_rank_matches_float64_and_unfused(backend):
    check_matches_float64_and_unfused(0, 1, None, backend)
    check_only_one_output_used(0, 1, None, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_rank_bf16(backend):
    check_bf16(0, 1, None, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_rank_tied_weights(backend):
    check_tied_weights(0, 1, None, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_float64(world, backend):
    run_gloo(_ranks_main, world, backend, timeout_s=300)


def test_collision_does_not_change_the_rest():
    hidden, weight, targets, g_lp, g_h = make_case(7, vocab_size=VOCAB - 13)
    results = []
    for collision in (False, True):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent, *_ = vocab_parallel_linear_logprobs_entropy(
            x, w, targets, temperature=1.7, vocab_size=VOCAB - 13, chunk_tokens=5, chunk_vocab=7, return_collision=collision
        )
        (lp * g_lp + ent * g_h).sum().backward()
        results.append((lp, ent, x.grad, w.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_no_gradient_needed_for_frozen_inputs():
    hidden, weight, targets, g_lp, g_h = make_case(8)
    x = hidden.clone().requires_grad_()
    lp, ent = vocab_parallel_linear_logprobs_entropy(x, weight, targets, chunk_tokens=4, chunk_vocab=5)
    (lp * g_lp + ent * g_h).sum().backward()
    *_, ref_dx, _ = reference_f64(hidden, weight, targets, g_lp, g_h, 1.0)
    close(x.grad, ref_dx, "grad hidden with a frozen weight")


def test_backward_saves_no_vocab_sized_tensors():
    """Only the caller's hidden and weight and [N]-sized vectors may be kept for backward."""
    n, h, vocab = 64, 16, 512
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(vocab, h, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_linear_logprobs_entropy(hidden, weight, torch.randint(0, vocab, (n,)), chunk_tokens=8, chunk_vocab=64)
    inputs = {hidden.data_ptr(), weight.data_ptr()}
    assert {t.data_ptr() for t in saved} >= inputs
    assert sum(t.numel() for t in saved if t.data_ptr() not in inputs) <= 3 * n


def _call(**kwargs):
    args = dict(hidden=torch.randn(2, 4), weight=torch.randn(8, 4), targets=torch.tensor([1, 2]))
    args.update(kwargs)
    return vocab_parallel_linear_logprobs_entropy(**args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(chunk_tokens=0), "chunk_tokens must be a positive int"),
        (dict(chunk_vocab=-3), "chunk_vocab must be a positive int"),
        (dict(chunk_vocab=2.5), "chunk_vocab must be a positive int"),
        (dict(vocab_size=9), r"vocab_size must be in \(0, 8\]"),
        (dict(weight=torch.randn(8, 5)), r"weight must be the \[V/tp, h\] vocab shard with h = hidden.shape\[-1\] = 4"),
        (dict(weight=torch.randn(8)), r"weight must be the \[V/tp, h\]"),
        (dict(weight=torch.randn(8, 4, dtype=torch.float64)), "weight must have hidden's dtype"),
        (dict(hidden=torch.ones(2, 4, dtype=torch.long)), "hidden must be a floating point"),
        (dict(targets=torch.tensor([1])), "targets shape"),
        (dict(targets=torch.tensor([1, 8])), r"targets must be token ids in \[0, 8\)"),
        (dict(targets=torch.tensor([-1, 0])), r"targets must be token ids in \[0, 8\)"),
        (dict(targets=torch.tensor([1, 6]), vocab_size=6), r"targets must be token ids in \[0, 6\)"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


# The Triton kernels against the chunked PyTorch path they replace, and the split merge.


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernels_equal_the_torch_path(dtype):
    """Same logits (bf16/fp16: rounded the same way), so values agree up to fp32 summation order (1e-5)
    and the gradients, summed by the same GEMMs, to an ulp of the tile gradient's rounding."""
    hidden, weight, targets, g_lp, g_h = make_case(40, dtype, shape=(5, 9), vocab_size=VOCAB - 7)
    results = {}
    for backend in ("torch", "triton"):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent, coll = vocab_parallel_linear_logprobs_entropy(
            x, w, targets, temperature=0.9, vocab_size=VOCAB - 7, chunk_tokens=16, chunk_vocab=40,
            return_collision=True, backend=backend,
        )
        (lp * g_lp + ent * g_h).sum().backward()
        results[backend] = (lp, ent, coll, x.grad, w.grad)
    grad_tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, got, want in zip(("logprob", "entropy", "collision"), results["triton"][:3], results["torch"][:3]):
        torch.testing.assert_close(got, want, **FP32, msg=f"{dtype} {name}")
    close(results["triton"][3], results["torch"][3], f"{dtype} grad hidden", tol=grad_tol)
    close(results["triton"][4], results["torch"][4], f"{dtype} grad weight", tol=grad_tol)
    assert results["triton"][4].dtype == dtype and not results["triton"][4][VOCAB - 7:].any()


@needs_triton
@pytest.mark.parametrize("n_splits", [1, 2, 3, 7, 40])
def test_vocabulary_splits_merge_exactly(n_splits):
    """The forward kernel's per-split statistics, merged, give float64's logZ, H and collision
    whatever the split count, including splits left without a single column (40 > 3 blocks)."""
    from entr_megatron.parallel import fused_output_triton
    from entr_megatron.parallel.vocab_parallel import VocabParallelLogProbEntropy as Ops

    hidden, weight, targets, g_lp, g_h = make_case(41, shape=(37,))  # 3 token blocks of 16: a partial group
    ref_lp, ref_h, ref_coll, *_ = reference_f64(hidden, weight, targets, g_lp, g_h, 0.8)
    stats = fused_output_triton.local_stats(hidden, weight, targets, 0, 1 / 0.8, n_splits=n_splits)
    lp, ent, _ = Ops.merge_stats(stats.unsqueeze(0))
    coll = Ops.merge_collision(stats.unsqueeze(0))
    for name, got, want in (("logprob", lp, ref_lp), ("entropy", ent, ref_h), ("collision", coll, ref_coll)):
        torch.testing.assert_close(got.double(), want, **FP32, msg=f"{name} with {n_splits} splits")


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"):
        _call(backend="cuda")
    if triton_available():
        with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors .*TRITON_INTERPRET=1.*cpu"):
            _call(backend="triton")
    else:
        with pytest.raises(ValueError, match="backend='triton' needs the triton package"):
            _call(backend="triton")
    # "auto" on CPU tensors is the PyTorch path, with or without triton installed.
    assert not uses_triton("auto", torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not uses_triton("auto", torch.zeros(1)), "auto never picks the interpreter"
    if INTERPRETER:
        assert uses_triton("triton", torch.zeros(1))


# What the JIT specializes on a real call with contiguous, 16-byte aligned tensors (pointers,
# leading strides and h divisible by 16; unit strides become constants), so that the
# ahead-of-time compile below builds the kernels a GPU run would build.
_ALIGNED = {"x_ptr", "w_ptr", "t_ptr", "out_ptr", "z_ptr", "log_z_ptr", "a_ptr", "c_ptr", "tg_ptr", "d_ptr",
            "hdim", "stride_xn", "stride_wv", "stride_dn", "stride_zn"}
_UNIT = {"stride_xh": 1, "stride_wh": 1, "stride_dv": 1, "stride_zv": 1}


def _compile_for_sm90(jit_fn, config, dtype, flags):
    """Compiles one kernel for an H100/H200 (sm_90) without a GPU; (ttgir, cuobjdump -res-usage)."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {k: v for k, v in {**config.kwargs, **flags, **_UNIT}.items() if k in jit_fn.arg_names}
    pointers = {"x_ptr": dtype, "w_ptr": dtype, "d_ptr": dtype, "z_ptr": dtype, "t_ptr": "i64"}
    signature = {
        name: "constexpr" if name in constexprs
        else f"*{pointers.get(name, 'fp32')}" if name.endswith("_ptr")
        else "fp32" if name == "inv_temp" else "i32"
        for name in jit_fn.arg_names
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(jit_fn.arg_names) if name in _ALIGNED}
    kernel = triton.compile(
        ASTSource(jit_fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
    )
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return kernel.asm["ttgir"], usage


@pytest.mark.skipif(not triton_available(), reason="needs triton (the dev extra installs it)")
def test_kernels_compile_for_sm90_pipelined_without_spills():
    """Every tile shape the autotuner would try on an H100/H200, compiled for sm_90 here: 16-bit
    operands on wgmma, global loads pipelined through shared memory (async copies), and no
    register spills (a spilling shape was seen for the forward kernel's epilogue at 128
    accumulator elements per thread). In a process of its own without TRITON_INTERPRET:
    triton's library functions must be built for the GPU, not the interpreter."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import test_fused_output as t; t.check_sm90_kernels()"
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("ok ") == 3 * (4 + 3) + 2 * 4, done.stdout  # + the 4 elementwise shapes in 2 dtypes


def check_sm90_kernels():
    import re

    from entr_megatron.parallel import fused_output_triton as ft

    stats, grad, grad_from_z = ft._build(False)
    flags_of = {"bf16": dict(ROUND_Z=True, UPCAST=False, IEEE=False, RN_BF16=False),
                "fp32": dict(ROUND_Z=False, UPCAST=False, IEEE=True, RN_BF16=False)}
    # The forward kernel with its largest epilogues: q (the log-prob op's collision term), and the
    # logits tile stored (the fused loss's GEMM 1).
    variants = [("stats", stats, ft._CUDA_STATS_16, dict(HAS_Q=True, STORE_Z=False)),
                ("stats+store", stats, ft._CUDA_STATS_16, dict(HAS_Q=False, STORE_Z=True)),
                ("grad", grad, ft._CUDA_GRAD_16, {})]
    for name, tuner, want_16, extra in variants:
        for dtype, flags in flags_of.items():
            tried = tuner.early_config_prune(tuner.configs, {}, **flags)
            assert [ft._shape(c) for c in tried] == (want_16 if dtype == "bf16" else ft._CUDA_CONFIGS_32)
            for config in tried:
                where = f"{name} {dtype} {ft._shape(config)}"
                ttgir, usage = _compile_for_sm90(tuner.fn, config, dtype, {**flags, **extra})
                stack = re.search(r"STACK:(\d+)", usage)
                assert stack and int(stack.group(1)) <= 16, f"{where}: spills registers: {usage.strip()}"
                assert "async_copy_global_to_local" in ttgir, f"{where}: loads not pipelined"
                if dtype == "bf16":
                    assert "warp_group_dot" in ttgir, f"{where}: no wgmma"
                print(f"ok {where}: {usage.strip().splitlines()[-1].strip()}", flush=True)
    # The fused loss's in-place gradient kernel: elementwise, so only its register use is checked.
    for dtype in ("bf16", "fp32"):
        for config in grad_from_z.configs:
            where = f"grad_from_z {dtype} {config.kwargs} warps {config.num_warps}"
            _, usage = _compile_for_sm90(grad_from_z.fn, config, dtype, dict(RN_BF16=False))
            stack = re.search(r"STACK:(\d+)", usage)
            assert stack and int(stack.group(1)) == 0, f"{where}: spills registers: {usage.strip()}"
            print(f"ok {where}: {usage.strip().splitlines()[-1].strip()}", flush=True)
