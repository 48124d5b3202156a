"""Whether Triton is there and how it runs kernels, asked without importing it.

Read by the fused output ops to choose their backend (fused_output.py, fused_output_loss.py)
and by their Triton kernels for their interpreter-sized blocks (fused_output_triton.py); a
module of its own so that the kernels do not import the ops that import them.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["BACKENDS", "interpreter_ready", "triton_available", "triton_interpreting", "uses_triton"]

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_ready() -> bool:
    """Whether triton was imported with its interpreter on: its library functions (``tl.cdiv``,
    ``tl.sum``, ...) are then interpreted too; built for the GPU they cannot run on CPU."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.cdiv, InterpretedFunction)


def uses_triton(backend: str, hidden) -> bool:
    """Whether a fused output op given ``backend`` (one of ``BACKENDS``) runs its Triton kernels on
    ``hidden``: ``"auto"`` on CUDA tensors when triton is installed (never the interpreter),
    ``"triton"`` wherever it can run, ``"torch"`` never. Raises ValueError naming what the choice needs."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    interpret = triton_interpreting()
    if backend == "auto":
        return hidden.is_cuda and not interpret and triton_available()
    if not triton_available():
        raise ValueError("backend='triton' needs the triton package (pip install triton); use 'auto' or 'torch'")
    if not (hidden.is_cuda or (interpret and hidden.device.type == "cpu")):
        raise ValueError(
            f"backend='triton' runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got a tensor on "
            f"{hidden.device}; use 'auto' or 'torch'"
        )
    if interpret and not interpreter_ready():
        raise ValueError(
            "backend='triton' under TRITON_INTERPRET=1 needs the variable set before triton is first "
            "imported (triton builds its own library functions then); set it at the start of the process"
        )
    return True
