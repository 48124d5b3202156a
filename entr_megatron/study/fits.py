"""The saturating compute-performance curve of ScaleRL and a least-squares fit of it.

ScaleRL (Khatri et al. 2025, "The Art of Scaling Reinforcement Learning Compute for LLMs",
arXiv:2510.13786, Eq. 1) models the reward reached after RL compute C as

    R_C - R_0 = (A - R_0) / (1 + (C_mid / C)^B)

    R_0     the reward at the start (before RL)
    A       the asymptote, the reward the recipe tends to with unbounded compute
    B > 0   the scaling exponent: larger B climbs through the middle of the curve faster
    C_mid   the compute at which half of the gain A - R_0 is made

The paper fits held-out pass rate against GPU-hours; a study report fits the training
reward against cumulative rollout tokens (any positive, increasing measure of compute
works: the units only rescale C_mid).

`fit_sigmoid` holds R_0 fixed (given, or the mean reward of the lowest-compute tenth of the
points) and fits (A, B, C_mid) with `scipy.optimize.curve_fit` inside bounds
A in [R_0, 1.5 max(reward)], B in (0, 10], C_mid in (0, 100 max(C)]. C_mid is fitted as
log(C_mid / max C), which keeps the problem well scaled whatever the compute units, and
the fit starts from a few initial guesses and keeps the one with the least squared error.
It never raises on bad data: `SigmoidFit.ok` is False and `message` says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["MIN_FIT_POINTS", "SigmoidFit", "fit_frame", "fit_groups", "fit_sigmoid", "sigmoid_curve"]

# Three free parameters: with fewer than five points the fit has (almost) no residual
# degrees of freedom and R^2 says nothing.
MIN_FIT_POINTS = 5

_B_BOUNDS = (1e-3, 10.0)  # (0, 10]: a lower bound of exactly 0 makes the curve flat
_CMID_MAX_FACTOR = 100.0  # C_mid <= 100 max(C): the midpoint may lie beyond the data, not arbitrarily far
_CMID_MIN_FACTOR = 1e-6  # and >= 1e-6 min(C), a stand-in for "> 0" in log space
_EPS = 1e-9


def sigmoid_curve(C, A: float, B: float, C_mid: float, R0: float) -> np.ndarray:
    """R_C = R0 + (A - R0) / (1 + (C_mid / C)^B), elementwise over the array-like C (C > 0)."""
    C = np.asarray(C, dtype=float)
    with np.errstate(over="ignore", divide="ignore"):
        return R0 + (A - R0) / (1.0 + (C_mid / C) ** B)


@dataclass(frozen=True)
class SigmoidFit:
    """A fitted (or failed) ScaleRL curve: `ok` False leaves the parameters NaN (R0 aside)
    and says why in `message`."""

    A: float
    B: float
    C_mid: float
    R0: float
    r2: float
    """1 - SSE / SST over the fitted points (NaN when the rewards are all equal)."""
    n: int
    """Number of (compute, reward) points used: finite, with compute > 0."""
    ok: bool
    message: str

    def __call__(self, C) -> np.ndarray:
        """The fitted curve at compute C (NaN everywhere when the fit failed)."""
        if not self.ok:
            return np.full(np.shape(C), math.nan)
        return sigmoid_curve(C, self.A, self.B, self.C_mid, self.R0)


def _failed(n: int, r0: float, message: str) -> SigmoidFit:
    return SigmoidFit(math.nan, math.nan, math.nan, r0, math.nan, n, False, message)


def fit_sigmoid(compute, reward, r0: float | None = None) -> SigmoidFit:
    """Least-squares ScaleRL curve through (compute, reward) points (any order, repeats allowed).

    r0: the start reward R_0, held fixed; None takes the mean reward of the lowest-compute
    tenth of the points (at least one). Points with non-finite values or compute <= 0 are
    dropped. Returns ok=False, never raises, when fewer than MIN_FIT_POINTS remain, when no
    reward exceeds R_0 (no gain to fit) or when curve_fit fails."""
    C = np.asarray(compute, dtype=float).ravel()
    y = np.asarray(reward, dtype=float).ravel()
    if C.shape != y.shape:
        return _failed(0, math.nan if r0 is None else float(r0),
                       f"compute and reward differ in length ({C.size} vs {y.size})")
    keep = np.isfinite(C) & np.isfinite(y) & (C > 0)
    C, y = C[keep], y[keep]
    n = int(C.size)
    if r0 is None and n:
        order = np.argsort(C, kind="stable")
        r0 = float(y[order[: max(1, n // 10)]].mean())
    r0 = math.nan if r0 is None else float(r0)
    if n < MIN_FIT_POINTS:
        return _failed(n, r0, f"too few points ({n} < {MIN_FIT_POINTS})")
    if not math.isfinite(r0):
        return _failed(n, r0, f"R0 must be finite, got {r0}")
    y_max = float(y.max())
    if y_max <= r0 + _EPS:
        return _failed(n, r0, f"no gain: max reward {y_max:.4g} <= R0 {r0:.4g}")

    c_max, c_min = float(C.max()), float(C.min())
    x = C / c_max  # compute in units of its maximum
    a_hi = max(1.5 * y_max, y_max + 0.5 * (y_max - r0)) + _EPS
    lo = np.array([r0, _B_BOUNDS[0], math.log(_CMID_MIN_FACTOR * c_min / c_max)])
    hi = np.array([a_hi, _B_BOUNDS[1], math.log(_CMID_MAX_FACTOR)])

    def model(x, A, B, log_cmid):
        return sigmoid_curve(x, A, B, math.exp(log_cmid), r0)

    # Start C_mid where the data first crosses half of its observed gain.
    half = r0 + 0.5 * (y_max - r0)
    order = np.argsort(x, kind="stable")
    crossed = order[y[order] >= half]
    x_half = float(x[crossed[0]]) if crossed.size else 1.0
    starts = [(min(y_max, a_hi), b, math.log(xm))
              for b in (0.5, 1.0, 2.0, 4.0) for xm in (x_half, 1.0)]

    from scipy.optimize import curve_fit  # scipy is needed only for fits

    best, best_sse, last_error = None, math.inf, "no start converged"
    for p0 in starts:
        p0 = np.clip(np.array(p0, dtype=float), lo + 1e-12, hi - 1e-12)
        try:
            params, _ = curve_fit(model, x, y, p0=p0, bounds=(lo, hi), maxfev=20000)
        except (RuntimeError, ValueError, FloatingPointError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
            continue
        residual = y - model(x, *params)
        sse = float(residual @ residual)
        if math.isfinite(sse) and sse < best_sse:
            best, best_sse = params, sse
    if best is None:
        return _failed(n, r0, f"curve_fit failed ({last_error})")
    A, B, log_cmid = (float(v) for v in best)
    sst = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - best_sse / sst if sst > 0 else math.nan
    return SigmoidFit(A, B, math.exp(log_cmid) * c_max, r0, r2, n, True, "ok")


def fit_groups(frame, by: list[str], compute: str, reward: str) -> dict[tuple, SigmoidFit]:
    """A fit per group of a long pandas frame (one row per run x step, with "cell" and
    "step" columns): every row's (compute, reward), R0 = the mean over the group's cells of
    the reward at each cell's first step."""
    fits = {}
    for key, part in frame.groupby(by, sort=True):
        firsts = part.sort_values("step").groupby("cell")[reward].first()
        r0 = float(firsts.mean()) if firsts.notna().any() else None
        fits[key] = fit_sigmoid(part[compute].to_numpy(float), part[reward].to_numpy(float), r0=r0)
    return fits


def fit_frame(fits: dict[tuple, SigmoidFit], names: list[str]):
    """The fits as a pandas frame: the group key's columns `names`, then A, B, C_mid, R0,
    r2, n, ok, message."""
    import pandas as pd

    return pd.DataFrame.from_records([
        {**dict(zip(names, key)), "A": f.A, "B": f.B, "C_mid": f.C_mid, "R0": f.R0, "r2": f.r2, "n": f.n,
         "ok": f.ok, "message": f.message} for key, f in fits.items()])
