"""Triton kernels for the fused output ops (``fused_output.py``, ``fused_output_loss.py``): the GEMM
with its epilogue, in one kernel.

Two GEMM kernels, each a tiled GEMM ``z = x @ W^T`` (bf16/fp16 operands with fp32
accumulation; fp32 operands in full fp32, never TF32) whose ``[BLOCK_M, BLOCK_N]``
accumulator is consumed in registers instead of being written out:

``stats`` (forward): one program per (token block i, split s) takes token block i and
    the s-th of ``n_splits`` contiguous runs of this rank's vocabulary blocks, and folds every
    block's logits into running per-token statistics (m, s, sy, zt, q) by an online
    log-sum-exp. Output: ``[n_splits, N, 5]`` fp32 partial statistics, merged on the host
    by the same exact merge as the ranks' statistics (``vocab_parallel``'s ``fold_stats``).
    Splitting the vocabulary keeps the GPU busy when there are few token blocks; the
    partials are ``n_splits x N x 20`` bytes, never logits.

``logits_grad`` (backward): recomputes one ``[chunk_tokens, chunk_vocab]`` tile of z
    and writes d(sum g_lp*logprob + g_h*H)/dz for it,
        dz_j = p_j (a log p_j + c) + (g_lp / T) 1[j = target],
        a = -g_h / T,  c = -(g_lp + g_h H) / T,  log p_j = z_j / T - logZ,
    in the input dtype; the two gradient GEMMs on that tile (``grad_x += dz @ W_c``,
    ``grad_W_c += dz^T @ x_t``) are cuBLAS matmuls, issued by ``fused_output.py``.

For the fused policy loss (``fused_output_loss.py``: 3 GEMMs, the tile kept in memory between
its two passes) ``stats`` also writes the raw logits tile (``STORE_Z``: ``local_stats(...,
logits_out=z)``), and ``logits_grad_in_place``, an elementwise kernel, overwrites the tile with
``logits_grad``'s dz (the same epilogue, ``_grad_epilogue``, reading z instead of recomputing it).

With bf16/fp16 inputs the raw logits are rounded to the input dtype before the
epilogue, as the unfused output layer's bf16 GEMM output is, so both paths see the
same logits. Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, how the tests
run these kernels without a GPU) two of its defects in Triton 3.9 are avoided:
bf16/fp16 tiles are widened to fp32 before ``tl.dot``, whose interpreted
low-precision product is wrong (products of two bf16 numbers are exact in fp32, so
this changes nothing but the order of summation), and fp32 -> bf16 rounding is done
by hand to nearest even, because the interpreter's cast truncates.

The interpreter must be on (``TRITON_INTERPRET=1``) before triton is first imported,
which builds triton's own library functions, and before this module is, whose device
functions (``_logits_tile``, ...) are built the same way (``triton_env.interpreter_ready``
checks it); the kernels are built on first use (``kernels``).

On CUDA each kernel is autotuned over a few tile shapes per (hidden size, dtype). They
were chosen without a GPU to time them on: the tests compile every one for sm_90
(H100/H200) ahead of time, as a real call would specialise it, and check that 16-bit
operands run on wgmma, loads are pipelined and no registers spill;
``tools/bench_fused_output.py`` reports the throughput they reach on a GPU. Row offsets
are int64: a ``[V/tp, h]`` shard passes 2**31 elements at 128k x 16k (Llama 3 405B at TP 1).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from entr_megatron.parallel.triton_env import triton_interpreting
from entr_megatron.parallel.vocab_parallel import VocabParallelLogProbEntropy as _Ops

__all__ = [
    "default_splits", "kernels", "local_stats", "logits_grad_in_place", "logits_grad_tile",
]

# Statistics columns, the same order as vocab_parallel's _MAX, _SUM_EXP, _SUM_EXP_Y,
# _TARGET_LOGIT, _SUM_EXP2.
_N_STATS = 5
_LOWEST = tl.constexpr(-3.4028234663852886e38)  # float32's lowest finite: exp(_LOWEST - m) = 0 and (_LOWEST - m) * 0 = 0


@triton.jit
def _grouped(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """Program id -> (token block, column block or vocabulary split) in grouped order (Triton's
    matmul tutorial): programs that run together take GROUP_M token blocks x every column
    block, so L2 holds their row tiles of x and column tiles of W."""
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still fp32: the interpreter's cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _logits_tile(
    x_ptr, w_ptr, rows, cols, row_ok, col_ok, hdim, stride_xn, stride_xh, stride_wv, stride_wh,
    ROUND_Z: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, RN_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The raw ``[BLOCK_M, BLOCK_N]`` logits x[rows] @ W[cols]^T in fp32 (0 on masked rows and
    columns), rounded to the input dtype with ROUND_Z."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hdim, BLOCK_K):
        k_ok = (k0 + ks) < hdim
        xk = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_xn + (k0 + ks)[None, :] * stride_xh,
            mask=row_ok[:, None] & k_ok[None, :], other=0.0,
        )
        wk = tl.load(
            w_ptr + cols.to(tl.int64)[:, None] * stride_wv + (k0 + ks)[None, :] * stride_wh,
            mask=col_ok[:, None] & k_ok[None, :], other=0.0,
        )
        if UPCAST:
            xk = xk.to(tl.float32)
            wk = wk.to(tl.float32)
        if IEEE:
            acc = tl.dot(xk, tl.trans(wk), acc, input_precision="ieee")
        else:
            acc = tl.dot(xk, tl.trans(wk), acc)
    if ROUND_Z and RN_BF16:
        acc = _round_bf16(acc)
    elif ROUND_Z:
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    return acc


@triton.jit
def _grad_epilogue(acc, rows, cols, row_ok, t_ptr, log_z_ptr, a_ptr, c_ptr, tg_ptr, vocab_start, inv_temp,
                   RN_BF16: tl.constexpr):
    """d(sum g_lp*logprob + g_h*H)/dz of the raw logits ``acc`` (fp32) of a block (module docstring)."""
    log_z = tl.load(log_z_ptr + rows, mask=row_ok, other=0.0)
    coef_a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
    coef_c = tl.load(c_ptr + rows, mask=row_ok, other=0.0)
    t_grad = tl.load(tg_ptr + rows, mask=row_ok, other=0.0)
    local_t = tl.load(t_ptr + rows, mask=row_ok, other=0) - vocab_start
    log_p = acc * inv_temp - log_z[:, None]
    d = tl.exp(log_p) * (coef_a[:, None] * log_p + coef_c[:, None])
    d += tl.where(cols[None, :] == local_t[:, None], t_grad[:, None], 0.0)
    if RN_BF16:  # the store then truncates an exact bf16 value
        d = _round_bf16(d)
    return d


def _stats_fn(
    x_ptr, w_ptr, t_ptr, out_ptr, z_ptr,
    n_tokens, width, hdim, vocab_start, inv_temp,
    stride_xn, stride_xh, stride_wv, stride_wh, stride_zn, stride_zv,
    n_splits,
    HAS_Q: tl.constexpr, STORE_Z: tl.constexpr,
    ROUND_Z: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, RN_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_s = _grouped(tl.program_id(0), tl.cdiv(n_tokens, BLOCK_M), n_splits, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_tokens
    local_t = tl.load(t_ptr + rows, mask=row_ok, other=0) - vocab_start
    n_blocks = tl.cdiv(width, BLOCK_N)
    per_split = tl.cdiv(n_blocks, n_splits)
    b_begin = pid_s * per_split
    b_end = tl.minimum(b_begin + per_split, n_blocks)

    m = tl.full([BLOCK_M], _LOWEST, tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    sy = tl.zeros([BLOCK_M], tl.float32)
    q = tl.zeros([BLOCK_M], tl.float32)
    zt = tl.zeros([BLOCK_M], tl.float32)
    for b in range(b_begin, b_end):
        cols = b * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < width
        acc = _logits_tile(
            x_ptr, w_ptr, rows, cols, row_ok, col_ok, hdim, stride_xn, stride_xh, stride_wv, stride_wh,
            ROUND_Z, UPCAST, IEEE, RN_BF16, BLOCK_M, BLOCK_N, BLOCK_K,
        )
        if STORE_Z:  # the raw logits, in the input dtype (exact: ROUND_Z already rounded them)
            tl.store(
                z_ptr + rows.to(tl.int64)[:, None] * stride_zn + cols[None, :] * stride_zv,
                acc.to(z_ptr.dtype.element_ty),
                mask=row_ok[:, None] & col_ok[None, :],
            )
        z = acc * inv_temp
        # Online log-sum-exp straight onto the new running max: this block's sums are taken
        # about m_new, the running ones re-centred from m to m_new (the merge of
        # fused_output.py's docstring with the block's own max skipped: fewer live tiles, no spills).
        m_new = tl.maximum(m, tl.max(tl.where(col_ok[None, :], z, _LOWEST), 1))
        y = z - m_new[:, None]  # finite on masked columns too (their weight rows load as 0)
        e = tl.where(col_ok[None, :], tl.exp(y), 0.0)
        a = tl.exp(m - m_new)
        sy = a * (sy + (m - m_new) * s) + tl.sum(e * y, 1)
        s = a * s + tl.sum(e, 1)
        if HAS_Q:
            q = a * a * q + tl.sum(e * e, 1)
        zt += tl.sum(tl.where(cols[None, :] == local_t[:, None], z, 0.0), 1)
        m = m_new

    base = out_ptr + (pid_s * n_tokens + rows.to(tl.int64)) * 5
    tl.store(base + 0, m, mask=row_ok)
    tl.store(base + 1, s, mask=row_ok)
    tl.store(base + 2, sy, mask=row_ok)
    tl.store(base + 3, zt, mask=row_ok)
    tl.store(base + 4, q, mask=row_ok)


def _grad_fn(
    x_ptr, w_ptr, t_ptr, log_z_ptr, a_ptr, c_ptr, tg_ptr, d_ptr,
    n_tokens, width, hdim, vocab_start, inv_temp,
    stride_xn, stride_xh, stride_wv, stride_wh, stride_dn, stride_dv,
    ROUND_Z: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, RN_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(n_tokens, BLOCK_M), tl.cdiv(width, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_tokens
    col_ok = cols < width
    acc = _logits_tile(
        x_ptr, w_ptr, rows, cols, row_ok, col_ok, hdim, stride_xn, stride_xh, stride_wv, stride_wh,
        ROUND_Z, UPCAST, IEEE, RN_BF16, BLOCK_M, BLOCK_N, BLOCK_K,
    )
    d = _grad_epilogue(acc, rows, cols, row_ok, t_ptr, log_z_ptr, a_ptr, c_ptr, tg_ptr, vocab_start, inv_temp,
                       RN_BF16)
    tl.store(
        d_ptr + rows.to(tl.int64)[:, None] * stride_dn + cols[None, :] * stride_dv,
        d.to(d_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _grad_from_z_fn(
    z_ptr, t_ptr, log_z_ptr, a_ptr, c_ptr, tg_ptr,
    n_tokens, width, vocab_start, inv_temp, stride_zn, stride_zv,
    RN_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The logits gradient of a stored tile of raw logits, written over it: each program reads its
    ``[BLOCK_M, BLOCK_N]`` block before writing the block's gradient, so in place is exact."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_tokens
    ok = row_ok[:, None] & (cols < width)[None, :]
    at = z_ptr + rows.to(tl.int64)[:, None] * stride_zn + cols[None, :] * stride_zv
    acc = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    d = _grad_epilogue(acc, rows, cols, row_ok, t_ptr, log_z_ptr, a_ptr, c_ptr, tg_ptr, vocab_start, inv_temp,
                       RN_BF16)
    tl.store(at, d.to(z_ptr.dtype.element_ty), mask=ok)


# Tile shapes tried by the autotuner on CUDA (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the
# common Hopper/Ampere GEMM shapes with at most 64 accumulator elements per thread for the
# forward kernel (its epilogue keeps several tiles live: more spills registers on sm_90, as
# compiling them for it shows: tests/distributed/test_fused_output.py), larger ones for the
# backward kernel, and smaller ones for fp32 operands.
_CUDA_STATS_16 = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3), (64, 128, 64, 4, 3)]
_CUDA_GRAD_16 = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4)]
_CUDA_CONFIGS_32 = [(64, 64, 16, 4, 4), (128, 64, 32, 8, 3), (64, 128, 32, 8, 3)]
# The in-place gradient kernel is elementwise (memory bound): row x column blocks and warps.
_CUDA_ELEMENTWISE = [(8, 512, 4), (16, 256, 4), (16, 512, 8), (32, 256, 8)]
# The interpreter runs each program in numpy: tl.dot's smallest shape (16) keeps tests fast.
_INTERPRET_BLOCKS = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2)


def _configs(shapes):
    return [
        triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8), num_warps=w, num_stages=st)
        for m, n, k, w, st in shapes
    ]


@functools.lru_cache(maxsize=2)
def _build(interpret: bool):
    stats = triton.jit(_stats_fn)
    grad = triton.jit(_grad_fn)
    grad_from_z = triton.jit(_grad_from_z_fn)
    if interpret:
        return stats, grad, grad_from_z
    key = ["hdim", "ROUND_Z", "IEEE"]  # the dtypes of the tensor arguments are part of it too
    # The autotuner times each config with the kernel's real arguments: the two GEMM kernels only
    # write their outputs (never read them), so rerunning them is harmless; the in-place one
    # gets its tile restored after each timed run.
    return (
        triton.autotune(_configs(_CUDA_STATS_16 + _CUDA_CONFIGS_32), key=key + ["HAS_Q", "STORE_Z"],
                        prune_configs_by={"early_config_prune": _prune(_CUDA_STATS_16)})(stats),
        triton.autotune(_configs(_CUDA_GRAD_16 + _CUDA_CONFIGS_32), key=key,
                        prune_configs_by={"early_config_prune": _prune(_CUDA_GRAD_16)})(grad),
        triton.autotune([triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w) for m, n, w in _CUDA_ELEMENTWISE],
                        key=["width"], restore_value=["z_ptr"])(grad_from_z),
    )


def _shape(config) -> tuple:
    k = config.kwargs
    return k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], config.num_warps, config.num_stages


def _prune(shapes_16):
    """An early-prune function: 16-bit operands try ``shapes_16``, fp32 the fp32 shapes."""

    def prune(configs, named_args, **kwargs):
        ieee = kwargs.get("IEEE", named_args.get("IEEE"))
        want = set(_CUDA_CONFIGS_32 if ieee else shapes_16)
        return [c for c in configs if _shape(c) in want]

    return prune


def kernels():
    """``(stats, logits_grad, logits_grad_in_place)`` kernels: interpreted under ``TRITON_INTERPRET=1``,
    autotuned JIT otherwise."""
    return _build(triton_interpreting())


def _flags(x):
    """Compile-time switches for ``x``'s dtype: ROUND_Z, UPCAST, IEEE, RN_BF16 (as keyword arguments)."""
    low = x.dtype != torch.float32
    interp = triton_interpreting()
    return dict(ROUND_Z=low, UPCAST=low and interp, IEEE=not low, RN_BF16=interp and x.dtype == torch.bfloat16)


