"""Is the speculative loop lossless? A goodness-of-fit check against the target's exact law.

Speculative decoding promises that its committed tokens are distributed
exactly as if the target had produced them alone. This module tests that
promise on the loop users run (`harness.core.loop.speculative_decode`, with the
configured pair, k, temperature, top-k and top-p), as a statistician would:

  draw      N independent speculative continuations of L tokens after a
            prompt, each with its own seeded generator. L defaults to k + 2,
            so every continuation crosses at least one cycle boundary.
  law       the target's exact probability of any continuation is a product
            of its own shaped rows, computed by teacher forcing
            (`TargetLaw`). Nothing about the law is estimated.
  cells     sequence space is cut into cells from the exact law alone,
            before looking at a single sample (`Partition`): a prefix tree
            in which a child token whose expected count is at least
            `min_expected` gets its own subtree and the rest of the node is
            pooled into one "prefix + other" cell. Remainders too small to
            stand alone go to one shared pooled cell.
  tests     per prompt, three G-tests (likelihood-ratio chi-square) of
            observed against expected cell counts:
              joint  the L-token continuation;
              first  the first token alone;
              bonus  the bonus token of the first cycle, in samples whose
                     first cycle accepted every draft. Conditioned on the
                     accepted drafts x_1..x_k', the bonus must follow the
                     target's row after them: the acceptance coins never
                     look at the bonus draw. Samples are grouped by their
                     accepted prefix, each group is tested against its own
                     row (cells pooled the same way, given the group size)
                     and the G statistics and degrees of freedom add up.
            A sample the target gives probability 0 (a token outside top-k
            or top-p, say) fails the check outright.
  family    p-values over prompts x tests are Holm-corrected; the check
            passes when no adjusted p-value falls below alpha.

Power is shown, not assumed. Against the cell law pi, an alternative law r
shifts the G (and Pearson) statistic by the noncentrality
lambda = N sum_c (r_c - pi_c)^2 / pi_c >= N (sum_c |r_c - pi_c|)^2 = 4 N d^2
(Cauchy-Schwarz, since sum_c pi_c = 1), where d is the total variation
between the two cell laws. With lambda* the noncentrality at which a
level-a chi-square test with df degrees of freedom rejects 80% of the time
(scipy.stats.ncx2), every alternative with d >= sqrt(lambda* / 4N) is caught
at least that often, whatever its direction: that is the "detectable TV"
reported, and `samples_for_tv` inverts it to size N. Two consequences:
cells must be few (lambda* grows with df, so at a fixed expected count per
cell the detectable TV stops shrinking with N; `max_cells` raises the
expected count instead), and a difference that cancels inside a pooled
cell is invisible, so the guarantee is about the law of the cells.

The tests in tests/test_exactness.py run this same check on deliberately
broken samplers (tests/broken.py, unreachable from any configuration) and
require each to be rejected at the N the correct loop passes at.

Command line (a Hydra app on conf/, thin over `run_check`):

    python -m harness.exactness +pair=smollm2 k=4 temperature=1.0 exactness.detect_tv=0.05

writes `exactness.json` into `<out_dir>/exactness-<cell key>/`, prints a
table and exits 0 when the check passes, 1 when it rejects exactness and 2
on bad input. docs/exactness.md explains how to read it.

    python -m harness.exactness +pair=smollm2 k=4 acceptance=true

runs the teacher-forced acceptance check instead (harness.exactness.acceptance,
`acceptance_check`): the first exactness.num_prompts prompts decoded greedily
(temperature=0, max_new_tokens tokens) with the pair and k, each prompt's cycles
replayed by a fresh drafter; it prints, per drafted position, the acceptance
the loop reported beside the teacher-forced agreement (and the ties), writes
`acceptance.json` into `<out_dir>/acceptance-<cell key>/`, and exits 1 when
they disagree.

The draws, the exact law and the cells are in harness.exactness.law, the
statistics in harness.exactness.stats, the tests and the report in
harness.exactness.check; this module is the command line.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

import harness.tracking.tracker as tracking
from harness.config.checks import CONF_DIR
from harness.core.sampling import Sampling
from harness.errors import HarnessError
from harness.exactness.check import acceptance_check, check, format_acceptance, format_report, no_verdict_error, size_samples

# Defaults of the `exactness` config node, overridable as exactness.<key>=...
DEFAULTS = {
    "samples": None,  # continuations per prompt; null: sized from detect_tv
    "detect_tv": 0.05,  # size N so that a cell-level TV this large is caught with 80% power
    "length": None,  # L, tokens per continuation; null: k + 2, so every continuation crosses a cycle boundary
    "num_prompts": 3,  # the first prompts of the configured dataset (chosen as `python -m harness` chooses them)
    "alpha": 0.001,  # family-wise level, Holm over prompts x tests
    "max_cells": 200,  # bound on cells per test (see the module docstring)
    "rows": 8,  # at batch_size=1, each prompt's continuations drawn this many at a time, as rows of one batch (1: one by one)
}

# The primary config is conf/config.yaml plus this node, so every run option
# (+pair=, k=, temperature=, top_k=, top_p=, seed=, out_dir=, ...) means here
# what it means for `python -m harness`.
# `acceptance=true` runs the teacher-forced acceptance check instead of the law's.
ConfigStore.instance().store(
    name="exactness_check",
    node={"defaults": ["config", "/schema/exactness_check@_here_", "_self_"], "exactness": DEFAULTS, "acceptance": False},
)


def validate_exactness(cfg: DictConfig) -> None:
    e = cfg.exactness
    unknown = set(e) - set(DEFAULTS)

    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    acceptance = cfg.get("acceptance", False)
    checks = [
        (not unknown, f"unknown exactness option(s) {sorted(unknown)}: known are {', '.join(DEFAULTS)}"),
        (
            acceptance or cfg.temperature > 0,
            f"temperature={cfg.temperature} is greedy: the exactness check tests a sampling law, set temperature > 0 (e.g. temperature=1.0)",
        ),
        (
            not acceptance or cfg.temperature == 0,
            f"acceptance=true checks greedy decoding (the draft's proposals replayed at temperature 0): "
            f"temperature={cfg.temperature} must be 0",
        ),
        (
            e.samples is None or (is_int(e.samples) and e.samples >= 20),
            f"exactness.samples={e.samples} must be an integer >= 20, or null (sized from exactness.detect_tv)",
        ),
        (
            isinstance(e.detect_tv, (int, float)) and 0 < e.detect_tv < 1,
            f"exactness.detect_tv={e.detect_tv} must be in (0, 1), e.g. 0.05",
        ),
        (
            is_int(e.rows) and e.rows >= 1,
            f"exactness.rows={e.rows} must be an integer >= 1 (1: draw continuations one at a time)",
        ),
        (
            e.length is None or (is_int(e.length) and e.length >= 2),
            f"exactness.length={e.length} must be an integer >= 2, or null (k + 2)",
        ),
        (is_int(e.num_prompts) and e.num_prompts >= 1, f"exactness.num_prompts={e.num_prompts} must be a positive integer"),
        (isinstance(e.alpha, float) and 0 < e.alpha < 1, f"exactness.alpha={e.alpha} must be in (0, 1), e.g. 0.001"),
        (is_int(e.max_cells) and e.max_cells >= 2, f"exactness.max_cells={e.max_cells} must be an integer >= 2"),
        (
            not acceptance or cfg.get("batch_size", 1) == 1,
            "acceptance=true replays one sequence's cycles at a time: use batch_size=1 with it",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise HarnessError(message)


HALF = ("float16", "bfloat16")


def full_precision_for_truncation(cfg: DictConfig, device: torch.device) -> str | None:
    """With top-k or top-p, run a model whose dtype is auto in float32 where auto would mean half
    precision (CUDA: bfloat16), and say so. A truncated law is defined there only up to rounding: the
    law's rows come from one pass over a continuation, the loop's from verify passes of other lengths,
    and a token at the truncation edge can fall on either side (SmolLM2 in bfloat16: a fifth of the
    rows, 1e-4 to 1e-3 of their mass), which the zero-probability rule fails outright.

    A dtype given explicitly is kept: dtype=bfloat16 checks in bfloat16. A model's dtype pinned on
    the pair (pair.target.dtype, pair.draft.dtype) is kept too, and the note says so: a target
    pinned to half precision may fail the check on rounding at the truncation edge; a draft's
    rounding is harmless (verify uses the very rows it sampled from), but it is named, so that the
    note never claims float32 for a model that is not in it."""
    from harness.models.loading import resolve_dtype

    if not (cfg.top_k > 0 or cfg.top_p < 1):
        return None
    auto = str(resolve_dtype("auto", device)).removeprefix("torch.")
    asked = cfg.dtype
    models = {"target": cfg.pair.target}
    if cfg.pair.draft.get("kind", "model") == "model":
        models["draft"] = cfg.pair.draft
    switched, kept = [], {}
    for name, node in models.items():
        dtype = node.get("dtype") or "auto"  # as the loader resolves it (${dtype} unless the pair pins its own)
        if dtype == "auto" and auto in HALF:
            with open_dict(node):
                node.dtype = "float32"
            switched.append(name)
        elif dtype in HALF and dtype != asked:  # pinned on the pair, not the dtype= asked for
            kept[name] = dtype
    if switched and asked == "auto":
        cfg.dtype = "float32"

    def edge(half):
        return f"top-k / top-p in {half} would put tokens at the truncation edge on either side from one pass shape to another"

    if "target" in kept:
        t = kept["target"]
        return (
            f"{edge(t)}: pair.target.dtype={t} is pinned, so the target stays in {t} and the check may fail on "
            f"rounding at the truncation edge (pair.target.dtype=float32 rules that out)"
            + ("; the draft is checked in float32" if "draft" in switched else "")
        )
    if not switched:
        return None
    if "draft" in kept:
        return (
            f"{edge(auto)}: checking the target in float32; the draft stays in {kept['draft']}, pinned by "
            f"pair.draft.dtype (harmless: verify uses the rows the draft sampled from)"
        )
    return f"{edge(auto)}: checking in float32 (dtype=bfloat16 checks in bfloat16)"


def chosen_prompts(cfg: DictConfig) -> list[dict]:
    """The first `exactness.num_prompts` prompts of the configured dataset, as `python -m harness` chooses them."""
    from harness.data.datasets import load_prompts
    from harness.data.prompts import select

    return select(load_prompts(cfg.dataset), cfg.exactness.num_prompts, cfg.seed, cfg.prompts.shuffle)


def encode_prompts(
    cfg: DictConfig, pair, length: int, chosen: list[dict], setting: str = "exactness.length"
) -> list[tuple[str, torch.Tensor]]:
    """The chosen prompts (chosen_prompts), as `python -m harness` encodes them, within the context left by
    `length` tokens of continuation (the `setting` that gives it): cut (prompts.overlong=truncate) or left out (skip)."""
    from harness.data.prompts import as_tensor, encode_within

    budget = pair.prompt_budget(length)
    if budget < 1:
        raise HarnessError(
            f"{setting}={length} leaves no room for a prompt in the pair's {pair.context}-token context: lower {setting}"
        )
    encoded = [
        (
            p["id"],
            encode_within(pair.tokenizer, p["prompt"], cfg.prompts.template, budget, cfg.prompts.overlong, setting),
        )
        for p in chosen
    ]
    kept = [(pid, as_tensor(ids, pair.device)) for pid, ids in encoded if ids is not None]
    if not kept:
        raise HarnessError(
            f"every chosen prompt is longer than the context budget ({budget} tokens) and prompts.overlong=skip: "
            f"lower {setting} or use prompts.overlong=truncate"
        )
    return kept


def run_check(cfg: DictConfig, quiet: bool = False) -> dict:
    """Load the configured pair, run the check on its first prompts, write
    exactness.json into the run directory and return the report. A run
    directory that already holds a report is not redone unless force=true.
    With acceptance=true: the teacher-forced acceptance check, into acceptance.json."""
    from harness.base.files import write_json_atomic
    from harness.config.checks import validate, with_default_pair
    from harness.models.loading import resolve_device
    from harness.runner.costs import measure_costs
    from harness.runner.pair import load_pair
    from harness.runner.provenance import conditions
    from harness.runner.store import cell_key

    cfg = with_default_pair(cfg)
    OmegaConf.set_struct(cfg, False)
    cfg.exactness = OmegaConf.merge(DEFAULTS, cfg.get("exactness") or {})  # tolerate configs composed without our node
    validate(cfg)
    validate_exactness(cfg)
    device = resolve_device(cfg.device)
    dtype_note = full_precision_for_truncation(cfg, device)
    if dtype_note and not quiet:
        print(f"[harness] {dtype_note}", file=sys.stderr)
    e, acceptance = cfg.exactness, bool(cfg.get("acceptance", False))
    keyed = copy.deepcopy(cfg)
    if not acceptance:
        keyed.pop("acceptance", None)  # a law check's cell key as before the setting existed: its results are found
    name = "acceptance" if acceptance else "exactness"
    run_dir = Path(cfg.out_dir) / f"{name}-{cell_key(keyed)}"
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            run_dir.mkdir()
            created = True
        except FileExistsError:  # a check run before, or one of another process running now
            created = False
    except OSError as err:
        raise HarnessError(f"cannot write results to {run_dir}: {err.strerror}; set out_dir=<a writable directory>") from None
    report_path = run_dir / f"{name}.json"
    if report_path.exists() and not cfg.force:
        if not quiet:
            print(f"[harness] {name} check already done, not re-run (force=true to redo): {run_dir}", file=sys.stderr)
        return json.loads(report_path.read_text())
    length = cfg.max_new_tokens if acceptance else e.length if e.length is not None else cfg.k + 2
    try:
        chosen = chosen_prompts(cfg)  # first: a dataset problem should stop the check before a model loads
        # The pair exactly as `python -m harness` loads it: same cache kind, same compilation.
        pair = load_pair(
            cfg.pair,
            device,
            cfg.get("cache", "dynamic"),
            cfg.get("compile", False),
            cfg.get("cpu_linear", "auto"),
            cfg.get("forward", "hf"),
        )
        prompts = encode_prompts(cfg, pair, length, chosen, "max_new_tokens" if acceptance else "exactness.length")
    except BaseException:  # a check that cannot start leaves no empty folder of its own making
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # once the check can start
    sampling = Sampling(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p))
    pair.reserve(max(ids.shape[0] for _, ids in prompts), length, cfg.k)
    rows = e.rows if cfg.get("batch_size", 1) == 1 and not acceptance and cfg.get("tree") is None else 1  # trees: one row
    if rows > 1:
        try:
            pair.reserve(max(ids.shape[0] for _, ids in prompts), length, cfg.k, rows)
        except HarnessError:  # a pair that decodes one sequence at a time (static cache, compiled steps, sliding windows)
            rows = 1
    pair.follow_draft_length(cfg.get("draft_length"))  # the draft-length policy a run would use
    pair.follow_tree(cfg)
    pair.use_costs(measure_costs(pair, prompts[0][1], cfg.k, sampling))  # as run_cell does: the proposals a run makes

    started = time.perf_counter()
    if acceptance:
        report = acceptance_check(pair, prompts, cfg.k, length)
        report.update(
            pair=cfg.pair.name,
            target=cfg.pair.target.id,
            draft=cfg.pair.draft.get("id", cfg.pair.draft.kind),
            time_s=time.perf_counter() - started,
            conditions=conditions(cfg, pair),
            run_dir=str(run_dir),
        )
        write_json_atomic(report_path, report)
        return report
    samples = e.samples
    if samples is None:
        samples = size_samples(
            pair.target,
            prompts,
            sampling=sampling,
            length=length,
            eos_ids=pair.eos_ids,
            detect_tv=e.detect_tv,
            alpha=e.alpha,
            max_cells=e.max_cells,
        )
        if not quiet:
            print(
                f"[harness] {samples} continuations per prompt detect a TV of {e.detect_tv} (exactness.samples= to override)",
                file=sys.stderr,
            )
    report = check(
        pair.target,
        pair.drafter,
        prompts,
        k=cfg.k,
        sampling=sampling,
        length=length,
        samples=samples,
        eos_ids=pair.eos_ids,
        seed=cfg.seed,
        alpha=e.alpha,
        max_cells=e.max_cells,
        progress=not quiet,
        batch=cfg.get("batch_size", 1) if cfg.get("batch_size", 1) > 1 else None,
        rows=rows,
    )
    if cfg.get("batch_size", 1) > 1:
        report["batch_size"] = cfg.batch_size
    report["rows"] = rows  # continuations drawn as rows of one batch (1: one at a time)
    report.update(
        pair=cfg.pair.name,
        target=cfg.pair.target.id,
        draft=cfg.pair.draft.get("id", cfg.pair.draft.kind),
        detect_tv_asked=None if e.samples is not None else e.detect_tv,
        time_s=time.perf_counter() - started,
        conditions=conditions(cfg, pair),
        run_dir=str(run_dir),
        dtype_note=dtype_note,
    )
    for p in report["prompts"].values():
        for c in p["worst_cells"]:
            c["text"] = pair.tokenizer.decode(c["prefix"])
    write_json_atomic(report_path, report)
    tracker = tracking.start(cfg, run_dir, job_type="exactness")
    tracker.finish(
        tracking.exactness_summary(report),
        [],
        extra=tracking.exactness_media(report) if isinstance(tracker, tracking.WandbTracker) else None,
    )
    return report


# Exit status: 0 passed, 1 exactness rejected, 2 bad input, 3 the check itself failed (a traceback), 130 interrupted.
# In a multirun every job runs, and the process exits with the highest status of its jobs.
EXIT_CODES: list[int] = []


def end_job(code: int) -> None:
    """Exit now in a single run, or in a multirun whose jobs run in processes of their own (SLURM's
    submitit: its launcher sees the failure); in a multirun run in this process, record the code
    and let the next job run."""
    from hydra.core.hydra_config import HydraConfig

    from harness.cli.callbacks import in_multirun

    in_process = in_multirun() and HydraConfig.get().launcher._target_.endswith("BasicLauncher")
    if code and not in_process:
        sys.exit(code)
    EXIT_CODES.append(code)


@hydra.main(config_path=str(CONF_DIR), config_name="exactness_check", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading bars would bury the table
    try:
        report = run_check(cfg)
    except KeyboardInterrupt:
        print("interrupted: the check writes its report only when it finishes; run the same command again", file=sys.stderr)
        sys.exit(130)
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        return end_job(err.exit_code)
    except Exception:  # a bug or a broken model, not a verdict: exit 1 would read as "not exact"
        traceback.print_exc()
        print("error: the check itself failed (traceback above): no verdict", file=sys.stderr)
        return end_job(3)
    print(format_acceptance(report) if report.get("check") == "acceptance" else format_report(report))
    print(json.dumps({k: v for k, v in report.items() if k not in ("prompts", "conditions")}))
    if not report.get("testable", True):  # a report stored before the key existed had a verdict
        print(f"error: {no_verdict_error(report)}", file=sys.stderr)
        return end_job(2)
    end_job(0 if report["passed"] else 1)


def cli() -> None:
    """`python -m harness.exactness`: exits 1 when a check rejects the law, 2 on bad input."""
    from harness.config.checks import check_choices

    EXIT_CODES.clear()  # a second call in one process (tests) starts with no job's status
    check_choices(sys.argv[1:], config_name="exactness_check")
    main()
    sys.exit(max(EXIT_CODES, default=0))
