"""analysis.report: the loader, the fitted model, the decision, the figures, the command.

Synthetic cells are built with known alpha, c and v(n): every prompt's
acceptance histogram is the exact i.i.d. expectation (alpha rational, so the
counts are integers), and its timings are what the cost model says, times a
small seeded jitter. Their summaries go through harness.core.metrics.summarize,
so they have the harness's own schema. The fitted values, the predicted
speedups and the recommended draft must then be what the formulas give.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import decide as decide_mod
from analysis import fit as fit_mod
from analysis import paired, report, ship
from analysis.figures import make_figures, pareto_front
from analysis.load import load, load_wandb
from harness.core import metrics
from harness.errors import HarnessError
from harness.runner.store import SCHEMA_VERSION

ROOT = Path(__file__).parent.parent

STEP_S = 0.01  # target decode step of the synthetic machine


# Synthetic results with known alpha, c and v(n) = 1 + b (n - 1)


def exact_hist(alpha: Fraction, k: int) -> list[int]:
    """Cycles that accept 0..k drafted tokens, proportional to the i.i.d. law, in integers."""
    scale = alpha.denominator**k
    probs = [alpha**j * (1 - alpha) for j in range(k)] + [alpha**k]
    return [int(p * scale) for p in probs]


def prompt_record(i: int, category: str, alpha: Fraction, k: int, c: float, b: float, jitter: float, kind: str) -> dict:
    hist = exact_hist(alpha, k)
    cycles = sum(hist)
    accepted = sum(j * n for j, n in enumerate(hist))
    tested = sum((j + 1) * n for j, n in enumerate(hist[:-1])) + k * hist[-1]
    committed = accepted + cycles  # each cycle commits its accepted tokens plus one (correction or bonus)
    spec_time = cycles * (k * c + 1 + b * k) * STEP_S * jitter
    base_time = committed * STEP_S
    return {
        "index": i,
        "id": f"{category}-{i:02d}",
        "category": category,
        "prompt_tokens": 50,
        "spec": {
            "cycles": cycles,
            "committed": committed,
            "drafted": k * cycles,
            "drafted_after_eos": 0,
            "accepted": accepted,
            "tested": tested,
            "expected_sum": float(alpha) * tested,
            "accept_hist": hist,
            # every cycle of a synthetic prompt is its average one, the first (its prompt pass) too
            "drafted_hist": [0] * k + [cycles],
            "first_drafted": k,
            "first_committed": committed / cycles,
            "position_reached": [sum(hist[i:]) for i in range(k)],
            "position_accepted": [sum(hist[i + 1 :]) for i in range(k)],
            "new_tokens": committed,
            "time_s": spec_time,
            "ttft_s": spec_time / cycles,
            "first_tokens": 1,
            "draft_passes": k * cycles if kind == "model" else 0,
            "tokens": [],
        },
        "base": {"new_tokens": committed, "time_s": base_time, "ttft_s": STEP_S, "first_tokens": 1, "tokens": []},
        "speedup": (committed / spec_time) / (committed / base_time),
        "rss_mb": 100.0,
        "schema_version": SCHEMA_VERSION,
    }


GPU = {"device": "cuda", "device_name": "Synthetic GPU", "dtype": "bfloat16", "threads": 8, "forward": "hf"}


def write_cell(
    root: Path,
    name: str,
    kind: str,
    alpha: Fraction,
    k: int,
    c: float,
    b: float,
    temperature: float = 0.0,
    categories: tuple[str, ...] = ("chat", "code"),
    per_category: int = 6,
    seed: int = 0,
    params: int | None = None,
    dataset: str = "synthetic",
    alphas: dict | None = None,
    target: str = "org/target",
    conditions: dict = GPU,
    config: dict | None = None,
    time_factors: list[float] | None = None,
    tag: str = "",
) -> Path:
    """One cell directory as harness.runner.cell.run_cell writes it. `alphas` gives a category its own alpha;
    `conditions` the summary's run conditions; `config` extra config keys; `time_factors` sets prompt
    i's speculative time to its baseline time x time_factors[i] (a speedup of 1 / factor); `tag` ends the cell key;
    `params` the draft's parameters as the run recorded them (default: 10^6 for a model draft, none for prompt lookup)."""
    rng = np.random.default_rng(seed)
    records = []
    for g in categories:
        for _ in range(per_category):
            jitter = float(np.exp(rng.normal(0, 0.03)))
            records.append(prompt_record(len(records), g, (alphas or {}).get(g, alpha), k, c, b, jitter, kind))
            if time_factors:
                r = records[-1]
                r["spec"]["time_s"] = r["base"]["time_s"] * time_factors[(len(records) - 1) % len(time_factors)]
                r["speedup"] = r["base"]["time_s"] / r["spec"]["time_s"]
    verify = [1 + b * (n - 1) for n in range(1, k + 2)]
    costs = {
        "target_step_s": STEP_S,
        "draft_step_s": c * STEP_S,
        "cost_ratio": c,
        "verify_s": [v * STEP_S for v in verify],
        "verify_cost": verify,
    }
    summary = metrics.summarize(records, k, costs)
    cell = f"{name}-k{k}-t{temperature}-{dataset}{tag}"
    draft = {"kind": kind, "id": f"org/{name}"} if kind == "model" else {"kind": "ngram", "max_ngram": 3, "min_ngram": 1}
    builtin = {"name": dataset, "source": "builtin", "text_field": "prompt", "template": None, "id_field": "id"}
    config = {
        "pair": {"name": name, "target": {"id": target}, "draft": draft},
        "dataset": builtin,
        "k": k,
        "temperature": temperature,
        "top_k": 0,
        "top_p": 1.0,
        "seed": 0,
        "max_new_tokens": 64,
        "cache": "dynamic",
        "compile": False,
        "prompts": {"template": "auto"},
        **(config or {}),
    }
    params = (0 if kind == "ngram" else 10**6) if params is None else params
    summary.update(
        pair=name,
        target=target,
        draft=draft.get("id", "ngram"),
        k=k,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=config["max_new_tokens"],
        dataset=config["dataset"]["name"],
        dataset_sha256=None,
        prompts_skipped=0,
        prompt_ids=[r["id"] for r in records],
        categories=metrics.by_category(records, k, costs),
        costs=costs,
        draft_params=params,
        draft_bytes=2 * params,
        conditions=conditions,
        peak_rss_mb=100.0,
        cell=cell,
        cell_dir=str(root / cell),
        status="finished",
        schema_version=SCHEMA_VERSION,
    )
    out = root / cell
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    (out / "summary.json").write_text(json.dumps(summary))
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def test_lookup_length_policies_are_told_apart(tmp_path):
    """One pair name, two prompt-lookup length policies: two drafts, each labelled."""
    for length, cell_name in (("match", "lookup"), ("cost_aware", "lookup2")):
        out = write_cell(tmp_path, cell_name, "ngram", Fraction(1, 4), 2, 0.002, SLOPE)
        config = json.loads((out / "config.yaml").read_text())
        config["pair"]["name"] = "lookup"
        config["pair"]["draft"]["length"] = length
        (out / "config.yaml").write_text(json.dumps(config))
        summary = json.loads((out / "summary.json").read_text())
        (out / "summary.json").write_text(json.dumps({**summary, "pair": "lookup"}))
    cells = load(tmp_path).cells
    assert sorted(cells["draft"]) == ["ngram(1-3)", "ngram(1-3)-cost_aware"]
    assert sorted(cells["label"]) == ["lookup/ngram(1-3)", "lookup/ngram(1-3)-cost_aware"]


def test_speedup_against_size_never_sets_one_dataset_against_another(tmp_path):
    """A draft measured on two prompt sets is one point per set in speedup_vs_size, not its best over both."""
    from analysis.figures import size_points

    for k in (1, 2):
        write_cell(tmp_path, "a", "model", Fraction(4, 5), k, 0.05, SLOPE, dataset="x", seed=k, params=10**7)
        write_cell(tmp_path, "a", "model", Fraction(1, 5), k, 0.05, SLOPE, dataset="y", seed=10 + k, params=10**7)
    cells = load(tmp_path).cells.assign(series="a")
    points = size_points(cells).set_index("dataset")
    assert sorted(points.index) == ["x", "y"]
    for dataset in ("x", "y"):
        assert points.loc[dataset, "speedup"] == cells[cells["dataset"] == dataset]["speedup"].max()


def test_drafts_under_one_pair_name_never_share_a_label(tmp_path):
    """Two lookup settings, and two model drafts whose ids end alike, under one pair name each: every
    draft keeps its own label (and so its own fit and candidate), by the shortest end of its id that
    tells it apart."""
    for name, draft in (
        ("l2", {"kind": "ngram", "max_ngram": 2, "min_ngram": 1}),
        ("l5", {"kind": "ngram", "max_ngram": 5, "min_ngram": 1}),
        ("m1", {"kind": "model", "id": "/ckpt/a/final"}),
        ("m2", {"kind": "model", "id": "/ckpt/b/final"}),
    ):
        out = write_cell(tmp_path, name, draft["kind"], Fraction(1, 2), 2, 0.05, SLOPE)
        pair = "lookup" if draft["kind"] == "ngram" else "mine"
        config = json.loads((out / "config.yaml").read_text())
        config["pair"].update(name=pair, draft=draft)
        (out / "config.yaml").write_text(json.dumps(config))
        summary = json.loads((out / "summary.json").read_text())
        (out / "summary.json").write_text(json.dumps({**summary, "pair": pair, "draft": draft.get("id", "ngram")}))
    cells = load(tmp_path).cells
    assert sorted(cells["label"]) == ["lookup/ngram(1-2)", "lookup/ngram(1-5)", "mine/a/final", "mine/b/final"]
    # The same folder named with a trailing slash is the same draft; a cell whose pair has no name loads too.
    out = write_cell(tmp_path, "m3", "model", Fraction(1, 2), 4, 0.05, SLOPE)
    config = json.loads((out / "config.yaml").read_text())
    config["pair"].update(name="mine", draft={"kind": "model", "id": "/ckpt/a/final/"})
    (out / "config.yaml").write_text(json.dumps(config))
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "pair": "mine", "draft": "/ckpt/a/final/"}))
    out = write_cell(tmp_path, "unnamed", "model", Fraction(1, 2), 2, 0.05, SLOPE)
    config = json.loads((out / "config.yaml").read_text())
    config["pair"]["name"] = None
    (out / "config.yaml").write_text(json.dumps(config))
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "pair": None}))
    cells = load(tmp_path).cells.set_index("cell")
    assert (
        cells.loc["m3-k4-t0.0-synthetic", "label"] == "mine/a/final"
        and cells.loc["unnamed-k2-t0.0-synthetic", "label"] == "unnamed"
    )


def test_a_draft_in_another_dtype_or_revision_is_another_draft(tmp_path):
    """pair.draft.dtype and pair.draft.revision change the draft: cells that differ in one were
    pooled into one fit, and one of them was never compared. The dtype counts as resolved (auto is
    bfloat16 on CUDA), and only where it differs from the target's; a revision other than main counts."""
    drafts = {
        "bf": {"dtype": "auto"},
        "bf2": {"dtype": "bfloat16"},
        "fp": {"dtype": "float32"},
        "v2": {"dtype": "auto", "revision": "v2"},
        "main": {"revision": "main"},
        "pr": {"revision": "refs/pr/3"},
        "q4": {"gguf_file": "d-q4.gguf"},
    }
    for name, extra in drafts.items():
        out = write_cell(tmp_path, name, "model", Fraction(1, 2), 2, 0.05, SLOPE)
        config = json.loads((out / "config.yaml").read_text())
        config["pair"].update(name="p", draft={"kind": "model", "id": "org/d", **extra})
        config["pair"]["target"]["revision"] = "r1" if name == "main" else "main"
        (out / "config.yaml").write_text(json.dumps(config))
        summary = json.loads((out / "summary.json").read_text())
        (out / "summary.json").write_text(json.dumps({**summary, "pair": "p", "draft": "org/d"}))
    cells = load(tmp_path).cells.set_index("cell")
    label = lambda name: cells.loc[f"{name}-k2-t0.0-synthetic", "label"]  # noqa: E731
    assert label("bf") == label("bf2") == "p/d" and label("fp") == "p/d[float32]" and label("v2") == "p/d@v2"
    assert label("pr") == "p/d@refs/pr/3" and label("q4") == "p/d[d-q4.gguf]"  # a revision's own slashes stay in it
    assert (
        cells.loc["main-k2-t0.0-synthetic", "target"] == "org/target@r1"
        and cells.loc["bf-k2-t0.0-synthetic", "target"] == "org/target"
    )


