"""`python -m analysis.report <results>`: a sweep in, a decision out (docs/report.md).

<results> is a local directory (a cell, a results store, a Hydra run or
multirun) or a W&B path (entity/project/sweep_id, or entity/project for
every run in it). Writes one folder, readable without W&B:

  report.md       the decision, what would change it, the fitted model,
                  the what-if, every cell, the figures, the methods
  figures/*.png   seaborn figures
  cells.csv       one row per cell
  fits.csv        one row per (target, run setup, draft, dataset, sampling)
  decision.json   the decisions, machine-readable

Settings come from conf/report.yaml (traffic weights, confidence,
resamples, what-if costs), then --config FILE, then the flags. A file that
defines one of the maps in REPLACED replaces it whole (a traffic mix is one
mix, not a union of two).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from analysis import decide as decide_mod
from analysis import fit as fit_mod
from analysis import shapes as shapes_mod
from analysis.batch import batch_frame, pays_up_to, statement
from analysis.figures import make_figures, predicted_at_scale
from analysis.load import WANDB_PATH, load
from analysis.markdown import markdown, shapes_only
from harness.errors import HarnessError

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "conf" / "report.yaml"
DEFAULTS = {
    "weights": {},
    "confidence": 0.95,
    "n_resamples": 2000,
    "seed": 0,
    "max_k": fit_mod.MAX_K,
    "whatif": {
        "name": "other hardware",
        "cost_ratio": None,
        "target_step_ms": None,
        "draft_step_ms": None,
        "verify_slope": None,
        "ridge_rows": None,
    },
    "wandb_log": True,
}
# Maps that a settings file replaces whole when it defines them (other keys merge).
REPLACED = ("weights", "whatif.cost_ratio", "whatif.draft_step_ms")
_ABSENT = object()  # OmegaConf.select's answer for a key the file does not define


# Settings


def settings(args: argparse.Namespace) -> dict:
    cfg = OmegaConf.create(DEFAULTS)
    for path in [DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None, args.config]:
        if path is not None:
            if not Path(path).exists():
                raise HarnessError(f"--config {path} does not exist")
            layer = _settings_file(Path(path))
            try:
                cfg = OmegaConf.merge(cfg, layer)
            except Exception as err:  # noqa: BLE001 - a list where a map belongs, say: one line for the user
                raise HarnessError(f"--config {path}: {str(err).splitlines()[0]}") from None
            for key in REPLACED:
                if OmegaConf.select(layer, key, default=_ABSENT) is not _ABSENT:
                    OmegaConf.update(cfg, key, OmegaConf.select(layer, key), merge=False)
    out = OmegaConf.to_container(cfg, resolve=True)
    if args.weights:
        out["weights"] = parse_assignments(args.weights, "--weights")
    for flag, key in (("confidence", "confidence"), ("resamples", "n_resamples"), ("seed", "seed"), ("max_k", "max_k")):
        if getattr(args, flag) is not None:
            out[key] = getattr(args, flag)
    w = out["whatif"]
    if args.whatif_name:
        w["name"] = args.whatif_name
    if args.cost_ratio:
        w["cost_ratio"] = parse_scalar_or_map(args.cost_ratio, "--cost-ratio")
    if args.draft_step_ms:
        w["draft_step_ms"] = parse_scalar_or_map(args.draft_step_ms, "--draft-step-ms")
    if args.target_step_ms is not None:
        w["target_step_ms"] = args.target_step_ms
    if args.verify_slope is not None:
        w["verify_slope"] = args.verify_slope
    if args.ridge_rows is not None:
        w["ridge_rows"] = args.ridge_rows
    if args.no_wandb_log:
        out["wandb_log"] = False
    if not (isinstance(out["confidence"], (int, float)) and 0 < out["confidence"] < 1):
        raise HarnessError(f"confidence={out['confidence']} must be in (0, 1), e.g. 0.95")
    if not (isinstance(out["n_resamples"], int) and out["n_resamples"] >= 2):
        raise HarnessError(f"resamples={out['n_resamples']} must be a whole number of at least 2, e.g. --resamples 2000")
    if not (isinstance(out["seed"], int) and not isinstance(out["seed"], bool) and out["seed"] >= 0):
        raise HarnessError(f"seed={out['seed']} must be a whole number of at least 0, e.g. --seed 0")
    if not (isinstance(out["max_k"], int) and out["max_k"] >= 1):
        raise HarnessError(f"max_k={out['max_k']} must be a whole number of at least 1, e.g. --max-k 16")
    try:
        out["weights"] = decide_mod.check_weights(out["weights"])
    except (TypeError, ValueError, AttributeError):
        raise HarnessError(
            f"weights={out['weights']} must map categories to numbers, e.g. --weights conversation=0.5,code=0.3"
        ) from None
    if not all(math.isfinite(w) for w in out["weights"].values()):
        raise HarnessError(f"weights={out['weights']} must be finite numbers, e.g. --weights conversation=0.5,code=0.3")
    if out["weights"] and not sum(out["weights"].values()) > 0:
        raise HarnessError(f"traffic weights {out['weights']} are all zero: give at least one category a share above 0")
    _check_whatif(w)
    return out


def _settings_file(path: Path):
    """A settings file as OmegaConf, refused in one line when it does not parse or names a key the
    report does not know (a typo such as `weigths` would otherwise be silently ignored)."""
    try:
        layer = OmegaConf.load(path)
    except Exception as err:  # noqa: BLE001 - YAML and OmegaConf errors alike: one line for the user
        raise HarnessError(f"--config {path} does not parse: {str(err).splitlines()[0]}") from None
    if not isinstance(layer, DictConfig):
        raise HarnessError(f"--config {path} must be a mapping of settings (as in conf/report.yaml)")
    if "whatif" in layer and layer.whatif is None:
        del layer["whatif"]  # as if not given
    if "whatif" in layer and not isinstance(layer.whatif, DictConfig):
        raise HarnessError(
            f"--config {path}: whatif must be a mapping (name, cost_ratio, target_step_ms, draft_step_ms, verify_slope)"
        )
    unknown = [key for key in layer if key not in DEFAULTS]
    unknown += [f"whatif.{key}" for key in (layer.get("whatif") or {}) if key not in DEFAULTS["whatif"]]
    if unknown:
        raise HarnessError(
            f"--config {path}: unknown setting {unknown[0]}; known are {', '.join(DEFAULTS)} "
            f"and whatif.{', whatif.'.join(DEFAULTS['whatif'])}"
        )
    return layer


def _check_whatif(w: dict) -> None:
    """Costs another machine could have: c and b at least 0, step times above 0, and a draft step
    time only with the target's (or with c given for those drafts), which it would otherwise be unused."""

    def numbers(value) -> list:
        return list(value.values()) if isinstance(value, dict) else [] if value is None else [value]

    for key, low, strict in (
        ("cost_ratio", 0.0, False),
        ("draft_step_ms", 0.0, True),
        ("target_step_ms", 0.0, True),
        ("verify_slope", 0.0, False),
        ("ridge_rows", 0.0, True),
    ):
        for value in numbers(w.get(key)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value > low if strict else value >= low)
            if not ok or value != value or value == float("inf"):
                raise HarnessError(
                    f"whatif.{key}={w.get(key)} must be {'above' if strict else 'at least'} 0 "
                    f"(a finite number{' per draft' if isinstance(w.get(key), dict) else ''})"
                )
    draft_ms, given_c = w.get("draft_step_ms"), w.get("cost_ratio")
    c_covers = isinstance(given_c, (int, float)) or (
        isinstance(draft_ms, dict) and isinstance(given_c, dict) and set(draft_ms) <= set(given_c)
    )
    if draft_ms not in (None, {}) and not w.get("target_step_ms") and not c_covers:
        raise HarnessError(
            "a what-if draft step time needs the target's step time on that machine too: add --target-step-ms MS "
            "(or give the cost ratio itself with --cost-ratio)"
        )


