"""HF <-> learner checkpoint conversion: the checks and records around the streamed conversion.

The conversion itself is `dist_convert` (no model); verification loads the checkpoint into the
learner on ranks (`entr_megatron.cli.convert_ranks`, which may import both `learner` and
`checkpoint`). This module holds what the command decides before and after them:

    compare_model_configs(ckpt_config, hf_config, "checkpoint", "--hf-config")   # field by field
    check_tied_embeddings(files, spec)            # a stored lm_head must equal the tied embedding
    seqs = verify_sequences(spec.vocab_size, ...) # random token sequences, seeded
    ref = hf_logprobs(hf_dir, seqs)               # transformers' forward, float64 log_softmax
    result = compare_logprobs(ref, got, seqs, tolerance)   # max |delta log-prob|, mean KL
    write_provenance(out, {...})                  # conversion.json

Nothing here imports torch.distributed or megatron (transformers only inside `hf_logprobs`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from entr_megatron import models
from entr_megatron.checkpoint import manifest
from entr_megatron.checkpoint.hf_files import HfFiles

__all__ = ["ASSET_FILES", "PROVENANCE_FILE", "VERIFY_TOLERANCE", "VerifyResult", "compare_logprobs",
           "compare_model_configs", "copy_assets", "check_tied_embeddings", "hf_logprobs", "source_digests",
           "verify_sequences", "write_provenance"]

PROVENANCE_FILE = "conversion.json"
# What an HF directory holds beside the weights that a converted model should keep.
ASSET_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
# max |delta log-prob| a faithful conversion stays under: fp32 differs by reduction order only; bf16
# weights round each parameter (~3 significant digits), a wrong layout moves log-probs by O(1).
VERIFY_TOLERANCE = {"fp32": 1e-4, "bf16": 0.25}
# ModelSpec fields that config.json spells differently (the family tables of every model_type).
_HF_KEY = {"num_layers": "num_hidden_layers", "num_query_groups": "num_key_value_heads",
           "ffn_hidden_size": "intermediate_size", "moe_router_topk": "num_experts_per_tok",
           "moe_ffn_hidden_size": "moe_intermediate_size", "llama3_rope_factor": "rope_scaling.factor",
           "moe_router_pre_softmax": "norm_topk_prob (negated)",
           "num_experts": "num_experts / num_local_experts / n_routed_experts",
           "qkv_bias": "attention_bias", "qk_norm": "use_qk_norm", "rotary_percent": "partial_rotary_factor",
           "first_k_dense": "first_k_dense_replace", "moe_router_num_groups": "n_group",
           "moe_router_group_topk": "topk_group", "moe_router_scaling_factor": "routed_scaling_factor",
           "moe_shared_expert_size": "moe_intermediate_size * n_shared_experts",
           "mtp_layers": "num_nextn_predict_layers", "yarn": "rope_scaling", "mla": "the MLA dims"}
# Fields of the nested records (ModelSpec.mla, .yarn): config.json keys of the same name, or under rope_scaling.
_NESTED_PREFIX = {"mla": "", "yarn": "rope_scaling."}


def compare_model_configs(a: Mapping, b: Mapping, a_name: str, b_name: str) -> None:
    """Raise ValueError unless two HF configs describe the same model: the model_type, then every
    field of the `ModelSpec` each builds (what decides the function the model computes); the error
    names the config key and both values."""
    type_a, type_b = a.get("model_type"), b.get("model_type")
    if type_a != type_b:
        raise ValueError(f"config mismatch: model_type is {type_a!r} in the {a_name}, {type_b!r} in the {b_name}")
    spec_a, spec_b = models.model_spec(a), models.model_spec(b)
    for f in dataclasses.fields(spec_a):
        if f.name in ("table", "naming"):
            continue
        va, vb = getattr(spec_a, f.name), getattr(spec_b, f.name)
        if va != vb and f.name in _NESTED_PREFIX and va is not None and vb is not None:
            for sub in dataclasses.fields(va):  # name the one differing key
                sa, sb = getattr(va, sub.name), getattr(vb, sub.name)
                if sa != sb:
                    raise ValueError(f"config mismatch: {_NESTED_PREFIX[f.name]}{sub.name} is {sa!r} in the "
                                     f"{a_name}, {sb!r} in the {b_name}")
        if va != vb:
            raise ValueError(f"config mismatch: {_HF_KEY.get(f.name, f.name)} is {va!r} in the {a_name}, "
                             f"{vb!r} in the {b_name}")


def check_tied_embeddings(files: HfFiles, spec: models.ModelSpec) -> None:
    """A config that ties the embeddings may still store `lm_head.weight` (it is not loaded): it
    must then equal the embedding, else the conversion would silently drop a different matrix."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if not spec.tie_word_embeddings or head not in files.tensors or embed not in files.tensors:
        return

    def read(name: str) -> torch.Tensor:
        with safe_open(str(files.dir / files.tensors[name].file), framework="pt") as f:
            return f.get_tensor(name)

    if not torch.equal(read(head), read(embed)):
        raise ValueError(f"{files.dir}: config.json ties the embeddings (tie_word_embeddings=true) but {head} "
                         f"differs from {embed}; fix tie_word_embeddings or drop {head}")


