"""How each Megatron GPTModel parameter is split across tensor- and expert-parallel ranks.

Megatron parameter names do not depend on the model family, so one table covers
all of them. TP kinds (for expert parameters read "expert-TP"):

| kind         | parameters                                  | shard r of the full tensor            |
|--------------|---------------------------------------------|---------------------------------------|
| VOCAB        | word embeddings, output layer               | rows r*V/tp .. (r+1)*V/tp             |
| COLUMN       | linear_qkv weight and bias; MLA q/kv projs  | rows, contiguous chunk r              |
| GATED_COLUMN | linear_fc1 of a gated MLP (dense, expert,   | cat(gate chunk r, up chunk r)         |
|              | shared expert)                              |                                       |
| ROW          | linear_proj, linear_fc2 (dense or expert)   | columns, contiguous chunk r           |
| REPLICATED   | norms, q/k/latent norms, router, its bias   | the full tensor                       |

linear_qkv is a plain contiguous split only because its rows are interleaved per
query group (`layouts.interleave_qkv`) and Megatron requires num_query_groups to
be a multiple of the TP size: each rank gets whole groups. linear_fc1 is
`[gate; up]` on every rank, so the full tensor's two halves are split separately.
MLA (portable spec): the q and kv down projections are ColumnParallelLinear (their outputs are
gathered over TP before the latent norms), the up projections split whole heads.

EP: expert e of E lives on EP rank e // (E/ep) as local expert e % (E/ep);
Megatron's module names carry the local index.
"""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import torch

from entr_megatron.models import tables
from entr_megatron.models.spec import ModelSpec
from entr_megatron.models.templates import compile_template, resolve


class TpSplit(enum.Enum):
    """How a parameter is split under tensor parallelism."""

    REPLICATED = "replicated"
    COLUMN = "column"  # dim 0
    GATED_COLUMN = "gated_column"  # dim 0, gate and up halves split separately
    ROW = "row"  # dim 1
    VOCAB = "vocab"  # dim 0, vocab-parallel (needs a padded vocab)


TP_SPLITS: dict[str, TpSplit] = {
    tables.MEGATRON_EMBEDDING: TpSplit.VOCAB,
    tables.MEGATRON_OUTPUT: TpSplit.VOCAB,
    tables.MEGATRON_FINAL_NORM: TpSplit.REPLICATED,
    tables.MEGATRON_INPUT_NORM: TpSplit.REPLICATED,
    tables.MEGATRON_TE_INPUT_NORM: TpSplit.REPLICATED,
    tables.MEGATRON_QKV_WEIGHT: TpSplit.COLUMN,
    tables.MEGATRON_QKV_BIAS: TpSplit.COLUMN,
    tables.MEGATRON_PROJ: TpSplit.ROW,
    tables.MEGATRON_Q_NORM: TpSplit.REPLICATED,
    tables.MEGATRON_K_NORM: TpSplit.REPLICATED,
    tables.MEGATRON_PRE_MLP_NORM: TpSplit.REPLICATED,
    tables.MEGATRON_TE_PRE_MLP_NORM: TpSplit.REPLICATED,
    tables.MEGATRON_FC1: TpSplit.GATED_COLUMN,
    tables.MEGATRON_FC2: TpSplit.ROW,
    tables.MEGATRON_ROUTER: TpSplit.REPLICATED,
    tables.MEGATRON_EXPERT_FC1: TpSplit.GATED_COLUMN,
    tables.MEGATRON_EXPERT_FC2: TpSplit.ROW,
    tables.MEGATRON_GROUPED_FC1: TpSplit.GATED_COLUMN,
    tables.MEGATRON_GROUPED_FC2: TpSplit.ROW,
    tables.MEGATRON_EXPERT_BIAS: TpSplit.REPLICATED,
    tables.MEGATRON_SHARED_FC1: TpSplit.GATED_COLUMN,
    tables.MEGATRON_SHARED_FC2: TpSplit.ROW,
    tables.MEGATRON_MLA_Q: TpSplit.COLUMN,
    tables.MEGATRON_MLA_Q_DOWN: TpSplit.COLUMN,
    tables.MEGATRON_MLA_Q_UP: TpSplit.COLUMN,
    tables.MEGATRON_MLA_KV_DOWN: TpSplit.COLUMN,
    tables.MEGATRON_MLA_KV_NORM: TpSplit.REPLICATED,
    tables.MEGATRON_MLA_KV_UP: TpSplit.COLUMN,
}
"""Megatron name template -> TP split, for every parameter of the supported families."""

