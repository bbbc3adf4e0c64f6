"""The report's figures (seaborn on the Agg backend, PNG). One function per figure;
each returns the path it wrote, or None when the results cannot show it
(e.g. a single k, or no per-prompt rows). A draft keeps its colour in every figure.

A line, point or row is one *series*: a draft on one target under one set of
run conditions (analysis.names.names: the label, followed by the target and
the conditions where the cells have more than one), so cells of two targets
or two devices are never averaged into one line.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from analysis.batch import batch_frame  # noqa: E402
from analysis.names import names  # noqa: E402
from harness.core.metrics import expected_tokens_per_cycle  # noqa: E402

DPI = 110
STYLES = ["-", "--", ":", "-."]  # one per sampling setting where a panel mixes them


def make_figures(
    cells: pd.DataFrame, prompts: pd.DataFrame, fits: pd.DataFrame, curves: pd.DataFrame, out_dir: Path
) -> dict[str, Path]:
    """Write every figure into out_dir; {name: path} of those written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.9)
    series = names(cells)[["target", "setup", "label", "name"]].rename(columns={"name": "series"})
    cells, prompts, fits, curves = (_with_series(frame, series) for frame in (cells, prompts, fits, curves))
    palette = dict(zip(sorted(cells["series"].unique()), sns.color_palette("tab10", cells["series"].nunique())))
    made = {
        "speedup_vs_k": speedup_vs_k(cells, curves, palette, out_dir / "speedup_vs_k.png"),
        "acceptance_by_sampling": acceptance_by_sampling(fits, out_dir / "acceptance_by_sampling.png"),
        "acceptance_by_category": acceptance_by_category(prompts, out_dir / "acceptance_by_category.png"),
        "position_acceptance": position_acceptance(cells, fits, palette, out_dir / "position_acceptance.png"),
        "tokens_per_cycle": tokens_per_cycle(cells, fits, palette, out_dir / "tokens_per_cycle.png"),
        "measured_vs_predicted": measured_vs_predicted(cells, palette, out_dir / "measured_vs_predicted.png"),
        "speedup_vs_size": speedup_vs_size(cells, palette, out_dir / "speedup_vs_size.png"),
        "fitted_model": fitted_model(cells, fits, curves, palette, out_dir / "fitted_model.png"),
        "speedup_vs_batch_size": speedup_vs_batch_size(cells, out_dir / "speedup_vs_batch_size.png"),
    }
    return {name: path for name, path in made.items() if path is not None}


def _with_series(frame: pd.DataFrame, series: pd.DataFrame) -> pd.DataFrame:
    return frame if frame.empty else frame.merge(series, on=["target", "setup", "label"], how="left")


def save_figure(fig, path: Path) -> Path:
    """Write a figure as PNG and close it; its path."""
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _panels(n: int, width: float = 4.6, height: float = 3.6):
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False, sharey=True)
    return fig, axes[0]


def _legend_outside(fig, axes) -> None:
    handles, labels = {}, []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
        if ax.get_legend():
            ax.get_legend().remove()
    fig.tight_layout()
    if handles:
        fig.legend([handles[lab] for lab in labels], labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)


def speedup_vs_k(cells: pd.DataFrame, curves: pd.DataFrame, palette: dict, path: Path) -> Path:
    """Measured speedup against k per draft (95% bands), the fit dashed, one panel per sampling setting."""
    samplings = sorted(cells["sampling"].unique())
    fig, axes = _panels(len(samplings))
    many_datasets = cells["dataset"].nunique() > 1
    for ax, sampling in zip(axes, samplings):
        here = cells[cells["sampling"] == sampling]
        for (series, dataset), g in here.groupby(["series", "dataset"]):
            g = g.sort_values("k")
            name = f"{series} · {dataset}" if many_datasets else series
            sns.lineplot(data=g, x="k", y="speedup", marker="o", color=palette[series], label=name, ax=ax)
            ax.fill_between(g["k"], g["speedup_ci_low"], g["speedup_ci_high"], color=palette[series], alpha=0.2, linewidth=0)
            fitted = curves[
                (curves["series"] == series)
                & (curves["dataset"] == dataset)
                & (curves["sampling"] == sampling)
                & (curves["k"] <= g["k"].max())
            ]
            ax.plot(fitted["k"], fitted["predicted"], "--", color=palette[series], linewidth=1, alpha=0.8)
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set(title=sampling, xlabel="k (drafted tokens per cycle)", ylabel="speedup (×)")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    _legend_outside(fig, axes)
    fig.suptitle("Speedup against k (bands: 95% paired bootstrap; dashed: fitted model)", y=1.02)
    return save_figure(fig, path)


