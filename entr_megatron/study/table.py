"""The results table a study report writes: which columns it keeps, and Arrow-safe types."""

from __future__ import annotations

import math

import pandas as pd

__all__ = ["TABLE_METRICS", "key_columns", "parquet_safe"]

TABLE_METRICS = ("policy_version", "reward/mean", "loss", "optim/grad_norm", "mismatch/k3", "mismatch/mean_abs_delta",
                 "is/ess", "mask/fraction", "entr/mask_fraction", "policy/entropy_mean", "policy_lag/mean",
                 "policy_lag/max", "policy_loss/clip_frac_high", "policy_loss/clip_frac_low", "policy_loss/ratio_max",
                 "rollout/response_len_mean", "rollout/tokens", "timing/step_s", "timing/train_s",
                 "timing/wait_rollout_s", "eval/accuracy", "eval/sampled_accuracy", "wall_s", "tokens_cum")
"""The metrics of the results table (`table="key"`), beside the cell, its state, its axes, the step
and the per-entropy-bin count, mean |delta| and mask fraction."""


def key_columns(results: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """The results table cut to TABLE_METRICS (what a committed study keeps small)."""
    keep = ["cell", "state", *axes, "step"]
    keep += [c for c in results.columns if c in TABLE_METRICS or c.endswith(":nonfinite")]
    keep += [c for c in results.columns if c.startswith("entropy_bin/")
             and c.rsplit("/", 1)[-1] in ("count", "mean_abs_delta", "mask_fraction")]
    return results[[c for c in dict.fromkeys(keep) if c in results.columns]]


def parquet_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """Object columns mixing types (e.g. an axis of ints and strings) as strings, for Arrow."""
    out = frame.copy()
    for col in out.columns:
        if out[col].dtype == object:
            kinds = {type(v) for v in out[col] if v is not None and not (isinstance(v, float) and math.isnan(v))}
            if len(kinds) > 1:
                out[col] = out[col].map(lambda v: None if v is None else str(v))
    return out
