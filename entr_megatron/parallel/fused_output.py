"""Output layer fused with vocab-parallel log-prob and entropy: the ``[N, V/tp]`` logits never exist.

Each tensor-parallel rank holds a contiguous shard ``W_r [V/tp, h]`` of the output
layer (Megatron's ``ColumnParallelLinear`` / tied-embedding layout: rank r owns ids
``[r * V/tp, (r + 1) * V/tp)``) and the full hidden states ``x [N, h]`` (with
sequence parallelism the caller gathers them first, as Megatron's output layer
does). The logits are computed one ``[chunk_tokens, chunk_vocab]`` tile at a time:

forward, per tile (t: a chunk of tokens, c: a chunk of this rank's columns)
    z_tc = (x_t @ W_c^T) / temperature         (GEMM with fp32 accumulation; fp32
                                                inputs give fp32 logits, bf16/fp16
                                                inputs logits rounded to that dtype,
                                                exactly as the unfused output layer)
  the tile's statistics (m, s, sy, zt[, q]) come from the unfused op's own step
  ``VocabParallelLogProbEntropy.local_stats``, and are folded into the running
  per-token statistics of this rank by an online log-sum-exp (``fold_stats``, the
  same exact merge as the ranks' statistics get after the all-gather):
    m'  = max(m, m_c),   a = exp(m - m'),   a_c = exp(m_c - m')
    s'  = a s + a_c s_c
    sy' = a (sy + (m - m') s) + a_c (sy_c + (m_c - m') s_c)
    q'  = a^2 q + a_c^2 q_c
    zt' = zt + zt_c
  (sy = sum_j exp(z_j - m)(z_j - m) is taken about the running max: when the max
  moves, the shift (m - m') s re-centres it.) Then, exactly as the unfused op, ONE
  all-gather of the ``[N, 4]`` (``[N, 5]`` with q) statistics and the same merge
  (``merge_stats`` / ``merge_collision``) give logprob, entropy H, logZ[, collision].

backward (no communication), per tile, recomputing z_tc instead of saving it:
    dz_j = p_j (a log p_j + c) + (g_lp / T) 1[j = target]
           a = -g_h / T,  c = -(g_lp + g_h H) / T    (the unfused ``logits_grad``)
    grad_x_t += dz_tc @ W_c,     grad_W_c += dz_tc^T @ x_t

Under tensor parallelism ``grad_x`` is this rank's PARTIAL sum over its vocabulary
shard: the caller must all-reduce it across the tensor-parallel group (or
reduce-scatter it with sequence parallelism), exactly as Megatron's
``ColumnParallelLinear`` backward does (``copy_to_tensor_model_parallel_region``).
``grad_W`` is complete for this rank's shard (zero on padding rows).

Memory: besides the input gradients, three tile-sized buffers (two fp32, one in the
input dtype for the raw GEMM tile) and ``[N]``-sized statistics. With bf16/fp16
inputs both gradients are summed in fp32 (``[N, h]`` and ``[V/tp, h]`` fp32 buffers,
cast at the end) from the bf16 GEMMs' ``[chunk_tokens, h]`` / ``[chunk_vocab, h]``
products. Saved for backward: hidden, weight, targets, logZ and H.
The extra cost over the unfused path is the recomputed GEMM in backward (4 GEMMs
instead of 3).

Two implementations of the same steps (``backend``): this chunked PyTorch path, the
reference, and on CUDA the Triton kernels of ``fused_output_triton.py`` (chosen by
default when Triton is installed): the forward GEMM with the statistics folded in
registers (no tile buffer at all), and in backward one kernel per tile that recomputes
the logits and writes their gradient, followed by the same two gradient GEMMs.
"""

from __future__ import annotations

import torch

from entr_megatron.parallel.triton_env import triton_available, triton_interpreting, uses_triton
from entr_megatron.parallel.vocab_parallel import (
    VocabParallelLogProbEntropy,
    group_rank_size,
    check_vocab_and_targets,
)

__all__ = ["vocab_parallel_linear_logprobs_entropy", "default_tile_shape", "triton_available", "triton_interpreting"]


