"""Experiment tracking: one W&B run per benchmark cell.

A cell's W&B run carries
  config    the full resolved Hydra config (Hydra is the one source of truth:
            nothing is configured twice), plus `conditions` at the end;
  summary   the harness summary verbatim (summary.json), plus the flat keys in
            METRICS and `status` (finished | interrupted | failed), so a
            sweep's `metric.name` is any of those keys;
  history   prompt/* per prompt while the cell runs (live progress);
  media     tables/prompts, tables/categories, charts/position_acceptance,
            charts/accept_hist (token trees: charts/sibling_accepted); and the cell's prompts.jsonl, summary.json and
            config.yaml as an artifact (type "cell-results").
docs/tracking.md lists every key.

Mode `auto` is online when W&B has credentials for its server (what `wandb
login` or WANDB_API_KEY set up, as W&B itself finds them) and offline without
(upload later with `wandb sync`), so nothing needs a network; `disabled` turns
W&B off. A W&B failure never fails a benchmark: one warning line, and the
results stay in the cell directory.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness.config.settings import WANDB_MODES as MODES
from harness.core import metrics
from harness.errors import HarnessError, one_line

# Top-level scalar summary keys: what dashboards plot and sweeps optimise.
METRICS = (
    "acceptance_rate",
    "alpha",
    "expected_alpha",
    "tokens_per_cycle",
    "accepted_per_cycle",
    "theoretical_tokens_per_cycle",
    "speedup",
    "speedup_ci_low",
    "speedup_ci_high",
    "speedup_geomean",
    "speedup_geomean_ci_low",
    "speedup_geomean_ci_high",
    "decode_speedup",
    "predicted_speedup",
    "efficiency",
    "predicted_speedup_formula",
    "efficiency_formula",
    "predicted_speedup_in_run",
    "efficiency_isolated",
    "cost_ratio",
    "cost_ratio_ci_low",
    "cost_ratio_ci_high",
    "limit_ratio",
    "verify_cost",
    "verify_cost_ci_low",
    "verify_cost_ci_high",
    "target_step_s",
    "target_step_s_ci_low",
    "target_step_s_ci_high",
    "draft_step_s",
    "draft_step_s_ci_low",
    "draft_step_s_ci_high",
    "spec_tpot_s",
    "base_tpot_s",
    "spec_ttft_s",
    "base_ttft_s",
    "num_prompts",
    "new_tokens",
    "cycles",
    "cycles_without_draft",
    "mean_drafted",
    "target_passes",
    "draft_passes",
    "spec_time_s",
    "base_time_s",
    "peak_rss_mb",
)


def _warn(message: str) -> None:
    print(f"warning: W&B: {message}", file=sys.stderr)


class NoTracking:
    """W&B off: every call does nothing."""

    def log_prompt(self, record: dict) -> None:
        pass

    def finish(self, summary: dict, records: list[dict], status: str = "finished", extra: dict | None = None) -> None:
        pass

    def __enter__(self) -> NoTracking:
        return self

    def __exit__(self, *exc) -> None:
        pass


_active: WandbTracker | None = None  # the run this process has open (one at a time)
_tried = False  # this process has tried to open a run (W&B on): record_failure then adds none
online_failed = False  # an online init failed: this process's later cells go straight to offline


class WandbTracker:
    """One cell's W&B run. As a context manager, an exception finishes the run
    as failed, Ctrl-C (and SIGTERM, which run_cell turns into it) as interrupted."""

    def __init__(self, run, cell_dir: Path):
        self.run, self.cell_dir = run, cell_dir
        self.closed = self.broken = False
        run.define_metric("prompt/n", summary="none")  # the curves' x axis
        run.define_metric("prompt/*", step_metric="prompt/n", summary="none")  # curves, not summary keys
        run.summary["status"] = "running"
        atexit.register(self._abandoned)  # before wandb's own exit hook: runs are finished in LIFO order

    def log_prompt(self, record: dict) -> None:
        if self.closed or self.broken:
            return
        spec = record["spec"]
        try:
            self.run.log(
                {
                    "prompt/n": record["index"]
                    + 1,  # the prompt's place in the cell, also when a resumed run logs from prompt 3 on
                    "prompt/speedup": record["speedup"],
                    "prompt/acceptance_rate": metrics.acceptance_rate(spec),
                    "prompt/tokens_per_cycle": metrics.ratio(spec["committed"], spec["cycles"]),
                    "prompt/new_tokens": spec["new_tokens"],
                }
            )
        except Exception as err:  # noqa: BLE001 - tracking must never stop a benchmark
            self.broken = True
            _warn(
                f"stopped logging prompts of {self.cell_dir.name} ({one_line(err, with_type=True)}); results stay in {self.cell_dir}"
            )

    def finish(self, summary: dict, records: list[dict], status: str = "finished", extra: dict | None = None) -> None:
        """Log the summary, tables, charts (and any `extra` media) and the results artifact, then finish the run."""
        global _active
        if self.closed:
            return
        self.closed = True
        if _active is self:
            _active = None
        atexit.unregister(self._abandoned)
        try:
            if records:
                self.run.log(media(summary, records))
            if extra:
                self.run.log(extra)
            self.run.summary.update({**summary, **flat_metrics(summary), "status": status})
            if "conditions" in summary:
                self.run.config.update({"conditions": summary["conditions"]}, allow_val_change=True)
            artifact = results_artifact(self.cell_dir, summary, status)
            if artifact is not None:
                self.run.log_artifact(artifact)
        except Exception as err:  # noqa: BLE001
            _warn(
                f"could not log the results of {self.cell_dir.name} ({one_line(err, with_type=True)}); they are in {self.cell_dir}"
            )
        try:
            self.run.finish(exit_code=0 if status == "finished" else 1)
        except Exception as err:  # noqa: BLE001
            _warn(f"could not finish the run of {self.cell_dir.name} ({one_line(err, with_type=True)})")

    def __enter__(self) -> WandbTracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self.closed:
            interrupted = issubclass(exc_type, (KeyboardInterrupt, SystemExit))
            self.finish({}, [], status="interrupted" if interrupted else "failed")

    def _abandoned(self) -> None:
        self.finish({}, [], status="interrupted")  # the process ends with this cell unfinished


def start(cfg: DictConfig, cell_dir: str | Path, job_type: str | None = None) -> WandbTracker | NoTracking:
    """Open the W&B run of one cell (or a no-op tracker when W&B is off or fails).
    `job_type` overrides wandb.job_type (the exactness check logs as "exactness")."""
    global _active, online_failed, _tried
    cell_dir = Path(cell_dir)
    if _active is not None:  # the previous cell raised and the launcher went on to this one
        _active.finish({}, [], status="failed")
    mode = resolve_mode(cfg.wandb.mode)
    if mode == "disabled":
        return NoTracking()
    _tried = True
    w, sweep = cfg.wandb, bool(os.environ.get("WANDB_SWEEP_ID"))
    run_dir = Path(w.dir) if w.dir else cell_dir.parent
    kwargs = dict(
        # Under `wandb agent` the run must land in the sweep's project: the agent's environment decides.
        project=(sweep and os.environ.get("WANDB_PROJECT")) or w.project,
        entity=(sweep and os.environ.get("WANDB_ENTITY")) or w.entity,
        group=w.group if w.group else (None if sweep else sweep_name()),
        job_type=job_type or w.job_type,
        tags=run_tags(w.tags),
        name=w.name or cell_dir.name,
        dir=str(run_dir),  # runs land in <dir>/wandb/
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    if mode == "online" and online_failed and not sweep:
        mode = "offline"
    try:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(**kwargs, mode=mode, settings=wandb.Settings(silent=True))
        except Exception as err:
            if mode != "online" or sweep:  # a sweep's run must be online
                raise
            # A key but no network (a compute node): keep the run, offline, and
            # do not wait for the server again in this process.
            online_failed, mode = True, "offline"
            _warn(f"online init failed ({one_line(err, with_type=True)}); logging offline from now on (upload later: wandb sync)")
            run = wandb.init(**kwargs, mode=mode, settings=wandb.Settings(silent=True))
    except Exception as err:  # noqa: BLE001 - bad key, full disk, ...: the benchmark goes on
        _warn(f"no run for {cell_dir.name} ({one_line(err, with_type=True)}); results stay in {cell_dir}")
        return NoTracking()
    if sweep:  # a swept config group (dataset=...) shows as its option name: keep its resolved fields too
        shadowed = {f"{k}_config": v for k, v in kwargs["config"].items() if isinstance(v, dict) and run.config.get(k) != v}
        run.config.update(shadowed)
    where = run.url if mode == "online" else f"{Path(run.dir).parent} (upload: wandb sync <that dir>)"
    print(f"[harness] W&B {mode} run {run.name}: {where}", file=sys.stderr)
    _active = WandbTracker(run, cell_dir)
    return _active


def record_failure(cfg: DictConfig, cell_dir: str | Path, error: str) -> None:
    """Under `wandb agent`: a cell that failed before its W&B run opened (a dataset or a model that would
    not load, a setting refused) still gets its run, finished as failed with the error. Otherwise the
    sweep's run never exists and its dashboard shows nothing of why. Nothing outside a W&B sweep, or once
    this process has tried to open a run."""
    if not os.environ.get("WANDB_SWEEP_ID") or _tried:
        return
    try:
        tracker = start(cfg, cell_dir)
    except Exception as err:  # noqa: BLE001 - the W&B settings may be what failed
        _warn(f"no run for the failed cell ({one_line(err, with_type=True)})")
        return
    tracker.finish({"error": error}, [], status="failed")


NO_KEY = "no API key (WANDB_API_KEY or `wandb login`)"


def resolve_mode(mode: str) -> str:
    """online / offline / disabled from `wandb.mode`; see the module docstring."""
    if mode not in MODES:
        raise HarnessError(f"wandb.mode={mode} must be one of {', '.join(MODES)}")
    if mode == "auto":
        env = {"dryrun": "offline", "run": "online"}.get(os.environ.get("WANDB_MODE", ""), os.environ.get("WANDB_MODE"))
        if env in ("online", "offline", "disabled"):  # the environment may pin it (CI: disabled)
            return env
    if mode in ("auto", "online"):
        problem = credentials_problem()
        if problem is None:
            return "online"
        if mode == "online" or problem != NO_KEY:  # auto without a key is offline as documented: no warning
            _warn(f"wandb.mode={mode} but {problem}: logging offline instead")
        return "offline"
    return mode


def credentials_problem() -> str | None:
    """None when W&B has credentials for its server, found as wandb.init finds them (WANDB_API_KEY, an
    identity token file, the netrc entry `wandb login` wrote for the server W&B is set to use, an
    api_key setting); else why not, in a few words (NO_KEY, or why W&B refuses the key it found).
    Neither asks the server nor prompts."""
    import wandb
    from wandb.errors import AuthenticationError
    from wandb.sdk import wandb_setup

    try:
        from wandb.sdk.lib import wbauth
    except ImportError:  # a wandb without its credentials module (wandb.sdk.lib.wbauth, as in 0.31)
        return f"wandb {wandb.__version__} cannot tell whether it has a key without asking the server (upgrade wandb)"
    # The public check, wandb.login(prompt=False, verify=False), also saves W&B's settings file and, to
    # print who is logged in, asks the server: the function it calls underneath does neither.
    settings = wandb_setup.singleton().settings  # W&B reads its environment and settings files once per process
    try:
        auth = wbauth.authenticate_session(
            host=wbauth.HostUrl(settings.base_url, app_url=settings.app_url),
            source="harness",
            prompt=False,
            verify=False,
            update_session=False,
        )
    except AuthenticationError as err:  # a key of the wrong form, or both a key and an identity token file
        return one_line(err).rstrip(".")
    return None if auth is not None else NO_KEY


def sweep_name() -> str | None:
    """The Hydra sweep directory of a multirun (the default W&B group), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return str(HydraConfig.get().sweep.dir)
    except Exception:  # noqa: BLE001 - outside Hydra there is no sweep
        pass
    return None