def test_a_cell_without_a_speedup_is_no_point_in_the_size_figure(tmp_path):
    """A summary whose speedup is NaN made the report stop with a traceback in the speedup-vs-size
    figure; the decision is made on the per-prompt rows anyway."""
    from analysis.figures import size_points

    out = write_cell(tmp_path, "a", "model", Fraction(4, 5), 2, 0.05, SLOPE)
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "speedup": float("nan"), "speedup_ci": [float("nan")] * 2}))
    write_cell(tmp_path, "b", "model", Fraction(3, 5), 2, 0.05, SLOPE)
    assert report.main([str(tmp_path), "--out", str(tmp_path / "rep"), "--resamples", "100"]) == 0
    cells = load(tmp_path).cells.assign(series=lambda f: f["label"])
    assert list(size_points(cells)["label"]) == ["b"] and size_points(cells[cells["label"] == "a"]).empty


def test_tested_positions_without_prompt_rows_come_from_alpha(tmp_path):
    """A cell known only by its summary (a W&B run without its artifact): prompt lookup's
    cycles that proposed nothing test no position, which the accepted histogram cannot
    show; alpha = accepted / tested can."""
    from analysis.frames import RawCell, cell_row

    cell = write_cell(tmp_path, "lookup", "ngram", Fraction(1, 4), 4, 0.002, SLOPE)
    config = json.loads((cell / "config.yaml").read_text())
    # 2 cycles without a match, 1 that proposed 2 tokens and kept both, 1 that proposed 4 and kept none:
    # 2 accepted over 3 tested positions.
    summary = {
        **json.loads((cell / "summary.json").read_text()),
        "accept_hist": [3, 0, 1, 0, 0],
        "alpha": 2 / 3,
        "cycles": 4,
        "cycles_without_draft": 0,
    }
    row = cell_row(RawCell(config, summary, None, "me/project/run"))
    assert (row["accepted_total"], row["tested_total"]) == (2.0, pytest.approx(3.0))
    nothing = cell_row(RawCell(config, {**summary, "accept_hist": [4, 0, 0, 0, 0], "alpha": 0.0}, None, "run"))
    assert (nothing["accepted_total"], nothing["tested_total"]) == (0.0, 4.0)
    unmatched = cell_row(
        RawCell(config, {**summary, "accept_hist": [4, 0, 0, 0, 0], "alpha": 0.0, "cycles_without_draft": 3}, None, "run")
    )
    assert unmatched["tested_total"] == 1.0  # three of the four cycles drafted nothing: they tested no position


# Three drafts with known alpha and c, b = 0.02, run at k = 1, 2, 3. By the
# formula the best measured is "small" at k=3 (1.798x), then "big" at k=3
# (1.631x), then "lookup" (1.26x); the fit puts small's best k at 4 (1.801x).
DRAFTS = {
    "big": ("model", Fraction(4, 5), 0.25, 68_000_000),
    "small": ("model", Fraction(3, 5), 0.05, 20_000_000),
    "lookup": ("ngram", Fraction(1, 4), 0.002, None),
}
SLOPE = 0.02
KS = (1, 2, 3)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    for seed, (name, (kind, alpha, c, params)) in enumerate(DRAFTS.items()):
        for k in KS:
            write_cell(root, name, kind, alpha, k, c, SLOPE, seed=seed * 10 + k, params=params)
            # the same drafts at T=1 with lower acceptance, for the figures' facets
            write_cell(root, name, kind, alpha * Fraction(3, 4), k, c, SLOPE, temperature=1.0, seed=seed * 10 + k, params=params)
    return root


@pytest.fixture(scope="module")
def loaded(sweep):
    results = load(sweep)
    fits, curves = fit_mod.fit(results.cells, results.prompts, n_resamples=500)
    return results, fits, curves


def formula_speedup(alpha: float, k: int, c: float, b: float = SLOPE) -> float:
    return metrics.predicted_speedup(alpha, k, c, 1 + b * k)


# The fitted model


def test_fit_recovers_alpha_cost_verify_curve_and_best_k(loaded):
    results, fits, curves = loaded
    assert len(results.cells) == 18 and len(results.prompts) == 18 * 12
    for name, (kind, alpha, c, _) in DRAFTS.items():
        f = fits[(fits["label"] == name) & (fits["sampling"] == "T=0")].iloc[0]
        assert f["alpha"] == pytest.approx(float(alpha), abs=1e-12)
        assert f["alpha_low"] <= float(alpha) <= f["alpha_high"]
        assert f["cost_ratio"] == pytest.approx(c) and f["verify_slope"] == pytest.approx(SLOPE)
        assert f["draft_kind"] == kind and f["ks"] == "1 2 3"
        expected = [formula_speedup(float(alpha), k, c) for k in range(1, 17)]
        got = curves[(curves["label"] == name) & (curves["sampling"] == "T=0")].sort_values("k")["predicted"]
        assert got.to_numpy() == pytest.approx(expected, rel=1e-12)
        assert f["best_k"] == int(np.argmax(expected)) + 1
        assert f["predicted_best"] == pytest.approx(max(expected))
        # break-even c: the prediction at the best k for that c is exactly 1
        k_star, s_star = fit_mod.best_k(float(alpha), f["break_even_cost_ratio"], SLOPE)
        assert s_star == pytest.approx(1.0)
    # measured speedups are the formula's (the timings were built from it), up to the 3% jitter
    cells = results.cells[results.cells["sampling"] == "T=0"]
    for r in cells.itertuples():
        kind, alpha, c, _ = DRAFTS[r.label]
        assert r.speedup == pytest.approx(formula_speedup(float(alpha), r.k, c), rel=0.04)
        assert r.predicted_speedup == pytest.approx(formula_speedup(float(alpha), r.k, c), rel=1e-9)  # harness's own
        assert r.tokens_per_cycle == pytest.approx(r.theoretical_tokens_per_cycle)


def test_alpha_interval_is_a_cluster_bootstrap_wider_than_binomial():
    # 10 easy prompts and 10 hard ones: positions are correlated within a prompt
    accepted = np.array([90] * 10 + [20] * 10, dtype=float)
    tested = np.full(20, 100.0)
    boot = fit_mod.alpha_interval(accepted, tested, n_resamples=2000)
    wilson = fit_mod.binomial_interval(accepted.sum(), tested.sum())
    assert boot.value == pytest.approx(0.55) and wilson.value == pytest.approx(0.55)
    assert boot.low < 0.55 < boot.high
    assert (boot.high - boot.low) > 3 * (wilson.high - wilson.low)


def test_verify_slope_and_break_even():
    points = [(1, 1.0), (2, 1.1), (3, 1.2), (5, 1.4)]
    assert fit_mod.verify_slope(points) == pytest.approx(0.1)
    assert fit_mod.verify_slope([(1, 1.0), (2, 0.98)]) == 0.0  # clipped: never cheaper to score more
    a = fit_mod.break_even_alpha(0.3, 0.0)
    assert fit_mod.best_k(a, 0.3, 0.0)[1] == pytest.approx(1.0, abs=1e-5)
    assert math.isnan(fit_mod.break_even_alpha(2.0, 0.5))  # nothing pays when a draft step costs two target steps


def test_whatif_uses_alpha_with_the_other_machines_costs(loaded):
    _, fits, _ = loaded
    spec = fit_mod.WhatIf(name="H100", cost_ratio={"big": 0.02}, target_step_ms=5.0, verify_slope=0.0)
    table = fit_mod.whatif(fits[fits["sampling"] == "T=0"], spec).set_index("label")
    big = table.loc["big"]
    expected = [metrics.predicted_speedup(0.8, k, 0.02, 1.0) for k in range(1, 17)]
    assert big["cost_ratio"] == 0.02 and big["best_k"] == int(np.argmax(expected)) + 1
    assert big["predicted"] == pytest.approx(max(expected))
    assert big["predicted_low"] <= big["predicted"] <= big["predicted_high"]
    # prompt lookup keeps its measured host time against the other machine's target step
    assert table.loc["lookup", "cost_ratio"] == pytest.approx(0.002 * STEP_S * 1e3 / 5.0)
    assert table.loc["small", "cost_source"].startswith("measured c kept")


# The decision


def test_decision_recommends_the_formulas_best_draft_and_k(loaded):
    results, fits, _ = loaded
    decisions = decide_mod.decide(results.cells, results.prompts, fits, {"chat": 0.7, "code": 0.3}, n_resamples=1000)
    d = next(d for d in decisions if d["sampling"] == "T=0")
    predicted = {(name, k): formula_speedup(float(a), k, c) for name, (_, a, c, _) in DRAFTS.items() for k in KS}
    best = max(predicted, key=predicted.get)
    assert best == ("small", 3)
    mix = d["mix"]
    assert (mix["ship"], mix["k"]) == best
    assert mix["best"]["low"] > 1 and mix["best"]["speedup"] == pytest.approx(predicted[best], rel=0.03)
    assert (mix["runner_up"]["label"], mix["runner_up"]["k"]) == ("big", 3)
    cmp = mix["comparison"]
    assert cmp["significant"] and cmp["low"] > 1 and cmp["wilcoxon_p"] < 0.01 and cmp["prompts"] == 12
    assert cmp["ratio"] == pytest.approx(predicted[best] / predicted[("big", 3)], rel=0.03)
    assert mix["verdict"].startswith("Ship small with k=3")
    for g in ("chat", "code"):
        assert d["per_category"][g]["ship"] == "small" and d["per_category"][g]["prompts"] == 6
    assert d["weights"] == {"chat": 0.7, "code": 0.3}
    # What would change it: the fit's best k for "small" is above the measured ones.
    k_fit = fits[(fits["label"] == "small") & (fits["sampling"] == "T=0")]["best_k"].iloc[0]
    assert k_fit == 4 and any(f"run k={k_fit}" in line for line in mix["what_would_change"])


def test_no_draft_beats_the_baseline_says_ship_no_speculation(tmp_path):
    for name, alpha, c in (("slow", Fraction(3, 10), 0.8), ("slower", Fraction(1, 5), 0.9)):
        for k in (1, 2):
            write_cell(tmp_path, name, "model", alpha, k, c, 0.05, per_category=4)
    results = load(tmp_path)
    fits, _ = fit_mod.fit(results.cells, results.prompts, n_resamples=200)
    (d,) = decide_mod.decide(results.cells, results.prompts, fits, None, n_resamples=500)
    assert d["mix"]["ship"] == ship.NO_SPECULATION and d["mix"]["k"] is None
    assert d["mix"]["verdict"].startswith("Ship no speculation")
    assert all(c["ship"] == ship.NO_SPECULATION for c in d["per_category"].values())
    assert any("pays off" in line for line in d["mix"]["what_would_change"])


