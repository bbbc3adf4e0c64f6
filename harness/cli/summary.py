"""The human-readable summary table printed after a run."""

from __future__ import annotations


def _f(x, fmt=".3f") -> str:
    return "nan" if x is None or x != x else format(x, fmt)


def format_summary(s: dict) -> str:
    c = s["conditions"]
    linear = ", linear W @ x.T" if (c.get("linear") or {}).get("product") == "transposed" else ""  # harness.models.cpu_linear
    lean = ", lean forward" if c.get("forward") == "lean" else ""  # harness.models.lean (forward=auto's choice on the CPU)
    lo, hi = s["speedup_ci"]
    glo, ghi = s["speedup_geomean_ci"]
    lines = [
        f"pair {s['pair']}: target {s['target']} | draft {s['draft']}",
        f"k={s['k']} temperature={s['temperature']} top_k={s['top_k']} top_p={s['top_p']} "
        f"max_new_tokens={s['max_new_tokens']} dataset={s.get('dataset', '?')} prompts={s['num_prompts']} "
        f"(skipped {s['prompts_skipped']}, truncated {s.get('prompts_truncated', 0)})",
        f"{c['device']} ({c['device_name']}), {c['dtype']}, {c['threads']} threads{linear}{lean}, torch {c['torch']}, transformers {c['transformers']}",
        "",
        f"{'metric':<34}{'value':>12}",
        f"{'acceptance rate (accepted/drafted)':<34}{_f(s['acceptance_rate']):>12}",
        f"{'alpha (accepted/tested)':<34}{_f(s['alpha']):>12}",
        f"{'expected alpha (mean sum min(p,q))':<34}{_f(s['expected_alpha']):>12}",
        f"{'tokens per cycle (incl. bonus)':<34}{_f(s['tokens_per_cycle']):>12}",
        f"{'  theoretical (1-a^(k+1))/(1-a)':<34}{_f(s['theoretical_tokens_per_cycle']):>12}",
        f"{'accepted drafts per cycle':<34}{_f(s['accepted_per_cycle']):>12}",
        f"{'speedup (ratio of totals)':<34}{_f(s['speedup']):>12}  [{_f(lo)}, {_f(hi)}] 95% CI",
        f"{'speedup (geomean of prompts)':<34}{_f(s['speedup_geomean']):>12}  [{_f(glo)}, {_f(ghi)}] 95% CI",
        f"{'speedup after the first token':<34}{_f(s.get('decode_speedup')):>12}  (TPOT ratio)",
        f"{'predicted speedup':<34}{_f(s['predicted_speedup']):>12}",
        f"{'efficiency (decode/predicted)':<34}{_f(s['efficiency']):>12}",
        f"{'  by the cycles run (predicted)':<34}{_f(s.get('efficiency_cycles')):>12}  ({_f(s.get('predicted_speedup_cycles'))})",
        f"{'cost ratio c (draft/target step)':<34}{_f(s['cost_ratio']):>12}",
        f"{'verify cost v(k+1) (target steps)':<34}{_f(s['verify_cost']):>12}",
        f"{'TPOT ms spec / baseline':<34}{_f(1e3 * s['spec_tpot_s'], '.2f'):>12} / {_f(1e3 * s['base_tpot_s'], '.2f')}",
        f"{'TTFT ms spec / baseline (median)':<34}{_f(1e3 * s['spec_ttft_s'], '.2f'):>12} / {_f(1e3 * s['base_ttft_s'], '.2f')}",
        f"{'per-position acceptance':<34}  " + " ".join(_f(a, ".2f") for a in s["position_acceptance"]),
        f"{'accepted per cycle histogram 0..k':<34}  " + " ".join(str(n) for n in s["accept_hist"])
        + (f"  (0 includes {s['cycles_without_draft']} cycles that drafted nothing)" if s.get("cycles_without_draft") else ""),
    ]
    if s.get("max_memory_allocated_mb") is not None:
        lines.append(f"{'peak CUDA memory allocated MB':<34}{_f(s['max_memory_allocated_mb'], '.0f'):>12}")
    if "peak_rss_mb" in s:
        growth = f"  (growth {_f(s['rss_growth_mb_per_prompt'], '+.2f')} MB/prompt)" if "rss_growth_mb_per_prompt" in s else ""
        lines.append(f"{'peak RSS MB':<34}{_f(s['peak_rss_mb'], '.0f'):>12}{growth}")
    cats = s.get("categories") or {}
    if cats:
        lines += ["", f"{'category':<16}{'prompts':>8}{'accept':>9}{'tok/cycle':>11}{'speedup':>9}"]
        for name, m in cats.items():
            lines.append(f"{name:<16}{m['num_prompts']:>8}{_f(m['acceptance_rate']):>9}{_f(m['tokens_per_cycle']):>11}{_f(m['speedup']):>9}")
    lines += ["", f"results: {s['cell_dir']}"]
    return "\n".join(lines)
