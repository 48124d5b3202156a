"""Per-token log-prob and entropy (and optionally collision) from vocabulary-sharded logits, in one pass.

Each tensor-parallel rank holds a contiguous shard ``[..., V/tp]`` of the logits
(Megatron's ``ColumnParallelLinear`` output layout: rank r owns ids
``[r * V/tp, (r + 1) * V/tp)``). The full vocabulary is never gathered:

forward, per chunk of tokens (temporaries: two fp32 ``[chunk, V/tp]`` buffers)
    m_r   = max_j z_j                      (z = logits / temperature)
    s_r   = sum_j exp(z_j - m_r)
    sy_r  = sum_j exp(z_j - m_r) (z_j - m_r)
    zt_r  = z_target if this rank owns the target else 0
    q_r   = sum_j exp(2 (z_j - m_r))       (only with ``return_collision``)
  then ONE all-gather of the ``[N, 4]`` (``[N, 5]`` with q) statistics and an
  exact log-sum-exp merge:
    M = max_r m_r,  a_r = exp(m_r - M),  S = sum_r a_r s_r,  Q = sum_r a_r^2 q_r
    logZ = M + log S,   H = log S - sum_r a_r (sy_r + (m_r - M) s_r) / S
    logprob = zt - logZ
    G = 1 - sum_j p_j^2 = 1 - Q / S^2      (collision; no gradient)
  Sums over j run over the true vocabulary only: padded columns (ids >=
  ``vocab_size``) are not looked at.

backward (no communication: the per-token upstream gradients are replicated
across the tensor-parallel group, as the loss is), recomputing p per chunk
instead of saving a softmax copy:
    d logprob / dz_j = 1[j = target] - p_j
    d H / dz_j       = -p_j (log p_j + H)

Only ``logits`` (the caller's tensor, not a copy), the targets and three
``[N]`` vectors are saved for backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "VocabParallelLogProbEntropy",
    "check_vocab_and_targets",
    "default_chunk_size",
    "group_rank_size",
    "vocab_parallel_logprobs_entropy",
]

# Elements per [chunk, V/tp] fp32 buffer when chunk_size is not given: 2 MiB
# buffers stay cache-resident on common CPUs and are large enough that per-chunk
# launch overhead stays small on GPUs.
_DEFAULT_CHUNK_ELEMENTS = 1 << 19

# Columns of the per-token statistics exchanged between ranks; the last one is
# only computed (and sent) when the collision term is asked for.
_MAX, _SUM_EXP, _SUM_EXP_Y, _TARGET_LOGIT, _SUM_EXP2 = range(5)


def default_chunk_size(vocab_shard: int) -> int:
    """Tokens per chunk so that one fp32 ``[chunk, vocab_shard]`` buffer is ~2 MiB."""
    return max(1, _DEFAULT_CHUNK_ELEMENTS // max(vocab_shard, 1))


def group_rank_size(group) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) for None (one rank)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class VocabParallelLogProbEntropy(torch.autograd.Function):
    """Autograd function; the math is split into the named static steps below, which the fused
    output op (fused_output.py) and its Triton kernels (fused_output_triton.py) share."""

    @staticmethod
    def local_stats(logits_NV, targets_N, vocab_start, inv_temp, chunk, buf_y, buf_e, n_stats):
        """Per-token ``[N, n_stats]`` statistics of this rank's shard (see module docstring).

        ``n_stats`` is 4, or 5 to add q_r = sum_j exp(2 (z_j - m_r)) for the collision term.
        """
        n_tokens, vocab_shard = logits_NV.shape
        stats = torch.empty(n_tokens, n_stats, dtype=torch.float32, device=logits_NV.device)
        local_t = targets_N - vocab_start
        owned = (local_t >= 0) & (local_t < vocab_shard)
        local_t = torch.where(owned, local_t, 0)
        for s in range(0, n_tokens, chunk):
            e_ = min(s + chunk, n_tokens)
            x = logits_NV[s:e_]
            y, ex = buf_y[: e_ - s], buf_e[: e_ - s]
            m = x.amax(dim=-1).float() * inv_temp
            # y = x / T - m in one pass (torch.add computes input + alpha * other).
            torch.add(-m.unsqueeze(-1), x, alpha=inv_temp, out=y)
            torch.exp(y, out=ex)
            stats[s:e_, _MAX] = m
            stats[s:e_, _SUM_EXP] = ex.sum(dim=-1)
            # e * y in place of y (no further use): no temporary, and no matmul that
            # TF32 settings could degrade.
            stats[s:e_, _SUM_EXP_Y] = y.mul_(ex).sum(dim=-1)
            if n_stats > _SUM_EXP2:
                # exp(2y) = e * e in place of e (no further use): no extra buffer.
                stats[s:e_, _SUM_EXP2] = ex.mul_(ex).sum(dim=-1)
            zt = x.gather(1, local_t[s:e_].unsqueeze(-1)).squeeze(-1).float() * inv_temp
            stats[s:e_, _TARGET_LOGIT] = torch.where(owned[s:e_], zt, 0.0)
        return stats

    @staticmethod
    def fold_stats(stats_RNC):
        """Exact merge of ``[R, N, C]`` partial statistics (ranks, or vocabulary splits) into
        ``[N, C]``: every sum re-centred on the largest max. A part that saw no column (max
        the lowest finite float, sums 0: ``padding_stats``) weighs exp(lowest - M) = 0."""
        m = stats_RNC[..., _MAX]
        big_m = m.amax(dim=0)
        shift = m - big_m
        scale = torch.exp(shift)
        out = torch.empty(stats_RNC.shape[1:], dtype=stats_RNC.dtype, device=stats_RNC.device)
        out[:, _MAX] = big_m
        out[:, _SUM_EXP] = (scale * stats_RNC[..., _SUM_EXP]).sum(dim=0)
        out[:, _SUM_EXP_Y] = (scale * (stats_RNC[..., _SUM_EXP_Y] + shift * stats_RNC[..., _SUM_EXP])).sum(dim=0)
        out[:, _TARGET_LOGIT] = stats_RNC[..., _TARGET_LOGIT].sum(dim=0)
        if stats_RNC.shape[-1] > _SUM_EXP2:
            out[:, _SUM_EXP2] = (scale.square() * stats_RNC[..., _SUM_EXP2]).sum(dim=0)
        return out

    @staticmethod
    def merge_stats(stats_RNC):
        """Exact log-sum-exp merge of the ranks' ``[R, N, C]`` statistics -> (logprob_N, entropy_N, logZ_N)."""
        folded = VocabParallelLogProbEntropy.fold_stats(stats_RNC[..., :_SUM_EXP2])
        sum_exp = folded[:, _SUM_EXP]
        log_sum = torch.log(sum_exp)
        log_z = folded[:, _MAX] + log_sum
        entropy = log_sum - folded[:, _SUM_EXP_Y] / sum_exp
        logprob = folded[:, _TARGET_LOGIT] - log_z
        return logprob, entropy, log_z

    @staticmethod
    def merge_collision(stats_RNC):
        """Exact merge of the q column -> collision_N = 1 - sum_j p_j^2 = 1 - Q / S^2."""
        folded = VocabParallelLogProbEntropy.fold_stats(stats_RNC)
        return 1.0 - folded[:, _SUM_EXP2] / folded[:, _SUM_EXP].square()

    @staticmethod
    def logits_grad(logits_NV, targets_N, log_z, entropy, g_lp, g_h, vocab_start, inv_temp, chunk, buf_p, out):
        """Writes d(sum g_lp*logprob + g_h*H)/d logits into ``out`` chunk by chunk.

        grad_j = inv_temp * (g_lp * 1[j = t] - p_j (g_lp + g_h (log p_j + H)))
        """
        n_tokens, vocab_shard = logits_NV.shape
        # Fold the temperature and the sign into per-token coefficients:
        #   grad_j = p_j * (a * log p_j + c),  a = -g_h / T,  c = -(g_lp + g_h H) / T
        a = (-g_h * inv_temp).unsqueeze(-1)
        c = (-(g_lp + g_h * entropy) * inv_temp).unsqueeze(-1)
        neg_log_z = (-log_z).unsqueeze(-1)
        local_t = targets_N - vocab_start
        owned = (local_t >= 0) & (local_t < vocab_shard)
        target_grad = torch.where(owned, g_lp * inv_temp, 0.0)
        local_t = torch.where(owned, local_t, 0)
        # fp32 contiguous rows: compute straight into the gradient (no extra buffer).
        direct = out.dtype == torch.float32 and out.is_contiguous()
        buf_w = None if direct else torch.empty_like(buf_p)
        for s in range(0, n_tokens, chunk):
            e_ = min(s + chunk, n_tokens)
            w = out[s:e_] if direct else buf_w[: e_ - s]
            p = buf_p[: e_ - s]
            torch.add(neg_log_z[s:e_], logits_NV[s:e_], alpha=inv_temp, out=w)  # log p
            torch.exp(w, out=p)
            torch.addcmul(c[s:e_], w, a[s:e_], out=w)
            w.mul_(p)
            w.scatter_add_(1, local_t[s:e_].unsqueeze(-1), target_grad[s:e_].unsqueeze(-1))
            if not direct:
                out[s:e_].copy_(w)

    @staticmethod
    def padding_stats(n_tokens, n_stats, device):
        """The statistics of a rank holding only padding: nothing in the softmax."""
        stats = torch.zeros(n_tokens, n_stats, dtype=torch.float32, device=device)
        # Lowest finite, not -inf: the merge's (m_r - M) * s_r must be 0, not nan.
        stats[:, _MAX] = torch.finfo(torch.float32).min
        return stats

    @staticmethod
    def gather_stats(stats, group, world):
        """The ONE all-gather: every rank's ``[N, C]`` statistics as ``[R, N, C]``."""
        if world == 1:
            return stats.unsqueeze(0)
        gathered = torch.empty(world, *stats.shape, dtype=stats.dtype, device=stats.device)
        dist.all_gather(list(gathered.unbind(0)), stats, group=group)
        return gathered

    @staticmethod
    def valid_columns(logits, rank, vocab_size):
        """This rank's columns that hold real vocabulary ids (Megatron pads the vocab)."""
        vocab_shard = logits.shape[-1]
        if vocab_size is None:
            return vocab_shard
        return max(0, min(vocab_shard, vocab_size - rank * vocab_shard))

    @staticmethod
    def forward(ctx, logits, targets, group, temperature, chunk_size, vocab_size, return_collision):
        rank, world = group_rank_size(group)
        vocab_start = rank * logits.shape[-1]
        width = VocabParallelLogProbEntropy.valid_columns(logits, rank, vocab_size)
        # Padding columns are simply not looked at: a narrowed view, no copy.
        logits_NV = logits.reshape(-1, logits.shape[-1])[:, :width]
        targets_N = targets.reshape(-1)
        inv_temp = 1.0 / temperature
        chunk = chunk_size or default_chunk_size(max(width, 1))
        chunk = min(chunk, max(logits_NV.shape[0], 1))
        n_stats = 5 if return_collision else 4
        if width > 0:
            buf_y = torch.empty(chunk, width, dtype=torch.float32, device=logits.device)
            stats = VocabParallelLogProbEntropy.local_stats(
                logits_NV, targets_N, vocab_start, inv_temp, chunk, buf_y, torch.empty_like(buf_y), n_stats
            )
            del buf_y
        else:
            stats = VocabParallelLogProbEntropy.padding_stats(targets_N.numel(), n_stats, logits.device)
        gathered = VocabParallelLogProbEntropy.gather_stats(stats, group, world)
        logprob, entropy, log_z = VocabParallelLogProbEntropy.merge_stats(gathered)

        ctx.save_for_backward(logits, targets_N, log_z, entropy)
        ctx.vocab_start, ctx.inv_temp, ctx.chunk, ctx.width = vocab_start, inv_temp, chunk, width
        out_shape = logits.shape[:-1]
        if not return_collision:
            return logprob.view(out_shape), entropy.view(out_shape)
        collision = VocabParallelLogProbEntropy.merge_collision(gathered).view(out_shape)
        ctx.mark_non_differentiable(collision)
        return logprob.view(out_shape), entropy.view(out_shape), collision

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_collision=None):
        # grad_collision: the collision output is non-differentiable (it only feeds masks).
        logits, targets_N, log_z, entropy = ctx.saved_tensors
        vocab_shard, width = logits.shape[-1], ctx.width
        zeros = None
        if grad_logprob is None or grad_entropy is None:
            zeros = torch.zeros_like(log_z)
        g_lp = zeros if grad_logprob is None else grad_logprob.reshape(-1).float()
        g_h = zeros if grad_entropy is None else grad_entropy.reshape(-1).float()
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        grad_NV = grad.view(-1, vocab_shard)
        if width < vocab_shard:
            grad_NV[:, width:] = 0
        if width > 0:
            VocabParallelLogProbEntropy.logits_grad(
                logits.reshape(-1, vocab_shard)[:, :width], targets_N, log_z, entropy, g_lp, g_h,
                ctx.vocab_start, ctx.inv_temp, ctx.chunk,
                torch.empty(ctx.chunk, width, dtype=torch.float32, device=logits.device), grad_NV[:, :width],
            )
        return grad, None, None, None, None, None, None