def test_what_would_change_names_the_traffic_share_that_flips_the_choice(tmp_path):
    # "chatty" drafts chat well and code badly, "coder" the reverse; chat is 80% of the traffic.
    write_cell(tmp_path, "chatty", "model", Fraction(4, 5), 2, 0.05, 0.0, alphas={"code": Fraction(2, 5)})
    write_cell(tmp_path, "coder", "model", Fraction(1, 2), 2, 0.05, 0.0, alphas={"code": Fraction(4, 5)})
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, {"chat": 0.8, "code": 0.2}, n_resamples=300)
    assert d["mix"]["ship"] == "chatty" and d["per_category"]["code"]["ship"] == "coder"
    (line,) = [x for x in d["mix"]["what_would_change"] if x.startswith("Traffic")]
    assert "if code rises from 20% to" in line and "coder k=2 overtakes chatty" in line
    share = float(line.split(" to ")[1].split("%")[0]) / 100
    per_cat = {c["label"]: c["categories"] for c in d["candidates"]}
    tau = {lab: {g: 1 / per_cat[lab][g]["speedup"] for g in ("chat", "code")} for lab in per_cat}  # base tau is equal
    mix = lambda lab, w: 1 / ((1 - w) * tau[lab]["chat"] + w * tau[lab]["code"])  # noqa: E731
    assert mix("coder", share + 0.01) > mix("chatty", share + 0.01) and mix("coder", share - 0.01) < mix("chatty", share - 0.01)


def test_mix_speedup_is_baseline_time_over_speculative_time():
    # One candidate, two categories: chat 2x faster, code 1.25x, code's baseline 3x slower per token.
    table = paired.Table(
        candidates=[("a", 2)],
        kinds=["model"],
        prompt_keys=["p0", "p1", "p2", "p3"],
        categories=["chat", "chat", "code", "code"],
        spec_tokens=np.array([[10.0, 10, 10, 10]]),
        spec_time=np.array([[0.5, 0.5, 2.4, 2.4]]),
        base_tokens=np.array([[10.0, 10, 10, 10]]),
        base_time=np.array([[1.0, 1.0, 3.0, 3.0]]),
    )
    names = ["chat", "code"]
    w = np.array([0.75, 0.25])
    per_cat, mix = paired.speedups(paired.category_sums(table, np.ones((1, 4)), names), w)
    assert per_cat[0, 0] == pytest.approx([2.0, 1.25])
    tau_base, tau_spec = np.array([0.1, 0.3]), np.array([0.05, 0.24])
    assert mix[0, 0] == pytest.approx((w @ tau_base) / (w @ tau_spec))  # = 0.15 / 0.0975
    u = w * tau_base / (w @ tau_base)
    assert mix[0, 0] == pytest.approx(1 / (u / per_cat[0, 0]).sum())  # weighted harmonic mean
    assert mix[0, 0] < w @ per_cat[0, 0]  # not the arithmetic mean


def test_traffic_weights_are_normalised_over_measured_categories():
    w, notes, left_out = decide_mod.resolve_weights({"chat": 2, "code": 1, "math": 1}, ["chat", "code", "qa"])
    assert w == pytest.approx({"chat": 2 / 3, "code": 1 / 3, "qa": 0.0}) and left_out == {"math": 0.25}
    assert any(n.startswith("no measurements: math (25%") for n in notes) and any("qa" in n for n in notes)
    _, notes, _ = decide_mod.resolve_weights({"chat": 2, "code": 1, "math": 1}, ["chat", "code"], unpaired={"math"})
    assert any(n.startswith("not run by every candidate, so not in the paired comparison: math (25%") for n in notes)
    assert decide_mod.resolve_weights({}, ["a", "b"])[0] == {"a": 0.5, "b": 0.5}
    with pytest.raises(HarnessError, match="no traffic weight"):  # in no context at all: a typo
        decide_mod.check_weights({"math": 1}, ["chat"])
    with pytest.raises(HarnessError, match=">= 0"):
        decide_mod.resolve_weights({"chat": -1}, ["chat"])


def test_pareto_front():
    size = np.array([0.0, 20.0, 68.0, 100.0, 50.0])
    speed = np.array([1.2, 1.8, 1.6, 2.0, 1.8])
    assert pareto_front(size, speed).tolist() == [True, True, False, True, False]


# Figures


def test_figures_are_written_and_not_blank(loaded, tmp_path):
    import matplotlib.image

    results, fits, curves = loaded
    made = make_figures(results.cells, results.prompts, fits, curves, tmp_path)
    assert set(made) == {
        "speedup_vs_k",
        "acceptance_by_sampling",
        "acceptance_by_category",
        "position_acceptance",
        "tokens_per_cycle",
        "measured_vs_predicted",
        "speedup_vs_size",
        "fitted_model",
    }
    for path in made.values():
        assert path.stat().st_size > 10_000
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 300 and pixels[..., :3].std() > 0.05


# Loading


