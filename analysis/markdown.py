"""report.md: the decision, what would change it, the fitted model, the what-if, every cell,
the figures and the methods, as markdown (analysis.report writes it)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.batch import statement
from analysis.frames import CELL_CONFIDENCE, Results
from analysis.names import names

CAPTIONS = {
    "speedup_vs_k": "Measured speedup against k for each draft, one panel per sampling setting. Bands: "
    f"{100 * CELL_CONFIDENCE:g}% paired bootstrap interval of each cell (the harness's); dashed: the "
    "fitted model, which prices the decode phase only (the measured speedup includes each "
    "prompt's prefill, so long prompts sit further from it).",
    "acceptance_by_sampling": "α (accepted / tested positions) per draft and sampling setting, pooled over k.",
    "acceptance_by_category": "α per draft and prompt category, pooled over k.",
    "position_acceptance": "P(drafted position i accepted | positions before it accepted), pooled over each draft's "
    "cells. A flat curve at α is the i.i.d. acceptance the formulas assume.",
    "tokens_per_cycle": "Measured tokens per cycle (bonus included) against (1 − α^(k+1)) / (1 − α). Measured sits "
    "slightly below where max_new_tokens or EOS cut a last cycle short.",
    "measured_vs_predicted": "Measured speedup after the first token (TPOT ratio) against the speedup the cost model "
    "predicts for the cycles the cell ran (harness.core.metrics: each cycle priced at the "
    "tokens it drafted, with the cell's own c and v), which prices decode steps only. Below "
    "the diagonal: overhead the model does not count (sampling, bookkeeping, cache rollback).",
    "speedup_vs_size": "Each draft at its best measured k against its size (parameters; weight memory at the run's "
    "dtype), one point per dataset. Ringed: the Pareto front of each dataset (no smaller draft is "
    "faster on it).",
    "speedup_vs_batch_size": "Measured speedup (ratio of throughputs over the same batches) against batch size, per "
    "draft and k; bars: each cell's 95% bootstrap interval over batches.",
    "predicted_at_scale": "Shape pairs (random weights of real architectures, costs only): the speedup their measured "
    "c and v(n) predict at the best k, against the acceptance rate a draft of real weights would have.",
    "fitted_model": "Left: predicted speedup for k = 1..{max_k} from the fitted α (band: α's interval), c and v; ★ best "
    "k, ● measured after the first token. Right: the verify cost v(n) measured (dots) and fitted (lines).",
}


def _f(x: Any, fmt: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, fmt) if fmt else str(x)


def _ci(low: Any, high: Any, fmt: str = ".3f") -> str:
    if low is None or high is None or low != low or high != high:
        return "–"
    return f"[{_f(low, fmt)}, {_f(high, fmt)}]"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _count(x: float) -> str:
    if x != x:
        return "unknown"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.1f}{unit}"
    return f"{x:.0f}"


def markdown(
    results: Results,
    fits: pd.DataFrame,
    decisions: list[dict],
    whatif: pd.DataFrame,
    figures: dict[str, Path],
    cfg: dict,
    batch_scaling: list[dict] | None = None,
    joined: pd.DataFrame | None = None,
) -> str:
    cells = results.cells
    pct = f"{100 * cfg['confidence']:g}%"
    where = names(cells)
    out = [
        "# Which draft to ship",
        "",
        f"Source: `{results.source}` ({'W&B' if results.kind == 'wandb' else 'local results'}): {len(cells)} cells; "
        f"targets {', '.join(sorted(cells['target'].unique()))}; "
        f"drafts {', '.join(sorted(cells['label'].unique()))}; k {', '.join(map(str, sorted(cells['k'].unique())))}; "
        f"{', '.join(sorted(cells['sampling'].unique()))}; datasets {', '.join(sorted(cells['dataset'].unique()))}.  ",
        f"Run conditions: {'; '.join(sorted(cells['setup'].unique()))}.  ",
        f"Generated {dt.datetime.now():%Y-%m-%d %H:%M} by `python -m analysis.report`; intervals are {pct}, "
        f"{cfg['n_resamples']} bootstrap resamples, except each cell's own ({100 * CELL_CONFIDENCE:g}%, the harness's).",
        "",
        "## Decision",
        "",
    ]
    for d in decisions:
        out += _decision_section(d)
    out += _fits_section(_named(fits, where), pct, cfg["max_k"])
    out += _whatif_section(_named(whatif, where), pct, cfg)
    out += _batch_section(batch_scaling)
    out += shapes_section(results.shapes, pd.DataFrame() if joined is None else joined, pct)
    out += _cells_section(_named(cells, where))
    out += ["## Figures", ""]
    for name, path in figures.items():
        caption = CAPTIONS.get(name, "").format(max_k=cfg["max_k"])
        out += [f"### {name.replace('_', ' ').capitalize()}", "", f"![{name}](figures/{path.name})", "", caption, ""]
    out += _sizes_section(cells)
    out += _methods_section(pct)
    if results.notes:
        out += ["## Left out", ""] + [f"- {n}" for n in results.notes] + [""]
    return "\n".join(out)


def _named(frame: pd.DataFrame, where: pd.DataFrame) -> pd.DataFrame:
    """The frame with `where` (its target and run conditions where the report has several, else '')."""
    if frame.empty:
        return frame
    return frame.merge(where[["target", "setup", "label", "where"]], on=["target", "setup", "label"], how="left")


def _where_column(frame: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """(header, cells) of a "target / conditions" column, only when the rows differ in them."""
    if frame.empty or not frame["where"].astype(bool).any():
        return [], [[] for _ in range(len(frame))]
    return ["target / conditions"], [[w] for w in frame["where"]]


def _draft_table(frame: pd.DataFrame, header: list[str], cells: Callable[[Any], list]) -> str:
    """A table of one row a frame row: its target and run conditions (where the rows differ in them), draft,
    dataset and sampling, then the columns `header` names, whose values cells(row) gives."""
    where_header, where_cells = _where_column(frame)
    rows = [[*where, r.label, r.dataset, r.sampling, *cells(r)] for where, r in zip(where_cells, frame.itertuples())]
    return _table([*where_header, "draft", "dataset", "sampling", *header], rows)


def _decision_section(d: dict) -> list[str]:
    mix = d["mix"]
    pct = f"{100 * d['confidence']:g}%"  # the cells' own intervals' level when decided from summaries
    weights = ", ".join(f"{g} {100 * w:.0f}%" for g, w in d["weights"].items()) or "none (cell-level data)"
    out = [
        f"### {d['context']}",
        "",
        f"**{mix['verdict']}**",
        "",
        f"Run conditions: {d['setup']}.",
        "",
        f"Traffic mix (share of generated tokens): {weights}. {d['prompts']} prompts, "
        f"{len(d['candidates'])} candidates (draft × k).",
        "",
    ]
    rows = []
    for scope, choice in [("**mix**", mix), *d["per_category"].items()]:
        b, r, c = choice["best"], choice["runner_up"], choice["comparison"]
        ship = choice["ship"] if choice["k"] is None else f"{choice['ship']} (k={choice['k']})"
        rows.append(
            [
                scope,
                ship,
                f"{b['label']} k={b['k']}",
                _f(b["speedup"]),
                _ci(b["low"], b["high"]),
                f"{r['label']} k={r['k']}" if r else "–",
                _f(c["ratio"]) if c else "–",
                _ci(c["low"], c["high"]) if c else "–",
                _f(c["wilcoxon_p"], ".3g") if c else "–",
            ]
        )
    out += [
        _table(
            [
                "scope",
                "ship",
                "best",
                "speedup ↑",
                f"{pct} CI",
                "runner-up (other draft)",
                "ratio best/runner-up",
                f"{pct} CI",
                "Wilcoxon p",
            ],
            rows,
        ),
        "",
    ]
    if mix["what_would_change"]:
        out += ["What would change it:", ""] + [f"- {line}" for line in mix["what_would_change"]] + [""]
    if d.get("draft_length"):  # each draft's best policy against its best constant k
        header = ["draft", "scope", "ship", "policy (k cap)", "constant k", "ratio policy/constant", f"{pct} CI"]
        cells = [
            (e["draft"], e["scope"], e["ship"], f"{e['policy']} ({e['policy_k']})", e["constant_k"]) for e in d["draft_length"]
        ]
        rows = [[*c, _f(e["ratio"]), _ci(e["low"], e["high"])] for c, e in zip(cells, d["draft_length"])]
        out += ["Draft length: each draft's best policy against its best constant k (paired ratio of speedups):", ""]
        out += [_table(header, rows), ""]
    for equal, title in [(False, "each draft's best tree against its best chain"), (True, "at equal verify width")]:
        trees = [e for e in d.get("trees", []) if (e.get("width") is not None) == equal]  # width: positions a pass scores
        pick = "pick at this width" if equal else "ship"
        header = ["draft", "scope", pick, "tree (k)", "chain k"] + ["width"] * equal + ["ratio tree/chain", f"{pct} CI"]
        cells = [
            [e["draft"], e["scope"], e["ship"], f"{e['tree']} ({e['tree_k']})", e["chain_k"]] + [e.get("width")] * equal
            for e in trees
        ]
        rows = [[*c, _f(e["ratio"]), _ci(e["low"], e["high"])] for c, e in zip(cells, trees)]
        out += [f"Token trees, {title} (paired ratio of speedups):", "", _table(header, rows), ""] if trees else []
    categories = list(d["categories"])
    rows = [
        [c["label"], c["k"], _f(c["speedup"]), _ci(c["low"], c["high"]), *[_f(c["categories"][g]["speedup"]) for g in categories]]
        for c in d["candidates"]
    ]
    out += [
        "Every candidate (mix speedup, then per category):",
        "",
        _table(["draft", "k", "mix ↑", f"{pct} CI", *[f"{g} ↑" for g in categories]], rows),
        "",
    ]
    if d["notes"]:
        out += ["Notes:", ""] + [f"- {n}" for n in d["notes"]] + [""]
    return out


def _fits_section(fits: pd.DataFrame, pct: str, max_k: int) -> list[str]:
    def cells(f) -> list:
        return [
            f.ks,
            _f(f.alpha),
            _ci(f.alpha_low, f.alpha_high),
            _f(f.cost_ratio, ".4f"),
            _f(f.verify_slope, ".4f"),
            f.verify_max_n,
            f.best_k,
            _f(f.predicted_best),
            _ci(f.predicted_best_low, f.predicted_best_high),
            f"{_f(f.measured_best_speedup)} (k={f.measured_best_k})",
            _f(f.efficiency, ".2f"),
            _f(f.break_even_cost_ratio) if f.break_even_cost_ratio > 0 or f.alpha != f.alpha else "none",
        ]

    header = [
        "k run",
        "α ↑",
        f"{pct} CI",
        "c ↓",
        "b ↓",
        "v measured to",
        "best k",
        "predicted ↑",
        f"{pct} CI",
        "measured best ↑",
        "efficiency",
        "break-even c",
    ]
    return [
        "## Fitted model",
        "",
        "Per target, run conditions, draft, dataset and sampling setting: α pooled over k with a cluster bootstrap "
        "over prompts; c the median measured cost ratio; v(n) = 1 + b(n − 1), b the median slope of the measured "
        "verify costs (measured up to "
        "n = `v measured to`, extrapolated beyond); the "
        f"predicted speedup S(k) = ((1 − α^(k+1)) / (1 − α)) / (k c + v(k+1)) for k ≤ {max_k}, its interval from α's.",
        "",
        _draft_table(fits, header, cells),
        "",
        "`measured best`: the whole-run speedup (prefill included) of the best k run. `efficiency`: measured "
        "speedup after the first token (TPOT ratio) / predicted speedup, median over cells. `break-even c`: the largest cost ratio at "
        f"which some k ≤ {max_k} still predicts a speedup above 1 at this α (none: not even a free draft).",
        "",
    ]


def _whatif_section(whatif: pd.DataFrame, pct: str, cfg: dict) -> list[str]:
    out = ["## What-if: other hardware", ""]
    if whatif.empty:
        return out + [
            "α does not depend on the hardware; c and v do. Give another machine's costs to predict the best k and "
            "speedup there: `--cost-ratio 0.05` (every model draft) or `--cost-ratio DRAFT=0.05`, or step times "
            "`--target-step-ms 25 --draft-step-ms 3`, optionally `--verify-slope 0.01` (or `whatif:` in "
            "conf/report.yaml).",
            "",
        ]
    name = whatif["machine"].iloc[0]

    def cells(w) -> list:
        return [
            _f(w.alpha),
            _f(w.cost_ratio, ".4f"),
            w.cost_source,
            _f(w.verify_slope, ".4f"),
            w.best_k,
            _f(w.predicted),
            _ci(w.predicted_low, w.predicted_high),
            f"{_f(w.here_predicted)} (k={w.here_best_k})",
        ]

    header = ["α", "c there", "c from", "b there", "best k there", "predicted there ↑", f"{pct} CI", "predicted here (best k)"]
    out += [
        f"Predicted on **{name}** with this sweep's α and the costs given:",
        "",
        _draft_table(whatif, header, cells),
        "",
    ]
    if "pays_up_to_batch" in whatif:
        crossing = whatif[whatif["pays_up_to_batch"].notna() | whatif["ridge_rows"].notna()]

        def batch(value) -> str:
            return "never" if value != value or value is None else f"{int(value)}"

        def crossover_cells(w) -> list:
            return [
                _f(w.alpha),
                batch(w.pays_up_to_batch),
                f"[{batch(w.pays_up_to_batch_low)}, {batch(w.pays_up_to_batch_high)}]",
            ]

        out += [
            f"Up to which batch size each draft pays on **{name}** (ridge at {_f(crossing['ridge_rows'].iloc[0], '.0f')} rows "
            "per pass; fits measured at batch size 1):",
            "",
            _draft_table(crossing, ["α", "pays up to batch size", f"over α's {pct} interval"], crossover_cells),
            "",
            "A pass of r rows × n positions is priced max(1 + b (n − 1), r n / ridge) one-row steps: memory-bound "
            "(flat but for the measured slope b) up to the ridge, compute-bound beyond it. Sizes tried: 1, 2, 4, …, 1024.",
            "",
        ]
    return out


def _batch_section(scaling: list[dict] | None) -> list[str]:
    """Up to which batch size each draft pays (analysis.batch), with its best k and speedup at every size."""
    if not scaling:
        return []
    out = ["## Batch size", ""]
    for entry in scaling:
        where = f"{entry['target']} · {entry['sampling']} · {entry['other_setup']}"
        out.append(f"- {statement(entry)} ({where}).")
    rows = [
        [e["label"], str(p["batch_size"]), str(p["k"]), _f(p["speedup"]), _ci(*p["ci"]), "yes" if p["pays"] else "no"]
        for e in scaling
        for p in e["best"]
    ]
    out += [
        "",
        _table(["draft", "batch size", "best k", "speedup ↑", f"{100 * CELL_CONFIDENCE:g}% CI", "pays"], rows),
        "",
        "Speedup at a batch size: the ratio of throughputs (tokens per second over the batch) of the speculative "
        "run and the baseline on the same batches of prompts; its interval bootstraps batches. A draft pays "
        "where the interval lies wholly above 1.",
        "",
    ]
    return out


def _cells_section(cells: pd.DataFrame) -> list[str]:
    """Every cell; its interval is the harness's own (CELL_CONFIDENCE), whatever the report's confidence."""

    def values(c) -> list:
        return [
            c.k,
            int(c.num_prompts) if c.num_prompts == c.num_prompts else "–",
            _f(c.alpha),
            _f(c.tokens_per_cycle, ".2f"),
            _f(c.theoretical_tokens_per_cycle, ".2f"),
            _f(c.speedup),
            _ci(c.speedup_ci_low, c.speedup_ci_high),
            _f(c.predicted_speedup),
            _f(c.efficiency, ".2f"),
            _f(c.cost_ratio, ".4f"),
            _f(c.verify_cost, ".3f"),
        ]

    header = [
        "k",
        "prompts",
        "α ↑",
        "tok/cycle ↑",
        "theory",
        "speedup ↑",
        f"{100 * CELL_CONFIDENCE:g}% CI",
        "predicted",
        "efficiency",
        "c ↓",
        "v(k+1) ↓",
    ]
    return ["## Cells", "", _draft_table(cells, header, values), ""]


def _sizes_section(cells: pd.DataFrame) -> list[str]:
    sizes = cells.drop_duplicates("label")
    rows = [[s.label, s.draft, _count(s.draft_params), _f(s.draft_bytes / 2**20, ".1f")] for s in sizes.itertuples()]
    return [
        "## Draft sizes",
        "",
        _table(["draft", "id", "parameters", "memory MiB"], rows),
        "",
        "The draft's own weights as the run held them in memory (harness.runner.pair.draft_size): weights it "
        "shares with its target are not counted, and prompt lookup has none.",
        "",
    ]


def _methods_section(pct: str) -> list[str]:
    return [
        "## Definitions and methods",
        "",
        "- **Speedup** of a candidate (a draft at one k) on a set of prompts: (spec tokens / spec time) / (baseline "
        "tokens / baseline time), totals over the prompts; each cell times its own baseline back to back.",
        "- **Mix speedup**. With w_g the share of generated tokens in category g and τ_g the seconds per token there, "
        "serving the mix takes Σ_g w_g τ_g per token, so S_mix = Σ_g w_g τ_base,g / Σ_g w_g τ_spec,g: a weighted "
        "harmonic mean of the per-category speedups S_g, each weighted by its share of the baseline's time "
        "(w_g τ_base,g / Σ_h w_h τ_base,h). Weights are normalised over the measured categories.",
        f"- **Intervals** ({pct}): a paired, stratified bootstrap over prompts: every replicate resamples the prompts "
        "of each category with replacement and applies the same resample to every candidate; percentile intervals. "
        "A category with one prompt has no interval. Each cell's own interval (Cells table, figures) is the "
        f"harness's {100 * CELL_CONFIDENCE:g}%.",
        "- **Context**: one decision per target, sampling setting (at temperature 0, greedy, top-k and top-p are "
        "ignored) and run conditions (device, dtype, max_new_tokens, cache, compile). With per-prompt rows, a candidate's "
        "cells are combined prompt by prompt, candidates are paired on the prompts they all ran, and a candidate with fewer "
        "than half the prompts of the lower median candidate is left out (listed in the notes): of two candidates, neither. "
        "From summaries alone, each candidate is one cell on the prompt set most candidates ran, and one with fewer than "
        "half the prompts of the median candidate is left out.",
        "- **Ship rule**: candidates are ranked by point estimate; the best one whose interval's lower bound is above 1 "
        "ships (when a higher one is uncertain, the verdict names it); if none, *ship no speculation*. Choosing the "
        "best of many candidates favours a lucky one, so its interval is slightly optimistic.",
        "- **Best two drafts**: the shipped candidate against the best candidate of another draft: the bootstrap interval "
        "of the ratio of their speedups (significant when it excludes 1) and a Wilcoxon signed-rank test of the "
        "per-prompt log speedup differences (unweighted).",
        "- **α**: accepted / tested positions, a cycle testing positions up to its first rejection, pooled over prompts "
        "and k; interval: cluster bootstrap over prompts (scipy.stats.bootstrap), since positions within a prompt are "
        "correlated. Without per-prompt rows: Wilson, positions taken as independent (too narrow).",
        "- **Cost model** (per target, run conditions, draft, dataset and sampling): c = draft step / target step "
        "(median over cells); v(n) = T(n positions) / T(1) fitted as 1 + b(n − 1) through v(1) = 1, b the median of "
        "the measured points' slopes; S(k) = ((1 − α^(k+1)) / (1 − α)) / (k c + v(k+1)) (Leviathan et al., with the "
        "measured verify cost). The interval of S carries α's uncertainty only.",
        "- **What-if**: α carries over to other hardware, c and v do not; a prompt-lookup draft keeps its measured "
        "lookup time (it runs on the host) when only a target step time is given.",
        "",
    ]


def shapes_section(shapes: pd.DataFrame, joined: pd.DataFrame, pct: str, alphas=(0.5, 0.7, 0.9)) -> list[str]:
    """Cost-only cells: their measured costs and predicted best k, and the fits of real weights joined to them."""
    from analysis.shapes import best, setting

    if shapes.empty:
        return []
    out = [
        "## At real scale: shape pairs (costs only)",
        "",
        "Random weights of real architectures: acceptance means nothing there, the costs are measured. Limit: target "
        "step / (bytes a step reads / the machine's copy bandwidth).",
        "",
        "| pair | measured on | target step ms | limit | draft step ms | c | v(2) | v(n) up to | "
        + " | ".join(f"best k, speedup at α={a:g}" for a in alphas)
        + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(alphas),
    ]
    for _, s in shapes.sort_values(["pair", "device_name", "batch_size", "compile"]).iterrows():
        v = s["verify_costs"]
        picks = [best(a, s["cost_ratio"], v) for a in alphas]
        out.append(
            f"| {s['pair']} | {setting(s)} | {_f(s['target_step_ms'], '.2f')} | {_f(s['limit_ratio'], '.2f')} | "
            f"{_f(s['draft_step_ms'], '.2f')} | {_f(s['cost_ratio'])} | {_f(v[1] if len(v) > 1 else None)} | n={len(v)} | "
            + " | ".join(f"{k}: {_f(p)}" for k, p in picks)
            + " |"
        )
    out.append("")
    if not joined.empty:
        out += [
            "Drafts of real weights with the same shapes as a shape pair: their measured α priced at that pair's costs "
            f"({pct} intervals from α's).",
            "",
            "| draft | dataset | sampling | α | measured on | costs of | best k | predicted speedup |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for _, j in joined.iterrows():
            out.append(
                f"| {j['label']} | {j['dataset']} | {j['sampling']} | {_f(j['alpha'])} [{_f(j['alpha_low'])}, {_f(j['alpha_high'])}] | "
                f"{j['measured_on']} | {j['costs_of']} ({j['costs_on']}) | {j['best_k']} | "
                f"{_f(j['predicted'])} [{_f(j['predicted_low'])}, {_f(j['predicted_high'])}] |"
            )
        out.append("")
    return out


def shapes_only(results: Results, figures: dict[str, Path], pct: str) -> str:
    """report.md of results that hold cost-only cells alone: nothing to decide, their costs and curves."""
    out = [
        "# Costs at real scale",
        "",
        f"Source: `{results.source}`: {len(results.shapes)} cost-only cells and no cell of real weights, so no draft "
        f"to decide on. Generated {dt.datetime.now():%Y-%m-%d %H:%M} by `python -m analysis.report`.",
        "",
    ]
    out += shapes_section(results.shapes, pd.DataFrame(), pct)
    for name, path in figures.items():
        out += [f"![{name}](figures/{path.name})", "", CAPTIONS.get(name, ""), ""]
    return "\n".join(out)
