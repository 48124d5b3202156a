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
"""

from __future__ import annotations

import types

import torch

from entr_megatron.learner.hf_load import unwrap_chunk

__all__ = ["enable_fused_output", "fused_output_weight", "is_fused"]

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