def test_loader_finds_cells_through_hydra_pointers_and_reports_unfinished(sweep, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(sweep / "small-k1-t0.0-synthetic", store / "small-k1-t0.0-synthetic")
    multirun = tmp_path / "multirun"
    (multirun / "0").mkdir(parents=True)
    (multirun / "0" / "cell.json").write_text(
        json.dumps({"job": 0, "status": "finished", "overrides": ["k=1"], "cell_dir": str(store / "small-k1-t0.0-synthetic")})
    )
    (multirun / "1").mkdir()
    (multirun / "1" / "cell.json").write_text(
        json.dumps({"job": 1, "status": "failed", "overrides": ["k=9"], "error": "boom", "cell_dir": None})
    )
    (multirun / "2").mkdir()  # a job interrupted, its cell finished since by a resumed run: found, not noted
    (multirun / "2" / "cell.json").write_text(
        json.dumps(
            {
                "job": 2,
                "status": "interrupted",
                "overrides": ["k=1"],
                "error": "interrupted",
                "cell_dir": str(store / "small-k1-t0.0-synthetic"),
            }
        )
    )
    results = load(multirun)
    assert results.cells["cell"].tolist() == ["small-k1-t0.0-synthetic"] and len(results.prompts) == 12
    assert any("failed" in n and "boom" in n for n in results.notes)
    assert not any("interrupted" in n for n in results.notes)
    (store / "half").mkdir()
    (store / "half" / "status.json").write_text(json.dumps({"status": "interrupted", "done": 3, "total": 12}))
    notes = load(store).notes
    assert any("half not finished (interrupted, 3/12" in n for n in notes)
    with pytest.raises(HarnessError, match="neither a results directory nor a W&B path"):
        load("not a path")
    with pytest.raises(HarnessError, match="no finished cell"):
        load(tmp_path / "multirun" / "1")


class FakeArtifact:
    type = "cell-results"

    def __init__(self, cell_dir: Path):
        self.cell_dir = cell_dir

    def download(self, root: str) -> str:
        for name in ("prompts.jsonl", "summary.json", "config.yaml"):
            shutil.copy(self.cell_dir / name, Path(root) / name)
        return root


class FakeRun:
    def __init__(
        self, run_id: str, config: dict, summary: dict, artifacts: list, state: str = "finished", job_type: str = "benchmark"
    ):
        self.id, self.name, self.state, self.job_type = run_id, run_id, state, job_type
        self.config, self.summary_metrics, self._artifacts = config, summary, artifacts

    def logged_artifacts(self):
        return self._artifacts


class FakeApi:
    """wandb.Api's surface that the loader uses: sweep(path).runs, runs(path)."""

    def __init__(self, runs: list[FakeRun]):
        self._runs, self.asked = runs, []

    def sweep(self, path: str):
        self.asked.append(("sweep", path))
        return type("Sweep", (), {"runs": self._runs})()

    def runs(self, path: str):
        self.asked.append(("runs", path))
        return self._runs


def fake_runs(sweep: Path, with_artifacts: bool = True) -> list[FakeRun]:
    """The sweep's cells as harness.tracking.tracker logs them: config + conditions, summary + flat keys, the artifact."""
    runs = []
    for i, cell_dir in enumerate(sorted(p for p in sweep.iterdir() if (p / "summary.json").exists())):
        summary = json.loads((cell_dir / "summary.json").read_text())
        config = {**json.loads((cell_dir / "config.yaml").read_text()), "conditions": summary["conditions"], "_wandb": {}}
        flat = {"speedup_ci_low": summary["speedup_ci"][0], "speedup_ci_high": summary["speedup_ci"][1]}
        runs.append(FakeRun(f"run{i}", config, {**summary, **flat}, [FakeArtifact(cell_dir)] if with_artifacts else []))
    runs.append(FakeRun("report", {"source": "x"}, {"status": "finished"}, []))  # an earlier report run: not a cell
    broken = dict(runs[0].summary_metrics, status="failed", cell="broken")
    runs.append(FakeRun("crashed", runs[0].config, broken, [], state="crashed"))
    return runs


def pointed_cell(exp: Path, hydra_yaml: bool = True) -> Path:
    """A cell (alpha 4/5) under exp/results and the pointer its sweep job left, exp/multirun/d/t/0/cell.json,
    as a job given out_dir=results writes it; with the job's .hydra/hydra.yaml (run from exp) where `hydra_yaml`."""
    cell = write_cell(exp / "results", "a", "model", Fraction(4, 5), 2, 0.05, SLOPE)
    job = exp / "multirun" / "d" / "t" / "0"
    job.mkdir(parents=True)
    if hydra_yaml:
        (job / ".hydra").mkdir()
        (job / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {exp}\n    output_dir: {job}\n")
    (job / "cell.json").write_text(
        json.dumps(
            {
                "job": 0,
                "status": "finished",
                "overrides": ["k=2"],
                "error": None,
                "cell": cell.name,
                "cell_dir": str(cell),
                "cell_dir_given": f"results/{cell.name}",
            }
        )
    )
    return cell


def test_a_pointer_is_read_from_where_its_job_ran(tmp_path, monkeypatch):
    """With out_dir=results a job is given results/<key>: a report run from another folder, which holds
    a cell of the same key under its own results/, reads the job's cell (the pointer's absolute path
    first while the job's folder is where it ran), not the one beside the report."""
    exp = tmp_path / "exp"
    cell = pointed_cell(exp)
    monkeypatch.chdir(tmp_path)  # not where the sweep ran
    assert list(load(exp / "multirun").cells["cell"]) == [cell.name]
    other = write_cell(tmp_path / "results", "a", "model", Fraction(1, 5), 2, 0.05, SLOPE)
    assert other.name == cell.name and list(load(exp / "multirun").cells["alpha"]) == [pytest.approx(0.8)]


def test_a_moved_experiment_is_found_through_the_path_its_job_was_given(tmp_path, monkeypatch):
    """Pointers hold the cell's absolute path and the one the job was given (out_dir=results): after
    the experiment folder is moved or copied, the second, relative to the folders above the pointer."""
    exp = tmp_path / "exp"
    cell = pointed_cell(exp, hydra_yaml=False)
    shutil.move(str(exp), str(tmp_path / "moved"))
    monkeypatch.chdir(tmp_path)
    results = load(tmp_path / "moved" / "multirun")
    assert list(results.cells["cell"]) == [cell.name] and not any("no summary.json" in n for n in results.notes)


def test_a_copied_experiment_reads_its_own_cells_not_the_originals(tmp_path, monkeypatch):
    """An experiment archived by copy, then the same config rerun in place: the copy's pointers still
    name the original folder, which now holds the rerun's cell. The copy's own cell comes first."""
    exp = tmp_path / "exp"
    cell = pointed_cell(exp)
    shutil.copytree(exp, tmp_path / "archive")
    shutil.rmtree(cell)
    write_cell(exp / "results", "a", "model", Fraction(1, 5), 2, 0.05, SLOPE)  # the rerun, in place
    monkeypatch.chdir(tmp_path)
    assert list(load(tmp_path / "archive" / "multirun").cells["alpha"]) == [pytest.approx(0.8)]
    assert list(load(exp / "multirun").cells["alpha"]) == [pytest.approx(0.2)]  # in place: the original's


def test_wandb_sweep_loads_into_the_same_frames_as_the_local_tree(sweep):
    local = load(sweep)
    api = FakeApi(fake_runs(sweep))
    remote = load_wandb("me/specbench/abc123", api=api)
    assert api.asked == [("sweep", "me/specbench/abc123")]
    assert remote.kind == "wandb" and any("crashed" in n for n in remote.notes)
    columns = [
        "cell",
        "label",
        "draft_kind",
        "dataset",
        "k",
        "sampling",
        "alpha",
        "speedup",
        "speedup_ci_low",
        "cost_ratio",
        "accepted_total",
        "tested_total",
        "draft_params",
        "has_prompts",
    ]
    pd.testing.assert_frame_equal(remote.cells[columns], local.cells[columns])
    key = ["cell", "prompt_key"]
    pd.testing.assert_frame_equal(
        remote.prompts.sort_values(key).reset_index(drop=True), local.prompts.sort_values(key).reset_index(drop=True)
    )
    # a project path reads every run; without artifacts the cells stay, cell-level only
    bare = load_wandb("me/specbench", api=FakeApi(fake_runs(sweep, with_artifacts=False)))
    assert len(bare.cells) == 18 and bare.prompts.empty and not bare.cells["has_prompts"].any()
    fits, _ = fit_mod.fit(bare.cells, bare.prompts)
    small = fits[(fits["label"] == "small") & (fits["sampling"] == "T=0")].iloc[0]
    assert small["alpha"] == pytest.approx(0.6) and small["alpha_method"].startswith("Wilson")
    d = next(d for d in decide_mod.decide(bare.cells, bare.prompts, fits) if d["sampling"] == "T=0")
    assert (d["mix"]["ship"], d["mix"]["k"]) == ("small", 3) and "From cell summaries" in d["mix"]["verdict"]


def test_wandb_project_with_a_swept_dataset_exactness_checks_and_failed_cells(sweep):
    """A project holds more than finished cells: runs whose swept `dataset` group shows as its
    name (its fields in `dataset_config`, as harness.tracking.tracker logs them under `wandb agent`),
    exactness checks (k in their summary, alpha their test level) and failed cells (a summary
    with no metric at all). The first load as cells, the second are not cells, the third are noted."""
    runs = fake_runs(sweep)[:-2]
    for run in runs:
        run.config = {**run.config, "dataset": run.config["dataset"]["name"], "dataset_config": run.config["dataset"]}
    config, summary = runs[0].config, runs[0].summary_metrics
    runs.append(FakeRun("exact", config, {"k": summary["k"], "alpha": 0.01, "status": "finished"}, [], job_type="exactness"))
    runs.append(FakeRun("exact-untyped", config, {"k": summary["k"], "alpha": 0.01, "status": "finished"}, [], job_type=None))
    runs.append(FakeRun("exact-failed", config, {"status": "failed"}, [], state="failed", job_type="exactness"))
    runs.append(FakeRun("failed", config, {"status": "failed"}, [], state="failed"))
    runs.append(FakeRun(summary["cell"], config, {"status": "interrupted"}, [], state="crashed"))  # another run finished it
    runs.append(
        FakeRun("again", config, {**summary, "reused": True}, runs[0]._artifacts)
    )  # a later sweep's run of the complete cell
    loaded = load_wandb("me/specbench", api=FakeApi(runs))
    local = load(sweep)
    assert sorted(loaded.cells["cell"]) == sorted(local.cells["cell"])
    assert list(loaded.cells["dataset"]) == list(local.cells["dataset"]) == ["synthetic"] * len(local.cells)
    assert loaded.notes == ["run failed (failed) is failed: left out"]


def test_prompts_of_two_local_files_are_never_paired(tmp_path):
    """Every local file runs as dataset `local`, and ids like local-0 recur from file to file: a
    file is its own prompt set, named by its file. Cells of one file name are one set, wherever the
    file was, unless the summaries' SHA-256 say they read two contents."""

    def local(path):
        return {
            "dataset": {
                "name": "local",
                "source": "local",
                "path": path,
                "text_field": "turns",
                "template": None,
                "id_field": "question_id",
            }
        }

    def content(cell, digest):
        summary = json.loads((cell / "summary.json").read_text())
        (cell / "summary.json").write_text(json.dumps({**summary, "dataset_sha256": digest}))

    def names():
        results = load(tmp_path)
        return results, dict(zip(results.cells["cell"].str.split("-t").str[0], results.cells["dataset"]))

    content(write_cell(tmp_path, "a", "model", Fraction(4, 5), 2, 0.05, SLOPE, config=local("/data/easy.jsonl")), "ea" * 32)
    b2 = write_cell(tmp_path, "b", "model", Fraction(1, 5), 2, 0.05, SLOPE, seed=1, config=local("/data/hard.jsonl"))
    content(b2, "ab" * 32)
    results, named = names()
    assert named == {"a-k2": "local:easy.jsonl", "b-k2": "local:hard.jsonl"}
    assert results.prompts.groupby("prompt_key")["cell"].nunique().max() == 1
    (d,) = decide_mod.decide(results.cells, results.prompts, None, None, n_resamples=100)
    assert len(d["candidates"]) == 1 and any("no prompt was run by every candidate" in n for n in d["notes"])

    b3 = write_cell(tmp_path, "b", "model", Fraction(1, 5), 3, 0.05, SLOPE, seed=2, config=local("/moved/hard.jsonl"))
    content(b3, "ab" * 32)  # the same content, moved since: one set
    results, named = names()
    assert named["b-k2"] == named["b-k3"] == "local:hard.jsonl" and "dataset_sha256" not in results.cells
    content(b3, "cd" * 32)  # two contents under one name
    _, named = names()
    assert (named["b-k2"], named["b-k3"]) == ("local:hard.jsonl#ababab", "local:hard.jsonl#cdcdcd")


def test_a_dataset_is_named_by_the_settings_that_change_its_text(tmp_path):
    """gsm8k's test and train splits share ids (gsm8k-<row>) but not questions: two sets, named by
    the setting that differs. A dataset's own template concerns that dataset only: cnn_dailymail's
    template does not split a decision over both datasets into two."""

    def hub(name, **fields):
        return {
            "dataset": {
                "name": name,
                "source": "hub",
                "hf_id": f"org/{name}",
                "hf_config": None,
                "split": "test",
                "text_field": "question",
                "template": None,
                "id_field": None,
                **fields,
            }
        }

    def hub_cell(name, seed, dataset, config, category="math"):
        """Draft `name`'s cell (alpha 3/5 for a, 4/5 for the others) on the set `config` describes."""
        alpha = Fraction(3, 5) if name == "a" else Fraction(4, 5)
        return write_cell(
            tmp_path, name, "model", alpha, 2, 0.05, SLOPE, categories=(category,), seed=seed, config=config, dataset=dataset
        )

    hub_cell("a", 0, "g1", hub("gsm8k"))
    hub_cell("b", 1, "g2", hub("gsm8k", split="train"))
    c = hub_cell("c", 2, "g3", hub("gsm8k", path="/data/gsm8k_copy.jsonl"))  # a local copy: its file, whatever its split says
    (c / "summary.json").write_text(json.dumps({**json.loads((c / "summary.json").read_text()), "dataset_sha256": "cc" * 32}))
    hub_cell("d", 3, "g4", hub("gsm8k", template="Q: {question}\nA:"))
    results = load(tmp_path)
    assert sorted(results.cells["dataset"]) == [
        "gsm8k[source=gsm8k_copy.jsonl, template=none]",
        "gsm8k[source=org/gsm8k:test, template=none]",
        "gsm8k[source=org/gsm8k:test, template=sha-" + hashlib.sha256(b"Q: {question}\nA:").hexdigest()[:6] + "]",
        "gsm8k[source=org/gsm8k:train, template=none]",
    ]
    assert results.prompts.groupby("prompt_key")["cell"].nunique().max() == 1
    copies = [
        hub_cell(name, seed, dataset, hub("gsm8k", path="/data/gsm8k_copy.jsonl"))
        for name, seed, dataset in (("e", 4, "g5"), ("f", 5, "g6"))
    ]
    for cell, digest in zip(copies, ("ee" * 32, "ff" * 32)):  # the copy edited between runs: two contents
        (cell / "summary.json").write_text(
            json.dumps({**json.loads((cell / "summary.json").read_text()), "dataset_sha256": digest})
        )
    named = dict(zip(load(tmp_path).cells["cell"].str.split("-t").str[0], load(tmp_path).cells["dataset"]))
    assert (named["c-k2"], named["e-k2"], named["f-k2"]) == ("gsm8k#cccccc", "gsm8k#eeeeee", "gsm8k#ffffff")
    assert named["a-k2"] == "gsm8k[source=org/gsm8k:test, template=none]"  # read from the hub: no file, no content suffix

    shutil.rmtree(tmp_path)
    for name, dataset, category, fields in (
        ("a", "gsm8k", "math", {}),
        ("a", "cnn", "summarization", {"template": "Summarize:\n\n{article}"}),
        ("b", "gsm8k", "math", {}),
        ("b", "cnn", "summarization", {"template": "Summarize:\n\n{article}"}),
    ):
        hub_cell(name, len(list(tmp_path.glob("*"))) if tmp_path.exists() else 0, dataset, hub(dataset, **fields), category)
    results = load(tmp_path)
    assert set(results.cells["dataset"]) == {"gsm8k", "cnn"} and results.cells["setup"].nunique() == 1
    (d,) = decide_mod.decide(results.cells, results.prompts, None, {"math": 0.5, "summarization": 0.5}, n_resamples=100)
    assert d["categories"] == {"math": 6, "summarization": 6} and d["weights"] == {"math": 0.5, "summarization": 0.5}


def test_a_decision_from_summaries_compares_cells_of_one_prompt_set(tmp_path):
    """Without per-prompt rows there is nothing to pair: a cell measured on another prompt set
    (here an easier one) is left out and named, not ranked against the others."""
    write_cell(tmp_path, "a", "model", Fraction(3, 5), 2, 0.05, SLOPE, dataset="hard")
    write_cell(tmp_path, "b", "model", Fraction(4, 5), 2, 0.05, SLOPE, seed=1, dataset="hard")
    write_cell(tmp_path, "a", "model", Fraction(9, 10), 4, 0.01, SLOPE, seed=2, dataset="easy")
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells.assign(has_prompts=False), results.prompts.iloc[:0], None, None)
    assert {(c["label"], c["k"]) for c in d["candidates"]} == {("a", 2), ("b", 2)}
    assert (d["mix"]["ship"], d["mix"]["k"]) == ("b", 2)
    assert any("decided on hard" in n and "a k=4 (easy)" in n for n in d["notes"])


def test_a_decision_from_summaries_leaves_out_cells_on_fewer_or_other_prompts(tmp_path):
    """quick ran 3 easy prompts (chat) of the 12 full ran: on summaries alone its speedup looked best,
    though full is the better draft on chat. Then two cells of one size on other prompt ids."""
    write_cell(tmp_path, "full", "model", Fraction(4, 5), 2, 0.05, SLOPE, alphas={"code": Fraction(1, 5)}, seed=1)
    write_cell(tmp_path, "quick", "model", Fraction(7, 10), 2, 0.05, SLOPE, categories=("chat",), per_category=3, seed=2)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells.assign(has_prompts=False), results.prompts.iloc[:0], None, None)
    assert [c["label"] for c in d["candidates"]] == ["full"] and d["mix"]["ship"] == "full"
    assert any("fewer than half the prompts of the median candidate: quick k=2 (3 prompts)" in n for n in d["notes"])

    other = write_cell(tmp_path, "other", "model", Fraction(9, 10), 2, 0.05, SLOPE, seed=3)
    summary = json.loads((other / "summary.json").read_text())  # 12 prompts, but not the same 12
    (other / "summary.json").write_text(json.dumps({**summary, "prompt_ids": [f"x{i}" for i in range(12)]}))
    write_cell(tmp_path, "b", "model", Fraction(3, 5), 2, 0.05, SLOPE, alphas={"code": Fraction(1, 5)}, seed=4)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells.assign(has_prompts=False), results.prompts.iloc[:0], None, None)
    assert sorted(c["label"] for c in d["candidates"]) == ["b", "full"]
    assert any("run on other prompts of synthetic: other k=2" in n for n in d["notes"])