def source_digests(directory: str | os.PathLike, names: Sequence[str]) -> dict[str, dict]:
    """{file: {"size", "sha256"}} of the given files of `directory` (hashed in parallel)."""
    return manifest.digest_files(directory, names)


def copy_assets(src: str | os.PathLike | None, dst: str | os.PathLike) -> list[str]:
    """Copy the `ASSET_FILES` `src` holds into `dst`; returns their names (none when src is None)."""
    if src is None or not Path(src).is_dir():
        return []
    copied = []
    for name in ASSET_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def verify_sequences(vocab_size: int, count: int = 4, length: int = 32, seed: int = 0) -> list[list[int]]:
    """`count` random token sequences of `length` ids in [0, vocab_size) (seeded: the same every run)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=g).tolist() for _ in range(count)]


@torch.no_grad()
def hf_logprobs(hf_dir: str | os.PathLike, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """transformers' next-token log-probs [L, V] (float64 log_softmax of float32 logits) of each
    sequence under the HF model in `hf_dir`, loaded in float32."""
    import transformers  # lazy: seconds of import, for --verify only

    model = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(hf_dir), dtype=torch.float32).eval()
    try:
        return [torch.log_softmax(model(torch.tensor([list(s)])).logits[0].double(), -1) for s in sequences]
    finally:
        del model


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """How far the converted model's next-token distributions are from the reference's."""

    max_abs_delta_logprob: float
    """max over positions of |log p_ref(next token) - log p_converted(next token)|."""
    mean_kl: float
    """KL(reference || converted) in nats, averaged over positions (full vocabulary)."""
    tokens: int
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_delta_logprob <= self.tolerance

    def summary(self) -> str:
        verdict = "ok" if self.passed else f"FAILED (tolerance {self.tolerance:g})"
        return (f"verify {verdict}: max |delta log-prob| {self.max_abs_delta_logprob:.3g}, mean KL "
                f"{self.mean_kl:.3g} nats over {self.tokens} positions")


def compare_logprobs(reference: Sequence[torch.Tensor], converted: Sequence[torch.Tensor],
                     sequences: Sequence[Sequence[int]], tolerance: float) -> VerifyResult:
    """Compare full next-token log-prob tables [L, V] of the same sequences (position j predicts token j+1)."""
    worst, kl_sum, n = 0.0, 0.0, 0
    for ref_LV, got_LV, seq in zip(reference, converted, sequences, strict=True):
        ref_LV, got_LV = ref_LV.double()[:-1], got_LV.double()[:-1]
        assert ref_LV.shape == got_LV.shape, (tuple(ref_LV.shape), tuple(got_LV.shape))
        targets_L = torch.tensor(list(seq[1:]))[:, None]
        delta = (ref_LV.gather(-1, targets_L) - got_LV.gather(-1, targets_L)).abs()
        worst = max(worst, float(delta.max()))
        kl_sum += float((ref_LV.exp() * (ref_LV - got_LV)).sum())
        n += ref_LV.shape[0]
    if not torch.isfinite(torch.tensor([worst, kl_sum])).all():
        worst = kl_sum = float("inf")
    return VerifyResult(worst, kl_sum / max(n, 1), n, tolerance)


def write_provenance(directory: str | os.PathLike, record: Mapping[str, Any]) -> Path:
    """`directory/conversion.json`: where the output came from and how it was checked."""
    path = Path(directory) / PROVENANCE_FILE
    path.write_text(json.dumps(dict(record), indent=2, sort_keys=True) + "\n")
    return path