def _check_whatif_labels(w: dict, labels: list[str]) -> None:
    """A what-if cost given for a draft label the results do not have would be silently unused."""
    for key in ("cost_ratio", "draft_step_ms"):
        unknown = sorted(set(w.get(key) or {}) - set(labels)) if isinstance(w.get(key), dict) else []
        if unknown:
            raise HarnessError(
                f"whatif.{key} names {', '.join(unknown)}, which is no draft in these results; "
                f"the drafts are: {', '.join(labels) or 'none'}"
            )


def parse_assignments(items: list[str], flag: str, example: str = "conversation=0.5,code=0.3") -> dict[str, float]:
    """["a=0.5,b=0.3", "c=0.2"] -> {a: 0.5, b: 0.3, c: 0.2}."""
    out = {}
    for item in ",".join(items).split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise HarnessError(f"{flag} {item!r}: expected NAME=NUMBER, e.g. {flag} {example}")
    return out


def parse_scalar_or_map(items: list[str], flag: str) -> float | dict[str, float]:
    """["0.05"] -> 0.05 (every model draft); ["a=0.05", "b=0.1"] -> {a: 0.05, b: 0.1}."""
    if len(items) == 1 and "=" not in items[0]:
        try:
            return float(items[0])
        except ValueError:
            raise HarnessError(f"{flag} {items[0]!r}: expected a number or DRAFT=NUMBER") from None
    return parse_assignments(items, flag, example="DRAFT=0.05 (a draft's label in the report)")