def test_report_from_wandb_logs_figures_back(sweep, tmp_path, monkeypatch):
    import wandb

    logged = {}

    class Run:
        dir, url = str(tmp_path), "https://wandb.example/run"

        def log(self, data):
            logged.update(data)

        def log_artifact(self, artifact):
            logged["artifact"] = artifact

        def finish(self):
            logged["finished"] = True

    def fake_init(**kwargs):
        logged["init"] = kwargs
        return Run()

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(wandb, "init", fake_init)
    document = report.build("me/specbench/abc123", tmp_path / "out", {"n_resamples": 200}, api=FakeApi(fake_runs(sweep)))
    assert logged["init"]["job_type"] == "report" and logged["init"]["group"] == "abc123"
    assert {"report/speedup_vs_k", "report/decision", "report/fits"} <= set(logged) and logged["finished"]
    assert isinstance(logged["report/speedup_vs_k"], wandb.Image)
    assert (tmp_path / "out" / "report.md").exists() and document["kind"] == "wandb"


# The command


def test_report_command_on_a_synthetic_sweep_writes_one_folder(sweep, tmp_path, capsys):
    out = tmp_path / "rep"
    code = report.main(
        [
            str(sweep),
            "--out",
            str(out),
            "--weights",
            "chat=0.7,code=0.3",
            "--resamples",
            "300",
            "--cost-ratio",
            "big=0.02",
            "--whatif-name",
            "H100",
        ]
    )
    assert code == 0
    assert "Ship small with k=3" in capsys.readouterr().out
    for name in ("report.md", "cells.csv", "fits.csv", "decision.json", "whatif.csv"):
        assert (out / name).stat().st_size > 0
    text = (out / "report.md").read_text()
    for heading in ("## Decision", "## Fitted model", "## What-if", "## Cells", "## Figures", "## Definitions"):
        assert heading in text
    assert "**H100**" in text and "![speedup_vs_k](figures/speedup_vs_k.png)" in text
    decision = json.loads((out / "decision.json").read_text())
    assert {d["sampling"] for d in decision["decisions"]} == {"T=0", "T=1"}
    assert len(pd.read_csv(out / "cells.csv")) == 18
    assert report.main([str(tmp_path / "missing" / "a" / "b" / "c")]) == 2  # no such results directory
    assert report.main([str(sweep), "--weights", "chat"]) == 2
    assert "expected NAME=NUMBER" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--max-k", "0"], "max_k=0 must be a whole number of at least 1"),
        (["--resamples", "0"], "resamples=0 must be a whole number of at least 2"),
        (["--resamples", "-1"], "resamples=-1 must be"),
        (["--draft-step-ms", "2.5"], "needs the target's step time on that machine too: add --target-step-ms"),
        (["--draft-step-ms", "big=2.5", "--cost-ratio", "small=0.1"], "needs the target's step time"),
        (["--cost-ratio", "-1"], "whatif.cost_ratio=-1.0 must be at least 0"),
        (["--verify-slope", "-1"], "whatif.verify_slope=-1.0 must be at least 0"),
        (["--target-step-ms", "-5", "--draft-step-ms", "2"], "whatif.target_step_ms=-5.0 must be above 0"),
        (
            ["--cost-ratio", "nosuch=0.04"],
            "whatif.cost_ratio names nosuch, which is no draft in these results; the drafts are: big, lookup, small",
        ),
        (["--weights", "chat=0,code=0"], "are all zero"),
        (["--weights", "chat=inf,code=1"], "must be finite numbers"),
        (["--weights", "chat=nan,code=1"], "must be finite numbers"),
    ],
)
def test_a_bad_setting_is_one_line_before_any_work(sweep, tmp_path, capsys, flags, says):
    out = tmp_path / "rep"
    assert report.main([str(sweep), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "text, says",
    [
        ("weigths: {code: 1}\n", "unknown setting weigths; known are weights"),
        ("whatif: {cost_ratoi: 0.1}\n", "unknown setting whatif.cost_ratoi"),
        ("weights: {code: abc}\n", "must map categories to numbers"),
        ("weights: [1, 2]\n", "--config"),
        ("weights: {code: 1\n", "does not parse"),
        ("confidence: abc\n", "confidence=abc must be in (0, 1)"),
        ("whatif: 5\n", "whatif must be a mapping"),
    ],
)
def test_a_bad_settings_file_is_one_line_before_any_work(sweep, tmp_path, capsys, text, says):
    (tmp_path / "bad.yaml").write_text(text)
    out = tmp_path / "rep"
    assert report.main([str(sweep), "--out", str(out), "--config", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_settings_file_with_whatif_null_keeps_the_defaults(tmp_path):
    (tmp_path / "s.yaml").write_text("whatif: null\n")
    assert (
        report.settings(report.parser().parse_args(["results", "--config", str(tmp_path / "s.yaml")]))["whatif"]["name"]
        == "other hardware"
    )


def test_a_draft_step_time_with_its_cost_ratio_given_needs_no_target_step():
    args = report.parser().parse_args(["results", "--draft-step-ms", "big=2.5", "--cost-ratio", "big=0.1,small=0.2"])
    assert report.settings(args)["whatif"]["draft_step_ms"] == {"big": 2.5}


def test_a_tilde_in_the_report_folder_is_the_home_folder(sweep, tmp_path, monkeypatch):
    """bash leaves `--out=~/rep` unexpanded: the report goes to $HOME/rep, not to a folder named ~."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert report.main([str(sweep), "--out=~/rep", "--resamples", "300", "--no-wandb-log"]) == 0
    assert (tmp_path / "home" / "rep" / "report.md").exists() and not (tmp_path / "~").exists()


def test_an_unknown_alpha_is_said_to_be_unknown(tmp_path):
    """A prompt lookup that never matched tested nothing: alpha is NaN, and the report says so rather than
    claiming that even a free draft could not pay."""
    cell = write_cell(tmp_path, "lookup", "ngram", Fraction(1, 4), 2, 0.002, SLOPE, time_factors=[1.02])
    records = [json.loads(line) for line in (cell / "prompts.jsonl").read_text().splitlines()]
    for r in records:
        r["spec"].update(
            accepted=0,
            tested=0,
            drafted=0,
            accept_hist=[r["spec"]["cycles"], 0, 0],
            position_reached=[0, 0],
            position_accepted=[0, 0],
            expected_sum=0.0,
        )
    (cell / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = json.loads((cell / "summary.json").read_text())
    (cell / "summary.json").write_text(json.dumps({**summary, "alpha": float("nan"), "accept_hist": [100, 0, 0]}))
    results = load(tmp_path)
    fits, _ = fit_mod.fit(results.cells, results.prompts, 0.95, 300, 0)
    (d,) = decide_mod.decide(results.cells, results.prompts, fits, None, n_resamples=300)
    changes = " ".join(d["mix"]["what_would_change"])
    assert "α is unknown" in changes and "even a free draft" not in changes


@pytest.mark.cli
def test_end_to_end_on_a_tiny_multirun(tiny_pair, tmp_path, capsys):
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    sweep_dir = tmp_path / "multirun"
    start = time.perf_counter()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "-m",
            "+pair=llama_7b_68m",
            f"pair.target.id={tiny_pair['target']}",
            f"pair.draft.id={tiny_pair['draft']}",
            "pair.draft.kind=model,ngram",
            "k=1,2",
            "dataset.num_prompts=3",
            "max_new_tokens=8",
            f"out_dir={tmp_path / 'results'}",
            f"hydra.sweep.dir={sweep_dir}",
            "cpu_linear=transposed",
        ],  # pinned: auto times each pair's tiny layers at load, and on a busy machine two
        # pairs could get different products, which the report keeps apart as two setups (two decisions)
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    sweep_s = time.perf_counter() - start
    # `python -m analysis.report` is report.main; called in-process it skips a second torch import (seconds here)
    assert report.main([str(sweep_dir), "--resamples", "300"]) == 0
    folder = sweep_dir / "report"
    assert f"report: {folder / 'report.md'}" in capsys.readouterr().out
    cells = pd.read_csv(folder / "cells.csv")
    assert len(cells) == 4 and set(cells["draft_kind"]) == {"model", "ngram"}
    assert set(cells["label"]) == {"llama_7b_68m/draft", "llama_7b_68m/ngram(1-3)"}
    assert cells.loc[cells["draft_kind"] == "ngram", "draft_params"].eq(0).all()
    assert cells.loc[cells["draft_kind"] == "model", "draft_params"].gt(0).all()  # recorded by the run itself
    assert len(pd.read_csv(folder / "fits.csv")) == 2
    (decision,) = json.loads((folder / "decision.json").read_text())["decisions"]
    assert decision["mix"]["verdict"].startswith("Ship")
    assert decision["mix"]["runner_up"] is not None  # two drafts compared
    pngs = sorted((folder / "figures").glob("*.png"))
    assert len(pngs) == 8 and all(p.stat().st_size > 5_000 for p in pngs)
    text = (folder / "report.md").read_text()
    assert "## Decision" in text and "llama_7b_68m/ngram" in text
    print(f"tiny multirun {sweep_s:.1f}s")


# Contexts: one target, one sampling setting, one set of run conditions


CPU = {"device": "cpu", "device_name": "Synthetic CPU", "dtype": "float32", "threads": 2, "forward": "hf"}


def test_a_context_and_a_fit_hold_one_device(tmp_path):
    """A fast GPU and a slow CPU: "a" wins on the GPU, "b" on the CPU; pooled, each device's
    decision and fit would be some of both."""
    write_cell(tmp_path / "gpu", "a", "model", Fraction(3, 5), 2, 0.05, SLOPE)
    write_cell(tmp_path / "gpu", "b", "model", Fraction(1, 2), 2, 0.05, SLOPE, seed=2)
    write_cell(tmp_path / "cpu", "a", "model", Fraction(3, 5), 2, 0.60, SLOPE, seed=1, conditions=CPU, tag="-cpu")
    write_cell(tmp_path / "cpu", "b", "model", Fraction(1, 2), 2, 0.10, SLOPE, seed=3, conditions=CPU, tag="-cpu")
    results = load(tmp_path)
    assert len(results.cells) == 4 and results.cells["cell"].is_unique and not results.notes
    assert len(results.prompts) == 4 * 12
    fits, _ = fit_mod.fit(results.cells, results.prompts, n_resamples=100)
    assert sorted(fits["cost_ratio"]) == pytest.approx([0.05, 0.05, 0.10, 0.60])
    decisions = decide_mod.decide(results.cells, results.prompts, fits, None, n_resamples=200)
    shipped = {d["device_name"]: d["mix"]["ship"] for d in decisions}
    assert shipped == {"Synthetic GPU": "a", "Synthetic CPU, 2 threads": "b"}
    assert all(d["prompts"] == 12 and "device=Synthetic" in d["context"] for d in decisions)
    # a second copy of one cell on one device is a duplicate
    shutil.copytree(tmp_path / "gpu" / "a-k2-t0.0-synthetic", tmp_path / "again" / "a-k2-t0.0-synthetic")
    again = load(tmp_path)
    assert len(again.cells) == 4 and any("found twice" in n for n in again.notes)


def test_one_cell_key_under_two_device_labels_keeps_both(tmp_path):
    """cpu_linear=auto picks a CPU's linear product as the models load: one cell key run in two results
    folders can carry two device labels. Both cells are kept, each `cell` suffixed by its device."""
    for folder, linear in (("torch", {"product": "torch"}), ("transposed", {"product": "transposed"})):
        write_cell(
            tmp_path / folder, "a", "model", Fraction(3, 5), 2, 0.05, SLOPE, per_category=3, conditions={**CPU, "linear": linear}
        )
    results = load(tmp_path)
    assert sorted(results.cells["cell"]) == [
        "a-k2-t0.0-synthetic@Synthetic CPU, 2 threads",
        "a-k2-t0.0-synthetic@Synthetic CPU, 2 threads, W @ x.T",
    ]
    assert not results.notes and results.prompts["cell"].nunique() == 2


def two_setups(root: Path, first: dict, second: dict):
    """Draft a's cell at k=2 written twice under `root`, with `first`'s and then `second`'s write_cell
    settings (the second's cell key tagged -other), and loaded."""
    for settings, tag in ((first, ""), (second, "-other")):
        config = {"cache": "dynamic", "compile": False}
        write_cell(root, "a", "model", Fraction(3, 5), 2, 0.05, SLOPE, per_category=3, tag=tag, **{"config": config, **settings})
    return load(root)


@pytest.mark.parametrize(
    "change",
    [
        {"conditions": {**GPU, "dtype": "float16"}},
        {"config": {"max_new_tokens": 256}},
        {"config": {"cache": "static"}},
        {"config": {"compile": True}},
        {"config": {"prompts": {"template": "raw"}}},  # other text under the same ids
        {"conditions": {**GPU, "forward": "lean"}},
    ],
)
def test_each_run_condition_splits_contexts_and_fits(tmp_path, change):
    results = two_setups(tmp_path, {}, change)
    assert results.cells["setup"].nunique() == 2
    fits, _ = fit_mod.fit(results.cells, results.prompts, n_resamples=50)
    assert len(fits) == 2
    assert len(decide_mod.decide(results.cells, results.prompts, fits, None, n_resamples=50)) == 2


def test_cpu_threads_split_contexts(tmp_path):
    """A CPU's timings depend on its torch threads, which the harness keys cells by:
    the same CPU at 2 and at 4 threads is two setups, never pooled."""
    results = two_setups(tmp_path, {"conditions": {**CPU, "threads": 2}}, {"conditions": {**CPU, "threads": 4}})
    assert results.cells["setup"].nunique() == 2
    assert {"Synthetic CPU, 2 threads", "Synthetic CPU, 4 threads"} == set(results.cells["device_name"])
    fits, _ = fit_mod.fit(results.cells, results.prompts, n_resamples=50)
    assert len(fits) == 2


def test_the_cpu_linear_product_splits_contexts(tmp_path):
    """cpu_linear changes a CPU's step times as much as its threads do: cells run with the
    transposed product are another setup than those with torch's."""
    results = two_setups(
        tmp_path,
        {"conditions": {**CPU, "linear": {"product": "torch"}}},
        {"conditions": {**CPU, "linear": {"product": "transposed"}}},
    )
    assert sorted(results.cells["device_name"]) == ["Synthetic CPU, 2 threads", "Synthetic CPU, 2 threads, W @ x.T"]
    assert results.cells["setup"].nunique() == 2


def test_ship_rule_ships_the_best_confident_candidate(tmp_path):
    """ "a" measures highest but varies wildly by prompt; "b" is a little slower and steady."""
    wild = [0.45, 0.5, 0.55, 1.9, 1.0, 0.5, 0.45, 0.5, 0.55, 1.9, 1.0, 0.5]  # a's time / the baseline's, prompt by prompt
    write_cell(tmp_path, "a", "model", Fraction(3, 5), 2, 0.05, SLOPE, time_factors=wild)
    write_cell(tmp_path, "b", "model", Fraction(3, 5), 2, 0.30, SLOPE, seed=5)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, None, n_resamples=1000)
    a, b = sorted(d["candidates"], key=lambda c: c["label"])
    assert a["speedup"] > b["speedup"] and a["low"] < 1 < b["low"]
    mix = d["mix"]
    assert (mix["ship"], mix["k"], mix["best"]["label"], mix["top"]["label"]) == ("b", 2, "b", "a")
    assert mix["verdict"].startswith("Ship b with k=2")
    assert "a k=2 measures higher" in mix["verdict"] and "not confidently faster than the baseline" in mix["verdict"]


def test_a_short_exploratory_cell_does_not_shrink_the_comparison(tmp_path):
    write_cell(tmp_path, "a", "model", Fraction(3, 5), 2, 0.05, SLOPE, per_category=12)
    write_cell(tmp_path, "b", "model", Fraction(4, 5), 2, 0.25, SLOPE, per_category=12, seed=1)
    write_cell(tmp_path, "a", "model", Fraction(3, 5), 4, 0.05, SLOPE, per_category=1, seed=2, categories=("chat", "code", "qa"))
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, None, n_resamples=300)
    assert d["prompts"] == 24 and d["categories"] == {"chat": 12, "code": 12}
    assert {(c["label"], c["k"]) for c in d["candidates"]} == {("a", 2), ("b", 2)}
    assert any("left out" in n and "a k=4 (3 prompts)" in n for n in d["notes"])
    assert (d["mix"]["ship"], d["mix"]["k"]) == ("a", 2)


def test_a_cell_with_more_prompts_than_the_rest_pushes_nobody_out(tmp_path):
    """Coverage is judged against the median candidate: a longer cell (a superset of the others'
    prompts) is compared on the shared prompts, not made the yardstick that leaves the sweep out."""
    write_cell(tmp_path, "a", "model", Fraction(1, 2), 2, 0.1, SLOPE, categories=("chat",), per_category=12)
    write_cell(tmp_path, "b", "model", Fraction(3, 4), 2, 0.05, SLOPE, categories=("chat",), per_category=12, seed=1)
    write_cell(tmp_path, "a", "model", Fraction(1, 2), 4, 0.1, SLOPE, categories=("chat",), per_category=30, seed=2)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, None, n_resamples=300)
    assert {(c["label"], c["k"]) for c in d["candidates"]} == {("a", 2), ("b", 2), ("a", 4)}
    assert d["prompts"] == 12 and not any("left out" in n for n in d["notes"])
    assert (d["mix"]["ship"], d["mix"]["k"]) == ("b", 2)


def test_of_two_candidates_the_one_that_ran_more_prompts_pushes_nobody_out(tmp_path):
    """Two drafts: a ran 10 prompts, b all 36 (a superset). The median of two is halfway, so b alone was
    the yardstick and a, the faster draft, was left out as exploratory. With two candidates neither is
    the typical one: they are paired on a's 10 prompts and a ships."""
    write_cell(tmp_path, "a", "model", Fraction(4, 5), 2, 0.05, SLOPE, categories=("chat",), per_category=10)
    write_cell(tmp_path, "b", "model", Fraction(1, 2), 2, 0.1, SLOPE, categories=("chat",), per_category=36, seed=1)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, None, n_resamples=300)
    assert {(c["label"], c["k"]) for c in d["candidates"]} == {("a", 2), ("b", 2)}
    assert d["prompts"] == 10 and not any("left out" in n for n in d["notes"])
    assert (d["mix"]["ship"], d["mix"]["k"]) == ("a", 2)


