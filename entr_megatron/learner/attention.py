"""Core attention of the portable layer spec, on ``torch.nn.functional.scaled_dot_product_attention``.

Drop-in for Megatron's ``DotProductAttention`` / TransformerEngine's
``TEDotProductAttention`` inside ``SelfAttention`` (same constructor and forward
signature, no parameters), computing the same math: ``softmax(q k^T * scale) v``
per head, with

* causal masking (``AttnMaskType.causal`` / ``padding_causal``), combined with an
  optional Megatron-style boolean ``attention_mask`` (True = masked out);
* grouped-query attention: ``num_query_groups < num_attention_heads`` (read from
  the tensor shapes, so it holds per tensor-parallel shard);
* a value head dim other than the query/key one (multi-latent attention);
* packed variable-length sequences (``PackedSeqParams`` with
  ``qkv_format='thd'``): each sequence attends only to itself. Short sequences attend in
  padded chunks (one call each: the per-call cost dominates them), long ones one by one,
  which costs ``sum L_i^2`` instead of the ``(sum L_i)^2`` of a block-diagonal mask. With
  ``cu_seqlens_*_padded`` the padding slots of each sequence produce zeros, as
  TransformerEngine does.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

__all__ = ["SHORT_SEQ_LEN", "SDPACoreAttention", "packed_attention"]

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


def _sdpa(q_BHSD, k_BGSD, v_BGSD, allowed, causal, scale, dropout_p):
    """SDPA with GQA and an optional boolean ``allowed`` mask (True = attend), combined with causality."""
    sq, sk = q_BHSD.shape[-2], k_BGSD.shape[-2]
    if causal and sq != sk:
        raise ValueError(f"causal attention needs as many keys as queries, got {sq} queries and {sk} keys")
    if causal and allowed is not None:
        allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=q_BHSD.device).tril()
        causal = False
    if allowed is not None:
        # A query with no allowed key would give NaN; let it attend everywhere (its output is
        # meaningless either way, as with Megatron's -10000 fill).
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    return F.scaled_dot_product_attention(
        q_BHSD, k_BGSD, v_BGSD, attn_mask=allowed, dropout_p=dropout_p, is_causal=causal,
        scale=scale, enable_gqa=q_BHSD.shape[1] != k_BGSD.shape[1],
    )


SHORT_SEQ_LEN = 128
"""Packed sequences up to this many tokens attend together, padded to the longest of their chunk
(one SDPA call per chunk); longer ones attend one by one. Forward + backward of 64 sequences of
7-18 tokens, 4 heads of 32, one CPU thread: 3-4.5 ms padded vs 16 ms one by one; 60-130 tokens:
0.6x; 200-400 tokens: 1.5x slower padded (masked SDPA, padding waste), hence the bound."""

_CHUNK_SCORES = 1 << 24
"""Attention scores (chunk sequences x heads x longest^2) of one padded chunk at most."""


def _padded_chunks(lens: list[int], heads: int) -> list[list[int]]:
    """Sequence indices grouped into padded chunks of at most `_CHUNK_SCORES` scores each."""
    chunks, chunk, longest = [], [], 0
    for i in sorted(range(len(lens)), key=lens.__getitem__):
        grown = max(longest, lens[i])
        if chunk and (len(chunk) + 1) * heads * grown * grown > _CHUNK_SCORES:
            chunks.append(chunk)
            chunk, grown = [], lens[i]
        chunk.append(i)
        longest = grown
    if chunk:
        chunks.append(chunk)
    return chunks


def _attend_padded(q_THD, k_TGD, v_TGD, starts_q, starts_k, lens, causal, scale, dropout_p):
    """Self-attention of several packed sequences in one SDPA call: each gathered into a row of
    `[B, heads, longest, dim]`, keys past its end masked out. Returns the rows of the packed
    output these sequences fill and their values `[rows, heads * dim]`."""
    device = q_THD.device
    lens_B = torch.tensor(lens, device=device)
    longest = max(lens)
    j = torch.arange(longest, device=device)
    valid_BL = j[None, :] < lens_B[:, None]
    gather_q = torch.where(valid_BL, torch.tensor(starts_q, device=device)[:, None] + j, 0)
    gather_k = torch.where(valid_BL, torch.tensor(starts_k, device=device)[:, None] + j, 0)
    allowed = valid_BL[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    out = _sdpa(q_THD[gather_q].transpose(1, 2), k_TGD[gather_k].transpose(1, 2), v_TGD[gather_k].transpose(1, 2),
                allowed, False, scale, dropout_p)  # [B, H, L, D]
    out = out.transpose(1, 2).reshape(len(lens), longest, -1)
    return gather_q[valid_BL], out[valid_BL]


def packed_attention(q_THD, k_TGD, v_TGD, cu_seqlens_q, cu_seqlens_kv, causal, scale, dropout_p=0.0,
                     cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None):
    """Attention over packed sequences ``[T, heads, dim]``; sequence i holds tokens
    ``[cu[i], cu[i+1])`` (or its first ``cu[i+1]-cu[i]`` slots from ``cu_padded[i]``).
    Sequences of at most `SHORT_SEQ_LEN` tokens (as many keys as queries) attend in padded
    chunks, the others one by one.

    Returns ``[T, heads * dim]`` with zeros at padding slots.
    """
    layout_q = (cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded).tolist()
    layout_k = (cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded).tolist()
    lens_q = torch.diff(cu_seqlens_q).tolist()
    lens_k = torch.diff(cu_seqlens_kv).tolist()
    total, heads = q_THD.shape[:2]
    dim = v_TGD.shape[-1]  # the output's head dim (MLA: the value dim differs from the query/key dim)
    short = [i for i, (lq, lk) in enumerate(zip(lens_q, lens_k)) if 0 < lq == lk <= SHORT_SEQ_LEN]
    rows, values = [], []
    for chunk in _padded_chunks([lens_q[i] for i in short], heads):
        picked = [short[c] for c in chunk]
        r, v = _attend_padded(q_THD, k_TGD, v_TGD, [layout_q[i] for i in picked], [layout_k[i] for i in picked],
                              [lens_q[i] for i in picked], causal, scale, dropout_p)
        rows.append(r)
        values.append(v)
    done = set(short)
    for i, (start_q, len_q, start_k, len_k) in enumerate(zip(layout_q, lens_q, layout_k, lens_k)):
        if i in done or len_q == 0:
            continue
        q = q_THD[start_q:start_q + len_q].transpose(0, 1).unsqueeze(0)
        k = k_TGD[start_k:start_k + len_k].transpose(0, 1).unsqueeze(0)
        v = v_TGD[start_k:start_k + len_k].transpose(0, 1).unsqueeze(0)
        out = _sdpa(q, k, v, None, causal, scale, dropout_p)  # [1, H, L, D]
        rows.append(torch.arange(start_q, start_q + len_q, device=q_THD.device))
        values.append(out[0].transpose(0, 1).reshape(len_q, heads * dim))
    out = q_THD.new_zeros(total, heads * dim)
    if not rows:  # only empty sequences: nothing attends
        return out
    return out.index_copy(0, torch.cat(rows), torch.cat(values))


class SDPACoreAttention(MegatronModule):
    """Megatron core attention on ``scaled_dot_product_attention`` (module docstring).

    Inputs as Megatron passes them: ``[s, b, heads, dim]``, or ``[t, heads, dim]``
    with ``packed_seq_params.qkv_format == 'thd'``; returns ``[s, b, heads*dim]``
    (resp. ``[t, heads*dim]``).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size} needs TransformerEngine's attention; "
                "the portable spec supports context_parallel_size=1"
            )
        if config.window_size is not None:
            raise ValueError(f"window_size={config.window_size} (sliding window) is not supported by the portable spec")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by the portable spec (use 'vanilla')")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        # MLA passes its own scale (YaRN's mscale included) and its query/key and value head dims.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _dropout_context(self, dropout_p):
        # As Megatron's DotProductAttention: the attention dropout mask differs across TP
        # ranks (their heads differ), unless sequence parallel already forks the RNG upstream.
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return get_cuda_rng_tracker().fork()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """Attention output; see the class docstring for shapes."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the portable attention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL_TYPES
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_context(dropout_p):
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                if attention_mask is not None:
                    raise ValueError("attention_mask must be None with packed (thd) sequences: cu_seqlens define the mask")
                p = packed_seq_params
                return packed_attention(
                    query, key, value, p.cu_seqlens_q, p.cu_seqlens_kv, causal, self.softmax_scale, dropout_p,
                    p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded,
                )
            sq, b, heads = query.shape[:3]
            allowed = None if attention_mask is None else ~attention_mask.bool()
            out = _sdpa(
                query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                allowed, causal, self.softmax_scale, dropout_p,
            )  # [b, heads, sq, dim]
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * out.shape[-1])