def default_splits(n_tokens: int, width: int, device) -> int:
    """Vocabulary splits per token block (2 on CPU).

    On CUDA at least enough programs to fill the GPU twice over, and at least 16 splits
    where the vocabulary has 32 column blocks per split to give: with the grouped order
    (8 token blocks at a time) the programs running together then read 8 row tiles of x
    and ~16 column tiles of W, which L2 holds, instead of one row tile each.
    """
    if device.type != "cuda":
        return 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # Estimated with 128-wide blocks (the autotuner picks the real shape later).
    token_blocks, col_blocks = triton.cdiv(n_tokens, 128), triton.cdiv(width, 128)
    fill = triton.cdiv(2 * sms, token_blocks)
    share = min(16, triton.cdiv(col_blocks, 32))
    return max(1, min(max(fill, share), col_blocks, 64))


def local_stats(hidden_NH, weight_VH, targets_N, vocab_start: int, inv_temp: float,
                n_splits: int | None = None, with_q: bool = True, logits_out=None) -> torch.Tensor:
    """This rank's per-token ``[N, 5]`` statistics (m, s, sy, zt, q) over ``weight_VH``'s rows
    (q = 0 unless ``with_q``: the collision term's sum, left out of the kernel when unused).

    ``n_splits``: contiguous runs of vocabulary blocks handled by separate programs
    (default ``default_splits``); more splits than blocks leave some empty, which is exact.
    ``logits_out``: an ``[N, V/tp]`` tensor of the input dtype that also receives the raw logits
    ``hidden @ W^T`` (the fused loss keeps its tile to take the gradient from).
    """
    n_tokens, hdim = hidden_NH.shape
    width = weight_VH.shape[0]
    stats_kernel = kernels()[0]
    n_splits = n_splits or default_splits(n_tokens, width, hidden_NH.device)
    out = torch.empty(n_splits, n_tokens, _N_STATS, dtype=torch.float32, device=hidden_NH.device)
    store = logits_out is not None
    if store and (logits_out.shape != (n_tokens, width) or logits_out.dtype != hidden_NH.dtype):
        raise ValueError(f"logits_out must be a [{n_tokens}, {width}] {hidden_NH.dtype} tensor, "
                         f"got {tuple(logits_out.shape)} {logits_out.dtype}")
    z = logits_out if store else out
    extra = _INTERPRET_BLOCKS if triton_interpreting() else {}
    stats_kernel[lambda meta: (triton.cdiv(n_tokens, meta["BLOCK_M"]) * n_splits,)](
        hidden_NH, weight_VH, targets_N, out, z,
        n_tokens, width, hdim, vocab_start, inv_temp,
        hidden_NH.stride(0), hidden_NH.stride(1), weight_VH.stride(0), weight_VH.stride(1),
        z.stride(0) if store else 0, z.stride(1) if store else 0, n_splits, with_q, store,
        **_flags(hidden_NH), **extra,
    )
    return _Ops.fold_stats(out)


