"""Output layer fused with a token-local loss: the gradients are computed in the forward pass.

`vocab_parallel_linear_logprobs_entropy` (fused_output.py) never writes the logits, but its
backward must recompute every tile (4 output-layer GEMMs against the unfused path's 3): the
upstream gradients of log-prob and entropy are only known after the loss. When the loss is
token-local (``algorithm/token_local.py``: the gradient of the numerator with respect to
token t's log-prob depends only on token t's log-prob and on inputs known before the pass),
they are known per token as soon as that token's log-prob is. So, per chunk of tokens (Liger's
fused linear loss, here vocab-parallel with the exact log-sum-exp merge of fused_output.py):

    z      = x_t @ W^T / T                              GEMM 1, [chunk, V/tp] (this rank's columns)
    stats  = local_stats(z); one all-gather of the chunk's [chunk, 4] statistics; merge
             -> logprob, entropy H, logZ                 (the unfused op's own steps)
    l      = token_loss(start, end, logprob, H)         per-token loss terms, [chunk]
    g_lp   = d sum(l) / d logprob                       autograd on a leaf copy (elementwise)
    dz     = g_lp (onehot(target) - p) / T              (``logits_grad`` with g_H = 0)
    grad_x[t] = dz @ W                                   GEMM 2 (this rank's partial sum)
    grad_W   += dz^T @ x_t                               GEMM 3

The returned loss is ``sum_t l_t`` (fp32 scalar); backward only multiplies the stored
gradients by the incoming scalar gradient. The entropy is returned without gradient: the
learner's losses read it detached (learner/loss.py), so g_H = 0 exactly.

As in fused_output.py the hidden gradient is this rank's PARTIAL sum over its vocabulary
shard: the caller all-reduces it over the tensor-parallel group (reduce-scatters it with
sequence parallelism), as Megatron's ``ColumnParallelLinear`` backward does; the weight
gradient is complete for this rank's shard (zero on padding rows). Padded vocabularies and
ranks holding only padding work as in fused_output.py.

Memory: the two input gradients (fp32 accumulators, cast at the end), kept from forward to
backward, one ``[chunk, V/tp]`` tile in the input dtype (the logits, then in place their
gradient) and, on the PyTorch path, two 1 MiB fp32 work buffers: the default chunk holds 2**23
elements (32 MiB in fp32, 256 tokens at V/tp = 32768).

On CUDA (``backend`` "auto" or "triton") the tile's two passes are Triton kernels of
fused_output_triton.py: GEMM 1 with the statistics in its epilogue (``local_stats`` with
``logits_out``: the logits tile is written once and never re-read for the statistics), and
the logits gradient written over the tile in one read and one write
(``logits_grad_in_place``); GEMMs 2 and 3 stay cuBLAS matmuls. Three GEMMs either way.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from entr_megatron.parallel.triton_env import uses_triton
from entr_megatron.parallel.vocab_parallel import VocabParallelLogProbEntropy as _Ops
from entr_megatron.parallel.vocab_parallel import check_vocab_and_targets, group_rank_size

__all__ = ["TokenLossFn", "vocab_parallel_linear_fused_loss", "GEMMS_PER_PASS"]

# Output-layer GEMMs of forward + backward (the unfused path: 3; fused_output.py's op: 4).
GEMMS_PER_PASS = 3

_DEFAULT_TILE_ELEMENTS = 1 << 23
"""Elements of the logits tile: 256 tokens at V/tp = 32768. Fewer tokens per GEMM lose BLAS
throughput (64 tokens: GEMM 1 takes ~1.5x the time per token of a whole-batch GEMM on CPU)."""
_ROW_BUFFER_ELEMENTS = 1 << 18
"""Elements of each fp32 work buffer (blocks of rows of the tile: 1 MiB)."""

TokenLossFn = Callable[[int, int, Tensor, Tensor], Tensor]
"""``(start, end, logprob_n, entropy_n) -> loss_n``: the per-token loss terms (already times each
token's aggregation scale) of tokens ``[start, end)``, differentiable in ``logprob_n``."""


def _tile(buf, rows, cols):
    return buf[: rows * cols].view(rows, cols)


class _FusedLinearLoss(torch.autograd.Function):

    @staticmethod
    def chunk_grad(token_loss, s, e_, logprob, entropy):
        """(sum of the chunk's loss terms, d sum / d logprob) from a leaf copy of the log-probs."""
        with torch.enable_grad():
            leaf = logprob.detach().requires_grad_(True)
            total = token_loss(s, e_, leaf, entropy).sum()
            if not total.requires_grad:  # no token of the chunk carries gradient
                return total.detach().float(), torch.zeros_like(logprob)
            (g_lp,) = torch.autograd.grad(total, leaf, allow_unused=True)
        return total.detach().float(), torch.zeros_like(logprob) if g_lp is None else g_lp.float()

    @staticmethod
    def forward(ctx, hidden, weight, targets, token_loss, group, temperature, vocab_size, chunk_tokens, use_triton):
        rank, world = group_rank_size(group)
        vocab_start = rank * weight.shape[0]
        width = _Ops.valid_columns(weight.t(), rank, vocab_size)
        x_NH = hidden.reshape(-1, hidden.shape[-1])
        targets_N = targets.reshape(-1)
        n_tokens, dev, low = x_NH.shape[0], hidden.device, hidden.dtype != torch.float32
        inv_temp = 1.0 / temperature
        ct = max(1, min(chunk_tokens or _DEFAULT_TILE_ELEMENTS // max(width, 1), max(n_tokens, 1)))
        rows = max(1, min(ct, _ROW_BUFFER_ELEMENTS // max(width, 1)))  # the fp32 work buffers' rows
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc_h = torch.zeros(x_NH.shape, dtype=torch.float32, device=dev) if want_h else None
        acc_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if want_w else None
        logprob = torch.empty(n_tokens, dtype=torch.float32, device=dev)
        entropy = torch.empty_like(logprob)
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        w = weight[:width]
        if width > 0 and n_tokens > 0:
            raw = torch.empty(ct * width, dtype=hidden.dtype, device=dev)  # the logits tile, then its gradient
            if not use_triton:
                buf_y, buf_e = (torch.empty(rows, width, dtype=torch.float32, device=dev) for _ in range(2))
        zero_h = torch.zeros(ct, dtype=torch.float32, device=dev)
        if use_triton:
            from entr_megatron.parallel import fused_output_triton as kernels
        # Every rank walks the same chunks: each chunk's all-gather pairs up across the group.
        for s in range(0, n_tokens, ct):
            e_ = min(s + ct, n_tokens)
            n, x_t, t_t = e_ - s, x_NH[s:e_], targets_N[s:e_]
            if width > 0:
                z = _tile(raw, n, width)
                if use_triton:  # GEMM 1, its statistics in the kernel's epilogue
                    stats = kernels.local_stats(x_t, w, t_t, vocab_start, inv_temp, with_q=False,
                                                logits_out=z)[:, :4].contiguous()
                else:
                    torch.mm(x_t, w.t(), out=z)  # GEMM 1
                    stats = _Ops.local_stats(z, t_t, vocab_start, inv_temp, rows, buf_y, buf_e, 4)
            else:
                stats = _Ops.padding_stats(n, 4, dev)
            lp, h, log_z = _Ops.merge_stats(_Ops.gather_stats(stats, group, world))
            logprob[s:e_], entropy[s:e_] = lp, h
            total, g_lp = _FusedLinearLoss.chunk_grad(token_loss, s, e_, lp, h)
            loss += total
            if width == 0 or not (want_h or want_w):
                continue
            # In place: each block of rows (PyTorch) or tile block (Triton) reads its logits before
            # writing their gradient (rounded to the input dtype when it is not fp32), so the tile
            # is the only [chunk, V/tp] buffer.
            if use_triton:  # d = p (a log p + c) + tg 1[target] with g_H = 0: a = 0, c = -g_lp / T, tg = g_lp / T
                kernels.logits_grad_in_place(z, t_t, log_z, zero_h[:n], -g_lp * inv_temp, g_lp * inv_temp,
                                             vocab_start, inv_temp)
            else:
                _Ops.logits_grad(z, t_t, log_z, h, g_lp, zero_h[:n], vocab_start, inv_temp, rows, buf_y, z)
            d = z
            if acc_h is not None:  # GEMM 2
                if low:
                    acc_h[s:e_] += d @ w
                else:
                    acc_h[s:e_].addmm_(d, w)
            if acc_w is not None:  # GEMM 3
                if low:
                    acc_w[:width] += d.t() @ x_t
                else:
                    acc_w[:width].addmm_(d.t(), x_t)
        ctx.grads = (
            None if acc_h is None else acc_h.to(hidden.dtype).view(hidden.shape),
            None if acc_w is None else acc_w.to(weight.dtype),
        )
        out_shape = hidden.shape[:-1]
        logprob, entropy = logprob.view(out_shape), entropy.view(out_shape)
        ctx.mark_non_differentiable(logprob, entropy)
        return loss, logprob, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_logprob=None, grad_entropy=None):
        grad_h, grad_w = ctx.grads
        ctx.grads = None  # one backward: the stored gradients are released
        # Scaled in place: the stored gradients have no other reader, and a scaled copy would hold
        # a second [V/tp, h] weight gradient at the peak of backward.
        for grad in (grad_h, grad_w):
            if grad is not None:
                grad.mul_(grad_loss.to(grad.dtype))
        return grad_h, grad_w, None, None, None, None, None, None, None


def vocab_parallel_linear_fused_loss(hidden: Tensor, weight: Tensor, targets: Tensor, token_loss: TokenLossFn,
                                     group=None, temperature: float = 1.0, vocab_size: int | None = None,
                                     chunk_tokens: int | None = None, backend: str = "auto"
                                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Sum of a token-local loss over ``softmax(hidden @ W^T / temperature)``, W vocab-sharded, with its
    gradients computed in the forward pass (3 output-layer GEMMs; see the module docstring).

    Args:
        hidden: ``[..., h]`` hidden states, the same on every tensor-parallel rank (gathered
            first under sequence parallelism); fp32, bf16 or fp16.
        weight: ``[V/tp, h]`` this rank's output-layer shard (a tied embedding works alike).
        targets: ``[...]`` global token ids in ``[0, V)``.
        token_loss: ``(start, end, logprob_n, entropy_n) -> [n]`` per-token loss terms of the
            flattened tokens ``[start, end)``, each already times its aggregation scale; it must
            be token-local (each term's gradient depends on its own log-prob only), give the
            same values on every rank of ``group``, and may read the entropy (no gradient).
        group, temperature, vocab_size: as `vocab_parallel_linear_logprobs_entropy`.
        chunk_tokens: tokens per chunk (default: 2**23 elements / this rank's columns).
        backend: ``"auto"`` (Triton kernels on CUDA when triton is installed, else PyTorch),
            ``"torch"`` or ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), as
            `vocab_parallel_linear_logprobs_entropy`'s.

    Returns:
        ``(loss, logprobs, entropy)``: ``loss`` the fp32 scalar ``sum_t token_loss_t``, carrying
        the gradient to ``hidden`` (this rank's partial sum over its vocabulary shard: all-reduce
        it over ``group``, as for the unfused output layer) and ``weight``; the float32 ``[...]``
        log-probs and entropy, detached, for the metrics.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    if not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"hidden must be a floating point [..., h] tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be the [V/tp, h] vocab shard with h = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), "
                         f"got {weight.dtype}, {weight.device}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    check_vocab_and_targets(targets, weight.shape[0], group, vocab_size)
    return _FusedLinearLoss.apply(hidden, weight, targets.long(), token_loss, group, float(temperature), vocab_size,
                                  chunk_tokens, uses_triton(backend, hidden))
