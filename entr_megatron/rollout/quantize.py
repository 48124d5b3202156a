"""FP8 (e4m3) rounding of the embedded engine's linear layers: the train-inference mismatch of an
FP8 rollout engine, emulated exactly on any device.

What is rounded is what the FP8 rollout recipes quantize (verl, slime, NeMo-RL, prime-rl on
SGLang / vLLM; llm-compressor's FP8 schemes): the weight of every `nn.Linear` of the decoder
layers (attention and MLP projections, MoE experts held as Linear modules). The embeddings, the
norms, the biases, the output layer (`lm_head`, tied or not) and MoE routers keep the engine's
dtype. Fused 3-D expert tensors (transformers 5.x MoE) are not Linear modules and are not rounded.

A weight ``W [out, in]`` is replaced by ``s * e4m3(W / s)`` with ``s = amax / 448`` over the
whole tensor (`per_tensor`), over each output channel (`per_channel`), or over each 128 x 128
tile (`block`, DeepSeek-V3's layout, the one verl's FP8 rollout uses). e4m3: 3 mantissa bits,
exponent bias 7, subnormals down to 2^-9, largest finite 448; round to nearest, ties to even
(torch's cast to `float8_e4m3fn`, on CPU too). The matmul then runs in the engine's dtype on
these values; an FP8 GEMM multiplies the same e4m3 numbers and scales with fp32 accumulation,
so the two differ only by accumulation order and the output's rounding.

With `activations`, each rounded Linear's input is rounded the same way, its scale computed from
the input itself (dynamic, as W8A8 kernels do): per tensor (`per_tensor`), per token
(`per_channel`, llm-compressor's "FP8-dynamic" scheme) or per 1 x 128 group of a token (`block`).

Weights change only by a swap (`weights.WeightStage.swap_into`): the engine calls `refresh()`
after every one (and the rounding rounds once when installed), so no forward ever sees an
unrounded weight. Rounding is applied in place; the weight stage's copy of the next version
arrives unrounded and is rounded after its own swap.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from entr_megatron.config.rollout import QUANTIZE, QUANTIZE_SCALES

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "Fp8Rounding",
    "NoRounding",
    "WeightRounding",
    "fp8_round_activation",
    "fp8_round_weight",
    "install_rounding",
    "rounded_linears",
]

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value: a scale amax / 448 maps a group's largest magnitude onto it."""
BLOCK = 128
"""Side of a `block` weight tile and length of a `block` activation group (DeepSeek-V3, verl)."""


