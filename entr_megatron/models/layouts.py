"""Tensor layout transforms between HF and Megatron parameters (full, unsharded tensors).

Every function here is a pure copy/reshape: values are never changed, so a round
trip is bit-exact. Shapes use `R` for rows of a linear weight (out features), `H`
for the hidden size; a bias is the same with the trailing dimension dropped.
"""

from __future__ import annotations

import torch


def interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int, head_dim: int
) -> torch.Tensor:
    """Fuse HF q/k/v projections into Megatron's `linear_qkv` layout.

    Megatron keeps the fused QKV rows grouped per query group: for each of the
    `num_query_groups` groups, the group's query heads (`heads_per_group * head_dim`
    rows), then its key head (`head_dim` rows), then its value head (`head_dim`
    rows). The attention module views the output as `[.., groups, (hpg + 2) * head_dim]`,
    and tensor parallelism splits that dim-0 contiguously, so each TP rank gets whole
    groups. Works for weights (`q: [Nq*hd, H]`) and biases (`q: [Nq*hd]`).
    """
    rest = q.shape[1:]
    assert k.shape[1:] == rest and v.shape[1:] == rest, (q.shape, k.shape, v.shape)
    assert k.shape[0] == v.shape[0] == num_query_groups * head_dim, (k.shape, num_query_groups)
    assert q.shape[0] % (num_query_groups * head_dim) == 0, (q.shape, num_query_groups, head_dim)
    q_g = q.reshape(num_query_groups, -1, *rest)
    k_g = k.reshape(num_query_groups, head_dim, *rest)
    v_g = v.reshape(num_query_groups, head_dim, *rest)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `interleave_qkv`: Megatron `linear_qkv` rows -> contiguous HF (q, k, v)."""
    rest = qkv.shape[1:]
    heads_per_group = num_attention_heads // num_query_groups
    rows = (num_attention_heads + 2 * num_query_groups) * head_dim
    assert qkv.shape[0] == rows, (qkv.shape, rows)
    grouped = qkv.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def merge_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF (gate_proj, up_proj) -> Megatron gated `linear_fc1`: rows `[gate; up]`.

    Megatron's gated MLP chunks the fc1 output in two along the feature dim and
    computes `act(first) * second`, so the gate must come first.
    """
    assert gate.shape == up.shape, (gate.shape, up.shape)
    return torch.cat([gate, up], dim=0)


def split_gated(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `merge_gated`: Megatron `linear_fc1` -> (gate, up)."""
    assert fc1.shape[0] % 2 == 0, fc1.shape
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab_rows(weight_VH: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows so an embedding/output weight has `padded_vocab_size` rows.

    Megatron's vocab-parallel layers need the vocab divisible by the TP size; the
    extra rows stand for tokens that never occur. Their logits are not -inf, so
    whoever computes log-probs over a padded vocab must mask them out.
    """
    vocab = weight_VH.shape[0]
    if padded_vocab_size < vocab:
        raise ValueError(
            f"padded_vocab_size={padded_vocab_size} is smaller than the vocab ({vocab} rows)"
        )
    if padded_vocab_size == vocab:
        return weight_VH
    pad = weight_VH.new_zeros(padded_vocab_size - vocab, *weight_VH.shape[1:])
    return torch.cat([weight_VH, pad], dim=0)


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Smallest size >= `vocab_size` divisible by `divisible_by * tp_size` (Megatron's rule)."""
    if vocab_size <= 0 or tp_size <= 0 or divisible_by <= 0:
        raise ValueError(
            f"vocab_size, tp_size and divisible_by must be positive, got "
            f"{vocab_size}, {tp_size}, {divisible_by}"
        )
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple
