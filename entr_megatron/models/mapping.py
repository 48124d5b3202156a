"""`to_hf` / `from_hf`: Megatron <-> HF names and layouts, on full (unsharded) tensors.

The family tables (`tables.py`) say which Megatron parameter is made of which HF
tensors and how; this module applies them for one `ModelSpec`. Two HF layouts:

- "checkpoint": the safetensors names on disk, also what SGLang/vLLM load. MoE
  experts are one tensor per expert. The default everywhere.
- "transformers": what a transformers >= 5 model holds in memory
  (`model.state_dict()`): MoE experts stacked per layer, and `lm_head.weight`
  present (sharing the embedding) when embeddings are tied. Same as "checkpoint"
  for dense untied models.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from entr_megatron.models import layouts, tables
from entr_megatron.models.spec import ModelSpec
from entr_megatron.models.tables import LayerKind, Layout, Rule
from entr_megatron.models.templates import compile_template, resolve

HF_LAYOUTS = ("checkpoint", "transformers")
HF_TIED_OUTPUT = "lm_head.weight"
HF_EMBEDDING = "model.embed_tokens.weight"

# Full Megatron shapes, keyed by the local-spec template (the `Rule.megatron` names).
_MEGATRON_SHAPES: dict[str, Callable[[ModelSpec], tuple[int, ...]]] = {
    tables.MEGATRON_EMBEDDING: lambda s: (s.vocab_size, s.hidden_size),
    tables.MEGATRON_OUTPUT: lambda s: (s.vocab_size, s.hidden_size),
    tables.MEGATRON_FINAL_NORM: lambda s: (s.hidden_size,),
    tables.MEGATRON_INPUT_NORM: lambda s: (s.hidden_size,),
    tables.MEGATRON_PRE_MLP_NORM: lambda s: (s.hidden_size,),
    tables.MEGATRON_QKV_WEIGHT: lambda s: (
        (s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim,
        s.hidden_size,
    ),
    tables.MEGATRON_QKV_BIAS: lambda s: ((s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim,),
    tables.MEGATRON_PROJ: lambda s: (s.hidden_size, s.num_attention_heads * s.head_dim),
    # per head (GQA), or MLA's q latent (the same Megatron name: tables.MEGATRON_MLA_Q_NORM)
    tables.MEGATRON_Q_NORM: lambda s: (s.mla.q_lora_rank,) if s.mla is not None else (s.head_dim,),
    tables.MEGATRON_K_NORM: lambda s: (s.head_dim,),
    tables.MEGATRON_FC1: lambda s: (2 * s.ffn_hidden_size, s.hidden_size),
    tables.MEGATRON_FC2: lambda s: (s.hidden_size, s.ffn_hidden_size),
    tables.MEGATRON_ROUTER: lambda s: (s.num_experts, s.hidden_size),
    tables.MEGATRON_EXPERT_FC1: lambda s: (2 * s.moe_ffn_hidden_size, s.hidden_size),
    tables.MEGATRON_EXPERT_FC2: lambda s: (s.hidden_size, s.moe_ffn_hidden_size),
    tables.MEGATRON_EXPERT_BIAS: lambda s: (s.num_experts,),
    tables.MEGATRON_SHARED_FC1: lambda s: (2 * s.moe_shared_expert_size, s.hidden_size),
    tables.MEGATRON_SHARED_FC2: lambda s: (s.hidden_size, s.moe_shared_expert_size),
    tables.MEGATRON_MLA_Q: lambda s: (s.num_attention_heads * s.mla.q_head_dim, s.hidden_size),
    tables.MEGATRON_MLA_Q_DOWN: lambda s: (s.mla.q_lora_rank, s.hidden_size),
    tables.MEGATRON_MLA_Q_UP: lambda s: (s.num_attention_heads * s.mla.q_head_dim, s.mla.q_lora_rank),
    tables.MEGATRON_MLA_KV_DOWN: lambda s: (s.mla.kv_lora_rank + s.mla.qk_rope_head_dim, s.hidden_size),
    tables.MEGATRON_MLA_KV_NORM: lambda s: (s.mla.kv_lora_rank,),
    tables.MEGATRON_MLA_KV_UP: lambda s: (
        s.num_attention_heads * (s.mla.qk_nope_head_dim + s.mla.v_head_dim), s.mla.kv_lora_rank),
}


# --- which names exist ----------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _rules(spec: ModelSpec) -> tuple[tuple[str, Rule], ...]:
    """(Megatron template in this spec's naming, rule) for every parameter kind present."""
    te_renames: dict[str, str] = {}
    if spec.naming.te_fused_norms:
        if spec.table.te_fused_norms is None:
            raise ValueError(f"{spec.model_type}: the TransformerEngine layer spec is not supported for this "
                             "family (use the portable spec: te_fused_norms=False)")
        te_renames.update(spec.table.te_fused_norms)
    expert_renames = dict(spec.table.grouped_experts) if spec.naming.grouped_experts else {}
    out = []
    for rule in spec.table.rules:
        if rule.untied_only and spec.tie_word_embeddings:
            continue
        if rule.when is not None and not getattr(spec, rule.when):
            continue
        if not any(_layer_matches(rule, spec, i) for i in range(spec.num_layers)):
            continue  # e.g. the dense MLP of an MoE model without dense layers
        name = expert_renames.get(rule.megatron, rule.megatron)
        if rule.layers is not LayerKind.MOE:  # an MoE layer's pre-MLP norm is not fused (tables.py)
            name = te_renames.get(name, name)
        out.append((name, rule))
    return tuple(out)


def _layer_matches(rule: Rule, spec: ModelSpec, layer: int) -> bool:
    return rule.layers is LayerKind.ALL or spec.layer_kind(layer) is rule.layers


def _index_sets(template: str, rule: Rule, spec: ModelSpec) -> Iterator[dict[str, int]]:
    """All index assignments of a template: every layer of the rule's kind, and every expert."""
    fields = compile_template(template).fields
    layers = [i for i in range(spec.num_layers) if _layer_matches(rule, spec, i)]
    ranges = {"layer": layers, "expert": range(spec.num_experts)}
    for values in itertools.product(*(ranges[f] for f in fields)):
        yield dict(zip(fields, values))


@functools.lru_cache(maxsize=16)
def _entries(spec: ModelSpec) -> tuple[tuple[str, Rule, dict[str, int]], ...]:
    """(Megatron name, rule, indices) for every parameter, in model order.

    Model order: embedding, then layer by layer (each layer's parameters in table
    order, experts innermost), then final norm and output layer, like a GPTModel's
    state dict, so a pipeline stage's parameters are one contiguous run.
    """
    keyed = []
    for rule_pos, (mt, rule) in enumerate(_rules(spec)):
        for idx in _index_sets(mt, rule, spec):
            if "layer" in idx:
                key = (1, idx["layer"], rule_pos, idx.get("expert", 0))
            else:
                key = (0 if rule.megatron == tables.MEGATRON_EMBEDDING else 2, 0, rule_pos, 0)
            keyed.append((key, compile_template(mt).format(**idx), rule, idx))
    keyed.sort(key=lambda entry: entry[0])
    return tuple((name, rule, idx) for _, name, rule, idx in keyed)


@functools.lru_cache(maxsize=16)
def _by_name(spec: ModelSpec) -> dict[str, tuple[Rule, dict[str, int]]]:
    return {name: (rule, idx) for name, rule, idx in _entries(spec)}


def megatron_names(spec: ModelSpec) -> list[str]:
    """Every GPTModel parameter name (global layer and expert indices), in model order."""
    return [name for name, _, _ in _entries(spec)]


def megatron_shape(megatron_name: str, spec: ModelSpec) -> tuple[int, ...]:
    """Full (unsharded, unpadded) shape of a Megatron parameter."""
    rule, _ = _lookup(megatron_name, spec)
    return _MEGATRON_SHAPES[rule.megatron](spec)


def hf_names(spec: ModelSpec, layout: str = "checkpoint") -> list[str]:
    """The exact set of HF tensor names this model has, in `layout` (see module doc)."""
    _check_layout(layout)
    names = [compile_template(h).format(**idx) for _, rule, idx in _entries(spec) for h in rule.hf]
    if layout == "checkpoint":
        return names
    out: dict[str, None] = {}  # ordered set
    for name in names:
        out[_transformers_name(name, spec)] = None
    if spec.tie_word_embeddings:
        out[HF_TIED_OUTPUT] = None
    return list(out)


def mtp_hf_prefixes(spec: ModelSpec) -> tuple[str, ...]:
    """Name prefixes of the multi-token-prediction layers a checkpoint of this model may carry after
    its decoder layers (`model.layers.{num_layers + i}.`, HF num_nextn_predict_layers of them)."""
    return tuple(compile_template(tables.HF_LAYER).format(layer=spec.num_layers + i) for i in range(spec.mtp_layers))


def check_hf_keys(
    keys: Iterable[str], spec: ModelSpec, layout: str = "checkpoint", strict: bool = True
) -> None:
    """Raise ValueError naming the missing (and, if strict, unexpected) HF keys."""
    expected = set(hf_names(spec, layout))
    keys = set(keys)
    missing = sorted(expected - keys)
    unexpected = sorted(keys - expected) if strict else []
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {_preview(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {_preview(unexpected)}")
        raise ValueError(
            f"HF weights do not match the {spec.model_type} config (layout={layout!r}): "
            + "; ".join(parts)
        )


def detect_hf_layout(keys: Iterable[str], spec: ModelSpec) -> str:
    """The HF layout whose exact name set is `keys` ("checkpoint" when both are)."""
    keys = set(keys)
    for layout in HF_LAYOUTS:
        if keys == set(hf_names(spec, layout)):
            return layout
    check_hf_keys(keys, spec, "checkpoint")  # raises, naming the differences
    raise AssertionError("unreachable")


# --- Megatron -> HF ---------------------------------------------------------------------


def to_hf(megatron_name: str, tensor: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """HF checkpoint (name, tensor) pairs for one full Megatron parameter.

    Returns [] for `output_layer.weight` of a tied model (the embedding carries it).
    Vocab padding rows past `spec.vocab_size` are dropped. Raises ValueError for a
    name that is not a parameter of this model.
    """
    if spec.tie_word_embeddings and megatron_name == tables.MEGATRON_OUTPUT:
        return []
    rule, idx = _lookup(megatron_name, spec)
    names = [compile_template(h).format(**idx) for h in rule.hf]
    return list(zip(names, _split(rule, tensor, spec, megatron_name)))


def to_hf_state_dict(
    megatron_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    spec: ModelSpec,
    *,
    layout: str = "checkpoint",
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """A whole HF state dict from full Megatron parameters (name -> tensor).

    strict: every HF tensor of the model must be produced (i.e. no Megatron
    parameter was left out).
    """
    _check_layout(layout)
    items = megatron_params.items() if isinstance(megatron_params, Mapping) else megatron_params
    out: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        out.update(to_hf(name, tensor, spec))
    if layout == "transformers":
        out = _stack_experts(out, spec)
    if strict:
        missing = sorted(set(hf_names(spec, layout)) - set(out))
        if missing:
            raise ValueError(
                f"Megatron parameters for {len(missing)} HF tensors were not given: {_preview(missing)}"
            )
    return out


# --- HF -> Megatron ---------------------------------------------------------------------


def from_hf(
    source: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor],
    spec: ModelSpec,
    *,
    layout: str = "checkpoint",
    strict: bool = True,
    padded_vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Full Megatron parameters (global names) from HF tensors.

    source: a state dict, or a getter `name -> tensor` (e.g. a safetensors handle's
      `get_tensor`, so a loader reads only what it needs); a dict is checked first
      and a mismatch raises ValueError naming the missing / unexpected keys.
    layout: "checkpoint", "transformers", or "auto" (dict sources only: the layout
      whose exact key set the dict has).
    strict: refuse unexpected keys (dict sources). Missing keys are always an error.
    padded_vocab_size: zero-pad embedding/output rows to this size (see
      `layouts.pad_vocab_rows`).

    Tensors whose layout is unchanged are returned as-is (sharing storage with the
    source); fused ones (QKV, gated fc1) are new tensors.
    """
    if isinstance(source, Mapping):
        if layout == "auto":
            layout = detect_hf_layout(source.keys(), spec)
        check_hf_keys(source.keys(), spec, layout, strict)
        get = source.__getitem__
    elif callable(source):
        get = source
    else:
        raise TypeError(f"source must be a mapping or a callable, got {type(source)}")
    _check_layout(layout)
    if layout == "transformers":
        get = _checkpoint_getter(get, spec)

    out: dict[str, torch.Tensor] = {}
    for name, rule, idx in _entries(spec):
        hf = [compile_template(h).format(**idx) for h in rule.hf]
        tensor = _fuse(rule, [get(n) for n in hf], spec)
        expected_shape = _MEGATRON_SHAPES[rule.megatron](spec)
        if tuple(tensor.shape) != expected_shape:
            shapes = {n: tuple(get(n).shape) for n in hf}
            raise ValueError(
                f"HF tensors {shapes} give {tuple(tensor.shape)} for {name}, "
                f"but the config implies {expected_shape}"
            )
        if rule.layout is Layout.VOCAB and padded_vocab_size is not None:
            tensor = layouts.pad_vocab_rows(tensor, padded_vocab_size)
        out[name] = tensor
    return out


# --- helpers ------------------------------------------------------------------------------


def _lookup(megatron_name: str, spec: ModelSpec) -> tuple[Rule, dict[str, int]]:
    found = _by_name(spec).get(megatron_name)
    if found is not None:
        return found
    # Not a parameter of this model: say why.
    if resolve(megatron_name, tuple(dict.fromkeys(mt for mt, _ in _rules(spec)))) is not None:
        raise ValueError(
            f"{megatron_name!r}: no such parameter at these indices (num_layers={spec.num_layers}, "
            f"num_experts={spec.num_experts}, dense layers first: {spec.first_k_dense}); names must use "
            "global indices"
        )
    raise ValueError(
        f"{megatron_name!r} is not a parameter of this {spec.model_type} GPTModel "
        f"(naming: {spec.naming}, tied embeddings: {spec.tie_word_embeddings})"
    )


def _split(rule: Rule, tensor: torch.Tensor, spec: ModelSpec, name: str) -> tuple[torch.Tensor, ...]:
    expected = _MEGATRON_SHAPES[rule.megatron](spec)
    if rule.layout is Layout.VOCAB:
        if tensor.shape[0] < spec.vocab_size or tuple(tensor.shape[1:]) != expected[1:]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {expected} (+ padding rows)")
        return (tensor[: spec.vocab_size],)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected the full {expected}")
    if rule.layout is Layout.QKV:
        return layouts.split_qkv(tensor, spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
    if rule.layout is Layout.GATED:
        return layouts.split_gated(tensor)
    return (tensor,)


def _fuse(rule: Rule, parts: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    if rule.layout is Layout.QKV:
        q, k, v = parts
        kv_rows, q_rows = spec.num_query_groups * spec.head_dim, spec.num_attention_heads * spec.head_dim
        if k.shape[0] != kv_rows or v.shape[0] != kv_rows or q.shape[0] != q_rows:
            raise ValueError(
                f"q/k/v shapes {[tuple(p.shape) for p in parts]} do not fit "
                f"{spec.num_attention_heads} heads, {spec.num_query_groups} kv heads of {spec.head_dim}"
            )
        return layouts.interleave_qkv(q, k, v, spec.num_query_groups, spec.head_dim)
    if rule.layout is Layout.GATED:
        gate, up = parts
        if gate.shape != up.shape:
            raise ValueError(f"gate/up shapes differ: {tuple(gate.shape)} vs {tuple(up.shape)}")
        return layouts.merge_gated(gate, up)
    (tensor,) = parts
    return tensor


def _check_layout(layout: str) -> None:
    if layout not in HF_LAYOUTS:
        raise ValueError(f"layout={layout!r}; allowed: {HF_LAYOUTS}")


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


# transformers >= 5 in-memory layout ------------------------------------------------------


def _part_templates(spec: ModelSpec) -> tuple[str, ...]:
    return tuple(p for s in spec.table.transformers_stacked for p in s.parts)


def _transformers_name(checkpoint_name: str, spec: ModelSpec) -> str:
    """In-memory name of a checkpoint tensor (a stacked tensor for per-expert ones)."""
    found = resolve(checkpoint_name, _part_templates(spec))
    if found is not None:
        template, idx = found
        stacked = next(s for s in spec.table.transformers_stacked if template in s.parts)
        return compile_template(stacked.fused).format(**idx)
    renames = dict(spec.table.transformers_renames)
    found = resolve(checkpoint_name, tuple(renames))
    if found is not None:
        return compile_template(renames[found[0]]).format(**found[1])
    return checkpoint_name


def _checkpoint_getter(get: Callable[[str], torch.Tensor], spec: ModelSpec) -> Callable[[str], torch.Tensor]:
    """A checkpoint-layout getter over transformers-layout tensors."""

    def get_checkpoint(name: str) -> torch.Tensor:
        found = resolve(name, _part_templates(spec))
        if found is None:
            return get(_transformers_name(name, spec))
        template, idx = found
        stacked = next(s for s in spec.table.transformers_stacked if template in s.parts)
        fused_ERC = get(compile_template(stacked.fused).format(**idx))
        if fused_ERC.shape[0] != spec.num_experts:
            raise ValueError(f"{stacked.fused}: {fused_ERC.shape[0]} experts, config says {spec.num_experts}")
        pieces = torch.chunk(fused_ERC[idx["expert"]], len(stacked.parts), dim=0)
        return pieces[stacked.parts.index(template)]

    return get_checkpoint


def _stack_experts(checkpoint: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Checkpoint-layout state dict -> transformers in-memory layout."""
    out: dict[str, torch.Tensor] = {}
    stacked_names = set()
    for name in checkpoint:
        if resolve(name, _part_templates(spec)) is not None:
            stacked_names.add(_transformers_name(name, spec))
        else:
            out[_transformers_name(name, spec)] = checkpoint[name]
    for stacked in spec.table.transformers_stacked:
        for layer in range(spec.num_layers):
            fused = compile_template(stacked.fused).format(layer=layer)
            if fused not in stacked_names:
                continue
            per_expert = []
            for expert in range(spec.num_experts):
                names = [compile_template(p).format(layer=layer, expert=expert) for p in stacked.parts]
                absent = [n for n in names if n not in checkpoint]
                if absent:
                    raise ValueError(f"cannot build {fused}: missing {_preview(absent)}")
                per_expert.append(torch.cat([checkpoint[n] for n in names], dim=0))
            out[fused] = torch.stack(per_expert, dim=0)
    if spec.tie_word_embeddings and HF_EMBEDDING in out:
        out[HF_TIED_OUTPUT] = out[HF_EMBEDDING]
    return out