# Default tile: 4096 columns x 512 tokens, an 8 MiB fp32 buffer (the tokens follow
# from the budget when only the columns are given, and vice versa). GEMMs of that
# shape run within ~5% of a full-size GEMM on CPU BLAS and saturate a GPU, while the
# three such buffers stay far below the [N, V/tp] logits they replace.
_DEFAULT_TILE_ELEMENTS = 1 << 21
_DEFAULT_CHUNK_VOCAB = 4096
# The Triton path's backward tile: 4096 x 4096 (32 MiB in bf16, its only tile buffer).
# Each tile costs three kernel launches (the fused recompute, two cuBLAS GEMMs), so
# tiles this size keep launches a few percent of a GEMM at h >= 2048; the forward
# kernel needs no buffer at all.
_TRITON_TILE_ELEMENTS = 1 << 24

_Ops = VocabParallelLogProbEntropy  # the unfused op's named steps, shared here


def default_tile_shape(n_tokens: int, width: int, chunk_tokens=None, chunk_vocab=None,
                       elements: int = _DEFAULT_TILE_ELEMENTS) -> tuple[int, int]:
    """(tokens, columns) of one tile: ``elements`` in all unless given, bounded by the problem's own size."""
    if chunk_vocab is None:
        chunk_vocab = elements // chunk_tokens if chunk_tokens else _DEFAULT_CHUNK_VOCAB
    cv = max(1, min(chunk_vocab, width))
    ct = chunk_tokens or elements // cv
    return max(1, min(ct, n_tokens)), cv


def _tile(buf, rows, cols):
    """A contiguous ``[rows, cols]`` view at the start of a flat buffer (ragged last tiles)."""
    return buf[: rows * cols].view(rows, cols)


