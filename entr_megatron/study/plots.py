"""The figures of a study report (matplotlib, Agg backend, PNG) and its tables' rendering.

Every function takes long-format pandas frames that carry a method column (`METHOD`) and a
lag column (`LAG`) next to the data, writes one PNG and closes its figure. Conventions
shared by all figures: one panel per lag, one colour per method (the same colour in every
figure), a curve is the mean over the seeds of a (method, lag) group and its band the
seeds' min..max. A function returns False, writing nothing, when it has nothing to draw;
the caller says so in report.md. Beside the figures: the per-(method, lag) aggregates
they draw (`accuracy_stats`, `bin_profile`) and the markdown rendering of tables.

matplotlib is imported inside the functions (after selecting Agg), so importing this
module costs nothing and never needs a display.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["LAG", "METHOD", "accuracy_stats", "bin_profile", "draw_figures", "entropy_bins",
           "final_accuracy_table", "lag_order", "markdown_table", "method_colors", "plot_bins", "plot_curves",
           "plot_diagnostics", "plot_final_accuracy", "plot_fits", "plot_heldout"]

METHOD = "_method"
"""Column holding a row's method label (str)."""
LAG = "_lag"
"""Column holding a row's lag label (str)."""

_LINESTYLES = ("-", "--", ":", "-.")
_PANEL_W, _PANEL_H, _DPI = 4.6, 3.4, 80


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def method_colors(methods: Sequence[str]) -> dict[str, Any]:
    """A fixed colour per method (tab10, in the given order)."""
    plt = _pyplot()
    cycle = plt.get_cmap("tab10").colors
    return {m: cycle[i % len(cycle)] for i, m in enumerate(methods)}


def _panels(plt, n: int, sharey: bool = True):
    fig, axes = plt.subplots(1, n, figsize=(_PANEL_W * n, _PANEL_H), squeeze=False, sharey=sharey)
    return fig, list(axes[0])


def _legend(axes: Sequence[Any], fontsize: str = "small") -> None:
    """The legend on the first panel that has labelled lines (none when no panel has: a legend
    without entries only warns); a panel with no data says so (a lag whose cells have not run)."""
    for ax in axes:
        if not ax.has_data():
            ax.text(0.5, 0.5, "no finished cells", transform=ax.transAxes, ha="center", va="center", color="grey")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=fontsize)
            return


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)


