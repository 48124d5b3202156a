"""Small assertions and references used by tests in more than one directory."""

import importlib.util
import signal
from pathlib import Path

import torch

__all__ = ["assert_close_f64", "hf_scores", "load_tool", "sigint_default"]

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    """tools/{name}.py as a module (tools/ is not a package), under the name tool_{name}."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sigint_default() -> None:
    """`preexec_fn` for a child whose Ctrl-C a test checks: SIGINT back to its default. A suite
    started as a background job (`pytest &`) has SIGINT ignored by its shell, and an ignored
    signal stays ignored through fork and exec, so the child would never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_close_f64(actual, expected):
    """`actual` equals the hand-computed float64 values `expected` (nested lists) to float64 round-off."""
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def hf_scores(model, ids):
    """HF transformers' own (log-probs_T-1, entropy_T-1) of the token ids `ids` under `model`, in float64:
    position j scores token j + 1."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)[:-1]
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
