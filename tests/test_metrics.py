"""Metric arithmetic on hand-made cycle records."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harness.core.loop import Cycle
from harness.core.metrics import cycle_counts, expected_tokens_per_cycle, median_ci, predicted_speedup, speedup_stats, summarize


def cyc(num_drafted, num_accepted, betas, tokens=None):
    return Cycle(tokens or [0] * (num_accepted + 1), num_drafted, num_accepted, torch.tensor(betas))


CYCLES = [
    cyc(4, 4, [0.9, 0.8, 0.7, 0.6]),  # all accepted + bonus: 5 tokens
    cyc(4, 0, [0.5]),  # first rejected: 1 token
    cyc(4, 2, [1.0, 0.5, 0.25]),  # two accepted, third rejected: 3 tokens
    cyc(2, 2, [0.5, 0.5]),  # short final cycle (budget), all accepted: 3 tokens
]


def test_cycle_counts():
    c = cycle_counts(CYCLES, k=4)
    assert c["cycles"] == 4
    assert c["committed"] == 5 + 1 + 3 + 3
    assert c["drafted"] == 14
    assert c["accepted"] == 8
    assert c["tested"] == 4 + 1 + 3 + 2
    assert c["expected_sum"] == pytest.approx(3.0 + 0.5 + 1.75 + 1.0)
    assert c["accept_hist"] == [1, 0, 2, 0, 1]
    assert c["drafted_hist"] == [0, 0, 1, 0, 3]
    # position i is reached when all before it were accepted (and it was drafted)
    assert c["position_reached"] == [4, 3, 2, 1]
    assert c["position_accepted"] == [3, 3, 1, 1]


def record(counts, spec_tokens, spec_time, base_tokens, base_time, category="qa"):
    return {
        "category": category,
        "spec": {
            **counts,
            "new_tokens": spec_tokens,
            "time_s": spec_time,
            "ttft_s": 0.1,
            "first_tokens": 2,
            "draft_passes": counts["drafted"],
        },
        "base": {"new_tokens": base_tokens, "time_s": base_time, "ttft_s": 0.05, "first_tokens": 1},
    }


def test_summary_from_counts():
    counts = cycle_counts(CYCLES, k=4)
    costs = {"cost_ratio": 0.1, "verify_cost": [1.0, 1.05, 1.1, 1.15, 1.2]}  # v(1)..v(k+1)
    records = [record(counts, 12, 1.0, 12, 2.0), record(counts, 12, 1.0, 12, 4.0)]
    for r in records:  # timed in the run: the same step and v(n), drafts twice as dear (c = 0.2) as timed apart
        r["spec"]["clock"] = {"draft": [0.2, 3], "verify@5": [0.24, 2], "verify@3": [0.11, 1]}
        r["base"]["clock"] = {"verify@1": [1.0, 10]}
    s = summarize(records, 4, costs)
    assert s["acceptance_rate"] == pytest.approx(8 / 14)
    assert s["alpha"] == pytest.approx(8 / 10)
    assert s["expected_alpha"] == pytest.approx(6.25 / 10)
    assert s["tokens_per_cycle"] == pytest.approx(12 / 4)
    assert s["accepted_per_cycle"] == pytest.approx(8 / 4)
    assert s["position_acceptance"] == pytest.approx([3 / 4, 1, 1 / 2, 1])
    assert s["accept_hist"] == [2, 0, 4, 0, 2]
    assert s["speedup"] == pytest.approx((24 / 2) / (24 / 6))  # ratio of totals: 3
    assert s["speedup_geomean"] == pytest.approx(math.sqrt(2 * 4))
    alpha = 0.8
    e = (1 - alpha**5) / (1 - alpha)
    assert s["theoretical_tokens_per_cycle"] == pytest.approx(e)
    assert s["predicted_speedup_formula"] == pytest.approx(e / (4 * 0.1 + 1.2))
    decode = ((1.95 + 3.95) / (2 * 11)) / ((2 * 0.9) / (2 * 10))  # base TPOT / spec TPOT: prefill and first cycle left out
    assert s["decode_speedup"] == pytest.approx(decode) and s["decode_speedup"] != pytest.approx(s["speedup"])
    # The prediction prices the cycles run after the first (the prompt's pass, 4 drafts, 5 tokens): 2 cycles
    # of 4 drafts + v(5), one of 2 drafts + v(3), for 7 tokens, per record
    assert s["predicted_speedup"] == pytest.approx(7 / (2 * (4 * 0.1 + 1.2) + (2 * 0.1 + 1.1)))
    assert s["efficiency_isolated"] == pytest.approx(decode / s["predicted_speedup"])
    assert s["predicted_speedup_in_run"] == pytest.approx(7 / (2 * (4 * 0.2 + 1.2) + (2 * 0.2 + 1.1)))
    assert s["efficiency"] == pytest.approx(decode / s["predicted_speedup_in_run"])  # the headline: costs timed in the run
    assert s["efficiency_formula"] == pytest.approx(decode / s["predicted_speedup_formula"])
    assert s["spec_tpot_s"] == pytest.approx((2 * 0.9) / (2 * 10))
    assert s["base_tpot_s"] == pytest.approx((1.95 + 3.95) / (2 * 11))


def test_speedup_interval_brackets_estimate_and_is_paired():
    rng = torch.Generator().manual_seed(0)
    ratios = 1.5 + 0.1 * torch.randn(40, generator=rng)
    records = [record(cycle_counts(CYCLES, 4), 10, 1.0, 10, float(r)) for r in ratios]
    s = speedup_stats(records)
    lo, hi = s["speedup_ci"]
    assert lo < s["speedup"] < hi
    assert hi - lo < 0.15  # 40 prompts with 7% spread: a tight interval
    glo, ghi = s["speedup_geomean_ci"]
    assert glo < s["speedup_geomean"] < ghi


def test_leviathan_formulas():
    assert expected_tokens_per_cycle(0.0, 4) == 1.0
    assert expected_tokens_per_cycle(1.0, 4) == 5.0
    assert expected_tokens_per_cycle(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # Leviathan et al.'s closed form with verify cost 1: (1 - a^(k+1)) / ((1 - a)(k c + 1))
    assert predicted_speedup(0.8, 4, 0.05, 1.0) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))


def test_cycles_that_drafted_nothing_are_counted_apart():
    """Prompt lookup without a match (or the budget's last token) drafts nothing: such a cycle counts in
    accept_hist[0], which alone would read as a rejection; alpha leaves it out, and the summary says how many."""
    from harness.cli.summary import format_summary

    cycles = [*CYCLES, cyc(0, 0, [])]
    counts = cycle_counts(cycles, k=4)
    assert counts["accept_hist"] == [2, 0, 2, 0, 1] and counts["drafted_hist"][0] == 1 and counts["tested"] == 10
    costs = {"cost_ratio": 0.1, "verify_cost": [1.0, 1.05, 1.1, 1.15, 1.2]}
    s = summarize([record(counts, 13, 1.0, 13, 2.0)], 4, costs)
    assert s["cycles_without_draft"] == 1 and s["alpha"] == pytest.approx(8 / 10)
    assert summarize([record(cycle_counts(CYCLES, k=4), 12, 1.0, 12, 2.0)], 4, costs)["cycles_without_draft"] == 0
    conditions = {"device": "cpu", "device_name": "x", "dtype": "float32", "threads": 1, "torch": "t", "transformers": "t"}
    header = {
        "pair": "p",
        "target": "t",
        "draft": "d",
        "k": 4,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": 13,
        "prompts_skipped": 0,
        "conditions": conditions,
        "cell_dir": "x",
    }
    line = next(row for row in format_summary({**s, **header}).splitlines() if row.startswith("accepted per cycle"))
    assert line.endswith("2 0 2 0 1  (0 includes 1 cycles that drafted nothing)")


def test_median_interval_covers_as_the_binomial_says():
    """The interval's coverage of the true median, over many samples of 9 from a skewed law, is at
    least its nominal 95% (the order statistics 2 and 8 of 9: 96.1%), and not far above it."""
    rng = np.random.default_rng(0)
    true_median = np.log(2)  # of the exponential law
    hits = [low <= true_median <= high for low, high in (median_ci(rng.exponential(size=9)) for _ in range(4000))]
    assert 0.95 <= np.mean(hits) <= 0.975
    assert median_ci(list(range(1, 10))) == (2.0, 8.0)
    assert all(math.isnan(x) for x in median_ci([1.0, 2.0, 3.0, 4.0, 5.0]))  # 5 samples cannot reach 95%
