"""LayerNorm / RMSNorm in plain torch for the portable spec, usable under sequence parallelism.

Megatron's local ``WrappedTorchNorm`` asserts when ``sequence_parallel`` is on,
and its fused norm needs apex. The math of a norm is per token, so it is the
same whether the sequence is sharded across TP ranks or not; what sequence
parallelism changes is the weight gradient, which becomes a partial sum per
rank. Megatron's ``finalize_model_grads`` all-reduces the gradients of
parameters marked ``sequence_parallel=True`` across TP, so that is all this
module has to do (TransformerEngine's ``TENorm`` marks them the same way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PortableNorm"]

_KINDS = ("LayerNorm", "RMSNorm")


class PortableNorm(torch.nn.Module):
    """``config.normalization`` (LayerNorm or RMSNorm) over the last dim, computed in fp32.

    Constructor signature of Megatron's norms (``build_module(norm, config=...,
    hidden_size=..., eps=...)``). With ``config.layernorm_zero_centered_gamma``
    the stored weight is ``gamma - 1`` (as TransformerEngine stores it).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str | None = None):
        super().__init__()
        kind = config.normalization
        if kind not in _KINDS:
            raise ValueError(f"normalization must be one of {_KINDS} for the portable spec, got {kind!r}")
        self.kind = kind
        self.eps = eps
        self.hidden_size = hidden_size
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in self.parameters():
            # Partial weight gradients under SP: finalize_model_grads sums them over TP.
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x):
        """Normalize ``x[..., hidden_size]``; returns ``x.dtype``."""
        weight = self.weight.float() + 1.0 if self.zero_centered_gamma else self.weight.float()
        xf = x.float()
        if self.kind == "RMSNorm":
            y = F.rms_norm(xf, (self.hidden_size,), weight, self.eps)
        else:
            y = F.layer_norm(xf, (self.hidden_size,), weight, self.bias.float(), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.kind}({self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma})"
