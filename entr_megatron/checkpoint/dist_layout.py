"""Where each Megatron parameter lives in a torch_dist checkpoint, without building the model.

    entries = dist_entries(spec)          # one per parameter: its sharded key and place in it
    e.key, e.prefix_offsets, e.prefix_shape, e.shape
    extra_state_keys(entries)             # the `_extra_state` objects Megatron writes beside them

Megatron's `sharded_state_dict` names a tensor by its module path with the layer and expert
indices taken out and put into the tensor as leading axes: layer `l` of `L` of
`decoder.layers.{l}.mlp.linear_fc2.weight` [H, F] is slice `l` of `decoder.layers.mlp.linear_fc2.weight`
[L, H, F]; expert `e` of `E` of `decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight`
is slice (l, e) of `decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, 2F, H]
(TransformerBlock, SequentialMLP; TEGroupedMLP writes the same keys). TensorEngine's layer spec
fuses a norm into the linear after it, and the portable spec saves under those names so the
checkpoints are interchangeable (`learner/spec.py`'s `sharded_state_dict_keys_map`): a layer's
`input_layernorm.*` is `self_attention.linear_qkv.layer_norm_*` when the layer has a
`linear_qkv` (not with multi-latent attention), its `pre_mlp_layernorm.*` is
`mlp.linear_fc1.layer_norm_*` when it has a dense `linear_fc1` (not in MoE layers).

When the layers differ (dense first layers, `moe_layer_freq` a list), Megatron keeps the layer
index in the key instead (`decoder.layers.{l}.mlp.linear_fc2.weight` [H, F]; experts
`decoder.layers.{l}.mlp.experts.experts.linear_fc1.weight` [E, 2F, H]): TransformerBlock's
`non_homogeneous_layers`, decided from the same TransformerConfig fields here.

Every linear layer of a decoder layer also saves an `_extra_state` object (TransformerEngine's
FP8 metadata; None in the portable spec) under `<key of its module>._extra_state/shard_<offsets>_<shape>`
of the leading axes (`shard_0_1` when there are none); the GPTModel drops the output layer's. The
vocabulary of the embedding and output layer is the true one here; a checkpoint saved at TP > 1
may pad it (Megatron loads either: allow_shape_mismatch).

The names are the portable spec's global ones (`models.megatron_names(spec)` with
te_fused_norms=False); `tests/e2e/test_convert.py` checks the keys, global shapes and objects
against checkpoints Megatron's own save wrote from the learner, for every family. Nothing here
imports megatron.
"""

from __future__ import annotations

import dataclasses
import re

from entr_megatron import models

__all__ = ["DistEntry", "dist_entries", "extra_state_keys", "non_homogeneous_layers"]

_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# TransformerEngine's fused norm+linear names, used for the keys by both specs: (norm module, the
# linear it is fused into, the name of the norm's parameters in that linear).
_FUSED_NORMS = (("input_layernorm.", "self_attention.linear_qkv.", "self_attention.linear_qkv.layer_norm_"),
                ("pre_mlp_layernorm.", "mlp.linear_fc1.", "mlp.linear_fc1.layer_norm_"))


@dataclasses.dataclass(frozen=True)
class DistEntry:
    """One Megatron parameter in a dist checkpoint: slice `prefix_offsets` of the tensor `key`."""

    name: str
    """The parameter's global Megatron name (portable spec, global layer and expert indices)."""
    key: str
    """The sharded key of the tensor that holds it (and the parameter of every other layer / expert)."""
    prefix_offsets: tuple[int, ...]
    """Its index along the leading layer (and expert) axes: (l,), (l, e), (e,) or ()."""
    prefix_shape: tuple[int, ...]
    """The sizes of those axes: (num_layers,), (num_layers, num_experts), (num_experts,) or ()."""
    shape: tuple[int, ...]
    """The full (TP-unsharded) parameter; embedding and output layer with the true vocabulary."""

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.prefix_shape + self.shape

    @property
    def is_vocab(self) -> bool:
        """Embedding / output layer: Megatron pads the rows to the saving TP size."""
        return models.tp_split(self.name) is models.TpSplit.VOCAB


def _layer_key(rest: str, layer_params: set[str]) -> str:
    """The key (after `decoder.layers.`) of a layer parameter `rest` (its path inside the layer)."""
    for norm, linear, fused in _FUSED_NORMS:
        if rest.startswith(norm) and linear + "weight" in layer_params:
            return fused + rest[len(norm):]
    return rest


def non_homogeneous_layers(spec: models.ModelSpec) -> bool:
    """Whether Megatron keys this model's layers one by one (TransformerBlock.sharded_state_dict: a
    `moe_layer_freq` list, or an int above 1), not stacked along a layer axis."""
    freq = models.transformer_config_kwargs(spec).get("moe_layer_freq", 1)
    return isinstance(freq, list) or (isinstance(freq, int) and freq > 1)


def dist_entries(spec: models.ModelSpec) -> list[DistEntry]:
    """Every parameter of the model (`models.megatron_names` order) and where a dist checkpoint holds it."""
    names = models.megatron_names(spec)
    per_layer_keys = non_homogeneous_layers(spec)
    per_layer: dict[int, set[str]] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            per_layer.setdefault(int(m.group(1)), set()).add(m.group(2))
    entries = []
    for name in names:
        shape = tuple(models.megatron_shape(name, spec))
        if m := _EXPERT.match(name):
            layer, expert = int(m.group(1)), int(m.group(2))
            key = f"decoder.layers.{layer}." if per_layer_keys else "decoder.layers."
            offsets, sizes = ((expert,), (spec.num_experts,)) if per_layer_keys else \
                ((layer, expert), (spec.num_layers, spec.num_experts))
            entries.append(DistEntry(name, key + f"mlp.experts.experts.{m.group(3)}", offsets, sizes, shape))
        elif m := _LAYER.match(name):
            layer = int(m.group(1))
            key = f"decoder.layers.{layer}." if per_layer_keys else "decoder.layers."
            offsets, sizes = ((), ()) if per_layer_keys else ((layer,), (spec.num_layers,))
            entries.append(DistEntry(name, key + _layer_key(m.group(2), per_layer[layer]), offsets, sizes, shape))
        else:
            entries.append(DistEntry(name, name, (), (), shape))
    keys = [(e.key, e.prefix_offsets) for e in entries]
    assert len(set(keys)) == len(keys), "two parameters in one place of the dist checkpoint"
    return entries


def extra_state_keys(entries: list[DistEntry]) -> list[str]:
    """The unique keys of the `_extra_state` objects Megatron saves with these parameters: one per
    linear module of a decoder layer (a `linear_*` module with a weight), per layer / expert."""
    keys = []
    for e in entries:
        module, _, param = e.key.rpartition(".")
        if param != "weight" or not e.key.startswith("decoder.layers.") or \
                not module.rpartition(".")[2].startswith("linear_"):
            continue
        offsets, shape = (e.prefix_offsets, e.prefix_shape) if e.prefix_offsets else ((0,), (1,))  # Megatron's
        keys.append(f"{module}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}")
    return keys
