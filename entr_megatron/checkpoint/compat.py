"""Fixes for checkpointing torch Adam inside megatron-core 0.16.1's distributed optimizer.

Without Apex/TransformerEngine, Megatron's ``DistributedOptimizer`` wraps torch's
``Adam``, which keeps a ``step`` tensor in every param state (FusedAdam keeps it
in the param groups). megatron-core 0.16.1's checkpoint code assumes the FusedAdam
layout; each fix below says which of its behaviours it works around. All are
no-ops where the optimizer keeps no per-param ``step``.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import DistributedOptimizer, distrib_optimizer

from entr_megatron.checkpoint.directory import CheckpointError
from entr_megatron.checkpoint.state import optimizer_parts

__all__ = ["load_optimizer_state", "prime_distributed_optimizer"]


def prime_distributed_optimizer(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet torch Adam's initial state.

    Works around: ``DistributedOptimizer.state_dict`` (called by
    ``sharded_state_dict`` to save or load) reads every param state's ``step``,
    which torch Adam creates only at its first step, so a save (or a load) before
    the first step fails. The state added is exactly what that first step would
    create (zero moments, step 0).
    """
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False):
        return  # FusedAdam keeps its step in the param groups: nothing to prime
    for part in optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if (not isinstance(part, DistributedOptimizer) or not isinstance(inner, torch.optim.Optimizer)
                or len(inner.state)):
            continue
        if part.init_state_fn is None:
            raise CheckpointError(f"cannot checkpoint a {type(inner).__name__} distributed optimizer before its "
                                  "first step without TransformerEngine/Apex (Megatron supports Adam there)")
        part.init_state_fn(inner, part.config)
        for state in inner.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))


def load_optimizer_state(optimizer, state_dict) -> None:
    """``optimizer.load_state_dict(state_dict)`` with two fixes for torch Adam in the distributed optimizer.

    Works around (megatron-core 0.16.1, the path without Apex/TransformerEngine):

    1. ``DistributedOptimizer.load_state_dict`` first puts the saved ``step`` (kept
       in the param groups) into every param state, then copies the checkpoint's
       tensors over every key of that state: the model-space formats have no
       ``step`` (KeyError), ``dp_reshardable`` hands back the state's step from
       before the load (resetting Adam's step to 0). Here ``step`` is always the
       one taken from the param groups (``_keep_step``).
    2. That ``step`` is ONE tensor shared by all param states, and torch Adam
       increments each param's step in place: it would advance once per parameter
       per step. Each state gets its own copy afterwards.

    Both are no-ops where the optimizer keeps no per-param ``step`` (TE/Apex FusedAdam).
    """
    patched = []
    for part in optimizer_parts(optimizer):
        if isinstance(part, DistributedOptimizer) and getattr(part, "optimizer", None) is not None:
            part._set_main_param_and_optimizer_states = _keep_step(part)
            patched.append(part)
    try:
        # Works around: Megatron's dp_reshardable loader copies in place into views of
        # the (fp32) params, which fails outside no_grad.
        with torch.no_grad():
            optimizer.load_state_dict(state_dict)
    finally:
        for part in patched:
            del part._set_main_param_and_optimizer_states  # back to the class's method
    for part in optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _keep_step(part):
    """``part._set_main_param_and_optimizer_states`` that keeps each param state's current ``step`` (fix 1)."""
    upstream = part._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(model_param, tensors):
        group_index, group_order = part.model_param_group_index_map[model_param]
        main_param = part.optimizer.param_groups[group_index]["params"][group_order]
        step = part.optimizer.state[main_param].get("step")
        if step is not None:  # keep the step load_state_dict took from the param groups
            tensors = {**tensors, "step": step}
        return upstream(model_param, tensors)

    return set_main_param_and_optimizer_states
