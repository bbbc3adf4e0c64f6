"""The benchmark on the tiny pair: it runs end to end, compares like with like, and writes its figures."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from scipy import stats

import harness.bench.contenders as contenders
import harness.bench.goals as bench_goals
import harness.bench.main as bench
import harness.bench.parts as parts
import harness.core.ties as ties
import harness.runner.costs as runner_costs
import harness.runner.provenance as provenance
from harness.core import metrics
from harness.core.loop import autoregressive_decode
from harness.core.sampling import Sampling
from harness.errors import HarnessError
from harness.models.cached import CachedLM
from harness.models.loading import ModelSpec, load_model
from harness.runner.pair import load_pair
from harness.runner.store import SCHEMA_VERSION


def run_bench(tiny_pair, tmp_path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    args = [
        "--reps",
        "2",
        "--prompts",
        "2",
        "--ks",
        "1",
        "2",
        "--max-new-tokens",
        "12",
        "--memory-prompts",
        "4",
        "--memory-new-tokens",
        "4",
        "--out",
        str(out),
        "+pair=llama_7b_68m",
        f"pair.target.id={tiny_pair['target']}",
        f"pair.draft.id={tiny_pair['draft']}",
        "wandb.mode=disabled",
        *extra,
    ]
    result = bench.main(args)
    written = json.loads(out.read_text())
    assert written["tokens_per_s"] == result["tokens_per_s"]  # what it printed is what it wrote
    assert written["schema_version"] == SCHEMA_VERSION and written["machine"] == result["machine"]
    started = datetime.fromisoformat(written["started_utc"])
    assert started.utcoffset() == timedelta(0) and abs(datetime.now(timezone.utc) - started) < timedelta(hours=1)
    return result


def test_bench_compares_ours_with_hf_on_the_same_work(tiny_pair, tmp_path):
    result = run_bench(tiny_pair, tmp_path)
    forwards = result["target_forwards_per_rep"]
    for k in (1, 2):  # same drafts verified per cycle: the same number of target passes
        assert forwards[f"ours_spec_k{k}"] == forwards[f"hf_assisted_k{k}"]
    assert forwards["ours_base"] == forwards["hf_base"]
    assert set(result["ratios"]) >= {"ours_base / hf_base", "ours_spec_k1 / hf_assisted_k1", "ours_ngram_k2 / hf_lookup_k2"}
    assert all(v > 0 for v in result["ratios"].values())
    reps = result["tokens_per_s_all_reps"]
    assert result["ratio_per_rep"]["ours_base / hf_base"] == [a / b for a, b in zip(reps["ours_base"], reps["hf_base"])]
    for name, per_rep in result["ratio_per_rep"].items():  # a ratio is the median of the paired ones, not of the medians
        assert result["ratios"][name] == statistics.median(per_rep)
        ours, theirs = name.split(" / ")
        assert result["ratio_of_medians"][name] == statistics.median(reps[ours]) / statistics.median(reps[theirs])
    for name, split in result["ratio_parts"].items():  # the lead = fewer passes x cheaper passes
        assert split["fewer_target_passes"] * split["cheaper_time_per_pass"] == pytest.approx(result["ratios"][name])
    tokens = result["tokens_per_rep"]
    assert result["ratio_parts"]["ours_base / hf_base"]["fewer_target_passes"] == 1.0
    assert result["ratio_parts"]["ours_ngram_k2 / hf_lookup_k2"]["fewer_target_passes"] == pytest.approx(
        (forwards["hf_lookup_k2"] / tokens["hf_lookup_k2"]) / (forwards["ours_ngram_k2"] / tokens["ours_ngram_k2"])
    )
    assert result["greedy_ties"] == [] and set(result["same_output_as_hf"].values()) == {1.0}  # float32: no ties
    assert set(result["same_output_as_hf"]) == {
        "ours_base / hf_base",
        *(
            f"ours_{a}_k{k} / hf_{b}_k{k}"
            for k in (1, 2)
            for a, b in (("spec", "assisted"), ("ngram", "lookup"), ("ngram_cost_aware", "lookup"))
        ),
    }
    for limit in (result["limits"][1], result["limits"][2]):
        assert len(limit["measured_speedup_per_rep"]) == 2 and limit["measured_speedup"] == pytest.approx(
            sum(limit["measured_speedup_per_rep"]) / 2
        )  # the median of two
        assert 0 < limit["alpha"] <= 1 and limit["efficiency"] > 0 and 0 <= limit["overhead_fraction"] < 1
        assert limit["measured_speedup_cv"] == pytest.approx(stats.variation(limit["measured_speedup_per_rep"], ddof=1))
    for k, limit in result["limits"].items():  # in-loop v(n) from the verify passes over n positions; v(k + 1) in the formula
        in_loop = limit["in_loop"]
        assert k + 1 in in_loop["verify_cost_by_positions"] and set(in_loop["verify_cost_by_positions"]) <= set(range(1, k + 2))
        assert in_loop["verify_cost"] == in_loop["verify_cost_by_positions"][k + 1] and in_loop["efficiency_formula"] > 0
        for figures, c, v in (
            (limit, limit["cost_ratio"], limit["verify_cost"]),
            (in_loop, in_loop["cost_ratio"], in_loop["verify_cost"]),
        ):
            # a run summary's names and meanings: the closed form under _formula, each efficiency measured / its prediction
            assert figures["predicted_speedup_formula"] == metrics.predicted_speedup(limit["alpha"], k, c, v)
            assert figures["efficiency"] == limit["measured_speedup"] / figures["predicted_speedup"]
            assert figures["efficiency_formula"] == limit["measured_speedup"] / figures["predicted_speedup_formula"]
            assert not {"predicted_speedup_cycles", "efficiency_cycles"} & set(figures)
    for name, per_rep in result["ratio_per_rep"].items():
        assert result["ratio_cv"][name] == pytest.approx(stats.variation(per_rep, ddof=1))
    assert result["memory"]["prompts"] == 4
    for k in (1, 2):  # no lookup policy takes fewer passes than the floor
        floor = result["lookup_floor"][k]
        assert floor["fewest_passes"] <= min(floor["hf_passes"], floor["ours_passes"])
        assert (floor["hf_passes"], floor["ours_passes"]) == (forwards[f"hf_lookup_k{k}"], forwards[f"ours_ngram_k{k}"])
    goals = result["goals"]  # each goal judged on its worst measured value
    assert goals["ours / HF assisted"]["value"] == min(result["ratios"][f"ours_spec_k{k} / hf_assisted_k{k}"] for k in (1, 2))
    # the prompt-lookup goal is like for like: HF proposes whole matches, so cost_aware stays out of it
    assert goals["ours / HF prompt lookup"]["value"] == min(result["ratios"][f"ours_ngram_k{k} / hf_lookup_k{k}"] for k in (1, 2))
    assert goals["time outside forward passes"]["value"] == max(lim["overhead_fraction"] for lim in result["limits"].values())
    assert all(g["met"] == (g["value"] >= g["goal"] if g["side"] == "min" else g["value"] <= g["goal"]) for g in goals.values())
    assert len(goals) == len(bench_goals.GOALS)
    assert result["setup"]["cache"] == "dynamic" and result["conditions"]["device"] == "cpu"
    assert result["machine"]["cores"] >= 1 and result["machine"]["gpus"] == torch.cuda.device_count()
    assert result["conditions"]["linear"]["mode"] == "auto" and "plan" in result["conditions"]["linear"]
    profiled = result["profile"]  # one prompt profiled: passes run operators, the loop reads the host once a cycle
    assert profiled["target_passes"] >= profiled["cycles"] and profiled["draft_steps"] > profiled["cycles"]
    assert profiled["per_cycle"]["host_reads"] == 1.0 and profiled["device_waits"] == profiled["graph_launches"] == 0
    assert profiled["per_pass"]["kernels"] > 10 and "CPU operators" in profiled["kernels_are"]
    for audit in result["sync_audit"].values():  # on a CPU too: host reads, 1 per cycle, none per drafted token
        assert audit["drafted"] > audit["cycles"] and audit["host_reads_per_cycle"] == 1.0 and "syncs" not in audit
    batched = result["batched"]["4"]  # our batched baseline against generate() on the same left-padded batch
    assert batched["ratio"] == statistics.median(batched["ratio_per_rep"]) and len(batched["ratio_per_rep"]) == 2
    assert batched["same_output_as_hf"] == 1.0 and "refuse" in result["batched"]["note"]


def test_a_run_cut_short_keeps_the_parts_it_finished(tiny_pair, tmp_path, monkeypatch):
    def killed(*args, **kwargs):  # as the GPU check's timeout would, during the last part
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "memory", killed)  # main() runs the parts it imported
    with pytest.raises(KeyboardInterrupt):
        run_bench(tiny_pair, tmp_path)
    kept = json.loads((tmp_path / "bench.json").read_text())
    assert {"setup", "conditions", "ratios", "limits"} <= set(kept) and "memory" not in kept
    assert {"ours / HF assisted", "efficiency (measured / predicted speedup)"} <= set(kept["goals"])  # judged so far


def test_bench_with_compile_gives_hf_its_compiled_path(tiny_pair, tmp_path, monkeypatch):
    """cache=static compile=true: HF's contenders run generate() with a static cache and
    compile_config too, and their outputs still match ours token for token."""
    asked, lengths = [], []
    real = contenders.hf_generate
    monkeypatch.setattr(
        contenders,
        "hf_generate",
        lambda model, ids, *a, **kw: asked.append(kw) or lengths.append(len(ids)) or real(model, ids, *a, **kw),
    )
    try:
        result = run_bench(tiny_pair, tmp_path, "cache=static", "compile=true")
    except HarnessError as err:
        if "refuses the static cache" in str(err):  # transformers 5.17: assisted generate has no static cache
            pytest.skip(str(err))
        raise
    assert asked and all(kw["cache_implementation"] == "static" and kw["compile_config"] is not None for kw in asked)
    assert result["setup"]["compile"] is True and result["ratios"]["ours_base / hf_base"] > 0
    warm_up = 2 * 5  # 2 prompts x (hf_base, hf_assisted and hf_lookup at k = 1, 2), before anything is timed
    assert set(lengths[warm_up:]) <= set(lengths[:warm_up])  # HF met every prompt, and compiled for it, untimed


@pytest.mark.parametrize("k", [2, 4])
def test_hf_prompt_lookup_has_room_in_the_static_cache_it_is_given(tiny_pair, k):
    """HF's prompt lookup verifies up to k - 1 positions past its token budget. With compile=true the
    bench gives HF a static cache of our capacity: sized by lookup_room, it holds them, also for a
    prompt whose budget ends exactly at a 256-position boundary (sized for the budget alone: IndexError)."""
    n = 32
    model = load_model(ModelSpec(str(tiny_pair["target"])), torch.device("cpu"))
    lm = CachedLM(model, model.config.vocab_size, "static")
    prompt = torch.tensor([6, 30, 25, 11] * 64)[
        : 257 - n
    ]  # prompt + n - 1 = 256 positions; a repeating prompt: lookup always matches
    lm.reserve(prompt.shape[0] + contenders.lookup_room(n, k) - 1)  # as Pair.reserve sizes it
    tokens = contenders.hf_generate(
        model,
        prompt,
        n,
        [10**6],
        prompt_lookup_num_tokens=k,
        max_matching_ngram_size=3,
        cache_implementation="static",
        max_cache_len=lm.capacity,
    )
    assert len(tokens) == n


@pytest.mark.parametrize(
    "args, message",
    [
        (["compile=true", "forward=hf"], "compile=true on HF's forward needs fixed shapes: add cache=static"),
        (["cache=statik"], "cache=statik must be dynamic or static"),
        (["prompts.template=chatml"], "prompts.template=chatml must be auto, chat or raw"),
    ],
)
def test_the_bench_checks_its_config_as_the_harness_does(tiny_pair, tmp_path, args, message):
    with pytest.raises(HarnessError, match=message):
        run_bench(tiny_pair, tmp_path, *args)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ks", "1", "0"], "--ks 1 0: each must be at least 1"),
        (["--reps", "0"], "--reps 0: each must be at least 1"),
        (["--prompts", "-1"], "--prompts -1: each must be at least 1"),
        (["--max-new-tokens", "1"], "--max-new-tokens 1: each must be at least 2"),
        (["k=2"], "k=2: the bench sets this with --ks"),
        (["dataset.num_prompts=3"], "dataset.num_prompts=3: the bench sets this with --prompts"),
        (["--ks", "1", "+pair=smollm2_ngram"], "'+pair=smollm2_ngram' is an override, not a k: put overrides before --ks"),
        (["--out", "/etc/passwd/x.json"], "--out /etc/passwd/x.json: /etc/passwd is a file, not a folder"),
        (["--out", "/tmp"], "--out /tmp: is a folder"),
        (
            ["--ks", "1", "9", "--max-new-tokens", "8"],
            "--ks 1 9: each must be at most --max-new-tokens 8 (a cycle drafts at most 7)",
        ),
        (
            ["cache=static", "compile=true", "--ks", "1", "16"],
            "--ks 1 16: k=16 with compile=true: compiled steps take at most 16 positions",
        ),
    ],
)
def test_bench_sizes_are_checked_before_anything_loads(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "load_pair", lambda *a, **k: pytest.fail("loaded a pair"))
    with pytest.raises(SystemExit) as stop:
        bench.main(flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_each_repetition_is_written_as_it_ends(tiny_pair, tmp_path, monkeypatch):
    """The GPU check's compiled part may be cut off by its time limit: what it measured must be on disk."""
    written = []
    real = bench.write_result
    monkeypatch.setattr(
        bench, "write_result", lambda path, result: real(path, result) or written.append(json.loads(path.read_text()))
    )
    result = run_bench(tiny_pair, tmp_path)
    first = written[0]
    assert first["reps_done"] == 1 and first["partial"].startswith("throughput over 1 of 2 repetitions")
    assert len(first["tokens_per_s_all_reps"]["ours_base"]) == 1 and "ours / HF assisted" in first["goals"]
    assert result["reps_done"] == 2 and "partial" not in result


