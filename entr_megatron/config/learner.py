"""Configuration of the Megatron learner's training step: packing, optimizer, LR schedule.

Layer L0: plain dataclasses, no torch or megatron import. The learner
(`entr_megatron.learner.optimizer`) turns these fields into Megatron's
``OptimizerConfig``, ``DistributedDataParallelConfig`` and
``OptimizerParamScheduler``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from entr_megatron.config.validate import bad, boolean, choice, integer, number

LrDecayStyle = Literal["constant", "linear", "cosine"]
FusedOutputBackend = Literal["auto", "torch", "triton"]
LR_DECAY_STYLES: tuple[str, ...] = get_args(LrDecayStyle)


@dataclass(frozen=True)
class OptimConfig:
    """Adam (Megatron's optimizer) with decoupled weight decay, clipping and an LR schedule."""

    SECTION = "LearnerConfig.optim"  # the loader re-homes errors to learner.optim in a run

    lr: float = 1e-6
    """Peak learning rate (after warmup). >= 0."""

    min_lr: float = 0.0
    """Learning rate at the end of a linear/cosine decay. In [0, lr]."""

    lr_warmup_init: float = 0.0
    """Learning rate at step 0 when warming up; it rises linearly to `lr`. In [0, lr]."""

    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup. >= 0; < lr_decay_steps when decaying."""

    lr_decay_style: LrDecayStyle = "constant"
    """One of LR_DECAY_STYLES: 'constant' after warmup, or a 'linear'/'cosine' decay to min_lr."""

    lr_decay_steps: int | None = None
    """Step at which a linear/cosine decay reaches min_lr; required for them, > lr_warmup_steps.
    Ignored (may be None) for 'constant'."""

    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; Megatron exempts biases and 1-D parameters (norms). >= 0."""

    adam_beta1: float = 0.9
    """Adam first-moment decay. In [0, 1)."""

    adam_beta2: float = 0.999
    """Adam second-moment decay. In [0, 1)."""

    adam_eps: float = 1e-8
    """Adam denominator epsilon. > 0."""

    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping. >= 0. A step whose
    norm is not finite is always skipped, whatever this is."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state and main weights over data-parallel ranks (Megatron's
    DistributedOptimizer); gradients are reduce-scattered instead of all-reduced."""

    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass (Megatron DDP)."""

    def __post_init__(self) -> None:
        number(self, "lr", low=0)
        number(self, "min_lr", low=0, high=self.lr)
        number(self, "lr_warmup_init", low=0, high=self.lr)
        integer(self, "lr_warmup_steps", low=0)
        choice(self, "lr_decay_style", LrDecayStyle)
        if self.lr_decay_style != "constant" or self.lr_decay_steps is not None:
            if self.lr_decay_steps is None:
                raise bad(
                    self, "lr_decay_steps", None, f"must be an integer > lr_warmup_steps={self.lr_warmup_steps}",
                    when=f"lr_decay_style={self.lr_decay_style!r}",
                )
            integer(self, "lr_decay_steps", low=self.lr_warmup_steps + 1)
        number(self, "weight_decay", low=0)
        number(self, "adam_beta1", low=0, high=1, high_open=True)
        number(self, "adam_beta2", low=0, high=1, high_open=True)
        number(self, "adam_eps", low=0, low_open=True)
        number(self, "clip_grad", low=0)
        boolean(self, "use_distributed_optimizer")
        boolean(self, "overlap_grad_reduce")

    @property
    def schedule_decay_steps(self) -> int:
        """Decay steps handed to Megatron's scheduler (it needs one > warmup even when constant)."""
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.lr_warmup_steps + 1


@dataclass(frozen=True)
class LearnerConfig:
    """The training step of the Megatron learner; validated on construction."""

    SECTION = "LearnerConfig"  # the loader re-homes errors to learner in a run

    max_tokens_per_microbatch: int = 8192
    """Token budget of one packed micro-batch (sequences are never split; one longer than the
    budget gets a micro-batch of its own). >= 1."""

    mini_batches: int = 1
    """Optimizer steps per pass over a rollout batch: the global batch is split into this many
    contiguous mini-batches of (nearly) equal sequence counts, each one optimizer step (verl's
    train_batch_size / ppo_mini_batch_size, slime's num_steps_per_rollout). Every correction
    and the ENTR mask are recomputed on each mini-batch against the current weights. >= 1;
    each mini-batch needs at least one sequence per data-parallel rank."""

    epochs: int = 1
    """Passes over each rollout batch (verl's ppo_epochs); mini_batches * epochs optimizer steps
    per rollout batch, all of one policy version. >= 1."""

    logprob_chunk_size: int | None = None
    """Tokens per chunk of the vocab-parallel log-prob/entropy op (bounds its fp32 temporaries).
    None: about 2 MiB buffers (fused: 512 x 4096 tiles; given, the tiles hold this many tokens). >= 1."""

    fused_output: bool = True
    """Fuse the output layer into the log-prob/entropy op: the model returns hidden states and
    the loss multiplies them by the output weight one [tokens, vocab] tile at a time, so the
    [tokens, V/tp] logits are never written or kept for backward (learner/fused_output.py).
    Exact (the same math; rounding differs at the level of fp32 accumulation order)."""

    fused_output_backend: FusedOutputBackend = "auto"
    """Implementation of the fused op: "auto" (its Triton kernels on CUDA when triton is
    installed, else the chunked PyTorch path), "torch" (the chunked PyTorch path, the
    reference) or "triton" (CUDA only, or on CPU under TRITON_INTERPRET=1, as the tests do)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer, clipping and LR schedule."""

    def __post_init__(self) -> None:
        if isinstance(self.optim, dict):  # YAML gives a mapping
            object.__setattr__(self, "optim", OptimConfig(**self.optim))
        if not isinstance(self.optim, OptimConfig):
            raise bad(self, "optim", self.optim, "must be an OptimConfig or a mapping")
        integer(self, "max_tokens_per_microbatch", low=1)
        integer(self, "mini_batches", low=1)
        integer(self, "epochs", low=1)
        if self.logprob_chunk_size is not None:
            integer(self, "logprob_chunk_size", low=1)
        boolean(self, "fused_output")
        choice(self, "fused_output_backend", FusedOutputBackend)

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps (and LR-schedule steps) per rollout batch: mini_batches * epochs."""
        return self.mini_batches * self.epochs

