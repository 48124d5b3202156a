"""The output layer fused into the log-prob/entropy op (`learner.fused_output`): no logits.

Megatron's GPTModel ends with ``output_layer`` (a ``ColumnParallelLinear``), which writes the
``[s, b, V/tp]`` logits that the loss then reads and autograd keeps for backward. With the
fused path the output layer of each last-stage chunk returns its input instead, mapped into the
tensor-parallel region exactly as ``ColumnParallelLinear`` maps it before its matmul:

    sequence parallel   all-gather over TP (backward: reduce-scatter)
    otherwise           identity           (backward: all-reduce over TP)

so the model's output is the hidden states ``[b, s, h]`` every TP rank holds in full, and the
loss computes log-probs and entropy from them and the layer's weight (or the tied embedding,
``shared_embedding_or_output_weight``, as GPTModel passes it) with
`parallel.vocab_parallel_linear_logprobs_entropy`, tile by tile. The op returns this rank's
partial gradient of the hidden states; the mapping's backward sums it over the TP group as the
linear layer's own backward would. Parameter names, checkpoints and weight sync are unchanged:
only the instance's ``forward`` is replaced.

    enable_fused_output(chunks)                   # after building the learner's chunks
    weight = fused_output_weight(model)           # in forward_step: None unless fused, last stage

When the policy loss is token-local (`algorithm.token_local`), `fused_policy_loss` goes one step
further: the loss and its gradients are computed in the forward pass
(`parallel.vocab_parallel_linear_fused_loss`, 3 output-layer GEMMs instead of 4), each token run
through `policy_loss_terms` as its own one-token row; on CUDA its tile passes are Triton kernels
(`learner.fused_output_backend`, as for the log-prob op).
"""

from __future__ import annotations

import dataclasses
import logging
import types

import torch
from torch import Tensor

from entr_megatron.algorithm import policy_loss_terms
from entr_megatron.algorithm.masked_ops import zero_padding
from entr_megatron.algorithm.token_local import token_local_reason
from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.learner.hf_load import unwrap_chunk
from entr_megatron.parallel.fused_output_loss import vocab_parallel_linear_fused_loss

__all__ = ["enable_fused_output", "fused_loss_applies", "fused_output_weight", "fused_policy_loss", "is_fused"]

logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()

_FLAG = "_entr_fused_output"


def _hidden_forward(self, input_, weight=None, runtime_gather_output=None):
    """ColumnParallelLinear.forward without the matmul: (the input in the TP region, None)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if self.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(input_, group=self.tp_group)
    else:
        hidden = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
    return hidden, None


def enable_fused_output(chunks) -> int:
    """Make every last-stage chunk of `chunks` return hidden states instead of logits; returns how
    many chunks were changed (0 on a rank without the output layer). Idempotent."""
    changed = 0
    for chunk in chunks:
        gpt = unwrap_chunk(chunk)
        if not getattr(gpt, "post_process", False) or getattr(gpt, _FLAG, False):
            continue
        if getattr(gpt.config, "mtp_num_layers", None):
            raise ValueError("learner.fused_output does not support multi-token prediction layers "
                             "(mtp_num_layers): set learner.fused_output: false")
        layer = gpt.output_layer
        if getattr(layer, "bias", None) is not None:
            raise ValueError("learner.fused_output needs an output layer without bias: set learner.fused_output: false")
        layer.forward = types.MethodType(_hidden_forward, layer)
        setattr(gpt, _FLAG, True)
        changed += 1
    return changed


def is_fused(model) -> bool:
    """Whether `model` (a chunk, wrapped or not) returns hidden states (`enable_fused_output`)."""
    return bool(getattr(unwrap_chunk(model), _FLAG, False))


def fused_output_weight(model) -> torch.Tensor | None:
    """The ``[V/tp, h]`` weight the fused loss multiplies the hidden states by (the output layer's,
    or the tied embedding's as GPTModel passes it), or None when `model` returns logits."""
    gpt = unwrap_chunk(model)
    if not getattr(gpt, _FLAG, False):
        return None
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def fused_loss_applies(algo_cfg: AlgorithmConfig) -> bool:
    """Whether the fused output layer also fuses the policy loss (its gradient in the forward
    pass); logs the path chosen, once per reason."""
    reason = token_local_reason(algo_cfg)
    if reason is not None:
        _log_once(f"fused output: the loss is computed after the op (4 output-layer GEMMs): {reason}")
        return False
    _log_once("fused output: token-local loss, gradients computed in the forward pass (3 output-layer GEMMs)")
    return True


def _packed(mb, values_BT: Tensor, like: Tensor) -> Tensor:
    """``[B_mb, T_resp]`` response values -> the micro-batch's packed ``[T]`` layout (0 elsewhere)."""
    mask_BT = mb.response_mask_BT.to(values_BT.device)
    out = torch.zeros(mb.length, dtype=values_BT.dtype, device=like.device)
    out[mb.gather_index_BT.to(values_BT.device)[mask_BT].to(like.device)] = values_BT[mask_BT].to(like.device)
    return out


def _token_scales(mb, algo_cfg: AlgorithmConfig, like: Tensor) -> Tensor:
    """Each response token's factor in its micro-batch's numerator (learner/loss.py's unit counts):
    1 (token-mean), 1 / |o_i| (seq-mean-token-mean), 1 / L (seq-mean-token-sum-norm)."""
    mask_BT = mb.response_mask_BT.to(like.device)
    if algo_cfg.aggregation == "seq-mean-token-mean":
        per_seq = 1.0 / mask_BT.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float32)
        return _packed(mb, per_seq.expand(mask_BT.shape).contiguous(), like)
    scale = 1.0 if algo_cfg.aggregation == "token-mean" else 1.0 / max(float(algo_cfg.loss_norm_tokens), 1.0)
    return _packed(mb, torch.full(mask_BT.shape, scale, dtype=torch.float32, device=like.device), like)