def test_a_k_given_twice_runs_once():
    """--ks 2 2 would run k=2's parts twice and sum its lookup floor twice (HF's lookup would look 2x off the floor)."""
    _, args = bench.parse_args(["--ks", "2", "1", "2", "--max-new-tokens", "8"])
    assert args.ks == [2, 1]


def test_the_limit_part_survives_a_decode_phase_without_drafts(tiny_pair, tmp_path, monkeypatch):
    """Every prompt ending in its first cycle (EOS) leaves the decode phase no draft forward: the
    in-loop costs are unknown (nan), not a ZeroDivisionError after minutes of measuring."""
    real = bench.limit

    def ends_early(pair, *args, **kwargs):
        eos, pair.eos_ids = pair.eos_ids, set(range(pair.target.vocab_size))  # the first committed token ends a prompt
        try:
            return real(pair, *args, **kwargs)
        finally:
            pair.eos_ids = eos  # the pair is cached for later tests

    monkeypatch.setattr(bench, "limit", ends_early)
    result = bench.main(
        [
            "--reps",
            "1",
            "--prompts",
            "2",
            "--ks",
            "1",
            "--max-new-tokens",
            "6",
            "--memory-prompts",
            "0",
            "--skip-throughput",
            "--out",
            str(tmp_path / "b.json"),
            "+pair=llama_7b_68m",
            f"pair.target.id={tiny_pair['target']}",
            f"pair.draft.id={tiny_pair['draft']}",
        ]
    )
    (lim,) = result["limits"].values()
    assert lim["decode_cycles"] == 0 and math.isnan(lim["in_loop"]["cost_ratio"]) and math.isnan(lim["measured_speedup"])


