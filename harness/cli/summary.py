"""The human-readable summary table printed after a run."""

from __future__ import annotations

from typing import Any


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _interval(ci: Any, scale: float = 1.0, spec: str = ".3f") -> str:
    """ "  [low, high] 95% CI" of a measured cost, or nothing where the summary has none."""
    if not ci or any(x is None for x in ci):
        return ""
    return f"  [{fmt(scale * ci[0], spec)}, {fmt(scale * ci[1], spec)}] 95% CI"


def fmt(value: Any, spec: str = ".3f", missing: str = "nan") -> str:
    """A number as a table shows it: formatted by `spec` (str() when empty), "nan" for NaN and
    `missing` for None (the summary's nan, the sweep table's empty cell)."""
    if value is None:
        return missing
    if value != value:  # NaN, of any float type
        return "nan"
    return format(value, spec) if spec else str(value)


def format_summary(s: dict) -> str:
    c = s["conditions"]
    linear = ", linear W @ x.T" if (c.get("linear") or {}).get("product") == "transposed" else ""  # harness.models.cpu_linear
    lean = ", lean forward" if c.get("forward") == "lean" else ""  # harness.models.lean (forward=auto's choice on the CPU)
    lo, hi = s["speedup_ci"]
    glo, ghi = s["speedup_geomean_ci"]
    head = [
        f"pair {s['pair']}: target {s['target']} | draft {s['draft']}",
        f"k={s['k']} temperature={s['temperature']} top_k={s['top_k']} top_p={s['top_p']} "
        f"max_new_tokens={s['max_new_tokens']} dataset={s.get('dataset', '?')} prompts={s['num_prompts']} "
        f"(skipped {s['prompts_skipped']}, truncated {s.get('prompts_truncated', 0)})"
        + (f" batch_size={c['batch']['size']} ({s['batches']} batches)" if c.get("batch") else ""),
        f"{c['device']} ({c['device_name']}), {c['dtype']}, {c['threads']} threads{linear}{lean}, torch {c['torch']}, transformers {c['transformers']}",
        "",
    ]
    if s.get("cost_only"):
        return "\n".join(head + cost_only_lines(s) + ["", f"results: {s['cell_dir']}"])
    lines = head + [
        f"{'metric':<34}{'value':>12}",
        f"{'acceptance rate (accepted/drafted)':<34}{fmt(s['acceptance_rate']):>12}",
        f"{'alpha (accepted/tested)':<34}{fmt(s['alpha']):>12}",
        f"{'expected alpha (mean sum min(p,q))':<34}{fmt(s['expected_alpha']):>12}",
        f"{'tokens per cycle (incl. bonus)':<34}{fmt(s['tokens_per_cycle']):>12}",
        f"{'  theoretical (1-a^(k+1))/(1-a)':<34}{fmt(s['theoretical_tokens_per_cycle']):>12}",
        f"{'accepted drafts per cycle':<34}{fmt(s['accepted_per_cycle']):>12}",
        f"{'speedup (ratio of totals)':<34}{fmt(s['speedup']):>12}  [{fmt(lo)}, {fmt(hi)}] 95% CI",
        f"{'speedup (geomean of ' + ('batches)' if c.get('batch') else 'prompts)'):<34}{fmt(s['speedup_geomean']):>12}  [{fmt(glo)}, {fmt(ghi)}] 95% CI",
        f"{'speedup after the first token':<34}{fmt(s.get('decode_speedup')):>12}  (TPOT ratio)",
        f"{'predicted speedup (cycles run)':<34}{fmt(s['predicted_speedup']):>12}  (formula {fmt(s.get('predicted_speedup_formula'))})",
        f"{'efficiency (decode/predicted)':<34}{fmt(s['efficiency']):>12}  (costs timed in the run: predicted "
        f"{fmt(s.get('predicted_speedup_in_run'))}, c {fmt(s.get('in_run', {}).get('cost_ratio'))}, v(k+1) "
        f"{fmt((s.get('in_run', {}).get('verify_cost') or [float('nan')])[-1])})",
        f"{'  with costs timed apart':<34}{fmt(s.get('efficiency_isolated')):>12}  (predicted {fmt(s['predicted_speedup'])})",
        f"{'cost ratio c (draft/target step)':<34}{fmt(s['cost_ratio']):>12}{_interval(s.get('cost_ratio_ci'))}",
        f"{'verify cost v(k+1) (target steps)':<34}{fmt(s['verify_cost']):>12}{_interval(s.get('verify_cost_ci'))}"
        + (
            f"  MEASUREMENT PROBLEM: v(n) falls at n={', '.join(map(str, s['verify_cost_dips']))}"
            if s.get("verify_cost_dips")
            else ""
        ),
        f"{'target step ms':<34}{fmt(_ms(s.get('target_step_s')), '.2f'):>12}{_interval(s.get('target_step_s_ci'), 1e3, '.2f')}",
        f"{'tokens/s spec / baseline':<34}{fmt(s.get('spec_tokens_per_s'), '.1f'):>12} / {fmt(s.get('base_tokens_per_s'), '.1f')}",
        f"{'TPOT ms spec / baseline':<34}{fmt(1e3 * s['spec_tpot_s'], '.2f'):>12} / {fmt(1e3 * s['base_tpot_s'], '.2f')}",
        f"{'TTFT ms spec / baseline (median)':<34}{fmt(1e3 * s['spec_ttft_s'], '.2f'):>12} / {fmt(1e3 * s['base_ttft_s'], '.2f')}",
        f"{'per-position acceptance':<34}  " + " ".join(fmt(a, ".2f") for a in s["position_acceptance"]),
        f"{'accepted per cycle histogram 0..k':<34}  "
        + " ".join(str(n) for n in s["accept_hist"])
        + (f"  (0 includes {s['cycles_without_draft']} cycles that drafted nothing)" if s.get("cycles_without_draft") else ""),
    ]
    lines += draft_length_lines(s)
    if s.get("max_memory_allocated_mb") is not None:
        lines.append(f"{'peak CUDA memory allocated MB':<34}{fmt(s['max_memory_allocated_mb'], '.0f'):>12}")
    if "peak_rss_mb" in s:
        growth = f"  (growth {fmt(s['rss_growth_mb_per_prompt'], '+.2f')} MB/prompt)" if "rss_growth_mb_per_prompt" in s else ""
        lines.append(f"{'peak RSS MB':<34}{fmt(s['peak_rss_mb'], '.0f'):>12}{growth}")
    if s.get("recompiles_after_warm_up") is not None:  # compile=true
        lines.append(f"{'recompiles after warm-up':<34}{s['recompiles_after_warm_up']:>12}")
    lines += limit_lines(s)
    cats = s.get("categories") or {}
    if cats:
        lines += ["", f"{'category':<16}{'prompts':>8}{'accept':>9}{'tok/cycle':>11}{'speedup':>9}"]
        for name, m in cats.items():
            lines.append(
                f"{name:<16}{m['num_prompts']:>8}{fmt(m['acceptance_rate']):>9}{fmt(m['tokens_per_cycle']):>11}{fmt(m['speedup']):>9}"
            )
    lines += ["", f"results: {s['cell_dir']}"]
    return "\n".join(lines)