def run_tags(tags) -> list[str] | None:
    """wandb.tags=[a,b] is a list; wandb.tags=a a string (one tag, not one per character), or a number."""
    if tags is None or tags == "":
        return None
    values = [tags] if isinstance(tags, (str, int, float)) else list(tags)
    return [str(t) for t in values] or None


def flat_metrics(summary: dict) -> dict:
    """The CI bounds as scalar keys (a W&B sweep metric or a panel needs a scalar)."""
    flat = {}
    for key in ("speedup", "speedup_geomean", "cost_ratio", "verify_cost", "target_step_s", "draft_step_s"):
        if summary.get(f"{key}_ci") is not None:
            flat[f"{key}_ci_low"], flat[f"{key}_ci_high"] = summary[f"{key}_ci"]
    return flat


def media(summary: dict, records: list[dict]) -> dict:
    """Tables and charts of a finished cell, keyed as they appear in W&B."""
    import wandb

    columns = [
        "index",
        "id",
        "category",
        "prompt_tokens",
        "new_tokens",
        "base_new_tokens",
        "acceptance_rate",
        "tokens_per_cycle",
        "speedup",
        "spec_time_s",
        "base_time_s",
    ]
    rows = [
        [
            r["index"],
            r["id"],
            r["category"],
            r["prompt_tokens"],
            r["spec"]["new_tokens"],
            r["base"]["new_tokens"],
            metrics.acceptance_rate(r["spec"]),
            metrics.ratio(r["spec"]["committed"], r["spec"]["cycles"]),
            r["speedup"],
            r["spec"]["time_s"],
            r["base"]["time_s"],
        ]
        for r in records
    ]
    logged = {"tables/prompts": wandb.Table(columns=columns, data=rows)}
    categories = summary.get("categories") or {}
    if categories:
        logged["tables/categories"] = wandb.Table(
            columns=[
                "category",
                "num_prompts",
                "acceptance_rate",
                "tokens_per_cycle",
                "speedup",
                "speedup_ci_low",
                "speedup_ci_high",
            ],
            data=[
                [name, m["num_prompts"], m["acceptance_rate"], m["tokens_per_cycle"], m["speedup"], *m["speedup_ci"]]
                for name, m in categories.items()
            ],
        )
    if "position_acceptance" in summary:
        positions = wandb.Table(
            columns=["position", "acceptance"], data=[[i + 1, a] for i, a in enumerate(summary["position_acceptance"])]
        )
        logged["charts/position_acceptance"] = wandb.plot.line(
            positions, "position", "acceptance", title="P(draft position accepted | earlier ones accepted)"
        )
    if grid := summary.get("predicted_grid"):  # a cost-only cell: the speedup its costs predict, one line per k
        points = [[a, k, x] for a, row in zip(grid["alpha"], grid["speedup"]) for k, x in zip(grid["k"], row)]
        logged["tables/predicted_grid"] = wandb.Table(columns=["alpha", "k", "predicted_speedup"], data=points)
        logged["charts/predicted_grid"] = wandb.plot.line_series(
            xs=grid["alpha"],
            ys=[list(column) for column in zip(*grid["speedup"])],
            keys=[f"k={k}" for k in grid["k"]],
            title="predicted speedup by acceptance rate (cost-only: random weights)",
            xname="alpha",
        )
    if "accept_hist" in summary and not summary.get("cost_only"):
        # Cycles that drafted nothing (lookup without a match, the budget's last token) get their own bar:
        # in bin 0 they would read as rejections that alpha does not count.
        none = int(summary.get("cycles_without_draft") or 0)
        bars = [["none drafted", none]] if none else []
        bars += [[str(n), c - (none if n == 0 else 0)] for n, c in enumerate(summary["accept_hist"])]
        hist = wandb.Table(columns=["accepted", "cycles"], data=bars)
        logged["charts/accept_hist"] = wandb.plot.bar(hist, "accepted", "cycles", title="cycles by accepted drafts (0..k)")
    if (summary.get("draft_length") or {}).get("policy", "constant") != "constant" and "drafted_hist" in summary:
        drafted = wandb.Table(columns=["drafted", "cycles"], data=[[str(n), c] for n, c in enumerate(summary["drafted_hist"])])
        logged["charts/drafted_hist"] = wandb.plot.bar(drafted, "drafted", "cycles", title="cycles by drafted tokens (0..k)")
        calibration = summary["draft_length"].get("calibration") or []
        if calibration:
            table = wandb.Table(
                columns=["bin_low", "predicted", "observed", "tested"],
                data=[[b["bin"][0], b["predicted"], b["observed"], b["tested"]] for b in calibration],
            )
            logged["charts/calibration"] = wandb.plot.scatter(
                table, "predicted", "observed", title="draft confidence: predicted against observed acceptance"
            )
    if summary.get("sibling_accepted"):  # token trees: accepted nodes by their place among their siblings
        places = wandb.Table(columns=["place", "accepted"], data=[[str(n), c] for n, c in enumerate(summary["sibling_accepted"])])
        logged["charts/sibling_accepted"] = wandb.plot.bar(
            places, "place", "accepted", title="accepted tree nodes by sibling place"
        )
    return logged