def test_hf_refusing_the_static_cache_is_one_clear_error():
    """transformers 5.17's assisted generate refuses the static cache that compile=true gives HF."""

    class Refuses:
        def generate(self, *args, **kwargs):
            raise ValueError("assisted generate is not supported with Static cache classes`")

    ids = torch.tensor([1, 2, 3])
    with pytest.raises(HarnessError, match="refuses the static cache that compile=true gives it"):
        contenders.hf_generate(Refuses(), ids, 4, [0], cache_implementation="static", assistant_model=object())
    with pytest.raises(ValueError):  # any other ValueError is not ours to rephrase
        contenders.hf_generate(Refuses(), ids, 4, [0])


def test_hf_generates_in_the_grad_mode_our_loop_runs_in():
    """A mode that costs HF more per step (its own no_grad) would be credited to our loop."""

    class Records:
        def generate(self, ids, **kwargs):
            self.mode = torch.is_inference_mode_enabled()
            return torch.cat([ids, ids], -1)

    model = Records()
    assert contenders.hf_generate(model, torch.tensor([1, 2, 3]), 3, [0]) == [1, 2, 3] and model.mode


def test_the_efficiency_goal_takes_the_lower_of_both_predictions():
    limits = {
        "1": {"efficiency": 1.02, "in_loop": {"efficiency": 0.96}, "overhead_fraction": 0.01},
        "4": {"efficiency": 1.07, "in_loop": {"efficiency": 0.94}, "overhead_fraction": 0.01},
    }
    goal = bench_goals.goals({"limits": limits})["efficiency (measured / predicted speedup)"]
    assert goal["value"] == 0.94 and not goal["met"]


