"""Speedup against batch size: up to which batch size each draft pays.

Cells that differ only in `batch_size` (same target, sampling, other run conditions, draft and k)
draw one curve. At each batch size a draft's best k is the one with the highest measured speedup
(each cell's speedup is the ratio of throughputs over its batches, its interval the harness's
bootstrap over batches). A draft *pays* at a batch size when that best cell's interval lies wholly
above 1; it pays *up to* B when it pays at every measured batch size up to B. Speculation costs
verify passes of B (k + 1) positions, which stop being nearly free as B grows, so past some batch
size it loses: the statement names the first measured size where it no longer pays, with its figure.
"""

from __future__ import annotations

import pandas as pd

from analysis.names import CONDITION_KEYS, describe

GROUP_KEYS = ["target", "sampling", "other_setup", "label"]


def batch_frame(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per cell with `other_setup`: its run conditions but the batch size (the curve it belongs to)."""
    if cells.empty or "batch_size" not in cells:
        return pd.DataFrame()
    others = [key for key in CONDITION_KEYS if key != "batch_size"]
    frame = cells.assign(other_setup=[describe(row, others) for _, row in cells.iterrows()])
    columns = [*GROUP_KEYS, "k", "batch_size", "speedup", "speedup_ci_low", "speedup_ci_high", "cell"]
    return frame[columns].sort_values([*GROUP_KEYS, "batch_size", "k"], kind="stable").reset_index(drop=True)


def pays_up_to(frame: pd.DataFrame) -> list[dict]:
    """Per draft curve over at least two batch sizes: its best k and speedup at each size, and the
    largest batch size up to which it pays (None: it does not pay at the smallest size measured)."""
    out = []
    if frame.empty:
        return out
    for key, group in frame.groupby(GROUP_KEYS, sort=True):
        sizes = sorted(int(b) for b in group["batch_size"].unique())
        if len(sizes) < 2:
            continue
        best = []
        for size in sizes:
            row = group[group["batch_size"] == size].sort_values("speedup", ascending=False).iloc[0]
            best.append(
                {
                    "batch_size": size,
                    "k": int(row["k"]),
                    "speedup": float(row["speedup"]),
                    "ci": [float(row["speedup_ci_low"]), float(row["speedup_ci_high"])],
                    "pays": bool(row["speedup_ci_low"] > 1.0),
                }
            )
        up_to = None
        for point in best:
            if not point["pays"]:
                break
            up_to = point["batch_size"]
        stop = next((p for p in best if not p["pays"]), None)
        out.append({**dict(zip(GROUP_KEYS, key)), "sizes": sizes, "best": best, "pays_up_to": up_to, "first_not_paying": stop})
    return out


def statement(entry: dict) -> str:
    """One line: up to which batch size the draft pays, with the figures that say so."""

    def at(point: dict) -> str:
        low, high = point["ci"]
        return f"batch size {point['batch_size']}, k={point['k']}: {point['speedup']:.3f} [{low:.3f}, {high:.3f}]"

    label, stop = entry["label"], entry["first_not_paying"]
    if entry["pays_up_to"] is None:
        return f"{label} does not pay at any measured batch size from {entry['sizes'][0]} on (best at {at(entry['best'][0])})"
    last = next(p for p in entry["best"] if p["batch_size"] == entry["pays_up_to"])
    if stop is None:
        return f"{label} pays at every measured batch size, up to {entry['pays_up_to']} ({at(last)})"
    return f"{label} pays up to batch size {entry['pays_up_to']} ({at(last)}); not at {at(stop)}"