def _round_to_amax(x32: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``s * e4m3(x / s)``, s = amax / 448 broadcast over x (fp32 in, fp32 out); an all-zero group
    keeps scale 1 (its values are 0 either way)."""
    scale = amax / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # amax / (amax / 448) can land a hair above 448 in fp32; the clamp keeps it finite (448).
    q = (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.to(torch.float32) * scale


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    missing = -x.shape[dim] % multiple
    if not missing:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, missing]
    return F.pad(x, pad)  # zeros never raise a group's amax


def fp8_round_weight(w_OI: torch.Tensor, scale: str, block: int = BLOCK) -> torch.Tensor:
    """`w_OI` rounded through FP8 e4m3 and dequantized, in its own dtype.

    scale: 'per_tensor' (one amax), 'per_channel' (one per output row), 'block' (one per
    `block` x `block` tile; the last tiles of a dimension that `block` does not divide are partial)."""
    if w_OI.dim() != 2:
        raise ValueError(f"fp8_round_weight takes a 2-D [out, in] weight, got shape {tuple(w_OI.shape)}")
    x = w_OI.detach().to(torch.float32)
    if scale == "per_tensor":
        out = _round_to_amax(x, x.abs().amax())
    elif scale == "per_channel":
        out = _round_to_amax(x, x.abs().amax(dim=1, keepdim=True))
    elif scale == "block":
        O, I = x.shape
        t = _pad_to(_pad_to(x, 0, block), 1, block)
        t = t.view(t.shape[0] // block, block, t.shape[1] // block, block)
        out = _round_to_amax(t, t.abs().amax(dim=(1, 3), keepdim=True)).view(-1, t.shape[2] * block)[:O, :I]
    else:
        raise ValueError(f"scale must be one of {QUANTIZE_SCALES}, got {scale!r}")
    return out.to(w_OI.dtype)


def fp8_round_activation(x: torch.Tensor, scale: str, block: int = BLOCK) -> torch.Tensor:
    """`x [..., in]` rounded through FP8 e4m3 with a dynamic scale, in its own dtype: one amax over
    the tensor ('per_tensor'), per token ('per_channel'), per `block` features of a token ('block')."""
    x32 = x.to(torch.float32)
    if scale == "per_tensor":
        out = _round_to_amax(x32, x32.abs().amax())
    elif scale == "per_channel":
        out = _round_to_amax(x32, x32.abs().amax(dim=-1, keepdim=True))
    elif scale == "block":
        n = x32.shape[-1]
        t = _pad_to(x32, -1, block)
        t = t.view(*t.shape[:-1], t.shape[-1] // block, block)
        out = _round_to_amax(t, t.abs().amax(dim=-1, keepdim=True)).flatten(-2)[..., :n]
    else:
        raise ValueError(f"scale must be one of {QUANTIZE_SCALES}, got {scale!r}")
    return out.to(x.dtype)


def rounded_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The Linear modules FP8 rollout quantizes, by module name: every `nn.Linear` but the output
    layer, any Linear sharing a weight with an embedding, and MoE routers (the `gate` of a module
    that also has `experts`, as `hf_model.RouteRecorder` finds them)."""
    keep_dtype: set[int] = set()
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        keep_dtype.add(id(output.weight))
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            keep_dtype.add(id(m.weight))
        if hasattr(m, "gate") and hasattr(m, "experts") and isinstance(m.gate, torch.nn.Module):
            keep_dtype.update(id(p) for p in m.gate.parameters(recurse=False))
    return {
        name: m for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in keep_dtype
    }


class WeightRounding(Protocol):
    """What the engine calls on its model's rounding: after every weight swap, and to take it off."""

    def refresh(self) -> int:
        """Round the weights the model holds now (they just arrived); returns how many tensors."""
        ...

    def remove(self) -> None:
        """Take the activation hooks off (weights stay as they are)."""
        ...


class NoRounding:
    """`rollout.quantize: none`: the engine computes in its dtype."""

    def refresh(self) -> int:
        return 0

    def remove(self) -> None:
        pass


class Fp8Rounding:
    """FP8 e4m3 rounding of a model's linear layers (see the module docstring), installed on it:
    the weights are rounded now and by every `refresh()`; with `activations`, a forward pre-hook
    rounds each rounded Linear's input."""

    def __init__(self, model: torch.nn.Module, scale: str = "per_channel", activations: bool = False,
                 block: int = BLOCK):
        if scale not in QUANTIZE_SCALES:
            raise ValueError(f"scale must be one of {QUANTIZE_SCALES}, got {scale!r}")
        self.scale, self.activations, self.block = scale, activations, block
        self.linears = rounded_linears(model)
        self._handles = [m.register_forward_pre_hook(self._round_input) for m in self.linears.values()] \
            if activations else []
        self.refresh()

    def refresh(self) -> int:
        """Round every rounded Linear's weight in place (call after the weights changed)."""
        done: set[int] = set()
        with torch.no_grad():
            for m in self.linears.values():
                if id(m.weight) not in done:  # a weight shared by two Linears is rounded once
                    done.add(id(m.weight))
                    m.weight.copy_(fp8_round_weight(m.weight, self.scale, self.block))
        return len(done)

    def _round_input(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (fp8_round_activation(args[0], self.scale, self.block), *args[1:])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def install_rounding(model: torch.nn.Module, quantize: str = "none", scale: str = "per_channel",
                     activations: bool = False) -> WeightRounding:
    """The rounding `rollout.quantize` asks for, installed on `model` (its weights rounded now)."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    if quantize == "none":
        if activations:
            raise ValueError("activations are rounded only with quantize 'fp8'")
        return NoRounding()
    return Fp8Rounding(model, scale, activations)