def fused_policy_loss(hidden_bsh: Tensor, weight: Tensor, mb, tp_group, algo_cfg: AlgorithmConfig, *,
                      behaviour_BT: Tensor, rollout_entropy_BT: Tensor | None, old_BT: Tensor | None,
                      versions_BT: Tensor | None, vocab_size: int | None, temperature: float,
                      chunk_tokens: int | None, backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """The micro-batch's numerator (learner/loss.py) of a token-local policy loss with its gradient
    computed in the forward pass, and the detached packed ``[T]`` log-probs and entropy.

    Each token of a chunk is its own one-token row of `policy_loss_terms` (advantage, mu, pi_old,
    versions, entropy per row), its loss times its aggregation scale (`_token_scales`); the sum
    equals `aggregate_loss` with the learner's unit counts because the objective is token-local.
    """
    device = hidden_bsh.device
    hidden = hidden_bsh[0].to(weight.dtype)
    mask_T = _packed(mb, mb.response_mask_BT, hidden)
    blp_T = _packed(mb, behaviour_BT, hidden)
    adv_T = _packed(mb, mb.advantages_B.to(device).unsqueeze(-1).expand(mb.response_mask_BT.shape).contiguous(),
                    hidden)
    scale_T = _token_scales(mb, algo_cfg, hidden)
    old_T = None if old_BT is None else _packed(mb, old_BT, hidden)
    versions_T = None if versions_BT is None else _packed(mb, versions_BT, hidden)
    rollout_h_T = None if algo_cfg.entropy_source == "learner" else _packed(mb, rollout_entropy_BT, hidden)
    # The counterfactual mask diagnostics are metrics only (computed after the op, whole batch).
    row_cfg = dataclasses.replace(algo_cfg, mask_diagnostics=False)

    def token_loss(s: int, e: int, logprob_n: Tensor, entropy_n: Tensor) -> Tensor:
        def col(t: Tensor | None) -> Tensor | None:  # packed [T] -> this chunk's [n, 1] rows
            return None if t is None else t[s:e].unsqueeze(1)

        m = mask_T[s:e].unsqueeze(1)
        zeros = torch.zeros_like(logprob_n).unsqueeze(1)
        # As the unfused path's to_padded: values outside the response are 0.
        lp = torch.where(m, logprob_n.unsqueeze(1), zeros)
        ent = torch.where(m, (entropy_n if rollout_h_T is None else rollout_h_T[s:e]).unsqueeze(1), zeros)
        terms = policy_loss_terms(lp, ent, col(blp_T), adv_T[s:e], m, row_cfg, old_logprobs_BT=col(old_T),
                                  versions_BT=col(versions_T), policy_version=mb.policy_version)
        return zero_padding(terms.loss_BT, terms.denominator_BT)[:, 0] * scale_T[s:e]

    numerator, logprob_T, entropy_T = vocab_parallel_linear_fused_loss(
        hidden, weight, mb.targets[0].to(device), token_loss, tp_group, temperature, vocab_size, chunk_tokens,
        backend=backend)
    return numerator, logprob_T, entropy_T