def check_vocab_and_targets(targets, vocab_shard: int, group, vocab_size: int | None) -> None:
    """``vocab_size`` within the sharded vocabulary (``vocab_shard`` x the group's ranks) and every
    target id a real one; raises ValueError naming the numbers."""
    _, world = group_rank_size(group)
    vocab = vocab_shard * world
    if vocab_size is not None:
        if not 0 < vocab_size <= vocab:
            raise ValueError(f"vocab_size must be in (0, {vocab}] (vocab shard {vocab_shard} x {world} ranks), got {vocab_size}")
        vocab = vocab_size
    lo, hi = torch.aminmax(targets) if targets.numel() else (0, 0)
    if int(lo) < 0 or int(hi) >= vocab:
        raise ValueError(
            f"targets must be token ids in [0, {vocab}) (vocab shard {vocab_shard} x {world} ranks), "
            f"got values in [{int(lo)}, {int(hi)}]"
        )


def vocab_parallel_logprobs_entropy(
    logits, targets, group=None, temperature=1.0, chunk_size=None, vocab_size=None, *, return_collision: bool = False
):
    """Log-prob of ``targets`` and entropy of ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V/tp]`` this rank's contiguous vocabulary shard (rank r owns
            ids ``[r*V/tp, (r+1)*V/tp)``); fp32, bf16 or fp16. Not copied: it is
            saved for backward as is, so do not modify it in place afterwards.
        targets: ``[...]`` global token ids in ``[0, V)``.
        group: the tensor-parallel process group; ``None`` means a single rank.
        temperature: sampling temperature (> 0) the distribution is taken at.
        chunk_size: tokens per chunk; temporaries are at most two fp32
            ``[chunk_size, V/tp]`` buffers. Default: ~2 MiB buffers.
        vocab_size: the true vocabulary size when the sharded vocabulary is padded;
            columns with ids ``>= vocab_size`` are excluded. ``None``: no padding.
        return_collision: also return the collision term ``1 - sum_j p_j^2``,
            computed in the same pass and the same single all-gather.

    Returns:
        ``(logprobs, entropy)``, both float32 ``[...]``, or with ``return_collision``
        ``(logprobs, entropy, collision)``, all float32 ``[...]``. Gradients flow to
        ``logits`` from logprobs and entropy; collision carries none. No collective
        runs in backward.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens or None, got {chunk_size}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating point tensor, got {logits.dtype}")
    check_vocab_and_targets(targets, logits.shape[-1], group, vocab_size)
    return VocabParallelLogProbEntropy.apply(
        logits, targets.long(), group, float(temperature), chunk_size, vocab_size, bool(return_collision)
    )
