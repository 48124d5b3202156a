"""Whether Triton is there and how it runs kernels, asked without importing it.

Read by the fused output op to choose its backend (fused_output.py) and by its Triton
kernels for their interpreter-sized blocks (fused_output_triton.py); a module of its own
so that the kernels do not import the op that imports them.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["triton_available", "triton_interpreting"]


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
