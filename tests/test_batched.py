"""batch_size > 1: batched forwards (harness.models.batched) give each row its own logits, and the
the loop (harness.core.loop) gives each row the tokens it would get alone."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import tiny_model
from transformers import LlamaForCausalLM

from harness.core.metrics import batch_passes, predicted_by_cycles
from harness.models.batched import HFBatch, LeanBatch
from harness.models.cached import CachedLM

VOCAB = 98
pytestmark = pytest.mark.usefixtures("one_thread")


def llama(dtype=torch.float64) -> LlamaForCausalLM:
    return tiny_model(LlamaForCausalLM, VOCAB, seed=0, scale=1.0, max_position_embeddings=1024).to(dtype)


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def alone(model, chunks: list[torch.Tensor], lengths: list[int | None], num_logits: list[int]) -> list[torch.Tensor]:
    """One row's logits fed chunk by chunk through the one-sequence CachedLM (hf forward), rolled back after each."""
    lm, out = CachedLM(model, VOCAB), []
    for chunk, length, n in zip(chunks, lengths, num_logits):
        if chunk.shape[0]:
            out.append(lm.forward(chunk, num_logits=n))
        else:
            out.append(torch.empty(0, VOCAB, dtype=model.dtype))
        if length is not None:
            lm.rollback(length)
    return out