_TEMPLATES = tuple(TP_SPLITS)


@functools.lru_cache(maxsize=1 << 16)  # a model has a fixed, finite set of names
def _resolve(megatron_name: str) -> tuple[str, dict[str, int]]:
    found = resolve(megatron_name, _TEMPLATES)
    if found is None:
        raise ValueError(f"{megatron_name!r} is not a known Megatron GPTModel parameter name")
    return found


def tp_split(megatron_name: str) -> TpSplit:
    """The TP split kind of a Megatron parameter (global or local indices alike)."""
    return TP_SPLITS[_resolve(megatron_name)[0]]


def is_expert_param(megatron_name: str) -> bool:
    """Whether the parameter belongs to one expert (split by EP, and by expert-TP)."""
    return "expert" in compile_template(_resolve(megatron_name)[0]).fields


def shard(megatron_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP shard `tp_rank` of `tp_size` of a full Megatron parameter (a contiguous tensor)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    kind = tp_split(megatron_name)
    if kind is TpSplit.REPLICATED:
        return full
    if kind is TpSplit.GATED_COLUMN:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat(
            [_chunk(megatron_name, gate, 0, tp_rank, tp_size), _chunk(megatron_name, up, 0, tp_rank, tp_size)]
        )
    dim = 1 if kind is TpSplit.ROW else 0
    return _chunk(megatron_name, full, dim, tp_rank, tp_size).contiguous()


def unshard(megatron_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the full parameter from all TP shards in rank order."""
    if not shards:
        raise ValueError(f"{megatron_name}: no shards given")
    kind = tp_split(megatron_name)
    if kind is TpSplit.REPLICATED:
        for rank, s in enumerate(shards[1:], start=1):
            if not torch.equal(s, shards[0]):
                raise ValueError(f"{megatron_name} is replicated but TP rank {rank} differs from rank 0")
        return shards[0]
    if kind is TpSplit.GATED_COLUMN:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if kind is TpSplit.ROW else 0)


def _chunk(name: str, t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(
            f"{name}: dim {dim} of size {t.shape[dim]} is not divisible by tp_size={size}"
            + (" (pad the vocab: layouts.padded_vocab_size)" if tp_split(name) is TpSplit.VOCAB else "")
        )
    step = t.shape[dim] // size
    return t.narrow(dim, rank * step, step)


# --- expert parallelism --------------------------------------------------------------------


def _experts_per_rank(num_experts: int, ep_size: int) -> int:
    if ep_size <= 0 or num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    return num_experts // ep_size


def expert_local_name(megatron_name: str, num_experts: int, ep_size: int) -> tuple[int, str]:
    """(EP rank, name on that rank) for an expert parameter named with its global index."""
    template, idx = _resolve(megatron_name)
    if "expert" not in idx:
        raise ValueError(f"{megatron_name!r} is not an expert parameter")
    per_rank = _experts_per_rank(num_experts, ep_size)
    if idx["expert"] >= num_experts:
        raise ValueError(f"{megatron_name!r}: expert index >= num_experts={num_experts}")
    local = dict(idx, expert=idx["expert"] % per_rank)
    return idx["expert"] // per_rank, compile_template(template).format(**local)


def expert_global_name(local_name: str, ep_rank: int, num_experts: int, ep_size: int) -> str:
    """Inverse of `expert_local_name`: the global-index name of a local expert parameter."""
    template, idx = _resolve(local_name)
    if "expert" not in idx:
        raise ValueError(f"{local_name!r} is not an expert parameter")
    per_rank = _experts_per_rank(num_experts, ep_size)
    if idx["expert"] >= per_rank or not 0 <= ep_rank < ep_size:
        raise ValueError(
            f"{local_name!r} on EP rank {ep_rank}: local expert index must be < {per_rank} "
            f"and the rank < ep_size={ep_size}"
        )
    return compile_template(template).format(**dict(idx, expert=ep_rank * per_rank + idx["expert"]))


def offset_layer(megatron_name: str, offset: int) -> str:
    """The name with its layer index shifted by `offset` (a PP stage's local -> global)."""
    template, idx = _resolve(megatron_name)
    if "layer" not in idx:
        return megatron_name
    if idx["layer"] + offset < 0:
        raise ValueError(f"{megatron_name!r}: layer index + {offset} is negative")
    return compile_template(template).format(**dict(idx, layer=idx["layer"] + offset))


# --- which layouts a model admits ------------------------------------------------------------


class LayoutConflict(NamedTuple):
    """A parallel size that does not divide a model dimension Megatron splits evenly by it."""

    size: str
    """Which size: "tp", "pp", "vpp" (pp * vpp virtual stages), "ep" or "expert_tp"."""
    divisor: int
    """What must divide the dimension: the size (pp * vpp for "vpp")."""
    field: str
    """The HF config field, e.g. num_attention_heads."""
    value: int
    """Its value in the model."""


LAYOUT_REASONS: dict[str, str] = {
    "tp": "each tensor-parallel rank holds whole attention and key/value heads and an equal share of the MLP",
    "pp": "each pipeline stage holds the same number of layers",
    "vpp": "each virtual pipeline stage holds the same number of layers",
    "ep": "each expert-parallel rank holds the same number of experts",
    "expert_tp": "each expert-tensor-parallel rank holds an equal share of every expert's MLP",
}
"""Why Megatron needs each size of LayoutConflict to divide its dimensions (for messages)."""


def layout_conflicts(
    spec: ModelSpec, *, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, expert_tp: int = 1
) -> list[LayoutConflict]:
    """Every model dimension the learner layout does not divide, in the order tp, pp, vpp, ep,
    expert_tp: heads, key/value heads (whole QKV groups per TP rank, see the module docstring) and
    the dense MLP by tp; layers by pp and by pp * vpp; experts by ep and their MLP by expert_tp.
    Empty: Megatron can build the model on this layout."""
    checks = [("tp", tp, "num_attention_heads", spec.num_attention_heads)]
    if spec.mla is not None:  # the down projections' outputs are split over TP too
        if spec.mla.q_lora_rank is not None:
            checks.append(("tp", tp, "q_lora_rank", spec.mla.q_lora_rank))
        checks.append(("tp", tp, "kv_lora_rank + qk_rope_head_dim", spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim))
    elif spec.num_query_groups % tp and tp % spec.num_query_groups:
        # more TP ranks than key/value heads works when they divide evenly (tested at TP=4 with
        # 2 kv heads: tests/e2e/test_on_policy_consistency.py)
        checks.append(("tp", tp, "num_key_value_heads", spec.num_query_groups))
    if spec.has_dense_layers:  # an MoE model without dense layers never uses the dense width
        checks.append(("tp", tp, "intermediate_size", spec.ffn_hidden_size))
    if spec.shared_expert:
        checks.append(("tp", tp, "moe_intermediate_size * n_shared_experts", spec.moe_shared_expert_size))
    checks.append(("pp", pp, "num_hidden_layers", spec.num_layers))
    if vpp is not None:
        checks.append(("vpp", pp * vpp, "num_hidden_layers", spec.num_layers))
    if spec.is_moe:
        checks += [("ep", ep, "num_experts", spec.num_experts),
                   ("expert_tp", expert_tp, "moe_intermediate_size", spec.moe_ffn_hidden_size)]
    return [LayoutConflict(*c) for c in checks if c[3] % c[1]]
