"""Performance benchmark: our loop against HF transformers, and against its own limit.

    python -m harness.bench [--reps 5] [--prompts 6] [--ks 1 2 4] [--max-new-tokens 64]
                            [--batch-sizes 4] [--memory-prompts 100] [--out results/bench/bench.json] [HYDRA OVERRIDES]

Greedy decoding on one pair (default: the embedded default pair). Five parts (run in the order 1, 2, 3, 5, 4):

  1. throughput, every contender on every prompt, interleaved prompt by prompt
     (order alternating), medians over repetitions of total tokens / total time:
       ours_base      vs hf_base          target only: our baseline must not be slow;
       ours_spec_kK   vs hf_assisted_kK   HF `generate(assistant_model=...)` with the
                                          assistant's generation config set to
                                          num_assistant_tokens=K, a constant schedule and
                                          the confidence threshold off (HF reads these
                                          from the assistant, not from generate's kwargs);
       ours_ngram_kK  vs hf_lookup_kK     prompt lookup, `prompt_lookup_num_tokens=K`;
       ours_ngram_cost_aware_kK           our lookup proposing only what pays for its
                                          verification (draft_length=cost on lookup,
                                          v(n) measured first), against the same HF run:
                                          not like for like, so outside the lookup goal.
     With cache=static compile=true, HF's contenders get generate()'s own compiled
     path (static cache, compile_config) so that both sides are compiled.
     Compared outputs must be token-identical, or the benchmark stops; the one
     exception is a numerical tie (outputs part where the target's two best logits
     are within its dtype's rounding (harness.core.ties.TIE_LOGIT_GAP), and every later token is still the
     target's greedy choice on the contender's own output, up to such a tie), recorded in
     greedy_ties. The target's
     forward passes per contender are counted: equal counts show that HF verified
     the same number of drafted tokens per cycle as we did.
     Each ratio splits into a part from fewer target passes per token and a part
     from less time per pass (ratio_parts): with equal passes, the lead is all loop.
     For prompt lookup, lookup_floor sets both sides' passes beside the fewest any
     lookup could take on these prompts (fewest_lookup_passes, in hindsight): how
     much a better choice of match could still gain.
  2. limit, per k (a draft model or a feature head): decode-phase speedup (prefill excluded) against the speedup
     predicted from the measured acceptance, draft cost ratio c and verify-cost
     curve v(n), with a run summary's names: predicted_speedup accounts for the
     cycles actually run, predicted_speedup_formula is Leviathan et al.'s closed
     form from alpha; efficiency (efficiency_formula) = measured / each.
  Each speedup (the ratios, the limits' measured speedup) comes with its
  coefficient of variation over the repetitions (ratio_cv, measured_speedup_cv).
  3. overhead, per k: the share of decode time spent outside model forward
     passes, and where it goes (the rule, cache rollback, stop handling, the rest).
  5. batched, per --batch-sizes B (default 4; none to skip): our batched baseline (harness.core.loop)
     against HF generate() on the same left-padded batch of B prompts, interleaved, tokens/s medians
     and the median per-rep ratio. HF's assisted generation and prompt lookup refuse B > 1, so the
     speculative contenders have no HF rival there.
  4. memory: resident memory (and CUDA allocated memory) after each of
     --memory-prompts prompts of a full baseline + speculative run, with the
     fitted growth per prompt (scipy.stats.linregress).

Figures and conditions go to JSON (--out), led by its schema_version, the run's start
time (started_utc, UTC ISO 8601) and the machine (CPU, cores, GPUs, memory); the last
stdout line is that JSON. The parts are in harness.bench.parts, the contenders in
harness.bench.contenders, the goals in harness.bench.goals.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers.utils import logging as hf_logging

from harness.base.files import write_json_atomic
from harness.bench.audit import cycle_profile, sync_audit
from harness.bench.contenders import lookup_room
from harness.bench.goals import goals
from harness.bench.parts import SPREAD_NOTE, batched_baselines, limit, memory, throughput
from harness.config.checks import CONF_DIR, check_choices, compiled_k_message, unmakeable, validate, with_default_pair
from harness.data.datasets import load_prompts
from harness.data.prompts import as_tensor, encode_within, select
from harness.errors import HarnessError
from harness.models.cached import CachedLM
from harness.models.loading import resolve_device
from harness.runner.pair import load_pair
from harness.runner.provenance import conditions, machine, process_peak_rss_mb, utc_now
from harness.runner.store import stamped


def setup(cfg, args, argv, prompts, encoded) -> dict:
    return {
        "pair": cfg.pair.name,
        "prompts": len(encoded),
        "prompt_ids": [p["id"] for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "reps": args.reps,
        "ks": args.ks,
        "cache": cfg.cache,
        "compile": cfg.compile,
        "forward": cfg.get("forward", "hf"),
        "grad_mode": "torch.inference_mode, every contender",
        "statistic": "tokens_per_s: median over reps of total tokens / total time; ratios: median over reps of the paired "
        "per-rep ratio (ratio_of_medians: of the medians); limits: median over reps of the decode-phase speedup, "
        "acceptance, costs and overhead over all reps; predicted_speedup priced on the cycles run and "
        "predicted_speedup_formula the closed form, as in a run's summary; " + SPREAD_NOTE,
        "command": "python -m harness.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
    }


def write_result(path: Path, result: dict) -> None:
    """The figures so far, judged: a run cut off later (the GPU check's timeouts) keeps its goals too."""
    result["goals"] = goals(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)


BENCH_FLAGS = {
    "k": "--ks",
    "max_new_tokens": "--max-new-tokens (the memory part: --memory-new-tokens)",
    "dataset.num_prompts": "--prompts (the memory part: --memory-prompts)",
}


def k_value(value: str) -> int:
    """A --ks value; an override swallowed by --ks (nargs) gets its own message."""
    if "=" in value:
        raise argparse.ArgumentTypeError(f"{value!r} is an override, not a k: put overrides before --ks")
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None


def unwritable(path: Path) -> str | None:
    """Why the JSON could not be written at `path` (checked before the minutes of measuring), or None."""
    return "is a folder: give a file name, e.g. results/bench/bench.json" if path.is_dir() else unmakeable(path.parent)


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The bench's flags, checked before anything loads (a bad one exits 2 with one line)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--ks", type=k_value, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--memory-prompts", type=int, default=100, help="0: skip the memory part")
    parser.add_argument("--memory-new-tokens", type=int, default=16)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument(
        "--batch-sizes", type=k_value, nargs="*", default=[4], help="part 6's batch sizes (none: skip it); each at least 2"
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench/bench.json"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +pair=smollm2 device=cuda")
    args = parser.parse_args(argv)
    for flag, values, low in (
        ("--reps", [args.reps], 1),
        ("--prompts", [args.prompts], 1),
        ("--ks", args.ks, 1),
        ("--max-new-tokens", [args.max_new_tokens], 2),
        ("--memory-prompts", [args.memory_prompts], 0),
        ("--memory-new-tokens", [args.memory_new_tokens], 1),
        ("--batch-sizes", args.batch_sizes or [2], 2),
    ):
        if min(values) < low:
            parser.error(f"{flag} {' '.join(map(str, values))}: each must be at least {low}")
    if 0 < args.memory_prompts < 4:
        parser.error(
            f"--memory-prompts {args.memory_prompts}: give 0 (skip the memory part) or at least 4 (growth is fitted over the second half)"
        )
    for arg in args.overrides:  # Hydra would take them and the bench ignore them: its flags set these
        if arg.partition("=")[0].lstrip("+") in BENCH_FLAGS:
            parser.error(f"{arg}: the bench sets this with {BENCH_FLAGS[arg.partition('=')[0].lstrip('+')]}")
    if message := unwritable(args.out):
        parser.error(f"--out {args.out}: {message}")
    if max(args.ks) > args.max_new_tokens:  # as validate() refuses k above max_new_tokens (a few more make the
        # limit part's figures nan where no cycle after a prompt's first drafts, rather than a crash)
        parser.error(
            f"--ks {' '.join(map(str, args.ks))}: each must be at most --max-new-tokens {args.max_new_tokens} "
            f"(a cycle drafts at most {args.max_new_tokens - 1})"
        )
    args.ks = list(dict.fromkeys(args.ks))  # --ks 2 2 would run k=2's parts twice and count its lookup floor twice
    check_choices(args.overrides, sweeps=False)  # as `python -m harness` checks them: one line for an unknown name
    return parser, args


def main(argv: list[str] | None = None) -> dict:
    parser, args = parse_args(argv)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    started = time.time()
    started_utc = utc_now()

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = with_default_pair(compose(config_name="config", overrides=args.overrides))
    validate(cfg)  # e.g. compile=true without cache=static would recompile ours at every step while HF ran compiled
    if cfg.compile and max(args.ks) + 1 > CachedLM.COMPILED_MAX_TOKENS:  # validate() saw only cfg.k, not --ks
        parser.error(f"--ks {' '.join(map(str, args.ks))}: {compiled_k_message(max(args.ks))}")
    device = resolve_device(cfg.device)
    all_prompts = select(load_prompts(cfg.dataset), None, cfg.seed, shuffle=False)  # a dataset problem before a model loads
    pair = load_pair(cfg.pair, device, cfg.cache, cfg.compile, cfg.cpu_linear, cfg.get("forward", "hf"))
    prompts = all_prompts[: args.prompts]
    # Prompts cut to leave room for the new tokens, the same budget at every k, as `python -m harness` does,
    # and for the k positions HF's prompt lookup may verify past them (lookup_room).
    new_tokens, k_max = max(args.max_new_tokens, args.memory_new_tokens), max(args.ks)
    room = lookup_room(new_tokens, k_max)
    budget = pair.prompt_budget(room)
    all_encoded = [
        as_tensor(encode_within(pair.tokenizer, p["prompt"], cfg.prompts.template, budget, "truncate"), device)
        for p in all_prompts
    ]
    encoded = all_encoded[: args.prompts]
    pair.reserve(max(ids.shape[0] for ids in all_encoded), room, k_max)
    pair.warm_up(k_max)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    result: dict = stamped(
        {"machine": machine(), "setup": setup(cfg, args, argv, prompts, encoded), "conditions": conditions(cfg, pair)},
        started_utc,
    )
    # Each part is written as soon as it is done: a run cut short (the GPU check's timeouts) keeps what it measured.
    if not args.skip_throughput:
        result.update(
            throughput(
                pair,
                encoded,
                args,
                device,
                on_rep=lambda partial: write_result(
                    args.out,
                    {
                        **result,
                        **partial,
                        "partial": f"throughput over {partial['reps_done']} of {args.reps} repetitions; the rest not run yet",
                    },
                ),
            )
        )
        write_result(args.out, result)
    if pair.drafter.forwards:
        result["limits"] = {k: limit(pair, encoded, k, args.max_new_tokens, device, args.reps) for k in args.ks}
        write_result(args.out, result)
    result["sync_audit"] = sync_audit(pair, encoded[0], max(args.ks), args.max_new_tokens, device)  # every drafter kind
    result["profile"] = cycle_profile(pair, encoded[0], max(args.ks), args.max_new_tokens, device)
    write_result(args.out, result)
    if args.batch_sizes and (cfg.compile or cfg.cache != "dynamic"):
        result["batched"] = {"note": "not run: the batch part compares eager dynamic-cache runs (cache=dynamic compile=false)"}
    elif args.batch_sizes:
        result["batched"] = batched_baselines(pair, encoded, args, device)
        write_result(args.out, result)
    peak_before = process_peak_rss_mb()  # memory() resets the peaks (Linux RSS, CUDA) to take its own
    cuda_before = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    if args.memory_prompts > 0:
        result["memory"] = memory(pair, cfg, all_prompts, all_encoded, args, device)
    result["process_peak_rss_mb"] = max(peak_before, process_peak_rss_mb(), result.get("memory", {}).get("peak_rss_mb", 0.0))
    # ^ loading included; the memory run's own peak is in "memory"
    if device.type == "cuda":
        result["process_max_memory_allocated_mb"] = max(
            cuda_before, torch.cuda.max_memory_allocated(device) / 2**20
        )  # since warm-up
    result["wall_s"] = time.time() - started
    write_result(args.out, result)
    print_summary(result)
    return result


def print_summary(result: dict) -> None:
    """The figures a person reads, one line each, then the whole JSON (less the per-repetition rates) as the last line."""
    if result.get("ratios") or result.get("limits"):
        print(SPREAD_NOTE)
    for name, value in result.get("ratios", {}).items():
        per_rep = result["ratio_per_rep"][name]
        parts = result["ratio_parts"][name]
        print(
            f"{name:<36}{value:8.3f} cv {percent(result['ratio_cv'][name])}   (per repetition {min(per_rep):.3f} to "
            f"{max(per_rep):.3f}, ratio of medians "
            f"{result['ratio_of_medians'][name]:.3f}; "
            f"{parts['fewer_target_passes']:.3f} from target passes per token x {parts['cheaper_time_per_pass']:.3f} from time per pass)"
        )
    if result.get("greedy_ties"):
        ties = result["greedy_ties"]
        print(
            f"greedy outputs parted at {len(ties)} numerical ties (largest logit gap {max(abs(t['logit_gap']) for t in ties):.3g}): "
            + ", ".join(sorted({t["contender"] for t in ties}))
        )
    if result.get("same_output_as_hf"):
        print(
            "share of prompt runs with output identical to HF's: "
            + ", ".join(f"{name.split(' / ')[0]} {share:.2f}" for name, share in result["same_output_as_hf"].items())
        )
    for k, floor in result.get("lookup_floor", {}).items():
        print(
            f"prompt lookup k={k}: target passes HF {floor['hf_passes']}, ours {floor['ours_passes']}, fewest any lookup could take "
            f"{floor['fewest_passes']} (HF's / fewest = {floor['most_fewer_passes_than_hf']:.3f})"
        )
    for k, lim in result.get("limits", {}).items():
        per_rep = lim["measured_speedup_per_rep"]
        print(
            f"k={k}: alpha {lim['alpha']:.3f}  decode speedup {lim['measured_speedup']:.3f} cv {percent(lim['measured_speedup_cv'])} "
            f"({min(per_rep):.3f} to {max(per_rep):.3f})  "
            f"predicted {lim['predicted_speedup']:.3f} (formula {lim['predicted_speedup_formula']:.3f})  "
            f"efficiency {lim['efficiency']:.3f} (formula {lim['efficiency_formula']:.3f}; in-loop costs {lim['in_loop']['efficiency']:.3f}, "
            f"formula {lim['in_loop']['efficiency_formula']:.3f})  overhead {100 * lim['overhead_fraction']:.1f}% ({lim['overhead_per_cycle_ms']:.2f} ms/cycle)"
        )
        v_apart = " ".join(f"{v:.3f}" for v in lim["verify_costs"])
        v_loop = " ".join(
            f"{lim['in_loop']['verify_cost_by_positions'][n]:.3f}" for n in sorted(lim["in_loop"]["verify_cost_by_positions"])
        )
        print(
            f"    v(1..{int(k) + 1}) measured apart {v_apart}; in the loop (n = {sorted(lim['in_loop']['verify_cost_by_positions'])}) {v_loop}; "
            f"c apart {lim['cost_ratio']:.3f}, in the loop {lim['in_loop']['cost_ratio']:.3f}"
        )
    batched = result.get("batched") or {}
    for size, figures in ((key, value) for key, value in batched.items() if key != "note"):
        print(
            f"batch size {size}: ours_base / hf_base {figures['ratio']:.3f} cv {percent(figures['ratio_cv'])} "
            f"({figures['tokens_per_s']['ours_base']:.1f} vs {figures['tokens_per_s']['hf_base']:.1f} tokens/s; "
            f"rows with HF's output {figures['same_output_as_hf']:.2f})"
        )
    if batched:
        print(batched["note"])
    for name, audit in result.get("sync_audit", {}).items():
        print(
            f"host reads of tensor values ({name}): {audit['host_reads_per_cycle']:.2f} per cycle over {audit['cycles']} cycles "
            f"({audit['drafted']} drafted tokens); by line: {audit['host_reads_by_line']}"
        )
        if "syncs" in audit:
            print(f"device syncs ({name}): {audit['syncs_per_cycle']:.2f} per cycle; by line: {audit['by_line']}")
    if profiled := result.get("profile"):
        cycle, one = profiled["per_cycle"], profiled["per_pass"] or {}
        print(
            f"one prompt profiled: {profiled['cycles']} cycles, {cycle['kernels']:.1f} {profiled['kernels_are']} "
            f"({one.get('kernels', 0):.1f} a pass), {cycle['graph_launches']:.1f} graph launches, "
            f"{cycle['device_waits']:.2f} device waits and {cycle['host_reads']:.2f} host reads per cycle"
        )
    if "memory" in result:
        mem = result["memory"]
        print(
            f"memory: {mem['prompts']} prompts, RSS {mem['rss_first_mb']:.0f} -> {mem['rss_last_mb']:.0f} MB, "
            f"growth {mem['rss_growth_mb_per_prompt_second_half']:+.3f} MB/prompt over the second half"
        )
    for name, g in result["goals"].items():
        print(
            f"goal: {name} {'>=' if g['side'] == 'min' else '<='} {g['goal']}: worst {g['value']:.3f}  {'met' if g['met'] else 'NOT MET'}"
        )
    print(json.dumps({k: v for k, v in result.items() if k not in ("tokens_per_s_all_reps",)}, default=str))


def percent(cv: float) -> str:
    """A coefficient of variation as a percentage; n/a with one repetition."""
    return "n/a" if math.isnan(cv) else f"{100 * cv:.1f}%"


def cli() -> None:
    """`python -m harness.bench`."""
    try:
        main()
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