def test_gpu_scripts_parse():
    for script in sorted((Path(__file__).parents[1] / "scripts").glob("gpu_*.sh")):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


def test_outputs_may_part_only_at_a_numerical_tie(tiny_pair, monkeypatch):
    """A contender whose greedy output differs from the target's is an error, unless the
    target's logits for the two tokens at the first difference are within the dtype's tie gap."""
    target = CachedLM(load_model(ModelSpec(str(tiny_pair["target"])), torch.device("cpu")), 98)
    ids = torch.tensor([5, 17, 42, 8, 3])
    reference = list(autoregressive_decode(target, ids, Sampling(0.0), 12, set(), None))
    assert ties.same_greedy_output(target, ids, reference, list(reference), "same", 0) is None
    target.reset()
    logits = target.prefill(torch.cat([ids, torch.tensor(reference[:6])]))
    runner_up = int(logits.topk(2).indices[1])
    parted = reference[:6] + [runner_up] + reference[7:]
    gap = float(logits[reference[6]] - logits[runner_up])
    assert gap > 1e-3  # a real preference in float32: not a tie, an error
    with pytest.raises(HarnessError, match="at token 6: the target prefers"):
        ties.same_greedy_output(target, ids, reference, parted, "parted", 0)
    with pytest.raises(HarnessError, match="stopped after 8 tokens"):
        ties.same_greedy_output(target, ids, reference, reference[:8], "short", 0)
    monkeypatch.setitem(ties.TIE_LOGIT_GAP, torch.float32, gap * 1.01)  # the same gap, now within the tie gap
    with pytest.raises(HarnessError, match="at token 7: the target prefers"):  # a tie at 6, but token 7 on is the old context's
        ties.same_greedy_output(target, ids, reference, parted, "parted", 0)
    continued = (
        reference[:6]
        + [runner_up]
        + list(
            autoregressive_decode(
                target, torch.cat([ids, torch.tensor(reference[:6] + [runner_up])]), Sampling(0.0), 5, set(), None
            )
        )
    )
    tie = ties.same_greedy_output(target, ids, reference, continued, "parted", 3)
    assert tie == {"contender": "parted", "prompt": 3, "position": 6, "logit_gap": pytest.approx(gap, rel=1e-4), "later_ties": 0}
    # After the tie, a later token that is not the target's greedy choice on its own context is no tie.
    target.reset()
    later = target.prefill(torch.cat([ids, torch.tensor(continued[:9])]))
    wrong = continued[:9] + [int(later.topk(2).indices[1])] + continued[10:]
    with pytest.raises(HarnessError, match="at token 9: the target prefers"):
        ties.same_greedy_output(target, ids, reference, wrong, "parted", 3)


