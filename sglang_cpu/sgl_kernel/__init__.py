"""A stand-in for SGLang's `sgl_kernel` package on CPU servers: the CPU ops that SGLang 0.5.23
imports on its CPU path (`SGLANG_USE_CPU_ENGINE=1`), in pure torch, so that a server starts without
the kernel wheel, which ships CUDA builds only (sm90 / sm100 `.so` files, no source distribution).

scripts/setup_sglang_cpu.sh copies this package into .venv-sglang; nothing in entr_megatron imports
it (docs/SGLANG_ON_CPU.md). Of SGLang's module-level `from sgl_kernel import ..._cpu` imports, one is
on the path of a plain /generate and is implemented here: `assign_req_to_token_pool_cpu` (where
each new token's KV-cache slot goes). The others belong to speculative decoding, hybrid linear
attention and KV-cache moves between pages; they are importable and raise NotImplementedError,
naming the op, when called (none of those features is used by our servers).

No op is registered under torch.ops.sgl_kernel: SGLang takes the presence of
`torch.ops.sgl_kernel.convert_weight_packed` as "the Intel AMX kernels are here" and would then
call dozens of fused kernels; without it every layer runs its plain torch forward and attention
falls back to the torch_native backend.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+entr.cpu"
"""Not a sglang-kernel release: this package is entr_megatron's CPU stand-in."""

__all__ = ["UNSUPPORTED", "assign_req_to_token_pool_cpu"]


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request i of a batch: req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]
    = the next end_offset[i] - start_offset[i] entries of out_cache_loc (requests in batch order,
    back to back). In place, as SGLang's Triton kernel `assign_req_to_token_pool` (pool_len is the
    row length of req_to_token, which the kernel needs and torch does not)."""
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"assign_req_to_token_pool_cpu: pool_len {pool_len} != req_to_token row length "
                         f"{req_to_token.shape[1]}")
    starts, ends = start_offset.long(), end_offset.long()
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return
    if int(lengths.min()) < 0:
        raise ValueError("assign_req_to_token_pool_cpu: an end_offset is below its start_offset")
    rows = torch.repeat_interleave(req_pool_indices.long(), lengths)
    # position of each written token inside its request's segment
    first = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(total, device=lengths.device) - torch.repeat_interleave(first, lengths)
    cols = torch.repeat_interleave(starts, lengths) + within
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def _unsupported(name: str, feature: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} ({feature}) is not implemented by entr_megatron's CPU stand-in for sgl_kernel "
            "(sglang_cpu/sgl_kernel); run the server without that feature, or on a GPU with the sglang-kernel wheel")

    op.__name__ = op.__qualname__ = name
    return op


UNSUPPORTED = {
    "copy_all_layer_kv_cache_cpu": "moving KV-cache entries between slots",
    "fill_accept_out_cache_loc_cpu": "EAGLE speculative decoding",
    "fill_bonus_tokens_cpu": "EAGLE speculative decoding",
    "assign_draft_cache_locs_contiguous_cpu": "speculative decoding",
    "assign_extend_cache_locs_cpu": "speculative decoding",
    "build_tree_kernel_efficient_cpu": "speculative decoding trees",
    "verify_tree_greedy_cpu": "speculative decoding trees",
    "rotate_input_ids_cpu": "multi-layer EAGLE",
    "build_draft_decode_metadata_cpu": "the Intel AMX attention backend",
    "causal_conv1d_fn_cpu": "hybrid linear-attention models",
    "causal_conv1d_update_cpu": "hybrid linear-attention models",
    "chunk_gated_delta_rule_cpu": "hybrid linear-attention models",
}
"""The other `_cpu` ops SGLang 0.5.23 imports from sgl_kernel under `is_cpu()`, and what they serve."""

globals().update({name: _unsupported(name, feature) for name, feature in UNSUPPORTED.items()})
