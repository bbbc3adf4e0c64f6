"""Cost-only cells (shape pairs: random weights of a real architecture, harness.models.shapes) in the report.

Such a cell measures what a pair of those shapes costs on its machine (target step, c, v(n), the
bandwidth limit) and nothing about acceptance. The report shows its costs and its predicted speedup
against the acceptance rate (`curves`), and joins it to the cells of real weights of the same shapes
(`joined`): their measured alpha, with its interval, priced at the cost-only cell's measured costs. So a
sweep of real 7-8B pairs on one machine and a shape pair timed on another answer what the draft gives there.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.names import device_label
from harness.core.metrics import predicted_speedup

CURVE_ALPHAS = tuple(np.round(np.arange(0.3, 0.951, 0.05), 2))


def shape_row(summary: dict, config: dict, origin: str) -> dict:
    """One cost-only cell: where it ran and what it measured."""
    costs, conditions = summary["costs"], summary["conditions"]
    limit, arch = costs.get("limit") or {}, summary.get("architectures") or {}
    return {
        "cell": summary["cell"],
        "origin": origin,
        "pair": summary["pair"],
        "target": summary["target"],
        "draft": summary["draft"],
        "device_name": device_label(conditions),
        "dtype": str(conditions["dtype"]),
        "compile": str(config.get("compile")),
        "batch_size": int(config.get("batch_size", 1)),
        "target_step_ms": 1e3 * costs["target_step_s"],
        "draft_step_ms": 1e3 * costs["draft_step_s"],
        "cost_ratio": costs["cost_ratio"],
        "verify_costs": list(costs["verify_cost"]),
        "limit_ratio": limit.get("target_limit_ratio"),
        "draft_limit_ratio": limit.get("draft_limit_ratio"),
        "bandwidth_gb_s": limit.get("bandwidth_gb_s"),
        "target_arch": arch.get("target"),
        "draft_arch": arch.get("draft"),
    }


def setting(row) -> str:
    """How a cost-only cell ran, in a few words: its machine, batch size and compile."""
    return f"{row['device_name']}, B={row['batch_size']}" + (", compiled" if row["compile"] == "True" else "")


def best(alpha: float, cost_ratio: float, verify_costs: list[float]) -> tuple[int, float]:
    """(best k, predicted speedup) at acceptance rate `alpha` over the k whose v(k + 1) was measured."""
    ks = range(1, len(verify_costs))
    speedups = [predicted_speedup(alpha, k, cost_ratio, verify_costs[k]) for k in ks]
    i = int(np.argmax(speedups))
    return ks[i], float(speedups[i])


def curves(shapes: pd.DataFrame, alphas=CURVE_ALPHAS) -> pd.DataFrame:
    """One row per cost-only cell and acceptance rate: the best k and its predicted speedup."""
    rows = []
    for _, s in shapes.iterrows():
        for alpha in alphas:
            k, speedup = best(alpha, s["cost_ratio"], s["verify_costs"])
            rows.append(
                {"cell": s["cell"], "pair": s["pair"], "setting": setting(s), "alpha": alpha, "best_k": k, "predicted": speedup}
            )
    return pd.DataFrame(rows)


def joined(fits: pd.DataFrame, shapes: pd.DataFrame) -> pd.DataFrame:
    """Each fit of real weights next to each cost-only cell of the same target and draft shapes: its alpha
    (with interval) priced at that cell's c and v(n), best k chosen at the fitted alpha."""
    rows = []
    if fits.empty or shapes.empty or "target_arch" not in fits:
        return pd.DataFrame(rows)
    for _, f in fits.iterrows():
        same = shapes[(shapes["target_arch"] == f["target_arch"]) & (shapes["draft_arch"] == f["draft_arch"])]
        for _, s in same.iterrows():
            k, speedup = best(f["alpha"], s["cost_ratio"], s["verify_costs"])
            low, high = (
                predicted_speedup(a, k, s["cost_ratio"], s["verify_costs"][k]) for a in (f["alpha_low"], f["alpha_high"])
            )
            rows.append(
                {
                    "label": f["label"],
                    "dataset": f["dataset"],
                    "sampling": f["sampling"],
                    "alpha": f["alpha"],
                    "alpha_low": f["alpha_low"],
                    "alpha_high": f["alpha_high"],
                    "measured_on": f["setup"],
                    "costs_of": s["cell"],
                    "costs_on": setting(s),
                    "cost_ratio": s["cost_ratio"],
                    "best_k": k,
                    "predicted": speedup,
                    "predicted_low": low,
                    "predicted_high": high,
                }
            )
    return pd.DataFrame(rows)
