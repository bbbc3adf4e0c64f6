"""One benchmark cell: a pair, a k, a sampling setting, a prompt set (`run_cell`, which the CLI wraps).

Per prompt (or batch) the target-only baseline and the speculative loop run back to back, alternating
which goes first, each timed from outside, one JSON line appended; the summary derives from the lines.
Results live in `<out_dir>/<cell key>/` (harness.runner.store): a re-run resumes, a finished cell is
reused unless `force=true`; the running process holds the cell's claim (harness.tracking.claims).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import harness.tracking.tracker as tracking
from harness.base.device import gpu_clocks
from harness.base.files import write_json_atomic
from harness.config.checks import validate, with_default_pair
from harness.config.settings import COMPILED_MAX_TOKENS, PROMPT_SEED_STRIDE
from harness.core import metrics
from harness.core.loop import autoregressive_decode_rows, speculative_decode_rows
from harness.core.sampling import Sampling
from harness.data.datasets import load_prompts
from harness.data.prompts import as_tensor, encode, encode_within, select
from harness.errors import HarnessError
from harness.models.batched import rows_of
from harness.models.captured import compiles
from harness.models.loading import resolve_device
from harness.runner.costs import Clock, limits, measure_costs, timed
from harness.runner.pair import Pair, architectures, draft_size, load_pair
from harness.runner.provenance import (
    conditions,
    current_rss_mb,
    harness_commit,
    libraries,
    machine,
    memory_growth,
    peak_rss_mb,
    reset_peak_rss,
    utc_now,
)
from harness.runner.signals import sigterm_as_interrupt
from harness.runner.store import cell_path, dataset_sha256, read_records, stamped
from harness.tracking.claims import claim


def run_cell(cfg: DictConfig, out_dir: str | Path | None = None, quiet: bool = False) -> dict:
    """Run (or resume) one cell; returns its summary, also written to summary.json."""
    cfg = with_default_pair(cfg)
    validate(cfg)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    cell_dir = cell_path(cfg, out_dir, device)
    try:
        cell_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise HarnessError(f"cannot write results to {cell_dir}: {err.strerror}; set out_dir=<a writable directory>") from None
    try:
        # SIGTERM ends a run as Ctrl-C does at any point, loading included: the claim is released, the exit is 130.
        with sigterm_as_interrupt(), claim(cell_dir, quiet=quiet):  # agents or SLURM tasks sharing out_dir may pick the same cell
            return _run_claimed(cfg, cell_dir, device, quiet)
    except BaseException:  # a run that wrote nothing leaves no empty cell (a claim or a result keeps it)
        with contextlib.suppress(OSError):
            cell_dir.rmdir()
        raise


def _run_claimed(cfg: DictConfig, cell_dir: Path, device: torch.device, quiet: bool) -> dict:
    """The body of run_cell, run while this process holds the cell's claim."""
    summary_path, status_path, lines_path = cell_dir / "summary.json", cell_dir / "status.json", cell_dir / "prompts.jsonl"
    if summary_path.exists() and not cfg.force:
        return _reused(cfg, cell_dir, quiet)
    started, here = utc_now(), machine()  # stamped on every result this run writes
    peak_since_reset = reset_peak_rss()

    # Prompts first: a dataset problem should stop the run before a model loads.
    prompts = select(load_prompts(cfg.dataset), cfg.dataset.num_prompts, cfg.seed, cfg.prompts.shuffle)
    pair = load_pair(cfg.pair, device, cfg.cache, cfg.compile, cfg.cpu_linear, cfg.get("forward", "hf"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sampling = Sampling(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p))
    encoded, skipped, truncated = _encoded(cfg, pair, prompts, device)
    (cell_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # once the cell can start
    if cfg.force:  # once prompts and pair have loaded (a redo that cannot start keeps the finished cell), before
        for path in (summary_path, status_path, lines_path):  # any new result: a stopped redo must not look complete
            path.unlink(missing_ok=True)
    records = read_records(lines_path, trim=True)
    pair.follow_linear(records)
    pair.follow_draft_length(cfg.get("draft_length"))
    pair.follow_tree(cfg)
    costs = _warmed_up(pair, encoded, cfg, sampling)
    clocks_at_start = gpu_clocks(device)  # None on a CPU

    resumed = len(records)  # records[resumed:] are run by this process
    done = {r["id"] for r in records}
    tracker = tracking.start(cfg, cell_dir)
    versions_now = libraries()

    def write_status(status: str, **extra) -> None:
        write_json_atomic(
            status_path,
            stamped({"status": status, "done": len(records), "total": len(encoded), **extra, "machine": here}, started),
        )

    write_status("running")
    try:
        with lines_path.open("a") as out:
            for result in results(pair, encoded, done, cfg, sampling, quiet):
                record = _record(result, started, here, versions_now, pair)
                out.write(json.dumps(record) + "\n")
                out.flush()  # append-only and flushed per prompt: an interruption loses at most the prompt in flight
                records.append(record)
                tracker.log_prompt(record)
        summary = metrics.summarize(records, cfg.k, costs, cfg.seed)
        peak_mb, peak_over = peak_rss_mb(peak_since_reset)
        run_conditions = conditions(cfg, pair)
        _note_mixed(run_conditions, records, versions_now, cell_dir.name)
        summary.update(
            _cell_figures(cfg, pair, encoded, records, costs, skipped, truncated),
            conditions=run_conditions,
            peak_rss_mb=peak_mb,
            peak_rss_over=peak_over,  # "cell": since this cell started; "process": since the process did
            max_memory_allocated_mb=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
            **memory_growth(records[resumed:]),  # a resumed run's earlier process had its own memory
            limit_ratio=costs["limit"]["target_limit_ratio"],
            **({"cost_only": pair.cost_only, "predicted_grid": metrics.predicted_grid(costs)} if pair.cost_only else {}),
            draft_length=pair.drafter.draft_length.describe(),  # the policy, its calibration and fitted settings
            tree=None if pair.drafter.tree is None else pair.drafter.tree.describe(),
            recompiles_after_warm_up=compiles() - pair.compiled_at_warm_up if cfg.compile else None,
            gpu_clocks={"start": clocks_at_start, "end": gpu_clocks(device)} if clocks_at_start else None,
            cell=cell_dir.name,
            cell_dir=str(cell_dir),
        )
        summary = stamped({**summary, "status": "finished"}, started)
        write_json_atomic(summary_path, summary)
        write_status("finished")
    except BaseException as err:  # Ctrl-C, SIGTERM, a requeue's SystemExit: interrupted; anything else: failed
        status = "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "failed"
        write_status(status, error=repr(err))
        try:
            partial = metrics.summarize(records, cfg.k, costs, cfg.seed) if records else {}
        except Exception:  # the summary may be what failed
            partial = {}
        tracker.finish({**partial, "status": status}, records, status=status)
        raise
    tracker.finish(summary, records)
    return summary


def _warmed_up(pair: Pair, encoded: list, cfg: DictConfig, sampling: Sampling) -> dict:
    """Size and warm the pair for the cell (compiled steps compile; nothing timed), then measure its costs at its batch size."""
    B = cfg.get("batch_size", 1)
    k = cost_k(pair, cfg)
    pair.reserve(max(ids.shape[0] for _, ids in encoded), cfg.max_new_tokens, k, B)
    pair.warm_up(k, B)
    pair.compiled_at_warm_up = compiles()  # compile=true: any graph compiled from here on is a recompile, counted
    warm_cfg = OmegaConf.merge(cfg, {"max_new_tokens": min(8, cfg.max_new_tokens)})
    run_batch(pair, [(p, ids[-32:], i) for i, (p, ids) in enumerate(encoded[:B])], 0, warm_cfg, sampling)
    prompts = [ids for _, ids in encoded[:B]]
    costs = measure_costs(pair, prompts, k, sampling, widest=pair.drafter.tree.nodes if pair.drafter.tree else 0)
    costs["limit"] = limits(pair, costs, prompts)
    pair.use_costs(costs)
    return costs


def cost_k(pair: Pair, cfg: DictConfig) -> int:
    """The k whose costs a cell measures: its own; a cost-only cell v(n) up to 2k + 2 (for its predicted grid),
    within the widths compile=true captures."""
    if not pair.cost_only:
        return cfg.k
    return min(2 * cfg.k + 1, COMPILED_MAX_TOKENS - 1) if cfg.compile else 2 * cfg.k + 1


def _record(result: dict, started: str, here: dict, versions: str, pair: Pair) -> dict:
    """A prompt's record as written: stamped, with where, with what code and how it ran."""
    record = stamped(result, started)
    record["machine"] = here
    record["rss_mb"] = current_rss_mb()
    record["host"] = platform.node()  # a resumed cell may have run part of its prompts elsewhere
    record["harness_commit"] = harness_commit()  # ... or with other code
    record["libraries"] = versions  # ... or other torch and transformers
    record["linear"] = pair.linear.get("product")
    if any((pair.linear.get("plans") or {}).values()):
        record["linear_plans"] = pair.linear["plans"]
    if pair.device.type == "cuda":
        record["cuda_allocated_mb"] = torch.cuda.memory_allocated(pair.device) / 2**20
    return record


def _cell_figures(cfg: DictConfig, pair: Pair, encoded: list, records: list, costs: dict, skipped: int, truncated: int) -> dict:
    """What a cell's summary says of its settings, prompts, categories, costs and draft."""
    return dict(
        pair=cfg.pair.name,
        target=cfg.pair.target.id,
        draft=cfg.pair.draft.get("id", cfg.pair.draft.kind),
        k=cfg.k,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        dataset=cfg.dataset.name,
        prompts_skipped=skipped,
        prompts_truncated=truncated,
        prompt_selection={"seed": cfg.seed, "shuffle": cfg.prompts.shuffle, "num_prompts": cfg.dataset.num_prompts},
        dataset_sha256=dataset_sha256(cfg),  # the analysis pairs prompts of one file only
        prompt_ids=[p["id"] for p, _ in encoded],
        categories=metrics.by_category(records, cfg.k, costs, cfg.seed),
        costs=costs,
        architectures=architectures(pair),
        **draft_size(pair),
    )


def _reused(cfg: DictConfig, cell_dir: Path, quiet: bool) -> dict:
    """A finished cell's stored summary, not run again (a W&B sweep's run still gets its numbers)."""
    summary = json.loads((cell_dir / "summary.json").read_text())
    if not quiet:
        print(f"[harness] cell already complete, not re-run (force=true to redo): {cell_dir}", file=sys.stderr)
    then, now = (summary.get("conditions") or {}).get("harness_commit"), harness_commit()
    if then and now and then != now:  # the cell key holds the settings, not the code that measured them
        print(
            f"warning: {cell_dir.name} was measured by harness commit {then}, and this is {now}: its numbers are "
            f"kept as they are; force=true remeasures it with this code",
            file=sys.stderr,
        )
    summary = {**summary, "cell": cell_dir.name, "cell_dir": str(cell_dir)}  # where it is now (the store may have moved)
    if os.environ.get("WANDB_SWEEP_ID"):  # the sweep's run gets the stored numbers: its metric, its report's cell
        with tracking.start(cfg, cell_dir) as tracker:
            tracker.finish({**summary, "reused": True}, read_records(cell_dir / "prompts.jsonl"))
    return summary


def _encoded(cfg: DictConfig, pair: Pair, prompts: list[dict], device: torch.device) -> tuple[list, int, int]:
    """The prompts that fit with max_new_tokens as (prompt, ids), and how many were skipped and truncated."""
    budget = pair.prompt_budget(cfg.max_new_tokens)
    if budget < 1:
        raise HarnessError(
            f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the pair's {pair.context}-token context: lower max_new_tokens"
        )
    encoded, skipped, truncated = [], 0, 0
    for p in prompts:
        full = encode(pair.tokenizer, p["prompt"], cfg.prompts.template)
        fits = len(full) <= budget
        ids = full if fits else encode_within(pair.tokenizer, p["prompt"], cfg.prompts.template, budget, cfg.prompts.overlong)
        if ids is None:
            skipped += 1
        else:
            truncated += not fits
            encoded.append((p, as_tensor(ids, device)))
    if not encoded:
        raise HarnessError(
            f"every prompt is longer than the context budget ({budget} tokens): lower max_new_tokens or use prompts.overlong=truncate"
        )
    return encoded, skipped, truncated


# What a resumed cell's prompts may have run under apart: (the conditions' key for all of them, what mixing means).
MIXED = {
    "hostnames": "ran under several host names ({}): if these are different machines its timings mix them; force=true reruns it in one go",
    "harness_commits": "were measured by several harness versions ({}): force=true reruns it with one",
    "libraries_mixed": "were measured with several library versions ({}): their timings may not compare; force=true reruns it with one",
}


def _note_mixed(run_conditions: dict, records: list[dict], versions_now: str, cell: str) -> None:
    """A resumed cell whose prompts ran on several machines, harness commits or library versions: the lists go in the conditions, with a warning."""
    seen = {
        "hostnames": {r["host"] for r in records if r.get("host")} | {run_conditions["hostname"]},
        "harness_commits": {r.get("harness_commit") or "unknown" for r in records}
        | {run_conditions["harness_commit"] or "unknown"},
        "libraries_mixed": {r["libraries"] for r in records if r.get("libraries")} | {versions_now},
    }
    for key, values in seen.items():
        if len(values) > 1:
            run_conditions[key] = sorted(values)
            print(f"warning: the prompts of {cell} {MIXED[key].format('; '.join(sorted(values)))}", file=sys.stderr)


def results(pair: Pair, encoded: list, done: set, cfg: DictConfig, sampling: Sampling, quiet: bool):
    """The records of the prompts not `done`, as measured: one at a time, or in batches of consecutive prompts (run whole)."""
    B = cfg.get("batch_size", 1)
    batches = [[(p, ids, i) for i, (p, ids) in enumerate(encoded)][j : j + B] for j in range(0, len(encoded), B)]
    todo = [(b, rows) for b, rows in enumerate(batches) if any(p["id"] not in done for p, _, _ in rows)]
    desc = f"{cfg.pair.name} k={cfg.k} T={cfg.temperature}" + (f" B={B}" if B > 1 else "")
    for b, rows in tqdm(todo, desc=desc, unit="batch" if B > 1 else "prompt", file=sys.stderr, disable=quiet):
        yield from (r for r in run_batch(pair, rows, b, cfg, sampling) if r["id"] not in done)


def run_prompt(pair: Pair, prompt: dict, ids: torch.Tensor, index: int, cfg: DictConfig, sampling: Sampling) -> dict:
    """Baseline and speculative decoding of one prompt, back to back: a batch of one."""
    return run_batch(pair, [(prompt, ids, index)], index, cfg, sampling)[0]


def run_batch(
    pair: Pair, rows: list[tuple[dict, torch.Tensor, int]], batch: int, cfg: DictConfig, sampling: Sampling
) -> list[dict]:
    """Baseline and speculative decoding of a batch of (prompt, ids, index), back to back (the first alternates
    with `batch`); one record per prompt. Each row has its own seed (seed x stride + index), as alone. A row's
    time_s is when it finished in its batch; at batch_size > 1 `batch` holds the batch's own figures."""
    target, drafter = rows_of(pair.target, len(rows)), pair.drafter
    prompts = [ids for _, ids, _ in rows]
    seeds = [cfg.seed * PROMPT_SEED_STRIDE + index for _, _, index in rows]

    def generators():
        return [torch.Generator(pair.device).manual_seed(seed) for seed in seeds]

    spec_out, base_out, clocks = back_to_back(
        pair.device,
        target,
        drafter,
        lambda: speculative_decode_rows(
            target, drafter, prompts, cfg.k, sampling, cfg.max_new_tokens, pair.eos_ids, generators()
        ),
        lambda: autoregressive_decode_rows(target, prompts, sampling, cfg.max_new_tokens, pair.eos_ids, generators()),
        base_first=batch % 2 == 0,
    )
    (spec_cycles, spec_stamps), (base_steps, base_stamps) = spec_out, base_out
    per_row = [[] for _ in rows]  # (cycle, stamp) per row
    for cycle, stamp in zip(spec_cycles, spec_stamps):
        for row, c in cycle:
            per_row[row].append((c, stamp))
    base_tokens, base_done = [[] for _ in rows], [0.0] * len(rows)
    for step, stamp in zip(base_steps, base_stamps):
        for row, token in step:
            base_tokens[row].append(token)
            base_done[row] = stamp
    spec_total, base_total = sum(len(c.tokens) for cycle in spec_cycles for _, c in cycle), sum(map(len, base_tokens))
    speedup = (spec_total / spec_stamps[-1]) / (base_total / base_stamps[-1])
    records = []
    for (prompt, ids, index), cycles, tokens, done in zip(rows, per_row, base_tokens, base_done):
        counts = metrics.cycle_counts([c for c, _ in cycles], cfg.k)
        spec_tokens = [t for c, _ in cycles for t in c.tokens]
        spec = {
            **counts,
            "new_tokens": len(spec_tokens),
            "time_s": cycles[-1][1],
            "ttft_s": spec_stamps[0],
            "first_tokens": len(cycles[0][0].tokens),
            "draft_passes": counts["drafted"] if drafter.forwards else 0,
            "tokens": spec_tokens,
        }
        base = {"new_tokens": len(tokens), "time_s": done, "ttft_s": base_stamps[0], "first_tokens": 1, "tokens": tokens}
        record = {"index": index, "id": prompt["id"], "category": prompt["category"], "prompt_tokens": int(ids.shape[0])}
        records.append({**record, "spec": spec, "base": base, "speedup": speedup})
    if cfg.get("batch_size", 1) == 1:
        records[0]["spec"]["clock"], records[0]["base"]["clock"] = clocks["spec"], clocks["base"]
    else:
        unit = batch_unit(rows, batch, cfg.k, spec_out, base_out, clocks, base_total)
        for record in records:
            record["batch"] = unit
    return records


def batch_unit(rows, batch: int, k: int, spec_out, base_out, clocks, base_total: int) -> dict:
    """A batch's own figures, which its rows' records share: its passes and clocks, the baseline's steps."""
    (spec_cycles, spec_stamps), (base_steps, base_stamps) = spec_out, base_out
    draft_steps = [max((c.num_drafted for _, c in cycle), default=0) for cycle in spec_cycles]  # a batched draft's passes
    return {
        "index": batch,
        "size": len(rows),
        "ids": [p["id"] for p, _, _ in rows],
        "spec": {
            "new_tokens": sum(len(c.tokens) for cycle in spec_cycles for _, c in cycle),
            "time_s": spec_stamps[-1],
            "ttft_s": spec_stamps[0],
            "first_tokens": sum(len(c.tokens) for _, c in spec_cycles[0]),
            "drafted": sum(draft_steps),
            "first_drafted": draft_steps[0],
            # [k + 1] the batch's passes by the most any row drafted (the pass is that wide: k' + 1 positions)
            "drafted_hist": [draft_steps.count(j) for j in range(k + 1)],
            "clock": clocks["spec"],
        },
        "base": {
            "new_tokens": base_total,
            "time_s": base_stamps[-1],
            "ttft_s": base_stamps[0],
            "first_tokens": len(rows),
            "steps": len(base_steps),
            "clock": clocks["base"],
        },
    }


def back_to_back(device, target, drafter, spec_decode, base_decode, base_first: bool):
    """The speculative decode and the baseline, one after the other in the order given, each timed from outside
    with a Clock on its passes after the first yield (the in-run costs): (spec, base, {side: tally})."""
    clocks = {"spec": Clock(device), "base": Clock(device)}
    sides = {"spec": (spec_decode, (target, drafter)), "base": (base_decode, (target,))}
    out = {}
    for side in ("base", "spec") if base_first else ("spec", "base"):
        decode, watched = sides[side]
        items = decode()
        with clocks[side].watching(*watched) as clock:
            out[side] = timed(clock.after_first(items), device)
    return out["spec"], out["base"], {side: clock.tally() for side, clock in clocks.items()}