def renumber(cell: Path, offset: int) -> None:
    """Shift a single-category cell's prompt ids by `offset` (chat-00 -> chat-<offset>), in its rows and its summary."""
    records = [json.loads(line) for line in (cell / "prompts.jsonl").read_text().splitlines()]
    for r in records:
        category, number = r["id"].rsplit("-", 1)
        r["id"] = f"{category}-{int(number) + offset:02d}"
    (cell / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = json.loads((cell / "summary.json").read_text())
    (cell / "summary.json").write_text(json.dumps({**summary, "prompt_ids": [r["id"] for r in records]}))


def test_a_candidates_cells_are_combined_prompt_by_prompt(tmp_path):
    """a ran chat-00..15 in one cell and chat-15..24 in another, b ran chat-15..24. Keeping a's larger
    cell paired a and b on the one prompt chat-15: no interval, "ship no speculation". a's cells are one
    candidate: combined prompt by prompt, a and b pair on all ten of b's prompts and a ships."""
    write_cell(tmp_path, "a", "model", Fraction(4, 5), 2, 0.05, SLOPE, categories=("chat",), per_category=16, tag="-big")
    small = write_cell(tmp_path, "a", "model", Fraction(4, 5), 2, 0.05, SLOPE, categories=("chat",), per_category=10, seed=1)
    b = write_cell(tmp_path, "b", "model", Fraction(1, 2), 2, 0.1, SLOPE, categories=("chat",), per_category=10, seed=2)
    renumber(small, 15)
    renumber(b, 15)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, None, n_resamples=300)
    assert d["prompts"] == 10 and {(c["label"], c["k"]) for c in d["candidates"]} == {("a", 2), ("b", 2)}
    assert (d["mix"]["ship"], d["mix"]["k"]) == ("a", 2)
    assert any(n.startswith("a k=2 on synthetic: 2 cells, combined prompt by prompt (25 prompts;") for n in d["notes"])


def test_a_decision_from_summaries_uses_a_candidates_cell_on_the_compared_prompts(tmp_path):
    """Without per-prompt rows: a ran all 12 prompts in one cell and the 6 that b and c ran in another.
    Keeping a's largest cell first, then the prompt set most ran, left a out although it has a cell on
    exactly that set."""
    write_cell(tmp_path, "a", "model", Fraction(4, 5), 2, 0.05, SLOPE, categories=("chat",), per_category=12, tag="-all")
    write_cell(tmp_path, "a", "model", Fraction(4, 5), 2, 0.05, SLOPE, categories=("chat",), per_category=6, seed=1)
    write_cell(tmp_path, "b", "model", Fraction(3, 5), 2, 0.05, SLOPE, categories=("chat",), per_category=6, seed=2)
    write_cell(tmp_path, "c", "model", Fraction(1, 2), 2, 0.05, SLOPE, categories=("chat",), per_category=6, seed=3)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells.assign(has_prompts=False), results.prompts.iloc[:0], None, None)
    assert {(c["label"], c["k"]) for c in d["candidates"]} == {("a", 2), ("b", 2), ("c", 2)}
    cells = results.cells.set_index("cell")
    a = next(c for c in d["candidates"] if c["label"] == "a")
    assert a["speedup"] == cells.loc["a-k2-t0.0-synthetic", "speedup"] and d["prompts"] == 6
    assert (d["mix"]["ship"], d["mix"]["k"]) == ("a", 2) and not any("other prompts" in n for n in d["notes"])


def test_greedy_cells_are_one_context_whatever_their_top_k_and_top_p(tmp_path):
    """At temperature 0 the harness decodes greedily (argmax) and ignores top_k and top_p: two greedy
    drafts run with other top_k settings are compared in one decision, not given one each."""
    from analysis.names import sampling_name

    write_cell(tmp_path, "a", "model", Fraction(3, 5), 2, 0.05, SLOPE)
    for name, setting, seed in (("b", {"top_k": 50}, 1), ("c", {"top_k": 50, "top_p": 0.9}, 2)):
        out = write_cell(tmp_path, name, "model", Fraction(4, 5), 2, 0.05, SLOPE, seed=seed, config=setting)
        summary = json.loads((out / "summary.json").read_text())
        (out / "summary.json").write_text(json.dumps({**summary, **setting}))
    results = load(tmp_path)
    assert set(results.cells["sampling"]) == {"T=0"}
    (d,) = decide_mod.decide(results.cells, results.prompts, None, None, n_resamples=200)
    assert {c["label"] for c in d["candidates"]} == {"a", "b", "c"} and d["sampling"] == "T=0"
    fits, _ = fit_mod.fit(results.cells, results.prompts, n_resamples=50)
    assert len(fits) == 3 and set(fits["sampling"]) == {"T=0"}
    assert sampling_name(1.0, 50, 0.9) == "T=1 top_k=50 top_p=0.9"  # sampling keeps them