def limit_lines(s: dict) -> list[str]:
    """The steps against the memory-bandwidth limit (harness.base.bandwidth), where measured."""
    limit = (s.get("costs") or {}).get("limit")
    if not limit:
        return []
    bandwidth = f"{limit['bandwidth_gb_s']:.1f} GB/s copy, spread {limit['bandwidth_spread']:.2f}, {limit['bandwidth_source']}"
    lines = [
        f"{'target step / bandwidth limit':<34}{fmt(limit['target_limit_ratio'], '.2f'):>12}  "
        f"({limit['target_bytes_per_step'] / 1e6:.0f} MB a step at {bandwidth})"
    ]
    if "draft_limit_ratio" in limit:
        lines.append(
            f"{'draft step / bandwidth limit':<34}{fmt(limit['draft_limit_ratio'], '.2f'):>12}  ({limit['draft_bytes_per_step'] / 1e6:.0f} MB a step)"
        )
    return lines


def cost_only_lines(s: dict) -> list[str]:
    """A cost-only cell (random weights): its measured costs and the speedup they predict per acceptance rate and k."""
    costs, grid = s["costs"], s["predicted_grid"]
    verify = " ".join(f"{n + 1}:{v:.3f}" for n, v in enumerate(costs["verify_cost"]))
    lines = [
        f"COST-ONLY: {s['cost_only']}",
        f"{'target step ms':<34}{fmt(_ms(s.get('target_step_s')), '.2f'):>12}{_interval(s.get('target_step_s_ci'), 1e3, '.2f')}",
        f"{'draft step ms':<34}{fmt(_ms(costs.get('draft_step_s')), '.2f'):>12}{_interval(costs.get('draft_step_s_ci'), 1e3, '.2f')}",
        f"{'cost ratio c (draft/target step)':<34}{fmt(s['cost_ratio']):>12}{_interval(s.get('cost_ratio_ci'))}",
        f"{'verify cost v(n) (target steps)':<34}  {verify}",
        *limit_lines(s),
    ]
    if s.get("peak_rss_mb") is not None:
        lines.append(f"{'peak RSS MB':<34}{fmt(s['peak_rss_mb'], '.0f'):>12}")
    lines += [
        "",
        "predicted speedup by acceptance rate (rows) and k (columns):",
        f"{'alpha':<8}" + "".join(f"{k:>8}" for k in grid["k"]) + "  best k",
    ]
    for alpha, row, best in zip(grid["alpha"], grid["speedup"], grid["best_k"]):
        lines.append(f"{alpha:<8.2f}" + "".join(f"{x:>8.3f}" for x in row) + f"  {best:>6}")
    return lines


def draft_length_lines(s: dict) -> list[str]:
    """A draft-length policy other than constant: what it drafted, and how the draft's confidence matched outcomes."""
    policy = s.get("draft_length") or {}
    if policy.get("policy", "constant") == "constant":
        return []
    settings = ", ".join(f"{key} {fmt(policy[key], '.3f')}" for key in ("threshold",) if policy.get(key) is not None)
    lines = [
        f"{'draft length':<34}  {policy['policy']}{f' ({settings})' if settings else ''}: mean {fmt(s.get('mean_drafted'), '.2f')} "
        f"drafted a cycle, cycles by drafted 0..k: {' '.join(str(n) for n in s.get('drafted_hist', []))}"
    ]
    table = policy.get("calibration") or []
    if table:
        lines.append(
            f"{'confidence: predicted / observed':<34}  "
            + "  ".join(
                f"[{b['bin'][0]:.1f},{b['bin'][1]:.1f}) {b['predicted']:.2f}/{b['observed']:.2f} n={b['tested']}" for b in table
            )
        )
    return lines