class _FusedLinearLogProbEntropy(torch.autograd.Function):
    """Autograd function; the math is split into the named static steps below."""

    @staticmethod
    def local_stats(hidden_NH, weight_VH, targets_N, vocab_start, inv_temp, ct, cv, n_stats):
        """Per-token ``[N, n_stats]`` statistics of this rank's (unpadded) shard, tile by tile."""
        n_tokens, width = hidden_NH.shape[0], weight_VH.shape[0]
        stats = torch.empty(n_tokens, n_stats, dtype=torch.float32, device=hidden_NH.device)
        raw = torch.empty(ct * cv, dtype=hidden_NH.dtype, device=hidden_NH.device)
        buf_y, buf_e = (torch.empty(ct * cv, dtype=torch.float32, device=hidden_NH.device) for _ in range(2))
        for s in range(0, n_tokens, ct):
            e_ = min(s + ct, n_tokens)
            x_t = hidden_NH[s:e_]
            for v0 in range(0, width, cv):
                v1 = min(v0 + cv, width)
                z = _tile(raw, e_ - s, v1 - v0)
                torch.mm(x_t, weight_VH[v0:v1].t(), out=z)
                tile = _Ops.local_stats(
                    z, targets_N[s:e_], vocab_start + v0, inv_temp, e_ - s,
                    _tile(buf_y, e_ - s, v1 - v0), _tile(buf_e, e_ - s, v1 - v0), n_stats,
                )
                # online log-sum-exp: the running statistics and this tile's, merged exactly
                stats[s:e_] = tile if v0 == 0 else _Ops.fold_stats(torch.stack((stats[s:e_], tile)))
        return stats

    @staticmethod
    def input_grads(hidden_NH, weight_VH, targets_N, log_z, entropy, g_lp, g_h, vocab_start, inv_temp, ct, cv,
                    grad_hidden, grad_weight, use_triton=False):
        """Accumulates d(sum g_lp*logprob + g_h*H) into ``grad_hidden [N, h]`` / ``grad_weight [width, h]``.

        Either may be ``None`` (not wanted); both are fp32. With bf16/fp16 inputs the
        tile's gradient is rounded to that dtype for the GEMMs (as the unfused path's
        logits gradient is), and the GEMMs' products are summed in fp32. With
        ``use_triton`` one kernel recomputes each tile's logits and writes its gradient
        (one tile buffer in the input dtype); otherwise a matmul and the unfused op's
        ``logits_grad`` do (three tile buffers).
        """
        n_tokens, width = hidden_NH.shape[0], weight_VH.shape[0]
        dev, low = hidden_NH.device, hidden_NH.dtype != torch.float32
        raw = torch.empty(ct * cv, dtype=hidden_NH.dtype, device=dev)
        if use_triton:
            from entr_megatron.parallel import fused_output_triton

            coef_a = -g_h * inv_temp
            coef_c = -(g_lp + g_h * entropy) * inv_temp
            target_grad = g_lp * inv_temp
        else:
            buf_p, buf_d = (torch.empty(ct * cv, dtype=torch.float32, device=dev) for _ in range(2))
        for s in range(0, n_tokens, ct):
            e_ = min(s + ct, n_tokens)
            x_t = hidden_NH[s:e_]
            for v0 in range(0, width, cv):
                v1 = min(v0 + cv, width)
                w_c = weight_VH[v0:v1]
                z = _tile(raw, e_ - s, v1 - v0)
                if use_triton:
                    d = fused_output_triton.logits_grad_tile(
                        x_t, w_c, targets_N[s:e_], log_z[s:e_], coef_a[s:e_], coef_c[s:e_], target_grad[s:e_],
                        vocab_start + v0, inv_temp, z,
                    )
                else:
                    torch.mm(x_t, w_c.t(), out=z)
                    d = _tile(buf_d, e_ - s, v1 - v0)
                    _Ops.logits_grad(
                        z, targets_N[s:e_], log_z[s:e_], entropy[s:e_], g_lp[s:e_], g_h[s:e_], vocab_start + v0,
                        inv_temp, e_ - s, _tile(buf_p, e_ - s, v1 - v0), d,
                    )
                    if low:  # the raw tile is spent: it holds the rounded gradient now
                        d = z.copy_(d)
                if grad_hidden is not None:
                    if low:
                        grad_hidden[s:e_] += d @ w_c
                    else:
                        grad_hidden[s:e_].addmm_(d, w_c)
                if grad_weight is not None:
                    if low:
                        grad_weight[v0:v1] += d.t() @ x_t
                    else:
                        grad_weight[v0:v1].addmm_(d.t(), x_t)

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, temperature, vocab_size, chunk_tokens, chunk_vocab,
                return_collision, use_triton):
        rank, world = group_rank_size(group)
        vocab_start = rank * weight.shape[0]
        # valid_columns reads the shard width from the last dim: W^T is [h, V/tp] (a view).
        width = _Ops.valid_columns(weight.t(), rank, vocab_size)
        hidden_NH = hidden.reshape(-1, hidden.shape[-1])
        targets_N = targets.reshape(-1)
        inv_temp = 1.0 / temperature
        ct, cv = default_tile_shape(
            hidden_NH.shape[0], width, chunk_tokens, chunk_vocab,
            elements=_TRITON_TILE_ELEMENTS if use_triton else _DEFAULT_TILE_ELEMENTS,
        )
        n_stats = 5 if return_collision else 4
        if width > 0 and hidden_NH.shape[0] > 0 and use_triton:
            from entr_megatron.parallel import fused_output_triton

            stats = fused_output_triton.local_stats(
                hidden_NH, weight[:width], targets_N, vocab_start, inv_temp, with_q=return_collision
            )[:, :n_stats].contiguous()
        elif width > 0 and hidden_NH.shape[0] > 0:
            stats = _FusedLinearLogProbEntropy.local_stats(
                hidden_NH, weight[:width], targets_N, vocab_start, inv_temp, ct, cv, n_stats
            )
        else:
            stats = _Ops.padding_stats(targets_N.numel(), n_stats, hidden.device)
        gathered = _Ops.gather_stats(stats, group, world)
        logprob, entropy, log_z = _Ops.merge_stats(gathered)

        ctx.save_for_backward(hidden, weight, targets_N, log_z, entropy)
        ctx.vocab_start, ctx.inv_temp, ctx.tile, ctx.width = vocab_start, inv_temp, (ct, cv), width
        ctx.use_triton = use_triton
        out_shape = hidden.shape[:-1]
        if not return_collision:
            return logprob.view(out_shape), entropy.view(out_shape)
        collision = _Ops.merge_collision(gathered).view(out_shape)
        ctx.mark_non_differentiable(collision)
        return logprob.view(out_shape), entropy.view(out_shape), collision

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_collision=None):
        # grad_collision: the collision output is non-differentiable (it only feeds masks).
        hidden, weight, targets_N, log_z, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        zeros = None
        if grad_logprob is None or grad_entropy is None:
            zeros = torch.zeros_like(log_z)
        g_lp = zeros if grad_logprob is None else grad_logprob.reshape(-1).float()
        g_h = zeros if grad_entropy is None else grad_entropy.reshape(-1).float()
        hidden_NH = hidden.reshape(-1, hidden.shape[-1])
        # fp32 accumulators: the gradients themselves when the inputs are fp32.
        acc_h = torch.zeros(hidden_NH.shape, dtype=torch.float32, device=hidden.device) if want_hidden else None
        acc_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        width = ctx.width
        if width > 0 and hidden_NH.shape[0] > 0 and (want_hidden or want_weight):
            ct, cv = ctx.tile
            _FusedLinearLogProbEntropy.input_grads(
                hidden_NH, weight[:width], targets_N, log_z, entropy, g_lp, g_h, ctx.vocab_start, ctx.inv_temp,
                ct, cv, acc_h, None if acc_w is None else acc_w[:width], use_triton=ctx.use_triton,
            )
        grad_hidden = None if acc_h is None else acc_h.to(hidden.dtype).view(hidden.shape)
        grad_weight = None if acc_w is None else acc_w.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def vocab_parallel_linear_logprobs_entropy(
    hidden, weight, targets, group=None, temperature=1.0, vocab_size=None, chunk_tokens=None, chunk_vocab=None,
    *, return_collision: bool = False, backend: str = "auto",
):
    """Log-prob of ``targets`` and entropy of ``softmax(hidden @ W^T / temperature)``, W vocab-sharded.

    Args:
        hidden: ``[..., h]`` hidden states, the same on every tensor-parallel rank
            (gather them first under sequence parallelism); fp32, bf16 or fp16.
        weight: ``[V/tp, h]`` this rank's shard of the output layer (rank r owns ids
            ``[r*V/tp, (r+1)*V/tp)``), the same dtype as ``hidden``. May be a tied
            embedding: its gradient accumulates like any other use.
        targets: ``[...]`` global token ids in ``[0, V)``.
        group: the tensor-parallel process group; ``None`` means a single rank.
        temperature: sampling temperature (> 0) the distribution is taken at.
        vocab_size: the true vocabulary size when the sharded vocabulary is padded;
            rows of ``weight`` with ids ``>= vocab_size`` are excluded (and get zero
            gradient). ``None``: no padding.
        chunk_tokens: tokens per tile (default: 2**21 elements / chunk_vocab).
        chunk_vocab: vocabulary columns per tile (default 4096, or 2**21 elements /
            chunk_tokens when only that is given). Temporaries are three
            ``[chunk_tokens, chunk_vocab]`` buffers (8 MiB each by default).
        return_collision: also return the collision term ``1 - sum_j p_j^2``,
            computed in the same pass and the same single all-gather.
        backend: ``"auto"`` (Triton kernels for CUDA tensors when Triton is
            installed, else the chunked PyTorch path), ``"torch"`` (the chunked
            PyTorch path, the reference) or ``"triton"`` (CUDA tensors, or any
            tensors under Triton's CPU interpreter, ``TRITON_INTERPRET=1``). The
            Triton path's forward writes no tile at all; its backward holds one
            ``[chunk_tokens, chunk_vocab]`` tile in the input dtype (default
            4096 x 4096 elements).

    Returns:
        ``(logprobs, entropy)``, both float32 ``[...]``, or with ``return_collision``
        ``(logprobs, entropy, collision)``. Gradients flow to ``hidden`` and ``weight``
        from logprobs and entropy; collision carries none. No collective runs in
        backward, so under tensor parallelism the gradient to ``hidden`` is this
        rank's partial sum: all-reduce it over ``group`` (reduce-scatter with sequence
        parallelism), as Megatron's ColumnParallelLinear backward does.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    for name, value in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"hidden must be a floating point [..., h] tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be the [V/tp, h] vocab shard with h = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"weight must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), "
            f"got {weight.dtype}, {weight.device}"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden shape without the hidden dim "
            f"{tuple(hidden.shape[:-1])}"
        )
    check_vocab_and_targets(targets, weight.shape[0], group, vocab_size)
    use_triton = uses_triton(backend, hidden)
    return _FusedLinearLogProbEntropy.apply(
        hidden, weight, targets.long(), group, float(temperature), vocab_size, chunk_tokens, chunk_vocab,
        bool(return_collision), use_triton,
    )
