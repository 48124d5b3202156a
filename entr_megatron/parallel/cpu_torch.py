"""``torch`` as megatron-core's CUDA-bound modules see it on a CPU build of torch.

``CpuTorch`` is a module object that ``cpu_compat.enable_cpu_compat`` puts in place of
``torch`` in exactly the megatron modules it lists (item 1 of its docstring): ``torch.cuda``
there has a CPU ``current_device()``, a no-op ``synchronize()``, null streams and events
(all CPU work is synchronous), and the tensor factories map ``device="cuda"`` to CPU.
Everything else is the real ``torch``; other modules never see the proxy.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

__all__ = ["NULL_STREAM", "TENSOR_FACTORIES", "CpuCuda", "CpuTorch", "NullEvent", "NullStream", "cpu_device", "on_cpu"]


def cpu_device(device):
    """Map any CUDA device spec (``"cuda"``, ``"cuda:1"``, ``torch.device('cuda')``, an int) to CPU."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def on_cpu(factory):
    """`factory` (a torch tensor factory) with a CUDA ``device=`` mapped to CPU and no pinning."""

    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
            kwargs.pop("pin_memory", None)  # pinning needs a CUDA driver
        return factory(*args, **kwargs)

    return wrapper


class NullEvent:
    """A CUDA event on a machine where all work is synchronous."""

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


class NullStream(NullEvent):
    """The one (synchronous) stream of a CPU: equal to itself, so no side stream is ever detected."""

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or NullEvent()


NULL_STREAM = NullStream()


class CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron's proxied modules see it on CPU; the rest forwards to the real one."""

    def __init__(self):
        super().__init__("torch.cuda")

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def Stream(*args, **kwargs):  # noqa: N802 (mirrors torch.cuda.Stream)
        return NULL_STREAM

    @staticmethod
    def current_stream(device=None):
        return NULL_STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def Event(*args, **kwargs):  # noqa: N802 (mirrors torch.cuda.Event)
        return NullEvent()

    @staticmethod
    def manual_seed(seed):
        # The CPU generator is "the device generator" on CPU (cpu_compat's RNG tracker).
        torch.manual_seed(seed)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


TENSOR_FACTORIES = (  # torch functions that take device=: CpuTorch's are on_cpu
    "arange", "as_tensor", "empty", "empty_like", "full", "full_like", "ones", "ones_like",
    "rand", "randint", "randn", "tensor", "zeros", "zeros_like",
)


class CpuTorch(types.ModuleType):
    """The ``torch`` module as megatron's proxied modules see it on CPU (see module docstring)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = CpuCuda()
        for name in TENSOR_FACTORIES:
            setattr(self, name, on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)  # later lookups skip __getattr__
        return value
