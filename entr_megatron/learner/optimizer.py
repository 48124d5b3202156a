"""Megatron DDP wrapping, Megatron's optimizer and LR schedule, and a step that refuses non-finite gradients.

Megatron's ``ChainedOptimizer.step`` / ``FP32Optimizer.step`` (megatron-core
0.16.1, ``optimizer/optimizer.py`` l. 1308-1340 / 961-) only skip a step when a
*grad scaler* reports inf/nan (fp16; ``prepare_grads``). In fp32 and bf16 there
is no scaler: a NaN norm gives a NaN clip coefficient, ``clip_coeff < 1.0`` is
False (``clip_grads.py`` l. 172-173) and the NaN gradients are applied; an inf
norm zeroes the gradients but still applies weight decay and Adam's momentum.
``optimizer_step`` therefore runs Megatron's own pieces (``prepare_grads``,
``get_grad_norm``, ``clip_grad_by_total_norm_fp32``, ``step_with_ready_grads``)
in ``ChainedOptimizer.step``'s order, with one addition: a non-finite global
norm (all-reduced: the same value on every rank) skips the update and the LR
schedule advance on every rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from entr_megatron.config.learner import LearnerConfig, OptimConfig

__all__ = ["StepResult", "build_optimizer", "check_training_config", "lr_scheduler", "optimizer_step",
           "wrap_model_chunks"]

logger = logging.getLogger(__name__)


def check_training_config(config, learner_cfg: LearnerConfig) -> None:
    """Raise ``ValueError`` when the model's ``TransformerConfig`` cannot give an exact RL loss.

    ``calculate_per_token_loss`` must be set BEFORE the model is built: Megatron's MoE
    router and DDP read it at construction (see learner/loss.py for the normalisation).
    """
    if not config.calculate_per_token_loss:
        raise ValueError(
            "TransformerConfig.calculate_per_token_loss=False: the learner needs True (set it before "
            "building the model) so that Megatron divides gradients by the global token/sequence count "
            "instead of averaging per micro-batch and per data-parallel rank"
        )
    if config.fp16:
        # The precision is the model's (bf16 or fp32, from model.dtype): fp16 would need loss scaling.
        raise ValueError("the model was built with TransformerConfig(fp16=True); the learner trains fp32 or "
                         "bf16 models (model.dtype float32 or bfloat16)")


def wrap_model_chunks(model_chunks: list, groups, learner_cfg: LearnerConfig) -> list[DistributedDataParallel]:
    """Wrap each model chunk in Megatron's ``DistributedDataParallel`` (bf16: ``Float16Module`` first).

    Gradients accumulate in fp32 buffers and are reduced over ``groups``' data-parallel
    group (expert-data-parallel for experts) by ``finalize_model_grads``. Only the first
    chunk uses bucketing, as Megatron-LM does with virtual pipeline stages.
    """
    config = get_model_config(model_chunks[0])
    check_training_config(config, learner_cfg)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=learner_cfg.optim.overlap_grad_reduce,
        use_distributed_optimizer=learner_cfg.optim.use_distributed_optimizer,
        # Non-finite gradients are handled by skipping the step (optimizer_step), not by raising.
        check_for_nan_in_grad=False,
    )
    wrapped = []
    for i, chunk in enumerate(model_chunks):
        if config.bf16:
            chunk = Float16Module(config, chunk)
        wrapped.append(DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0,
                                               pg_collection=groups.pg_collection))
    if learner_cfg.optim.overlap_grad_reduce:
        no_sync = [c.no_sync for c in wrapped]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return wrapped


def build_optimizer(model_chunks: list[DistributedDataParallel], learner_cfg: LearnerConfig
                    ) -> tuple[object, OptimizerParamScheduler]:
    """Megatron's Adam (``get_megatron_optimizer``) and ``OptimizerParamScheduler`` for DDP-wrapped chunks.

    Weight decay is decoupled (AdamW) and, as Megatron's default param groups do, not applied
    to biases and 1-D parameters. The schedule counts optimizer steps: linear warmup from
    ``lr_warmup_init`` to ``lr``, then constant, linear or cosine to ``min_lr``.
    """
    o = learner_cfg.optim
    bf16 = bool(get_model_config(model_chunks[0]).bf16)  # the model's precision (model.dtype)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
        use_distributed_optimizer=o.use_distributed_optimizer, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    # No pg_collection here: megatron-core 0.16.1 refuses gloo groups with an explicit one
    # (process_groups_config.py l. 420-425), and the distributed optimizer's memory-efficient
    # checkpoint gather (checkpoint/ on CPU) needs its gloo DP group. Megatron then
    # takes its own current groups: the ones `groups` was read from.
    optimizer = get_megatron_optimizer(opt_config, model_chunks, use_gloo_process_groups=True)
    # Megatron scales the loss through this before backward (1 for fp32/bf16).
    get_model_config(model_chunks[0]).grad_scale_func = optimizer.scale_loss
    return optimizer, lr_scheduler(optimizer, o)


def lr_scheduler(optimizer, o: OptimConfig) -> OptimizerParamScheduler:
    """Megatron's ``OptimizerParamScheduler`` for `o`'s schedule (any optimizer with param_groups):
    advance it by one (``step(1)``) after each applied optimizer step."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=o.lr_warmup_init if o.lr_warmup_steps > 0 else o.lr,
        max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=o.schedule_decay_steps, lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=o.schedule_decay_steps,
        wd_incr_style="constant",
    )


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    applied: bool
    """False when the step was skipped (non-finite gradient norm or a grad-scaler overflow)."""
    grad_norm: float
    """Global L2 norm of the gradients before clipping (may be nan/inf when skipped)."""
    lr: float
    """Learning rate the step used (or would have used)."""


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_step(optimizer, scheduler: OptimizerParamScheduler | None, clip_grad: float, *,
                   before_update: Callable[[], object] | None = None) -> StepResult:
    """Clip and apply the gradients, or skip the step when their global norm is not finite.

    Mirrors ``ChainedOptimizer.step`` (prepare, one global norm, clip every sub-optimizer
    with it, step) plus the finiteness check. The scheduler advances only on applied steps.
    ``before_update()`` runs right before the parameters change (not on a skipped step).
    """
    from megatron.core.optimizer import clip_grads  # lazy: read at call time, the CPU compat layer wraps it

    param_groups = optimizer.param_groups
    lr = float(param_groups[0]["lr"]) if param_groups else math.nan
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm):
        logger.warning("skipping optimizer step: gradient norm is %s%s", grad_norm,
                       " (grad scaler overflow)" if found_inf else "")
        return StepResult(applied=False, grad_norm=grad_norm, lr=lr)
    if clip_grad > 0:
        for sub in _sub_optimizers(optimizer):
            if getattr(sub, "is_stub_optimizer", False):
                continue
            params = sub.get_parameters()
            if params:
                clip_grads.clip_grad_by_total_norm_fp32(
                    params, max_norm=clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
    if before_update is not None:
        before_update()
    applied = bool(optimizer.step_with_ready_grads())
    if applied and scheduler is not None:
        scheduler.step(increment=1)
    return StepResult(applied=applied, grad_norm=grad_norm, lr=lr)