class DriftingClock:
    """A fake clock under which scoring n positions takes n units and drafting a
    token 0.2 units, on a machine that gets 1% slower with every model call."""

    def __init__(self):
        self.now, self.speed = 0.0, 1.0

    def spend(self, units: float):
        self.now += units * self.speed
        self.speed *= 1.01


def test_costs_are_measured_interleaved_so_drift_cancels(monkeypatch):
    clock = DriftingClock()
    target = SimpleNamespace(
        device=torch.device("cpu"),
        vocab_size=8,
        length=0,
        reset=lambda: None,
        prefill=lambda ids: None,
        forward=lambda ids, num_logits: clock.spend(ids.shape[0]),
        rollback=lambda n: setattr(clock, "now", clock.now + 0.5),
    )  # a decode step has none: not timed
    drafter = SimpleNamespace(
        reads_target=(),
        start=lambda prompts: None,
        propose=lambda rows, budgets, s: [clock.spend(0.2) for _ in range(budgets[0])],
    )
    pair = SimpleNamespace(target=target, drafter=drafter, device=torch.device("cpu"), context=512)
    monkeypatch.setattr(runner_costs.time, "perf_counter", lambda: clock.now)
    costs = runner_costs.measure_costs(pair, torch.arange(8), 3, Sampling(0.0))
    # Timed one block per n instead, v(4) would read 4.93 here.
    assert costs["verify_cost"][0] == 1.0
    assert costs["verify_cost"][3] == pytest.approx(4.0, rel=0.05)
    assert costs["cost_ratio"] == pytest.approx(0.2, rel=0.1)


