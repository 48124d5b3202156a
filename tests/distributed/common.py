"""The tiny Megatron model and the tolerance check shared by the multi-rank learner tests.

Imported by name (`from common import ...`): tests/distributed is on sys.path under
pytest, and spawned ranks inherit the parent's sys.path.
"""

import torch
import torch.nn.functional as F

from entr_megatron.parallel.fused_output import triton_interpreting

__all__ = ["REL_TOL", "close", "model_config"]

REL_TOL = 1e-5
"""max |got - want| <= REL_TOL * max |want|, per tensor: fp32 results of different layouts
differ by reduction order only."""


def model_config(tp=1, pp=1, ep=1, vpp=None, sp=False, moe=False, num_layers=4, *,
                 dispatcher="alltoall", shared_expert_size=None, dropout=0.0):
    """A 64-wide GQA transformer (RMSNorm, gated SiLU MLP, q/k norms, no biases) in fp32 on CPU.

    `moe`: 4 experts, top-2, on every layer but the first, with the token `dispatcher` and,
    given `shared_expert_size`, a shared expert that wide. `dropout`: hidden and attention.
    """
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=96, normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, qk_layernorm=True, hidden_dropout=dropout,
        attention_dropout=dropout, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1, calculate_per_token_loss=True,
    )
    if moe:
        kw.update(
            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0] + [1] * (num_layers - 1),
            moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
        )
        if shared_expert_size is not None:
            kw["moe_shared_expert_intermediate_size"] = shared_expert_size
    return TransformerConfig(**kw)


def close(got, want, what, tol=REL_TOL, floor=1e-6, atol=0.0):
    """max |got - want| <= tol * max(max |want|, floor) + atol, with equal shapes."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    assert err <= tol * max(scale, floor) + atol, f"{what}: max error {err:.3g}, max |want| {scale:.3g}"


def _triton_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(p) for p in version("triton").split(".")[:2] if p.isdigit())
    except PackageNotFoundError:
        return ()


# Whether the fused output op's Triton kernels can run here in Triton's CPU interpreter:
# TRITON_INTERPRET=1 from the start (tests/conftest.py sets it without CUDA) and triton >= 3.9
# (requirements/constraints-cpu.txt); 3.6's interpreter fails on a loop over tensor bounds
# with numpy 2 (int() of a 1-element array).
INTERPRETER = _triton_version() >= (3, 9) and triton_interpreting()