def test_either_is_defensible_only_when_the_runner_up_beats_the_baseline():
    choice = {
        "ship": "a",
        "k": 2,
        "top": None,
        "best": {"label": "a", "k": 2, "speedup": 1.33, "low": 1.23, "high": 1.44},
        "comparison": {"ratio": 1.2, "low": 0.98, "high": 1.47, "wilcoxon_p": 0.28, "prompts": 12, "significant": False},
    }
    uncertain = ship.verdict({**choice, "runner_up": {"label": "b", "k": 2, "speedup": 1.1, "low": 0.96, "high": 1.28}}, 0.95)
    assert "defensible" not in uncertain and "b k=2 is not confidently faster than the baseline" in uncertain
    confident = ship.verdict({**choice, "runner_up": {"label": "b", "k": 2, "speedup": 1.2, "low": 1.05, "high": 1.3}}, 0.95)
    assert confident.endswith("either is defensible.")


def test_alpha_interval_leaves_out_prompts_that_tested_nothing():
    accepted, tested = np.array([14.0, 10.0, 0.0]), np.array([20.0, 20.0, 0.0])  # lookup never matched the third
    interval = fit_mod.alpha_interval(accepted, tested, n_resamples=500)
    assert interval.value == pytest.approx(0.6) and interval.low == pytest.approx(0.5) and interval.high == pytest.approx(0.7)
    assert "1 that tested nothing" in interval.method


def test_weights_of_one_context_leave_the_others_on_equal_weights(tmp_path):
    write_cell(tmp_path, "a", "model", Fraction(3, 5), 2, 0.05, SLOPE)
    mt_bench = {"temperature": 1.0, "categories": ("writing", "roleplay"), "dataset": "mt_bench"}  # a second context
    write_cell(tmp_path, "a", "model", Fraction(3, 5), 2, 0.05, SLOPE, **mt_bench)
    results = load(tmp_path)
    t0, t1 = decide_mod.decide(results.cells, results.prompts, None, {"chat": 0.7, "code": 0.3}, n_resamples=100)
    assert t0["weights"] == pytest.approx({"chat": 0.7, "code": 0.3})
    assert t1["weights"] == {"roleplay": 0.5, "writing": 0.5}
    assert any("none of which is measured here" in n for n in t1["notes"])
    with pytest.raises(HarnessError, match="no traffic weight falls on a measured category"):
        decide_mod.decide(results.cells, results.prompts, None, {"math": 1.0}, n_resamples=100)


def test_a_mistyped_local_path_is_not_taken_for_wandb(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    for path in ("multirun/2026-11-29/12-00-0", "12-00-00.123456", "./multirun/x", "results/typo", str(tmp_path / "resluts")):
        assert report.main([path]) == 2
        assert capsys.readouterr().err == f"error: no such results directory: {path}\n"
    with pytest.raises(HarnessError, match="no finished benchmark run in W&B"):  # still a W&B path
        load("me/specbench/abc123", api=FakeApi([]))


def test_a_config_file_replaces_the_traffic_mix_and_whatif_maps(tmp_path, monkeypatch):
    default = tmp_path / "report.yaml"
    default.write_text(
        "weights: {conversation: 0.5, code: 0.3, qa: 0.2}\n"
        "whatif: {name: A100, cost_ratio: {big: 0.1}, draft_step_ms: {big: 2.0}, target_step_ms: 20.0}\n"
    )
    monkeypatch.setattr(report, "DEFAULT_CONFIG", default)
    product = tmp_path / "product.yaml"
    product.write_text("weights: {math: 0.9, code: 0.1}\nwhatif: {cost_ratio: {small: 0.02}}\n")
    cfg = report.settings(report.parser().parse_args(["results", "--config", str(product)]))
    assert cfg["weights"] == {"math": 0.9, "code": 0.1}
    assert cfg["whatif"]["cost_ratio"] == {"small": 0.02}
    assert (cfg["whatif"]["name"], cfg["whatif"]["draft_step_ms"]) == ("A100", {"big": 2.0})  # not defined: kept
    product.write_text("confidence: 0.9\n")
    cfg = report.settings(report.parser().parse_args(["results", "--config", str(product)]))
    assert cfg["weights"] == {"conversation": 0.5, "code": 0.3, "qa": 0.2} and cfg["confidence"] == 0.9


# One report over two targets, at --confidence 0.8 and --max-k 8


@pytest.fixture(scope="module")
def two_targets(tmp_path_factory):
    """report.main over "small" and "big" on org/target and "small" on org/other; the figures kept open."""
    import analysis.figures as figures_mod

    root = tmp_path_factory.mktemp("two_targets")
    for k in (1, 2):
        write_cell(root, "small", "model", Fraction(3, 5), k, 0.05, SLOPE, seed=k, params=1000)
        write_cell(root, "big", "model", Fraction(4, 5), k, 0.25, SLOPE, seed=10 + k, params=5000)
        write_cell(
            root, "small", "model", Fraction(3, 5), k, 0.40, SLOPE, seed=20 + k, params=1000, target="org/other", tag="-other"
        )
    drawn = {}
    save = figures_mod.save_figure
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(figures_mod, "save_figure", lambda fig, path: drawn.setdefault(path.stem, fig) and save(fig, path))
        mp.setattr(figures_mod.plt, "close", lambda fig=None: None)
        assert (
            report.main([str(root), "--out", str(root / "rep"), "--confidence", "0.8", "--max-k", "8", "--resamples", "200"]) == 0
        )
    yield root / "rep", drawn
    import matplotlib.pyplot as plt

    plt.close("all")


def _section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_figures_and_tables_keep_targets_apart(two_targets):
    out, drawn = two_targets
    legend = [t.get_text() for t in drawn["speedup_vs_k"].legends[0].get_texts()]
    assert sorted(legend) == ["big · org/target", "small · org/other", "small · org/target"]
    (ax,) = drawn["speedup_vs_k"].axes
    slow = next(line for line in ax.get_lines() if line.get_label() == "small · org/other")
    assert list(slow.get_xdata()) == [1, 2] and max(slow.get_ydata()) < 1.3  # org/other's cells alone (c = 0.4)
    text = (out / "report.md").read_text()
    for heading in ("## Fitted model", "## Cells"):
        section = _section(text, heading)
        assert "| target / conditions |" in section
        assert "| org/other | small |" in section and "| org/target | small |" in section
    assert "### org/other · T=0" in text and "### org/target · T=0" in text


def test_cell_intervals_are_labelled_at_the_harness_level(two_targets, sweep):
    out, _ = two_targets
    text = (out / "report.md").read_text()
    assert "| 95% CI |" in _section(text, "## Cells") and "80% CI" not in _section(text, "## Cells")
    assert "| 80% CI |" in _section(text, "## Decision")
    # without per-prompt rows the decision's intervals are the cells' own 95%
    results = load(sweep)
    cells = results.cells.assign(has_prompts=False)
    d = next(d for d in decide_mod.decide(cells, results.prompts.iloc[:0], None, None, confidence=0.8) if d["sampling"] == "T=0")
    assert d["confidence"] == 0.95 and "(95% interval)" in d["mix"]["verdict"]
    assert any("not 80%" in n for n in d["notes"])


def test_max_k_reaches_the_text_and_the_figures(two_targets):
    out, drawn = two_targets
    text = (out / "report.md").read_text()
    assert "≤ 16" not in text and "1..16" not in text
    assert "for k ≤ 8" in _section(text, "## Fitted model") and "k = 1..8" in text
    decisions = json.loads((out / "decision.json").read_text())["decisions"]
    lines = [line for d in decisions for line in d["mix"]["what_would_change"] if "pays off" in line]
    assert lines and all("some k ≤ 8)" in line for line in lines)
    left, right = drawn["fitted_model"].axes[:2]
    assert "k ≤ 8" in left.get_title()
    assert max(max(line.get_xdata()) for line in right.get_lines()) == 9  # v(k + 1) up to k = max_k


def test_without_common_prompts_the_draft_that_ran_both_datasets_meets_the_others(tmp_path):
    """a ran dataset x, b ran y, c ran both: no prompt is common to all. Grouping only identical
    prompt sets dropped c (the best draft on x) and shipped a; on x, c meets a and wins."""
    for k in (1, 2):
        write_cell(tmp_path, "a", "model", Fraction(3, 5), k, 0.05, SLOPE, dataset="x", seed=k)
        write_cell(tmp_path, "b", "model", Fraction(3, 5), k, 0.05, SLOPE, dataset="y", seed=10 + k)
    for dataset, seed in (("x", 21), ("y", 22)):
        write_cell(tmp_path, "c", "model", Fraction(4, 5), 2, 0.05, SLOPE, dataset=dataset, seed=seed)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, None, n_resamples=200)
    assert {(c["label"], c["k"]) for c in d["candidates"]} == {("a", 1), ("a", 2), ("c", 2)}
    assert d["mix"]["best"]["label"] == "c" and any("left out: b k=1, b k=2" in n for n in d["notes"])


def test_a_draft_that_ran_one_dataset_of_two_is_compared_not_left_out(tmp_path):
    """Coverage is per dataset: b ran all of dataset x and none of y, a ran both. b is a full run of x,
    so it is paired with a on x's prompts rather than dropped as exploratory for having fewer prompts."""
    for k in (1, 2, 3):
        write_cell(tmp_path, "a", "model", Fraction(1, 2), k, 0.1, SLOPE, per_category=6, dataset="x", seed=k)
        write_cell(tmp_path, "a", "model", Fraction(1, 2), k, 0.1, SLOPE, per_category=15, dataset="y", seed=10 + k)
    for k in (1, 2):
        write_cell(tmp_path, "b", "model", Fraction(9, 10), k, 0.05, SLOPE, per_category=6, dataset="x", seed=20 + k)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, None, n_resamples=300)
    assert {(c["label"], c["k"]) for c in d["candidates"]} == {("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2)}
    assert d["prompts"] == 12 and not any("left out" in n for n in d["notes"])
    assert any("paired on the 12 all ran" in n for n in d["notes"])
    assert d["mix"]["ship"] == "b"


def test_a_candidate_without_a_weighted_category_is_left_out_not_the_category(tmp_path):
    """Pairing on the prompts every candidate ran would drop code for all when b ran only chat: the
    verdict for a 70%-code mix would then come from chat alone. b is left out instead; where every
    candidate lacks a weighted category some other ran, the verdict says what it was decided without."""
    write_cell(tmp_path, "a", "model", Fraction(3, 5), 2, 0.05, 0.02)
    write_cell(tmp_path, "b", "model", Fraction(4, 5), 2, 0.05, 0.02, categories=("chat",), seed=1)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, {"chat": 0.3, "code": 0.7}, n_resamples=100)
    assert d["categories"] == {"chat": 6, "code": 6} and d["weights"] == pytest.approx({"chat": 0.3, "code": 0.7})
    assert [c["label"] for c in d["candidates"]] == ["a"] and d["mix"]["best"]["label"] == "a"
    assert (
        "left out, no prompts in weighted categories other candidates ran (10% of the traffic weight or more): "
        "b k=2 (no code: 70%)" in d["notes"]
    )
    assert "Decided without" not in d["mix"]["verdict"]
    # A category of 1% of the traffic does not push b out: the comparison goes without it, and says so.
    (d,) = decide_mod.decide(results.cells, results.prompts, None, {"chat": 0.99, "code": 0.01}, n_resamples=100)
    assert {c["label"] for c in d["candidates"]} == {"a", "b"} and d["categories"] == {"chat": 6}
    assert d["mix"]["verdict"].endswith("Decided without code (1% of the traffic weight): see the notes.")

    write_cell(tmp_path, "c", "model", Fraction(4, 5), 2, 0.05, 0.02, categories=("chat", "math"), seed=2)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, {"chat": 0.3, "code": 0.5, "math": 0.2}, n_resamples=100)
    assert d["categories"] == {"chat": 6}  # a lacks math, b and c code: no candidate can be kept for all
    assert d["mix"]["verdict"].endswith("Decided without code, math (70% of the traffic weight): see the notes.")
    assert any(n.startswith("not run by every candidate, so not in the paired comparison: code, math (70%") for n in d["notes"])


