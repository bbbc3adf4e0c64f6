"""The bench's figures from synthetic per-repetition values: each speedup's median and coefficient of
variation over the repetitions, and the limit's predictions under a run summary's names."""

from __future__ import annotations

import math

import pytest

import harness.bench.parts as parts


def test_throughput_figures_give_each_ratio_its_spread_over_the_reps():
    """The ratio of a comparison is the median of its per-repetition ratios, and its cv (scipy.stats.variation,
    ddof=1) is theirs, not the contenders' own rates'; one repetition has no cv."""
    tally = parts.Tally(
        tokens_per_s={"ours_base": [100.0, 120.0, 90.0, 110.0], "hf_base": [100.0, 100.0, 100.0, 100.0]},
        forwards={"ours_base": 10, "hf_base": 10},
        tokens_per_rep={"ours_base": 40, "hf_base": 40},
        same_as_hf={"ours_base / hf_base": 8},
    )
    pairs = {"ours_base / hf_base": ("ours_base", "hf_base")}
    figures = parts.throughput_figures(tally, pairs, reps_done=4, prompts=2)
    ratios = [1.0, 1.2, 0.9, 1.1]
    assert figures["ratio_per_rep"]["ours_base / hf_base"] == ratios
    assert figures["ratios"]["ours_base / hf_base"] == pytest.approx(1.05)  # the median of the four
    sd = math.sqrt(sum((r - 1.05) ** 2 for r in ratios) / 3)  # sample standard deviation: ddof=1
    assert figures["ratio_cv"]["ours_base / hf_base"] == pytest.approx(sd / 1.05)
    drifted = parts.Tally(**{**vars(tally), "tokens_per_s": {"ours_base": [50.0, 100.0], "hf_base": [50.0, 100.0]}})
    assert parts.throughput_figures(drifted, pairs, 2, 2)["ratio_cv"]["ours_base / hf_base"] == 0.0  # paired: drift cancels
    assert figures["same_output_as_hf"]["ours_base / hf_base"] == 1.0
    one = parts.Tally(**{**vars(tally), "tokens_per_s": {"ours_base": [100.0], "hf_base": [80.0]}})
    assert math.isnan(parts.throughput_figures(one, pairs, 1, 2)["ratio_cv"]["ours_base / hf_base"])
    assert parts.median_and_cv([2.0, 1.0, 3.0]) == (2.0, pytest.approx(0.5))
    assert math.isnan(parts.median_and_cv([1.3])[1]) and parts.median_and_cv([1.3])[0] == 1.3


def test_the_limit_prices_its_predictions_as_a_run_summary_does():
    """`predictions` under a run summary's names: predicted_speedup priced on the cycles each run ran after
    its first (metrics.predicted_by_cycles), predicted_speedup_formula the closed form, efficiency each's."""
    c, v = 0.1, [1.0, 1.1, 1.2]  # k = 2: v(1), v(2), v(3)
    runs = [  # drafted_hist [k + 1]: cycles that drafted 0, 1, 2 tokens; the first cycle drafted 2 and committed 3
        {"spec": {"drafted_hist": [0, 1, 3], "committed": 9, "first_drafted": 2, "first_committed": 3}},
        {"spec": {"drafted_hist": [1, 0, 2], "committed": 5, "first_drafted": 2, "first_committed": 1}},
    ]
    got = parts.predictions(runs, alpha=0.6, k=2, c=c, v=v, v_k1=v[2], measured=1.3)
    decode_cost = 1 * (0 * c + v[0]) + 1 * (1 * c + v[1]) + 3 * (2 * c + v[2])  # one cycle of 0, one of 1, three of 2
    assert got["predicted_speedup"] == pytest.approx((9 - 3 + 5 - 1) / decode_cost)
    assert got["predicted_speedup_formula"] == pytest.approx((1 + 0.6 + 0.36) / (2 * c + v[2]))
    assert got["efficiency"] == pytest.approx(1.3 / got["predicted_speedup"])
    assert got["efficiency_formula"] == pytest.approx(1.3 / got["predicted_speedup_formula"])