def exactness_summary(report: dict) -> dict:
    """An exactness report as W&B summary keys: the report without its per-prompt
    detail, plus exactness/* scalars a dashboard can plot."""
    tvs = [p["tv"]["tv"] for p in report["prompts"].values()]
    return {
        **{k: v for k, v in report.items() if k != "prompts"},
        "exactness/passed": int(report["passed"]),
        "exactness/family_p": report["family_p"],
        "exactness/detectable_tv": report["detectable_tv"],
        "exactness/tv_max": max(tvs, default=math.nan),
        "exactness/samples": report["samples"],
    }


def exactness_media(report: dict) -> dict:
    """Every test of an exactness report (prompt x test) as one W&B table."""
    import wandb

    columns = ["prompt", "test", "cells", "df", "statistic", "p_value", "p_holm", "detectable_tv", "tv", "tv_upper95"]
    rows = [
        [
            name,
            test,
            t["cells"],
            t["df"],
            t["statistic"],
            t["p_value"],
            t["p_holm"],
            t["detectable_tv"],
            *([p["tv"]["tv"], p["tv"]["upper95"]] if test == "joint" else [None, None]),
        ]
        for name, p in report["prompts"].items()
        for test, t in p["tests"].items()
    ]
    return {"tables/exactness": wandb.Table(columns=columns, data=rows)}


def results_artifact(cell_dir: Path, summary: dict, status: str):
    """The cell's own files (prompts.jsonl, summary.json or exactness.json, config.yaml) as one artifact;
    None when it has none (a cell that failed before it started)."""
    import wandb

    files = [cell_dir / f for f in ("prompts.jsonl", "summary.json", "exactness.json", "config.yaml") if (cell_dir / f).exists()]
    if not files:
        return None
    name = re.sub(r"[^\w.-]", "_", f"cell-{cell_dir.name}")[:128]
    artifact = wandb.Artifact(name, type="cell-results", metadata={"status": status, "cell_dir": str(cell_dir)})
    for file in files:
        artifact.add_file(str(file))
    return artifact