@pytest.mark.parametrize("layout", [LeanBatch, HFBatch])
def test_each_row_gets_its_own_logits(layout):
    """Ragged steps (prompts of different lengths, rows feeding 0..4 tokens), per-row rollbacks and a
    dropped row: every row's logits are those of its tokens alone."""
    model = llama()
    rows = 3
    steps = [  # per step: (per-row feeds, per-row logits wanted, per-row rollback lengths or None)
        ([ids(7, 1), ids(3, 2), ids(12, 3)], [1, 1, 1], None),
        ([ids(3, 4), ids(1, 5), ids(4, 6)], [3, 1, 4], [8, 4, 14]),
        ([ids(2, 7), ids(0, 8), ids(1, 9)], [2, 0, 1], [10, 4, 14]),
        ([ids(4, 10), ids(2, 11), ids(1, 12)], [4, 2, 1], [11, 5, 15]),
    ]
    batch = layout(CachedLM(model, VOCAB, forward="lean" if layout is LeanBatch else "hf"))
    batch.start(rows)
    got = [[] for _ in range(rows)]
    active = list(range(rows))
    for i, (feeds, wanted, lengths) in enumerate(steps):
        out = batch.forward([feeds[r] for r in active], [wanted[r] for r in active])
        for r, logits in zip(active, out):
            got[r].append(logits)
        if lengths is not None:
            batch.rollback([lengths[r] for r in active])
            assert batch.lengths == [lengths[r] for r in active]
        if i == 1:  # row 1 finishes: the others go on
            active = [0, 2]
            batch.keep([0, 2])
    for r in range(rows):
        n = len(got[r])
        want = alone(
            model, [s[0][r] for s in steps[:n]], [s[2][r] if s[2] else None for s in steps[:n]], [s[1][r] for s in steps[:n]]
        )
        for a, b in zip(got[r], want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def pair64(forward: str):
    """A peaked tiny target and a perturbed draft of it, in float64, as one-sequence and batched models."""
    from conftest import make_model, perturbed

    target = make_model(VOCAB, seed=0, scale=3.0).double()
    draft = perturbed(make_model(VOCAB, seed=0, scale=3.0), noise=0.3, seed=1).double()
    return CachedLM(target, VOCAB, forward=forward), CachedLM(draft, VOCAB, forward=forward)


def solo_runs(target, draft_lm, drafter_kind, prompts, k, sampling, max_new, seeds):
    from harness.core.drafters import ModelDrafter, NgramDrafter
    from harness.core.loop import autoregressive_decode, speculative_decode

    spec, base = [], []
    for prompt, seed in zip(prompts, seeds):
        drafter = ModelDrafter(draft_lm) if drafter_kind == "model" else NgramDrafter(VOCAB)
        cycles = list(speculative_decode(target, drafter, prompt, k, sampling, max_new, {2}, torch.Generator().manual_seed(seed)))
        spec.append(([t for c in cycles for t in c.tokens], sum(c.num_accepted for c in cycles)))
        base.append(list(autoregressive_decode(target, prompt, sampling, max_new, {2}, torch.Generator().manual_seed(seed))))
    return spec, base


def batch_runs(target, draft_lm, drafter_kind, prompts, k, sampling, max_new, seeds):
    from harness.core.drafters import ModelDrafter, NgramDrafter
    from harness.core.loop import autoregressive_decode_rows, speculative_decode_rows

    big = target
    drafter = ModelDrafter(draft_lm) if drafter_kind == "model" else NgramDrafter(VOCAB)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    tokens = [[] for _ in prompts]
    accepted = [0] * len(prompts)
    cycles = [0] * len(prompts)
    for cycle in speculative_decode_rows(big, drafter, prompts, k, sampling, max_new, {2}, gens):
        for row, c in cycle:
            tokens[row] += c.tokens
            accepted[row] += c.num_accepted
            cycles[row] += 1
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    base = [[] for _ in prompts]
    for step in autoregressive_decode_rows(big, prompts, sampling, max_new, {2}, gens):
        for row, token in step:
            base[row].append(token)
    return list(zip(tokens, accepted)), base, cycles


@pytest.mark.parametrize("forward", ["lean", "hf"])
@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_decode_as_they_would_alone(forward, drafter_kind, temperature):
    """Prompts of different lengths, rows ending at EOS or the budget at different cycles: each row's
    tokens and accepted counts are those of its run alone with the same seed, for the loop and the baseline."""
    from harness.core.sampling import Sampling

    target, draft_lm = pair64(forward)
    prompts = [ids(n, 20 + n) for n in (5, 9, 2, 14)]
    seeds = [11, 12, 13, 14]
    sampling = Sampling(temperature)
    alone_spec, alone_base = solo_runs(target, draft_lm, drafter_kind, prompts, 3, sampling, 24, seeds)
    spec, base, cycles = batch_runs(target, draft_lm, drafter_kind, prompts, 3, sampling, 24, seeds)
    assert spec == alone_spec
    assert base == alone_base
    assert len(set(cycles)) > 1, "rows should leave the batch at different cycles here"


@pytest.mark.parametrize("forward", ["auto", "hf"])
@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_a_batched_cell(tiny_pair, tmp_path, temperature, forward):
    """batch_size=3 over 7 prompts: batches of 3, 3 and 1; every prompt's tokens are its batch_size=1
    tokens (greedy and sampled: each row has its own seed); the summary's speedup is over the batches'
    throughputs, with their count, the costs at the batch size and the batch layout in the conditions."""
    from test_cli import tiny_args
    from test_config import composed

    from harness.runner.cell import run_cell

    args = tiny_args(
        tiny_pair,
        tmp_path,
        "k=2",
        f"temperature={temperature}",
        "dataset.num_prompts=7",
        "max_new_tokens=12",
        f"forward={forward}",
    )
    one = run_cell(composed([*args, "wandb.mode=disabled"]), out_dir=tmp_path, quiet=True)
    three = run_cell(composed([*args, "wandb.mode=disabled", "batch_size=3"]), out_dir=tmp_path, quiet=True)
    assert "-b3-" in three["cell"] and three["cell"].count("-") == one["cell"].count("-") + 1

    def lines(summary):
        return [json.loads(line) for line in (Path(summary["cell_dir"]) / "prompts.jsonl").read_text().splitlines()]

    alone, batched_rows = lines(one), lines(three)
    assert [r["id"] for r in batched_rows] == [r["id"] for r in alone]
    assert [r["spec"]["tokens"] for r in batched_rows] == [r["spec"]["tokens"] for r in alone]
    assert [r["base"]["tokens"] for r in batched_rows] == [r["base"]["tokens"] for r in alone]
    assert [r["batch"]["index"] for r in batched_rows] == [0, 0, 0, 1, 1, 1, 2]
    assert three["batches"] == 3 and three["alpha"] == one["alpha"]
    units = {r["batch"]["index"]: r["batch"] for r in batched_rows}
    throughput = lambda u, side: u[side]["new_tokens"] / u[side]["time_s"]  # noqa: E731
    ratios = [throughput(u, "spec") / throughput(u, "base") for u in units.values()]
    assert min(ratios) <= three["speedup_geomean"] <= max(ratios)
    assert three["speedup_ci"][0] <= three["speedup"] <= three["speedup_ci"][1]
    assert three["costs"]["batch_size"] == 3 and len(three["costs"]["verify_cost"]) == 3
    assert three["conditions"]["batch"]["size"] == 3 and three["conditions"]["batch"]["layout"]
    assert three["spec_tokens_per_s"] == pytest.approx(three["new_tokens"] / three["spec_time_s"])
    for index, u in units.items():  # the batch's passes (as many as its longest-running row's cycles) and baseline steps
        rows = [r for r in batched_rows if r["batch"]["index"] == index]
        assert sum(u["spec"]["drafted_hist"]) == max(r["spec"]["cycles"] for r in rows)
        assert u["base"]["steps"] == max(r["base"]["new_tokens"] for r in rows)
    assert three["predicted_speedup"] == pytest.approx(
        batch_passes(list(units.values()), three["cost_ratio"], three["costs"]["verify_cost"])
    )


def test_a_batch_is_priced_by_its_passes():
    """At batch_size > 1 a cycle is one pass as wide as the most any row drafted: two rows, one drafting
    2 tokens, the other none, cost a 3-position pass (v(3)) and 2 draft steps, not v(3) + v(1) per row;
    the baseline's rate is its tokens per step (both rows each step). The first yield is left out."""
    c, v = 0.1, [1.0, 1.2, 1.5]
    unit = {
        "index": 0,
        "spec": {"drafted_hist": [1, 0, 5], "first_drafted": 0, "new_tokens": 2 + 5 * 3, "first_tokens": 2},
        "base": {"new_tokens": 2 * 16, "first_tokens": 2, "steps": 16},
    }
    spec_rate = (5 * 3) / (5 * (2 * c + v[2]))  # 5 passes of width 3 after the first
    assert batch_passes([unit], c, v) == pytest.approx(spec_rate / 2.0)  # baseline: 30 tokens in 15 steps
    record = {"spec": {"drafted_hist": [6, 0, 0], "committed": 0, "first_drafted": 0, "first_committed": 0}, "batch": unit}
    assert predicted_by_cycles([record, record], c, v) == pytest.approx(spec_rate / 2.0)  # two rows of one batch


# ---------------------------------------------------------------- exactness at batch_size > 1

RULE_ONLY = ("accept_all", "resample_from_p", "ratio_q_over_p", "residual_abs", "bonus_wrong_row", "target_row_off_by_one")


def batch_check(tiny_pair, batch_size: int = 4, rule=None, layout=None, prompts=2):
    """The exactness check at the tiny settings, drawn from the batched loop on `prompts` prompts of
    different lengths (rows alternate between them), with an optional broken rule or batch layout."""
    from conftest import FAMILY_ALPHA, TINY_K, TINY_LENGTH, TINY_SAMPLES, TINY_SAMPLING, tiny_cached_pair

    from harness.core.drafters import ModelDrafter
    from harness.core.rule import verify_rows
    from harness.exactness.check import check
    from harness.models.batched import LeanBatch

    target, drafter, prompt = tiny_cached_pair(tiny_pair, forward="lean")
    layout = layout or LeanBatch
    chosen = [("long", prompt), ("short", prompt[:3])][:prompts]
    return check(
        layout(target),
        ModelDrafter(layout(drafter.lm)),
        chosen,
        k=TINY_K,
        sampling=TINY_SAMPLING,
        length=TINY_LENGTH,
        samples=TINY_SAMPLES,
        alpha=FAMILY_ALPHA,
        rule=rule or verify_rows,
        law_target=target,
        batch=batch_size,
    )


def test_the_batched_loop_passes_the_check(tiny_pair):
    """Four rows, two prompts of different lengths: each prompt's joint, first-token and bonus tests
    pass on the batched draws, and so does the rows' independence test."""
    from harness.exactness.check import format_report

    report = batch_check(tiny_pair)
    assert report["passed"], format_report(report)
    for p in report["prompts"].values():
        assert set(p["tests"]) == {"joint", "first", "bonus", "rows"} and p["tests"]["rows"]["observations"] > 200


@pytest.mark.parametrize("name", RULE_ONLY)
def test_broken_rules_are_rejected_at_batch_size_4(tiny_pair, name):
    from broken import VARIANTS, per_row

    from harness.exactness.check import format_report

    variant = next(v for v in VARIANTS if v.name == name)
    _, _, rule = variant.plug(None, None)
    report = batch_check(tiny_pair, rule=per_row(rule))
    assert report["testable"] and report["family_p"] < 1e-4, format_report(report)


def test_a_row_reading_another_rows_cache_is_rejected(tiny_pair):
    """Rows that move up in the batch when an earlier row finishes, but keep reading their old cache row."""
    from broken import ForgetsDroppedRows

    from harness.exactness.check import format_report

    report = batch_check(tiny_pair, layout=ForgetsDroppedRows)
    assert report["testable"] and report["family_p"] < 1e-4, format_report(report)


def test_rows_whose_caches_keep_rejected_tokens_are_rejected(tiny_pair):
    from broken import NoRollbackRows

    from harness.exactness.check import format_report

    report = batch_check(tiny_pair, layout=NoRollbackRows)
    assert report["testable"] and report["family_p"] < 1e-4, format_report(report)


def test_a_target_without_top_k_is_rejected_at_batch_size_4(tiny_pair, monkeypatch):
    """The target's p shaped without the top-k the draft used (the tiny check samples with top-k 5)."""
    from broken import target_unshaped

    import harness.core.loop
    from harness.exactness.check import format_report

    monkeypatch.setattr(harness.core.loop, "shape_probs", target_unshaped)
    report = batch_check(tiny_pair)
    assert report["testable"] and report["family_p"] < 1e-4, format_report(report)


def test_rows_sharing_random_draws_are_rejected(tiny_pair, monkeypatch):
    """Every row reseeded with one seed: each row alone still follows the target's law, so only the
    rows' independence test can see it, and it must."""
    from broken import shared_seeds

    import harness.exactness.law
    from harness.exactness.check import format_report

    monkeypatch.setattr(
        harness.exactness.law, "speculative_decode_rows", shared_seeds(harness.exactness.law.speculative_decode_rows)
    )
    report = batch_check(tiny_pair)
    assert report["testable"] and report["family_p"] < 1e-4, format_report(report)
    assert all(p["tests"]["rows"]["p_value"] < 1e-9 for p in report["prompts"].values())


def test_the_exactness_command_at_batch_size_4(tiny_pair, tmp_path):
    from conftest import TINY_CHECK, compose_check

    from harness.exactness.check import format_report
    from harness.exactness.main import run_check

    report = run_check(compose_check(tiny_pair, tmp_path, *TINY_CHECK, "batch_size=4"), quiet=True)
    assert report["passed"], format_report(report)
    assert report["batch_size"] == 4 and "-b4-" in report["run_dir"]
    assert "rows" in format_report(report)


@pytest.mark.cli
def test_a_batch_size_sweep_and_its_report(tiny_pair, tmp_path):
    """`python -m harness -m batch_size=1,3 k=1,2` runs four cells in one process (the pair loaded once);
    the report draws speedup against batch size and says up to which batch size the draft pays."""
    from test_cli import harness, tiny_args

    from analysis.report import build

    out = harness(
        "-m",
        *tiny_args(tiny_pair, tmp_path / "store", "batch_size=1,3", "k=1,2", "dataset.num_prompts=6", "max_new_tokens=8"),
        f"hydra.sweep.dir={tmp_path}/sweep",
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("loading pair") == 1
    document = build(str(tmp_path / "store"), tmp_path / "report")
    (entry,) = document["batch_size"]
    assert entry["sizes"] == [1, 3] and [p["batch_size"] for p in entry["best"]] == [1, 3]
    assert entry["statement"].startswith(entry["label"])
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Batch size" in report and "speedup_vs_batch_size.png" in report
    assert len(document["decisions"]) == 2  # one decision per batch size: its costs are its own
    from analysis.report import DEFAULTS

    build(str(tmp_path / "store"), tmp_path / "whatif", {"whatif": {**DEFAULTS["whatif"], "ridge_rows": 8.0}})
    whatif = pd.read_csv(tmp_path / "whatif" / "whatif.csv")
    assert whatif["ridge_rows"].notna().sum() == 1  # the fit at batch size 1 only
    assert "Up to which batch size each draft pays" in (tmp_path / "whatif" / "report.md").read_text()


def test_the_whatif_predicts_where_speculation_stops_paying():
    """On a machine whose passes turn compute-bound at 8 rows, a free draft accepted half the time pays
    while B (k + 1) rows still fit under the ridge for some k (B = 4, k = 1), and never from B = 8 on,
    where a verify of n positions costs n steps; a better draft pays no less far, prompt lookup's host
    time per row brings the crossing earlier."""
    from analysis.fit import batch_crossover, batch_speedup

    assert batch_speedup(0.5, 0.0, 0.0, 8.0, 4, "model", 16) == (1, 1.5)
    assert batch_speedup(0.5, 0.0, 0.0, 8.0, 8, "model", 16) == (0, 1.0)
    assert batch_crossover(0.5, 0.0, 0.0, 8.0, "model", 16) == 4
    assert batch_crossover(0.5, 0.0, 0.0, 1e9, "model", 16) == 1024  # memory-bound at every size tried
    assert batch_crossover(0.9, 0.05, 0.01, 295.0, "model", 16) >= batch_crossover(0.6, 0.05, 0.01, 295.0, "model", 16)
    assert batch_crossover(0.6, 0.05, 0.01, 295.0, "ngram", 16) < batch_crossover(0.6, 0.05, 0.01, 295.0, "model", 16)
    assert batch_crossover(0.1, 0.5, 0.2, 295.0, "model", 16) is None  # not even alone


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["batch_size=0"], "batch_size=0 must be a positive integer"),
        (["batch_size=4", "cache=static"], "batch_size > 1 runs with cache=dynamic, and on HF's forward with compile=false"),
        (["batch_size=4", "cache=static", "compile=true", "forward=hf"], "batch_size > 1 runs with cache=dynamic"),
        (["batch_size=two"], "batch_size"),
    ],
)
def test_a_batch_size_that_cannot_run_is_one_line(overrides, says):
    from test_config import refusal

    assert says in refusal(overrides)


@pytest.mark.cli
def test_the_summary_table_names_the_batches(tiny_pair, tmp_path):
    from test_cli import harness, tiny_args

    out = harness(*tiny_args(tiny_pair, tmp_path, "batch_size=4", "k=2", "dataset.num_prompts=6", "max_new_tokens=8"))
    assert out.returncode == 0, out.stderr
    assert "batch_size=4 (2 batches)" in out.stdout and "speedup (geomean of batches)" in out.stdout
    assert json.loads(out.stdout.strip().splitlines()[-1])["conditions"]["batch"]["size"] == 4