def speedup_vs_batch_size(cells: pd.DataFrame, path: Path) -> Path | None:
    """Measured speedup against batch size per draft (colour) and k (marker), one panel per curve group
    (target, sampling, other run conditions); bars: each cell's interval. None without two batch sizes."""
    frame = batch_frame(cells)
    if frame.empty or frame.groupby(["target", "sampling", "other_setup", "label"])["batch_size"].nunique().max() < 2:
        return None
    groups = list(frame.groupby(["target", "sampling", "other_setup"], sort=True))
    fig, axes = _panels(len(groups))
    labels = sorted(frame["label"].unique())
    palette = dict(zip(labels, sns.color_palette("tab10", len(labels))))
    for ax, ((target, sampling, _), g) in zip(axes, groups):
        g = g.assign(draft=g["label"], k=g["k"].astype(str))
        sns.lineplot(data=g, x="batch_size", y="speedup", hue="draft", style="k", markers=True, palette=palette, ax=ax)
        for row in g.itertuples():
            ax.plot([row.batch_size] * 2, [row.speedup_ci_low, row.speedup_ci_high], color=palette[row.label], linewidth=1)
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(g["batch_size"].unique()), labels=[str(b) for b in sorted(g["batch_size"].unique())])
        ax.set(title=f"{target} · {sampling}", xlabel="batch size", ylabel="speedup (× throughput)")
    _legend_outside(fig, axes)
    fig.suptitle("Speedup against batch size (bars: 95% bootstrap over batches)", y=1.02)
    return save_figure(fig, path)


def acceptance_by_sampling(fits: pd.DataFrame, path: Path) -> Path | None:
    """Heatmap of fitted alpha, draft (x dataset) by sampling setting."""
    if fits.empty:
        return None
    rows = fits["series"] + (" · " + fits["dataset"] if fits["dataset"].nunique() > 1 else "")
    grid = fits.assign(row=rows).pivot_table(index="row", columns="sampling", values="alpha")
    return _heatmap(grid, "α (accepted / tested positions), pooled over k", "sampling", path)


def acceptance_by_category(prompts: pd.DataFrame, path: Path) -> Path | None:
    """Heatmap of alpha per draft (x sampling) and prompt category, pooled over k and datasets."""
    if prompts.empty:
        return None
    many = prompts["sampling"].nunique() > 1
    rows = prompts["series"] + (" · " + prompts["sampling"] if many else "")
    sums = prompts.assign(row=rows).groupby(["row", "category"])[["spec_accepted", "spec_tested"]].sum()
    grid = (sums["spec_accepted"] / sums["spec_tested"]).unstack("category")
    return _heatmap(grid, "α by prompt category, pooled over k", "category", path)


def _heatmap(grid: pd.DataFrame, title: str, xlabel: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * grid.shape[1], 1.0 + 0.55 * grid.shape[0]))
    sns.heatmap(grid, annot=True, fmt=".2f", vmin=0, vmax=1, cmap="viridis", linewidths=0.5, cbar_kws={"label": "α"}, ax=ax)
    ax.set(title=title, xlabel=xlabel, ylabel="")
    ax.tick_params(axis="x", rotation=30)
    return save_figure(fig, path)