def test_the_gpu_measured_speedup_pass_runs(tiny_pair):
    """On CUDA, `limit` takes its measured speedup from uninstrumented passes; the pass runs anywhere."""
    pair_cfg = OmegaConf.create(
        {"name": "tiny", "target": {"id": str(tiny_pair["target"])}, "draft": {"kind": "model", "id": str(tiny_pair["draft"])}}
    )
    pair = load_pair(pair_cfg, torch.device("cpu"))
    encoded = [torch.tensor([5, 17, 42, 8, 3]), torch.tensor([9, 9, 30, 31])]
    speedup = parts.plain_decode_speedup(pair, encoded, 2, 12, torch.device("cpu"), rep=1)
    assert 0 < speedup < float("inf")


def _continuation(context: list[int], start: int, k: int) -> list[int]:
    """The k tokens a lookup proposes from `start`: what followed, repeated where it runs into the end."""
    return [context[start + j % (len(context) - start)] for j in range(k)]


def _lookup_passes_brute_force(prompt: list[int], output: list[int], k: int) -> int:
    """The fewest passes over every sequence of lookup choices (each cycle: any continuation
    after an earlier occurrence of any suffix n-gram, or nothing), by exhaustive search."""
    seq = prompt + output

    def fewest_from(committed: int) -> int:
        if committed >= len(seq):
            return 0
        k_cycle, context = min(k, len(seq) - committed - 1), seq[:committed]
        reach = {0}  # drafts accepted, for each choice
        for n in range(1, committed):
            for i in range(committed - n):
                if context[i : i + n] == context[-n:]:
                    proposal = _continuation(context, i + n, k_cycle)
                    agree = next((j for j, t in enumerate(proposal) if t != seq[committed + j]), len(proposal))
                    reach.add(agree)
        return 1 + min(fewest_from(committed + a + 1) for a in reach)

    return fewest_from(len(prompt))


def _latest_match_passes(prompt: list[int], output: list[int], k: int) -> int:
    """Passes of the loop's default lookup (latest match, n from 3 down to 1), by hand."""
    seq, committed, passes = prompt + output, len(prompt), 0
    while committed < len(seq):
        k_cycle, context, proposal = min(k, len(seq) - committed - 1), seq[:committed], []
        for n in range(min(3, committed - 1), 0, -1):
            hits = [i for i in range(committed - n) if context[i : i + n] == context[-n:]]
            if hits:
                proposal = _continuation(context, hits[-1] + n, k_cycle)
                break
        committed += next((j for j, t in enumerate(proposal) if t != seq[committed + j]), len(proposal)) + 1
        passes += 1
    return passes


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fewest_lookup_passes_is_the_minimum_over_lookup_choices(k):
    gen = torch.Generator().manual_seed(k)
    below_latest = 0
    for _ in range(30):  # a vocabulary of 3: many matches, and many that disagree
        prompt = torch.randint(0, 3, (5,), generator=gen).tolist()
        output = torch.randint(0, 3, (8,), generator=gen).tolist()
        fewest = contenders.fewest_lookup_passes(prompt, output, k)
        assert fewest == _lookup_passes_brute_force(prompt, output, k)
        latest = _latest_match_passes(prompt, output, k)
        assert fewest <= latest
        below_latest += fewest < latest
    assert below_latest > 0  # the floor is not just the latest match


def test_fewest_lookup_passes_on_a_copied_prompt():
    # The output copies the prompt: after its first token (no earlier match of the prompt's
    # last token), every cycle accepts k drafts and adds the target's own token.
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    assert contenders.fewest_lookup_passes(prompt, prompt, 3) == 1 + 2  # 1 token, then 4 + 3 (the last cycle drafts 2)
    assert contenders.fewest_lookup_passes(prompt, prompt, 1) == 1 + 4


def test_the_memory_part_reports_its_own_peak_not_the_loading(monkeypatch):
    """The process's peak includes loading (and a first run's GGUF dequantisation); the memory part's
    peak is over its own prompts. Here 400 MB touched and freed before it must not show in it."""
    import numpy as np

    if not provenance.reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs: the peak cannot be reset here")
    block = np.ones(400 * 2**20 // 8)  # touched: resident
    del block
    before, _ = provenance.peak_rss_mb(True)
    monkeypatch.setattr(parts, "run_prompt", lambda *a, **k: None)
    cfg = OmegaConf.create({"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 8})
    args = SimpleNamespace(memory_prompts=4, memory_new_tokens=4)
    out = parts.memory(None, cfg, [{"id": "p"}], [torch.tensor([1])], args, torch.device("cpu"))
    assert out["peak_rss_over"] == "cell"
    assert out["peak_rss_mb"] < before - 300
    assert out["peak_rss_mb"] == pytest.approx(out["rss_max_mb"], abs=50)