def test_a_category_only_a_left_out_candidate_ran_is_not_called_unmeasured(tmp_path):
    """b ran only math, on another dataset, and shares no prompt with a and c: it is left out, and math is
    'not run by every candidate', not 'no measurements'."""
    write_cell(tmp_path, "a", "model", Fraction(3, 5), 2, 0.05, 0.02, dataset="x")
    write_cell(tmp_path, "c", "model", Fraction(4, 5), 2, 0.05, 0.02, dataset="x", seed=2)
    write_cell(tmp_path, "b", "model", Fraction(4, 5), 2, 0.05, 0.02, categories=("math",), dataset="y", seed=1)
    results = load(tmp_path)
    (d,) = decide_mod.decide(results.cells, results.prompts, None, {"chat": 0.4, "code": 0.4, "math": 0.2}, n_resamples=100)
    assert {c["label"] for c in d["candidates"]} == {"a", "c"}
    assert any(n.startswith("not run by every candidate, so not in the paired comparison: math (20%") for n in d["notes"])
    assert not any(n.startswith("no measurements") for n in d["notes"])


def test_no_unmeasured_k_is_suggested_where_the_fit_predicts_a_loss(tmp_path):
    """'run k=... to confirm' only where the fit's best k would beat the baseline."""
    write_cell(tmp_path / "slow", "a", "model", Fraction(1, 5), 2, 0.5, 0.3)
    write_cell(tmp_path / "fast", "a", "model", Fraction(4, 5), 1, 0.05, 0.02)
    for name, expected in (("slow", False), ("fast", True)):
        results = load(tmp_path / name)
        fits, _ = fit_mod.fit(results.cells, results.prompts, 0.95, 200, 0)
        (d,) = decide_mod.decide(results.cells, results.prompts, fits, None, n_resamples=200)
        assert any(line.startswith("Unmeasured k") for line in d["mix"]["what_would_change"]) is expected, name


def test_report_mistakes_are_one_line(tmp_path, capsys):
    cell = write_cell(tmp_path / "results", "a", "model", Fraction(3, 5), 2, 0.05, 0.02)
    write_cell(tmp_path / "results", "b", "model", Fraction(4, 5), 2, 0.05, 0.02, seed=1)
    (tmp_path / "afile").write_text("")
    for args, message in (
        (["--seed", "-1"], "seed=-1 must be a whole number of at least 0"),
        (["--out", str(tmp_path / "afile")], f"cannot write the report to {tmp_path / 'afile'}:"),
        (["--cost-ratio", "a=abc"], "--cost-ratio 'a=abc': expected NAME=NUMBER, e.g. --cost-ratio DRAFT=0.05"),
    ):
        assert report.main([str(tmp_path / "results"), "--resamples", "50", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert report.main([str(cell / "summary.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {cell / 'summary.json'} is a file: give the folder")
    # A summary.json cut short is left out, and said so, not silently dropped.
    (cell / "summary.json").write_text('{"num_prompts": 1, "acc')
    assert report.main([str(tmp_path / "results"), "--resamples", "50"]) == 0
    assert f"warning: cell {cell.name}: its summary.json is not a finished cell's" in capsys.readouterr().err
    assert (
        f"cell {cell.name}: its summary.json is not a finished cell's"
        in (tmp_path / "results" / "report" / "report.md").read_text()
    )


def test_a_pinned_hub_revision_is_part_of_a_datasets_source():
    from analysis.names import text_settings

    hub = {
        "source": "hub",
        "hf_id": "openai/gsm8k",
        "hf_config": "main",
        "split": "test",
        "revision": None,
        "text_field": "question",
        "template": None,
        "id_field": None,
    }
    assert text_settings(hub)["source"] == "openai/gsm8k:main:test"
    assert text_settings({**hub, "revision": "abc123"})["source"] == "openai/gsm8k:main:test@abc123"


@pytest.mark.parametrize("version", [None, SCHEMA_VERSION + 1])
def test_a_cell_of_another_schema_is_refused_in_one_line(tmp_path, capsys, version):
    """A summary without the schema this analysis reads (written before it, or by a later harness) is
    not guessed at: the report names the file and says how to get one it reads."""
    write_cell(tmp_path / "results", "a", "model", Fraction(3, 5), 2, 0.05, SLOPE)
    old = write_cell(tmp_path / "results", "b", "model", Fraction(4, 5), 2, 0.05, SLOPE, seed=1)
    summary = json.loads((old / "summary.json").read_text())
    del summary["schema_version"]
    (old / "summary.json").write_text(json.dumps(summary if version is None else {**summary, "schema_version": version}))
    assert report.main([str(tmp_path / "results"), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {old / 'summary.json'} was written by an incompatible harness version (schema {version}, "
        f"this reads {SCHEMA_VERSION}): re-run the cell with force=true\n"
    )
    assert not (tmp_path / "rep").exists()


def test_a_wandb_run_of_another_schema_is_refused(sweep):
    runs = fake_runs(sweep)
    del runs[0].summary_metrics["schema_version"]
    with pytest.raises(
        HarnessError,
        match=f"^W&B run me/specbench/{runs[0].id} was written by an incompatible harness version "
        f"\\(schema None, this reads {SCHEMA_VERSION}\\): re-run the cell with force=true$",
    ):
        load_wandb("me/specbench/abc123", api=FakeApi(runs))


def test_a_cost_only_cell_is_no_cell_to_decide_on_but_a_shape_row():
    from analysis.frames import RawCell, frames

    summary = {
        "cost_only": "random weights (shapes:)",
        "cell": "shapes-cell",
        "pair": "shapes_x",
        "target": "shapes:a",
        "draft": "shapes:b",
        "conditions": {"device": "cpu", "device_name": "some CPU", "threads": 2, "dtype": "float32"},
        "costs": {"target_step_s": 0.02, "draft_step_s": 0.002, "cost_ratio": 0.1, "verify_cost": [1.0, 1.1, 1.2]},
    }
    results = frames([RawCell({"batch_size": 8, "compile": True}, summary, None, "results/shapes-cell")], "local", "local")
    assert results.cells.empty and results.notes == []
    (row,) = results.shapes.to_dict("records")
    assert row["target_step_ms"] == pytest.approx(20.0) and row["batch_size"] == 8 and row["verify_costs"] == [1.0, 1.1, 1.2]


def test_a_draft_length_policy_ships_only_when_its_paired_interval_clears_the_best_constant_k():
    from analysis.decide import draft_length_choices

    rng = np.random.default_rng(0)
    candidates = [{"label": "d", "k": 1}, {"label": "d", "k": 2}, {"label": "d~cost", "k": 4}, {"label": "e", "k": 1}]
    base = 1.2 + 0.02 * rng.standard_normal(200)
    mix = np.stack([np.r_[1.2, base], np.r_[1.1, base - 0.1], np.r_[1.3, base * 1.08], np.r_[2.0, base + 0.8]])  # [c, 1 + R]
    per_cat = mix[:, :, None]
    (entry, category) = draft_length_choices(candidates, mix, per_cat, ["qa"], 0.95, True, [])
    assert entry["draft"] == "d" and entry["constant_k"] == 1 and entry["policy"] == "cost" and entry["policy_k"] == 4
    assert entry["ratio"] == pytest.approx(1.3 / 1.2) and entry["low"] > 1 and entry["ship"] == "draft_length=cost, k cap 4"
    assert category["scope"] == "qa"
    mix[2, 1:] = base * rng.uniform(0.9, 1.1, 200)  # no better on the resamples: constant k is as good
    (entry, _) = draft_length_choices(candidates, mix, per_cat, ["qa"], 0.95, True, [])
    assert entry["low"] < 1 < entry["high"] and entry["ship"].startswith("constant k=1 (as good")


def test_a_tree_ships_only_when_its_paired_interval_clears_the_best_chain_and_policies_stay_apart():
    from analysis.decide import draft_length_choices, tree_choices

    rng = np.random.default_rng(1)
    candidates = [
        {"label": "d", "k": 1},
        {"label": "d~tree3x2x1", "k": 3},
        {"label": "d~treedyn8", "k": 3},
        {"label": "d~cost", "k": 4},
    ]
    base = 1.2 + 0.02 * rng.standard_normal(200)
    mix = np.stack([np.r_[1.2, base], np.r_[1.25, base * 1.04], np.r_[1.4, base * 1.15], np.r_[1.0, base - 0.2]])  # [c, 1 + R]
    per_cat = mix[:, :, None]
    (entry, _) = tree_choices(candidates, mix, per_cat, ["qa"], 0.95, True, [])
    assert entry["tree"] == "treedyn8" and entry["chain_k"] == 1 and entry["ship"] == "treedyn8, k 3" and entry["low"] > 1
    (policy, _) = draft_length_choices(candidates, mix, per_cat, ["qa"], 0.95, True, [])  # trees are not policies
    assert policy["policy"] == "cost" and policy["ship"] == "constant k=1"
    mix[2, 1:], mix[1, 1:] = base * rng.uniform(0.9, 1.1, 200), base * 0.8
    (entry, _) = tree_choices(candidates, mix, per_cat, ["qa"], 0.95, True, [])
    assert entry["ship"].startswith("chain k=1 (as good: treedyn8")


def test_trees_meet_the_chain_that_verifies_as_many_positions():
    """Beside the best tree against the best chain, each verify width a chain and a tree share (k + 1 positions
    for a chain, nodes + 1 for a tree) gets the best tree of that width against that chain."""
    from analysis.decide import tree_choices
    from analysis.frames import verify_width

    assert [verify_width(label, 2) for label in ["d", "d~tree2x1", "d~tree3x2x1-sampled", "d~treedyn8", "d~cost"]] == [
        3,
        5,
        16,
        9,
        3,
    ]
    labels = [("d", 1), ("d", 4), ("d~tree2x1", 2), ("d~treedyn4", 2), ("d", 8), ("d~treedyn8", 3), ("d~cost", 4)]
    speedups = [1.2, 0.9, 1.0, 1.1, 0.5, 1.05, 1.15]
    rng = np.random.default_rng(2)
    noise = 1 + 0.01 * rng.standard_normal(200)
    mix = np.stack([np.r_[s, s * noise] for s in speedups])  # [c, 1 + R]
    candidates = [{"label": label, "k": k} for label, k in labels]
    entries = tree_choices(candidates, mix, mix[:, :, None], ["qa"], 0.95, True, [])
    best, equal = [e for e in entries if e["width"] is None], [e for e in entries if e["width"] is not None]
    assert [(e["tree"], e["chain_k"]) for e in best] == [("treedyn4", 1)] * 2 and best[0]["ship"].startswith("chain k=1")
    assert [(e["width"], e["scope"], e["tree"], e["chain_k"]) for e in equal] == [
        (5, "mix", "treedyn4", 4),
        (5, "qa", "treedyn4", 4),
        (9, "mix", "treedyn8", 8),
        (9, "qa", "treedyn8", 8),
    ]
    assert equal[0]["ratio"] == pytest.approx(1.1 / 0.9) and equal[0]["low"] > 1 and equal[0]["ship"] == "treedyn4, k 2"
    assert equal[2]["ratio"] == pytest.approx(1.05 / 0.5)
