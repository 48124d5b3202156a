"""The `model` and `parallel` sections: the policy model and the learner's Megatron parallelism. Layer L0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from entr_megatron.config.validate import bad, boolean, choice, integer, string

MAX_SEQ_LEN = 1_048_576
"""Upper bound of model.max_seq_len and max_prompt_len (and of rollout.sampling.max_new_tokens)."""

ModelDtype = Literal["float32", "bfloat16"]
MODEL_DTYPES: tuple[str, ...] = get_args(ModelDtype)

# A tiny Qwen3-style model, so RunConfig() is valid and small enough for a CPU.
DEFAULT_ARCHITECTURE: dict[str, Any] = {
    "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class ModelConfig:
    """The policy model: where it comes from, its dtype and its sequence limits."""

    SECTION = "model"

    path: str | None = None
    """HF model directory (config.json, optionally safetensors) or a config.json file, or a
    learner checkpoint root / run directory (`entr-megatron convert hf-to-megatron` output): the
    train, sft and eval commands convert its latest step into run_dir/model_init once and start
    from that. None: build the model from `architecture` (random init; the SFT warm-up or the run
    saves it into the run directory)."""

    architecture: dict[str, Any] | None = field(default_factory=lambda: dict(DEFAULT_ARCHITECTURE))
    """HF config fields (model_type, hidden_size, num_hidden_layers, ...) of a model built from
    scratch when `path` is null (default: a tiny Qwen3). vocab_size may be left out: the task's
    tokenizer sets it. Set either this or `path`; with `path` the default becomes null."""

    tokenizer: str | None = None
    """HF tokenizer directory. None: the model directory's tokenizer, or the one the synthetic
    task builds locally."""

    dtype: ModelDtype = "float32"
    """Learner weights and compute: one of MODEL_DTYPES (bfloat16: Megatron's bf16 training,
    with fp32 main weights, gradients and optimizer state)."""

    max_prompt_len: int = 512
    """Longest prompt in tokens; longer prompts are skipped and counted. In [1, MAX_SEQ_LEN]."""

    max_seq_len: int = 2048
    """Prompt + response limit in tokens (positions the model must cover). In [2, MAX_SEQ_LEN]; at least
    max_prompt_len + rollout.sampling.max_new_tokens."""

    def __post_init__(self) -> None:
        string(self, "path", optional=True)
        if self.architecture is not None and not isinstance(self.architecture, dict):
            raise bad(self, "architecture", self.architecture, "must be null or a mapping of HF config fields")
        if self.path is not None and self.architecture == DEFAULT_ARCHITECTURE:
            object.__setattr__(self, "architecture", None)  # the default applies to path-less models only
        if self.path is not None and self.architecture:
            raise bad(self, "architecture", self.architecture, "must be null when model.path is set (one or the other)")
        if self.path is None and not self.architecture:
            raise bad(self, "path", None, "set model.path (an HF model dir or config.json) or model.architecture")
        if self.path is None and "model_type" not in self.architecture:
            raise bad(self, "architecture", self.architecture, "must name its model_type (e.g. qwen3)")
        string(self, "tokenizer", optional=True)
        choice(self, "dtype", ModelDtype)
        integer(self, "max_prompt_len", low=1, high=MAX_SEQ_LEN)
        integer(self, "max_seq_len", low=2, high=MAX_SEQ_LEN)


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallelism of the learner. Its world size is launcher.nnodes * nproc_per_node."""

    SECTION = "parallel"

    tp: int = 1
    """Tensor-parallel size. >= 1."""

    pp: int = 1
    """Pipeline-parallel size. >= 1."""

    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule). None or >= 2; needs pp >= 2."""

    cp: int = 1
    """Context-parallel size (sequence split over ranks in attention). >= 1."""

    ep: int = 1
    """Expert-parallel size (MoE models). >= 1; ep * expert_tp must divide tp * cp * dp."""

    expert_tp: int = 1
    """Tensor-parallel size inside the experts (Megatron's expert_tensor_parallel_size). >= 1."""

    dp: int | None = None
    """Data-parallel size. None: derived as world_size / (tp * pp * cp); if set, tp * pp * cp * dp
    must equal the world size."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (norms/dropout sharded over the TP group); needs tp >= 2."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "expert_tp"):
            integer(self, name, low=1)
        integer(self, "vpp", low=2, optional=True)
        integer(self, "dp", low=1, optional=True)
        boolean(self, "sequence_parallel")
        if self.vpp is not None and self.pp < 2:
            raise bad(self, "vpp", self.vpp, f"needs parallel.pp >= 2 (pp={self.pp}); use null")
        if self.ep > 1 and self.tp > 1 and not self.sequence_parallel:
            raise bad(
                self, "sequence_parallel", False,
                f"Megatron needs it with expert and tensor parallelism (ep={self.ep}, tp={self.tp}); use true",
            )
        if self.sequence_parallel and self.tp < 2:
            raise bad(self, "sequence_parallel", True, f"needs parallel.tp >= 2 (tp={self.tp}); use false")

    def data_parallel_size(self, world_size: int) -> int:
        """dp for a learner of `world_size` ranks (the set value, or the derived one)."""
        model_parallel = self.tp * self.pp * self.cp
        return self.dp if self.dp is not None else world_size // model_parallel