# The report


def build(source: str, out: Path | None = None, cfg: dict | None = None, api: Any = None) -> dict:
    """Load, fit, decide, draw and write the report folder; returns decision.json's content."""
    cfg = {**DEFAULTS, **(cfg or {})}
    results = load(source, api)
    _check_whatif_labels(cfg["whatif"], sorted(set(results.cells["label"])) if not results.cells.empty else [])
    out = (
        Path(out).expanduser()
        if out
        else (Path(source).expanduser() / "report" if results.kind == "local" else Path("report") / _slug(source))
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise HarnessError(f"cannot write the report to {out}: {err.strerror}; give --out a folder that can be made") from None
    (out / "figures").mkdir(exist_ok=True)
    shape_curves = shapes_mod.curves(results.shapes)
    at_scale = {"predicted_at_scale": predicted_at_scale(shape_curves, out / "figures" / "predicted_at_scale.png")}
    at_scale = {name: path for name, path in at_scale.items() if path is not None}
    if not results.shapes.empty:
        _csv(results.shapes, out / "shapes.csv")
    if results.cells.empty:  # cost-only cells alone: their costs and curves, nothing to decide
        document = {"source": str(source), "kind": results.kind, "report_dir": str(out), "decisions": [], "notes": results.notes}
        (out / "decision.json").write_text(json.dumps(_jsonable(document), indent=2, allow_nan=False) + "\n")
        (out / "report.md").write_text(shapes_only(results, at_scale, f"{100 * cfg['confidence']:g}%"))
        return document
    fits, curves = fit_mod.fit(results.cells, results.prompts, cfg["confidence"], cfg["n_resamples"], cfg["seed"], cfg["max_k"])
    decisions = decide_mod.decide(
        results.cells, results.prompts, fits, cfg["weights"], cfg["confidence"], cfg["n_resamples"], cfg["seed"]
    )
    whatif_spec = fit_mod.WhatIf(**{k: v for k, v in cfg["whatif"].items() if k in fit_mod.WhatIf.__dataclass_fields__})
    whatif = fit_mod.whatif(fits, whatif_spec, cfg["max_k"]) if whatif_spec.given() else pd.DataFrame()
    figures = make_figures(results.cells, results.prompts, fits, curves, out / "figures") | at_scale
    joined = shapes_mod.joined(fits, results.shapes)
    scaling = pays_up_to(batch_frame(results.cells))

    _csv(results.cells, out / "cells.csv")
    _csv(fits, out / "fits.csv")
    if not whatif.empty:
        _csv(whatif, out / "whatif.csv")
    if not joined.empty:
        _csv(joined, out / "shapes_joined.csv")
    document = {
        "source": str(source),
        "kind": results.kind,
        "generated": dt.datetime.now().isoformat(timespec="seconds"),
        "report_dir": str(out),
        "settings": cfg,
        "decisions": decisions,
        **({"batch_size": [{**entry, "statement": statement(entry)} for entry in scaling]} if scaling else {}),
        "notes": results.notes,
    }
    (out / "decision.json").write_text(json.dumps(_jsonable(document), indent=2, allow_nan=False) + "\n")
    (out / "report.md").write_text(markdown(results, fits, decisions, whatif, figures, cfg, scaling, joined))
    if results.kind == "wandb" and cfg.get("wandb_log", True):
        log_to_wandb(source, out, figures, decisions, fits)
    return document


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def _csv(frame: pd.DataFrame, path: Path) -> None:
    """Lists as JSON, so the file stays one value per field."""
    frame = frame.copy()
    for column in frame.columns:
        if frame[column].map(lambda v: isinstance(v, (list, tuple))).any():
            frame[column] = frame[column].map(json.dumps)
    frame.to_csv(path, index=False)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return None if not math.isfinite(obj) else float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


# W&B


def log_to_wandb(source: str, out: Path, figures: dict[str, Path], decisions: list[dict], fits: pd.DataFrame) -> None:
    """The figures, the decision table and the report folder as one W&B run (job_type=report) next to the sweep."""
    from harness.tracking.tracker import resolve_mode

    entity, project, sweep_id = WANDB_PATH.match(source).groups()
    try:
        import wandb

        mode = resolve_mode("auto")
        if mode == "disabled":
            return
        run = wandb.init(
            project=project,
            entity=entity,
            group=sweep_id,
            job_type="report",
            mode=mode,
            name=f"report-{sweep_id or project}",
            dir=str(out),
            config={"source": source},
            settings=wandb.Settings(silent=True),
        )
        logged: dict[str, Any] = {f"report/{name}": wandb.Image(str(path)) for name, path in figures.items()}
        logged["report/decision"] = wandb.Table(dataframe=decide_mod.decisions_frame(decisions))
        logged["report/fits"] = wandb.Table(dataframe=fits.astype({c: str for c in ("ks", "alpha_method")}))
        run.log(logged)
        artifact = wandb.Artifact(_slug(f"report-{sweep_id or project}")[:128], type="report")
        for name in ("report.md", "cells.csv", "fits.csv", "decision.json"):
            artifact.add_file(str(out / name))
        artifact.add_dir(str(out / "figures"), name="figures")
        run.log_artifact(artifact)
        run.finish()
        print(f"[report] logged to W&B ({mode}): {getattr(run, 'url', None) or run.dir}", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - the report folder is the result; W&B is a copy
        print(f"warning: W&B: report not logged ({type(err).__name__}: {err}); it is in {out}", file=sys.stderr)


# Command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis.report",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("results", help="results directory, Hydra (multi)run directory, or W&B entity/project[/sweep_id]")
    p.add_argument("--out", type=Path, help="report folder (default: <results>/report, or report/<path> for W&B)")
    p.add_argument("--config", type=Path, help="a YAML like conf/report.yaml (default: conf/report.yaml)")
    p.add_argument("--weights", action="append", help="traffic mix: CATEGORY=SHARE[,CATEGORY=SHARE...]")
    p.add_argument("--confidence", type=float)
    p.add_argument("--resamples", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--max-k", type=int)
    p.add_argument("--whatif-name", help="name of the other machine (what-if)")
    p.add_argument("--cost-ratio", action="append", help="what-if c: NUMBER for every model draft, or DRAFT=NUMBER")
    p.add_argument("--target-step-ms", type=float, help="what-if: the target's decode step there")
    p.add_argument("--draft-step-ms", action="append", help="what-if: a draft step there: NUMBER or DRAFT=NUMBER")
    p.add_argument("--verify-slope", type=float, help="what-if: b of v(n) = 1 + b(n - 1) there")
    p.add_argument(
        "--ridge-rows",
        type=float,
        help="what-if: rows per pass where a target step there turns compute-bound (peak FLOP/s x bytes per weight / "
        "(2 x memory bandwidth)): predicts up to which batch size each draft pays there",
    )
    p.add_argument("--no-wandb-log", action="store_true", help="reading from W&B: do not log the report back")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = settings(args)
        document = build(args.results, args.out, cfg)
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    for d in document["decisions"]:
        print(f"{d['context']}: {d['mix']['verdict']}")
    print(f"report: {Path(document['report_dir']) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