def position_acceptance(cells: pd.DataFrame, fits: pd.DataFrame, palette: dict, path: Path) -> Path:
    """P(position i accepted | earlier accepted), pooled over the cells of each draft; dotted: fitted alpha."""
    samplings = sorted(cells["sampling"].unique())
    fig, axes = _panels(len(samplings))
    for ax, sampling in zip(axes, samplings):
        for series, g in cells[cells["sampling"] == sampling].groupby("series"):
            reached = _sum_ragged(g["position_reached"])
            kept = _sum_ragged(g["position_accepted"])
            rate = np.divide(kept, reached, out=np.full(len(reached), np.nan), where=reached > 0)
            frame = pd.DataFrame({"position": np.arange(1, len(rate) + 1), "acceptance": rate})
            sns.lineplot(data=frame, x="position", y="acceptance", marker="o", color=palette[series], label=series, ax=ax)
            alpha = fits[(fits["series"] == series) & (fits["sampling"] == sampling)]["alpha"]
            if len(alpha):
                ax.axhline(alpha.mean(), color=palette[series], linestyle=":", linewidth=1)
        ax.set(title=sampling, xlabel="drafted position", ylabel="P(accepted | earlier accepted)", ylim=(0, 1.05))
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    _legend_outside(fig, axes)
    fig.suptitle("Per-position acceptance (dotted: pooled α; flat means i.i.d. acceptance holds)", y=1.02)
    return save_figure(fig, path)


def _sum_ragged(lists) -> np.ndarray:
    width = max((len(v) for v in lists), default=0)
    total = np.zeros(width)
    for v in lists:
        total[: len(v)] += np.asarray(v, dtype=float)
    return total


def tokens_per_cycle(cells: pd.DataFrame, fits: pd.DataFrame, palette: dict, path: Path) -> Path:
    """Measured tokens per cycle against (1 - α^(k+1)) / (1 - α): per cell, and against k with the fitted α."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    sns.scatterplot(
        data=cells,
        x="theoretical_tokens_per_cycle",
        y="tokens_per_cycle",
        hue="series",
        style="sampling",
        palette=palette,
        s=60,
        ax=left,
    )
    top = float(np.nanmax(cells[["theoretical_tokens_per_cycle", "tokens_per_cycle"]].to_numpy())) * 1.05
    left.plot([1, top], [1, top], color="grey", linestyle="--", linewidth=1)
    left.set(xlabel="theoretical, cell's own α", ylabel="measured tokens per cycle", title="each cell")
    sns.scatterplot(
        data=cells, x="k", y="tokens_per_cycle", hue="series", style="sampling", palette=palette, s=60, ax=right, legend=False
    )
    ks = np.arange(1, int(cells["k"].max()) + 1)
    style = _styles(fits)
    for _, f in fits.iterrows():
        right.plot(
            ks,
            [expected_tokens_per_cycle(f["alpha"], k) for k in ks],
            color=palette[f["series"]],
            linewidth=1,
            linestyle=style[f["sampling"]],
        )
    right.set(xlabel="k", ylabel="tokens per cycle", title="against k (lines: fitted α)")
    right.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    _legend_outside(fig, [left, right])
    fig.suptitle("Tokens per cycle: measured against (1 − α^(k+1)) / (1 − α)", y=1.02)
    return save_figure(fig, path)


def _styles(frame: pd.DataFrame) -> dict[str, str]:
    return {s: STYLES[i % len(STYLES)] for i, s in enumerate(sorted(frame["sampling"].unique()))}


def measured_vs_predicted(cells: pd.DataFrame, palette: dict, path: Path) -> Path:
    """Each cell's measured decode speedup against its predicted speedup (both after the first token)."""
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    cells = cells.assign(measured=cells["decode_speedup"])
    sns.scatterplot(data=cells, x="predicted_speedup", y="measured", hue="series", style="sampling", palette=palette, s=60, ax=ax)
    values = cells[["predicted_speedup", "measured"]].to_numpy(dtype=float)
    lo, hi = np.nanmin(values) * 0.95, np.nanmax(values) * 1.05
    ax.plot([lo, hi], [lo, hi], color="grey", linestyle="--", linewidth=1, label="measured = predicted")
    ax.axhline(1, color="black", linewidth=0.8)
    ax.set(
        xlabel="predicted speedup (the cycles run, measured c and v)",
        ylabel="measured speedup after the first token",
        title="Measured against predicted speedup",
    )
    _legend_outside(fig, [ax])
    return save_figure(fig, path)