def logits_grad_tile(x_t, w_c, targets_t, log_z_t, coef_a_t, coef_c_t, target_grad_t, vocab_start: int,
                     inv_temp: float, out):
    """Writes the ``[rows(x_t), rows(w_c)]`` tile of d loss / d z into ``out`` (recomputing z)."""
    n_tokens, hdim = x_t.shape
    width = w_c.shape[0]
    grad_kernel = kernels()[1]
    extra = _INTERPRET_BLOCKS if triton_interpreting() else {}
    grad_kernel[lambda meta: (triton.cdiv(n_tokens, meta["BLOCK_M"]) * triton.cdiv(width, meta["BLOCK_N"]),)](
        x_t, w_c, targets_t, log_z_t, coef_a_t, coef_c_t, target_grad_t, out,
        n_tokens, width, hdim, vocab_start, inv_temp,
        x_t.stride(0), x_t.stride(1), w_c.stride(0), w_c.stride(1), out.stride(0), out.stride(1),
        **_flags(x_t), **extra,
    )
    return out


def logits_grad_in_place(z, targets_t, log_z_t, coef_a_t, coef_c_t, target_grad_t, vocab_start: int,
                         inv_temp: float):
    """Overwrites ``z``, a ``[tokens, V/tp]`` tile of raw logits (``local_stats(logits_out=z)``), with
    d loss / d z: the epilogue of ``logits_grad_tile`` without its GEMM."""
    n_tokens, width = z.shape
    grad_kernel = kernels()[2]
    extra = dict(BLOCK_M=_INTERPRET_BLOCKS["BLOCK_M"], BLOCK_N=_INTERPRET_BLOCKS["BLOCK_N"]) \
        if triton_interpreting() else {}
    grad_kernel[lambda meta: (triton.cdiv(n_tokens, meta["BLOCK_M"]), triton.cdiv(width, meta["BLOCK_N"]))](
        z, targets_t, log_z_t, coef_a_t, coef_c_t, target_grad_t,
        n_tokens, width, vocab_start, inv_temp, z.stride(0), z.stride(1),
        RN_BF16=_flags(z)["RN_BF16"], **extra,
    )
    return z
