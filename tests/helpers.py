"""Small assertions and references used by tests in more than one directory."""

import torch

__all__ = ["assert_close_f64", "hf_scores"]


def assert_close_f64(actual, expected):
    """`actual` equals the hand-computed float64 values `expected` (nested lists) to float64 round-off."""
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def hf_scores(model, ids):
    """HF transformers' own (log-probs_T-1, entropy_T-1) of the token ids `ids` under `model`, in float64:
    position j scores token j + 1."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)[:-1]
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