def pareto_front(size: np.ndarray, speedup: np.ndarray) -> np.ndarray:
    """Mask of the points no other point beats on both: no smaller-or-equal size with a higher speedup."""
    front = np.zeros(len(size), dtype=bool)
    best = -np.inf
    for i in np.lexsort((-speedup, size)):  # by size, then by speedup descending
        if speedup[i] > best:
            front[i], best = True, speedup[i]
    return front


def size_points(cells: pd.DataFrame) -> pd.DataFrame:
    """Each draft's best measured k, one row per draft, sampling and dataset: a speedup on one prompt
    set is never set against another's (a draft's best over two datasets would mix them). Cells
    without a speedup (NaN) are no point."""
    measured = cells[np.isfinite(cells["speedup"].astype(float))]
    return measured.loc[measured.groupby(["series", "sampling", "dataset"])["speedup"].idxmax()].copy()


def speedup_vs_size(cells: pd.DataFrame, palette: dict, path: Path) -> Path:
    """Each draft at its best measured k, against parameters and weight memory; Pareto front marked
    per context and dataset."""
    best = size_points(cells)
    if best.empty:
        return None
    several = best["dataset"].nunique() > 1
    best["memory_mb"] = best["draft_bytes"] / 2**20
    known = best[best["draft_params"].notna()]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, column, xlabel in (
        (axes[0], "draft_params", "draft parameters"),
        (axes[1], "memory_mb", "draft weight memory (MiB)"),
    ):
        if known.empty:
            ax.text(0.5, 0.5, "draft sizes unknown", ha="center", va="center", transform=ax.transAxes)
            continue
        for series, g in known.groupby("series"):
            ax.errorbar(
                g[column],
                g["speedup"],
                yerr=[g["speedup"] - g["speedup_ci_low"], g["speedup_ci_high"] - g["speedup"]],
                fmt="none",
                ecolor=palette[series],
                alpha=0.5,
            )
        sns.scatterplot(data=known, x=column, y="speedup", hue="series", style="sampling", palette=palette, s=70, ax=ax, zorder=3)
        for i, (_, g) in enumerate(
            known.groupby(["target", "setup", "sampling", "dataset"])
        ):  # one front per context and prompt set
            mask = pareto_front(g[column].to_numpy(dtype=float), g["speedup"].to_numpy(dtype=float))
            front = g[mask].sort_values(column)
            ax.step(front[column], front["speedup"], where="post", color="black", linewidth=1, alpha=0.6)
            ax.scatter(
                front[column],
                front["speedup"],
                s=160,
                facecolors="none",
                edgecolors="black",
                linewidths=1.2,
                zorder=4,
                label="Pareto front" if i == 0 else None,
            )
        for _, r in known.iterrows():
            ax.annotate(
                f"k={r['k']}" + (f", {r['dataset']}" if several else ""),
                (r[column], r["speedup"]),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=7,
            )
        _size_axis(ax, known[column].to_numpy(dtype=float), column == "draft_params")
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set(xlabel=xlabel + " (0: prompt lookup)", ylabel="speedup at best k")
    _legend_outside(fig, list(axes))
    unknown = sorted(set(best["series"]) - set(known["series"]))
    note = f" (size unknown, not shown: {', '.join(unknown)})" if unknown else ""
    fig.suptitle(f"Speedup against draft size; ringed: Pareto front{note}", y=1.02)
    return save_figure(fig, path)