def _seed_stats(frame: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """Per (method, lag, step): x averaged over seeds, and y's mean / min / max over seeds."""
    data = frame[[METHOD, LAG, "step", x, y]].dropna(subset=[y]) if x != "step" else \
        frame[[METHOD, LAG, "step", y]].dropna(subset=[y])
    grouped = data.groupby([METHOD, LAG, "step"], sort=True)
    out = grouped[y].agg(["mean", "min", "max"])
    out["x"] = grouped[x].mean() if x != "step" else out.index.get_level_values("step")
    return out.reset_index().dropna(subset=["x"])


def plot_curves(frame: pd.DataFrame, x: str, y: str, path: Path, lags: Sequence[str],
                colors: Mapping[str, Any], xlabel: str, ylabel: str, title: str) -> bool:
    """y against x (a per-step column such as "step" or "wall_s"), one panel per lag, one
    line per method: the seeds' mean with their min..max band."""
    if y not in frame or (x != "step" and x not in frame) or frame[y].notna().sum() == 0:
        return False
    stats = _seed_stats(frame, x, y)
    if stats.empty:
        return False
    plt = _pyplot()
    fig, axes = _panels(plt, len(lags))
    for ax, lag in zip(axes, lags):
        for method, color in colors.items():
            part = stats[(stats[METHOD] == method) & (stats[LAG] == lag)].sort_values("x")
            if part.empty:
                continue
            ax.plot(part["x"], part["mean"], color=color, label=method)
            ax.fill_between(part["x"], part["min"], part["max"], color=color, alpha=0.2, linewidth=0)
        ax.set_title(f"{title} (lag {lag})")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    _legend(axes)
    _save(plt, fig, path)
    return True


def plot_heldout(frame: pd.DataFrame, cells: pd.DataFrame, path: Path, lags: Sequence[str],
                 colors: Mapping[str, Any]) -> bool:
    """Held-out accuracy against step: in-training evaluations from metrics.jsonl (lines:
    sampled solid, greedy dashed) and eval.json's before/after RL (hollow markers at step 0
    and at the cell's number of steps), each the mean over seeds."""
    kinds = (("eval/sampled_accuracy", "sampled", "-", "o"), ("eval/accuracy", "greedy", "--", "s"))
    has_rows = any(k in frame and frame[k].notna().any() for k, *_ in kinds)
    ends = cells.assign(end=cells["steps"]).copy()
    has_json = any(ends[c].notna().any() for c in
                   ("eval_before_sampled", "eval_after_sampled", "eval_before_greedy", "eval_after_greedy"))
    if not (has_rows or has_json):
        return False
    plt = _pyplot()
    fig, axes = _panels(plt, len(lags))
    for ax, lag in zip(axes, lags):
        for method, color in colors.items():
            for key, name, style, marker in kinds:
                if key in frame:
                    part = frame[(frame[METHOD] == method) & (frame[LAG] == lag)].dropna(subset=[key])
                    if not part.empty:
                        mean = part.groupby("step")[key].mean()
                        ax.plot(mean.index, mean.values, style, color=color, marker=marker, markersize=3,
                                label=f"{method} {name}")
                mine = ends[(ends[METHOD] == method) & (ends[LAG] == lag)]
                for col, at in ((f"eval_before_{name}", 0), (f"eval_after_{name}", None)):
                    vals = mine[[col, "end"]].dropna(subset=[col])
                    if vals.empty:
                        continue
                    xs = 0.0 if at == 0 else float(vals["end"].mean())
                    ax.plot([xs], [vals[col].mean()], marker, color=color, markerfacecolor="none", markersize=7)
        ax.set_title(f"held-out accuracy (lag {lag})")
        ax.set_xlabel("step (hollow: eval.json before / after RL)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    _legend(axes, "x-small")
    _save(plt, fig, path)
    return True


def _positions(lags: Sequence[str]) -> tuple[np.ndarray, bool]:
    """x positions of the lags: their values when all are numbers, else 0, 1, 2, ..."""
    try:
        return np.array([float(v) for v in lags]), True
    except ValueError:
        return np.arange(len(lags), dtype=float), False


def plot_final_accuracy(stats: pd.DataFrame, path: Path, lags: Sequence[str], colors: Mapping[str, Any]) -> bool:
    """Final held-out sampled accuracy against lag per method: the seeds' mean, error bars
    from their min to their max. `stats` has columns method, lag, mean, min, max, n."""
    if stats.empty:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(_PANEL_W * 1.3, _PANEL_H))
    xs, numeric = _positions(lags)
    where = dict(zip(lags, xs))
    for i, (method, color) in enumerate(colors.items()):
        part = stats[stats["method"] == method]
        if part.empty:
            continue
        # A small offset per method keeps overlapping error bars apart.
        offset = 0.0 if numeric else (i - (len(colors) - 1) / 2) * 0.08
        x = np.array([where[lag] for lag in part["lag"]]) + offset
        err = np.vstack([part["mean"] - part["min"], part["max"] - part["mean"]])
        ax.errorbar(x, part["mean"], yerr=err, color=color, marker="o", capsize=4, label=method)
    if not numeric:
        ax.set_xticks(xs, list(lags))
    ax.set_xlabel("lag")
    ax.set_ylabel("sampled accuracy after RL")
    ax.set_title("final held-out accuracy (mean, min..max over seeds)")
    ax.grid(alpha=0.3)
    _legend([ax])
    _save(plt, fig, path)
    return True


def plot_bins(values: pd.DataFrame, path: Path, bins: Sequence[str], lags: Sequence[str],
              colors: Mapping[str, Any], ylabel: str, title: str, kind: str = "line", logy: bool = False) -> bool:
    """A per-entropy-bin value per method (x: the bins in order), one panel per lag.
    `values` has columns method, lag, bin, value; kind "line" (markers joined) or "bar"."""
    values = values.dropna(subset=["value"])
    if values.empty:
        return False
    plt = _pyplot()
    fig, axes = _panels(plt, len(lags))
    x = np.arange(len(bins), dtype=float)
    width = 0.8 / max(len(colors), 1)
    for ax, lag in zip(axes, lags):
        for i, (method, color) in enumerate(colors.items()):
            part = values[(values["method"] == method) & (values["lag"] == lag)].set_index("bin")["value"]
            y = np.array([part.get(b, math.nan) for b in bins], dtype=float)
            if np.isnan(y).all():
                continue
            if kind == "bar":
                ax.bar(x + (i - (len(colors) - 1) / 2) * width, y, width, color=color, label=method)
            else:
                ax.plot(x, y, marker="o", color=color, label=method)
        ax.set_xticks(x, list(bins), rotation=30, fontsize="small")
        ax.set_xlabel("token entropy bin (nats)")
        ax.set_title(f"{title} (lag {lag})")
        ax.grid(alpha=0.3)
        positive = values["value"] > 0
        if logy and positive.all():
            ax.set_yscale("log")
    axes[0].set_ylabel(ylabel)
    _legend(axes)
    _save(plt, fig, path)
    return True


def plot_diagnostics(frame: pd.DataFrame, path: Path, panels: Sequence[tuple[str, str]], lags: Sequence[str],
                     colors: Mapping[str, Any]) -> list[str]:
    """A 2x2 grid of per-step curves (key, title), colour per method, linestyle per lag,
    mean over seeds. Returns the keys that had no data (all of them: nothing written)."""
    missing = [key for key, _ in panels if key not in frame or frame[key].notna().sum() == 0]
    if len(missing) == len(panels):
        return missing
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(_PANEL_W * 2, _PANEL_H * 2), squeeze=False)
    for ax, (key, title) in zip(axes.ravel(), panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key in missing:
            ax.text(0.5, 0.5, f"no {key} in metrics", ha="center", va="center", transform=ax.transAxes)
            continue
        stats = _seed_stats(frame, "step", key)
        for method, color in colors.items():
            for j, lag in enumerate(lags):
                part = stats[(stats[METHOD] == method) & (stats[LAG] == lag)]
                if not part.empty:
                    ax.plot(part["x"], part["mean"], _LINESTYLES[j % len(_LINESTYLES)], color=color,
                            label=f"{method}, lag {lag}")
    _legend([ax for row in axes for ax in row], "x-small")
    _save(plt, fig, path)
    return missing


def plot_fits(frame: pd.DataFrame, fits: Mapping[tuple[str, str], Any], path: Path, lags: Sequence[str],
              colors: Mapping[str, Any]) -> bool:
    """Reward against cumulative tokens (log x), one panel per lag: every seed's points and
    the fitted ScaleRL curve of each (method, lag) whose fit succeeded (dashed)."""
    if "tokens_cum" not in frame or "reward/mean" not in frame:
        return False
    data = frame.dropna(subset=["tokens_cum", "reward/mean"])
    data = data[data["tokens_cum"] > 0]
    if data.empty:
        return False
    plt = _pyplot()
    fig, axes = _panels(plt, len(lags))
    for ax, lag in zip(axes, lags):
        for method, color in colors.items():
            part = data[(data[METHOD] == method) & (data[LAG] == lag)]
            if part.empty:
                continue
            ax.scatter(part["tokens_cum"], part["reward/mean"], s=6, color=color, alpha=0.35)
            fit = fits.get((method, lag))
            label = method
            if fit is not None and fit.ok:
                c = np.geomspace(part["tokens_cum"].min(), part["tokens_cum"].max() * 3, 200)
                ax.plot(c, fit(c), "--", color=color)
                ax.axhline(fit.A, color=color, linewidth=0.6, alpha=0.5)
                label = f"{method} (A={fit.A:.3g}, B={fit.B:.3g})"
            ax.plot([], [], color=color, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("compute: cumulative rollout tokens")
        ax.set_title(f"ScaleRL fit (lag {lag})")
        ax.grid(alpha=0.3, which="both")
        _legend([ax], "x-small")
    axes[0].set_ylabel("reward/mean")
    _save(plt, fig, path)
    return True


# --- entropy-bin data ------------------------------------------------------------------------


def _lower_edge(label: str) -> float:
    """Lower edge of a bin label "lo-hi" ("1e-05-0.0001" too: split at a '-' with numbers on both sides)."""
    for i, ch in enumerate(label):
        if ch == "-" and i:
            try:
                float(label[i + 1:])
                return float(label[:i])
            except ValueError:
                continue
    return math.inf


def entropy_bins(columns: Sequence[str]) -> list[str]:
    """The entropy-bin labels of "entropy_bin/<label>/<field>" columns, by lower edge."""
    labels = {c.split("/")[1] for c in columns if c.startswith("entropy_bin/") and c.count("/") >= 2}
    return sorted(labels, key=lambda s: (_lower_edge(s), s))


def bin_profile(frame: pd.DataFrame, bins: Sequence[str], what: str, final_half: bool = False) -> pd.DataFrame:
    """Per (method, lag, bin): the mean over seeds of each cell's entropy_bin/<bin>/<what>
    averaged over its steps weighted by the bin's token count (unweighted without counts);
    final_half keeps each cell's second half of steps. Columns method, lag, bin, value."""
    records = []
    for (method, lag, _), part in frame.sort_values("step").groupby([METHOD, LAG, "cell"], sort=True):
        if final_half:
            part = part.iloc[len(part) // 2:]
        for b in bins:
            key, count = f"entropy_bin/{b}/{what}", f"entropy_bin/{b}/count"
            if key not in part:
                continue
            v = part[key].to_numpy(float)
            w = part[count].to_numpy(float) if count in part else np.ones_like(v)
            ok = np.isfinite(v) & np.isfinite(w) & (w > 0)
            if ok.any():
                records.append({"method": method, "lag": lag, "bin": b,
                                "value": float((v[ok] * w[ok]).sum() / w[ok].sum())})
    if not records:
        return pd.DataFrame(columns=["method", "lag", "bin", "value"])
    return pd.DataFrame.from_records(records).groupby(["method", "lag", "bin"], as_index=False)["value"].mean()


# --- per-group aggregates ---------------------------------------------------------------------


def lag_order(labels: Sequence[str]) -> list[str]:
    """The distinct lag labels, numbers first in numeric order, then the others by name."""
    def key(label: str) -> tuple[int, float, str]:
        try:
            return (0, float(label), label)
        except ValueError:
            return (1, 0.0, label)

    return sorted(set(labels), key=key)


def accuracy_stats(cells: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per (method, lag) of a per-cell frame: mean, min, max and count n of `column` over
    the cells (seeds) where it is not NaN; rows in method, then lag order."""
    data = cells.dropna(subset=[column])
    if data.empty:
        return pd.DataFrame(columns=["method", "lag", "mean", "min", "max", "n"])
    stats = data.groupby([METHOD, LAG])[column].agg(["mean", "min", "max", "count"]).reset_index()
    stats = stats.rename(columns={METHOD: "method", LAG: "lag", "count": "n"})
    rank = {lag: i for i, lag in enumerate(lag_order(stats["lag"]))}
    return stats.sort_values(["method", "lag"], key=lambda s: s.map(rank) if s.name == "lag" else s,
                             ignore_index=True)


def final_accuracy_table(stats: pd.DataFrame) -> pd.DataFrame:
    """accuracy_stats as rows method x columns lag, each "mean [min, max] (n seeds)"."""
    if stats.empty:
        return pd.DataFrame()
    text = stats.assign(cell=[f"{r['mean']:.3f} [{r['min']:.3f}, {r['max']:.3f}] "
                              f"({int(r['n'])} seed{'s' if r['n'] != 1 else ''})" for _, r in stats.iterrows()])
    table = text.pivot(index="method", columns="lag", values="cell")
    table = table[[lag for lag in lag_order(stats["lag"]) if lag in table.columns]].fillna("")
    table = table.loc[lag_order(list(table.index))]  # methods too: numbers (a tau axis) in numeric order
    table.columns.name = None
    return table.reset_index()


def _cell_text(value: Any, floatfmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (float, np.floating)):
        return format(float(value), floatfmt)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame, floatfmt: str = ".4g") -> str:
    """A GitHub-flavoured markdown table of a frame (no index; NaN -> empty)."""
    if frame.empty:
        return "_(empty)_"
    header = [_cell_text(str(c), floatfmt) for c in frame.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_cell_text(v, floatfmt) for v in row) + " |")
    return "\n".join(lines)


# --- all figures of report.md -----------------------------------------------------------------

_DIAGNOSTICS = (("mismatch/k3", "k3 (mismatch)"), ("is/ess", "importance-sampling ESS"),
                ("optim/grad_norm", "grad norm"), ("policy/entropy_mean", "policy entropy"))


def draw_figures(results: pd.DataFrame, cells: pd.DataFrame, accuracy: pd.DataFrame,
                 fits: Mapping[tuple[str, str], Any], out: Path, lags: Sequence[str],
                 methods: Sequence[str]) -> tuple[dict[str, str | None], list[str]]:
    """Every figure of report.md into `out` from the grouped results and cells frames, the
    accuracy_stats of the final accuracy and the ScaleRL fits. Returns ({file name: None
    when drawn, else why not}, notes on figures drawn with parts missing)."""
    colors = method_colors(methods)
    bins = entropy_bins(list(results.columns))
    reward = "reward/mean"
    drawn: dict[str, str | None] = {}

    def draw(name: str, ok: bool, why: str) -> None:
        drawn[name] = None if ok else why

    draw("reward_vs_step.png", plot_curves(results, "step", reward, out / "reward_vs_step.png", lags, colors,
                                           "step", reward, "reward"), f"no {reward} in any metrics row")
    draw("reward_vs_wall.png", plot_curves(results, "wall_s", reward, out / "reward_vs_wall.png", lags, colors,
                                           "wall-clock (s)", reward, "reward"),
         f"no {reward} with timing/step_s in the metrics")
    draw("heldout_accuracy.png", plot_heldout(results, cells, out / "heldout_accuracy.png", lags, colors),
         "no eval/* metrics and no eval.json")
    draw("final_accuracy_vs_lag.png", plot_final_accuracy(accuracy, out / "final_accuracy_vs_lag.png", lags, colors),
         "no eval.json with an after_rl sampled accuracy")
    draw("mask_fraction.png", plot_curves(results, "step", "mask/fraction", out / "mask_fraction.png", lags, colors,
                                          "step", "mask/fraction", "masked token fraction"),
         "no mask/fraction in the metrics (no method masks tokens)")
    draw("mask_by_entropy_bin.png",
         plot_bins(bin_profile(results, bins, "mask_fraction", final_half=True), out / "mask_by_entropy_bin.png",
                   bins, lags, colors, "mask fraction (final half)", "mask fraction by entropy", kind="bar"),
         "no entropy_bin/*/mask_fraction in the metrics")
    draw("delta_by_entropy_bin.png",
         plot_bins(bin_profile(results, bins, "mean_abs_delta"), out / "delta_by_entropy_bin.png", bins, lags,
                   colors, "mean |delta|", "mean |delta| by entropy", logy=True),
         "no entropy_bin/*/mean_abs_delta in the metrics")
    missing = plot_diagnostics(results, out / "diagnostics.png", _DIAGNOSTICS, lags, colors)
    draw("diagnostics.png", len(missing) < len(_DIAGNOSTICS),
         "none of " + ", ".join(k for k, _ in _DIAGNOSTICS) + " in the metrics")
    draw("sigmoid_fits.png", plot_fits(results, fits, out / "sigmoid_fits.png", lags, colors),
         "no reward/mean with rollout/tokens in the metrics")
    partial = 0 < len(missing) < len(_DIAGNOSTICS)
    return drawn, [f"diagnostics.png panels without data: {', '.join(missing)}"] if partial else []