def _size_axis(ax, values: np.ndarray, count: bool) -> None:
    """Symmetric log: linear from 0 (prompt lookup) to the smallest draft, logarithmic above."""
    positive = values[values > 0]
    top = positive.max() if positive.size else 1.0
    ax.set_xscale("symlog", linthresh=positive.min() / 2 if positive.size else 1.0, linscale=0.5)
    ax.set_xlim(-0.05 * top if not positive.size else -positive.min() / 4, top * 3)

    def fmt(x, _pos):
        if count:
            for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
                if abs(x) >= size:
                    return f"{x / size:g}{unit}"
        return f"{x:g}"

    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(fmt))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def fitted_model(cells: pd.DataFrame, fits: pd.DataFrame, curves: pd.DataFrame, palette: dict, path: Path) -> Path | None:
    """Predicted speedup for k = 1..max_k (band: α's interval) with the measured points; the verify-cost fit."""
    if fits.empty:
        return None
    max_k = int(curves["k"].max())  # the fit's range (--max-k)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    many = fits[["dataset", "sampling"]].drop_duplicates().shape[0] > 1
    style = _styles(fits)
    for _, f in fits.iterrows():
        key = (curves["series"] == f["series"]) & (curves["dataset"] == f["dataset"]) & (curves["sampling"] == f["sampling"])
        c = curves[key]
        color = palette[f["series"]]
        name = f"{f['series']} · {f['dataset']} · {f['sampling']}" if many else f["series"]
        left.plot(c["k"], c["predicted"], color=color, linestyle=style[f["sampling"]], label=name)
        left.fill_between(c["k"], c["low"], c["high"], color=color, alpha=0.2, linewidth=0)
        left.scatter([f["best_k"]], [f["predicted_best"]], marker="*", s=120, color=color, zorder=3)
        measured = cells[
            (cells["series"] == f["series"]) & (cells["dataset"] == f["dataset"]) & (cells["sampling"] == f["sampling"])
        ]
        left.scatter(measured["k"], measured["decode_speedup"], color=color, edgecolors="black", zorder=3)
        ns = np.arange(1, max_k + 2)  # v(k + 1) for k = 1..max_k
        right.plot(ns, 1 + f["verify_slope"] * (ns - 1), color=color, linewidth=1, linestyle=style[f["sampling"]])
    for series, g in cells.groupby("series"):
        points = pd.DataFrame([(n + 1, v) for costs in g["verify_costs"] for n, v in enumerate(costs)], columns=["n", "v"])
        sns.scatterplot(data=points, x="n", y="v", color=palette[series], ax=right, s=30)
    left.axhline(1, color="black", linewidth=0.8)
    left.set(xlabel="k", ylabel="predicted speedup (×)", title=f"Fitted S(k), k ≤ {max_k} (★ best k, ● measured)")
    right.set(
        xlabel="n positions scored in one pass",
        ylabel="v(n) = T(n) / T(1)",
        title="Verify cost: measured (dots), fitted 1 + b(n − 1)",
    )
    for ax in (left, right):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    _legend_outside(fig, [left, right])
    return save_figure(fig, path)


def predicted_at_scale(curves: pd.DataFrame, path: Path) -> Path | None:
    """Cost-only cells (analysis.shapes.curves): predicted speedup at the best k against the acceptance rate,
    one line per shape pair and setting. None without such cells."""
    if curves.empty:
        return None
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.9)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    sns.lineplot(data=curves, x="alpha", y="predicted", hue="pair", style="setting", markers=True, ax=ax)
    ax.axhline(1, color="black", linewidth=0.8)
    ax.set(xlabel="acceptance rate α (per drafted position)", ylabel="predicted speedup at the best k (×)")
    _legend_outside(fig, [ax])
    fig.suptitle("Shape pairs: predicted speedup from measured costs", y=1.02)
    return save_figure(fig, path)
