"""W&B tracking, multirun, resume, claims and the SLURM launcher config.

Real offline W&B runs are read back from their `.wandb` transaction log and
compared with the harness's own JSON results. Every W&B directory (runs,
cache, staging, settings) is under a temporary folder, no API key is visible,
and nothing touches the network.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import harness.tracking.claims as claims
import harness.tracking.tracker as tracking
from harness.config.checks import CONF_DIR
from harness.errors import HarnessError
from harness.runner.provenance import machine
from harness.runner.store import SCHEMA_VERSION

ROOT = Path(__file__).parent.parent


# Reading a run back. A `.wandb` file is W&B's record log: a 7-byte header
# (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a
# 7-byte header (CRC-32 of type byte + data, length, type: 1 full, 2 first,
# 3 middle, 4 last) followed by its data; a record is one protobuf `Record`.


def read_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"corrupt chunk at {pos}"
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _apply(target: dict, items, removes=()) -> None:
    for item in items:
        keys = list(item.nested_key) or [item.key]
        node = target
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = json.loads(item.value_json)
    for item in removes:
        keys = list(item.nested_key) or [item.key]
        node = target
        for key in keys[:-1]:
            node = node.get(key, {})
        node.pop(keys[-1], None)


def read_run(run_dir: Path, timeout_s: float = 30) -> dict:
    """A run's final state, replayed from its log: run, config, summary, history, artifacts, exit code."""
    (log,) = run_dir.glob("*.wandb")
    deadline = time.monotonic() + timeout_s
    # run.finish() returns before W&B's service has flushed the log: wait for its exit
    # record. Until then the last chunk may be half written (its CRC fails): read again.
    while True:
        try:
            records = read_records(log)
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        assert time.monotonic() < deadline, f"{log} has no exit record"
        time.sleep(0.1)
    run = {"run": None, "config": {}, "summary": {}, "history": [], "artifacts": [], "exit_code": None}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["run"] = record.run
            _apply(run["config"], record.run.config.update)
        elif kind == "config":
            _apply(run["config"], record.config.update, record.config.remove)
        elif kind == "summary":
            _apply(run["summary"], record.summary.update, record.summary.remove)
        elif kind == "history":
            row: dict = {}
            _apply(row, record.history.item)
            run["history"].append(row)
        elif kind == "artifact":
            run["artifacts"].append(
                (record.artifact.name, record.artifact.type, [e.path for e in record.artifact.manifest.contents])
            )
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def runs_in(wandb_dir: Path) -> list[dict]:
    return [read_run(d) for d in sorted(wandb_dir.glob("*run-*")) if d.is_dir()]


def plain(value):
    """A result as W&B gives it back: tuples as lists, NaN as null (W&B keeps NaN only inside nested values)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


@pytest.fixture(scope="session")
def wandb_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wandb-home")


@pytest.fixture
def offline(wandb_home, monkeypatch) -> Iterator[dict]:
    """No API key, no WANDB_MODE: wandb.mode=auto must choose offline. Every W&B folder is temporary.
    W&B reads its environment once per process: its state starts afresh here, as in a new process,
    so that no earlier test's key (or folders) lingers in it."""
    import wandb

    env = {
        "WANDB_DIR": wandb_home / "default",
        "WANDB_CACHE_DIR": wandb_home / "cache",
        "WANDB_DATA_DIR": wandb_home / "data",
        "WANDB_CONFIG_DIR": wandb_home / "config",
        "WANDB_ARTIFACT_DIR": wandb_home / "artifacts",
        "NETRC": wandb_home / "netrc",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    for name in (
        "WANDB_MODE",
        "WANDB_API_KEY",
        "WANDB_IDENTITY_TOKEN_FILE",
        "WANDB_SWEEP_ID",
        "WANDB_BASE_URL",
        "WANDB_PROJECT",
        "WANDB_ENTITY",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
    ):
        monkeypatch.delenv(name, raising=False)
    wandb.teardown()
    yield {k: str(v) for k, v in env.items()}
    wandb.teardown()  # later tests do not inherit this test's W&B state


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def tiny(tiny_pair, *extra: str) -> list[str]:
    return [
        "+pair=llama_7b_68m",
        f"pair.target.id={tiny_pair['target']}",
        f"pair.draft.id={tiny_pair['draft']}",
        "dataset.num_prompts=3",
        "max_new_tokens=8",
        *extra,
    ]


# One cell, in process.


def test_offline_run_matches_the_harness_results(tiny_pair, tmp_path, offline):
    from harness.runner.cell import run_cell

    cfg = composed(tiny(tiny_pair, "k=3", "temperature=0.7", "wandb.tags=[ci,tiny]", "wandb.group=g1"))
    summary = run_cell(cfg, out_dir=tmp_path, quiet=True)
    cell = Path(summary["cell_dir"])
    (run,) = runs_in(tmp_path / "wandb")  # default dir: <out_dir>/wandb/

    assert (run["run"].project, run["run"].run_group, run["run"].job_type) == ("specbench-harness", "g1", "benchmark")
    assert (run["run"].display_name, list(run["run"].tags)) == (cell.name, ["ci", "tiny"])
    config = {k: v for k, v in run["config"].items() if k not in ("_wandb", "conditions")}
    assert config == OmegaConf.to_container(OmegaConf.load(cell / "config.yaml"))  # the resolved Hydra config
    on_disk = json.loads((cell / "summary.json").read_text())
    for key, value in on_disk.items():
        assert plain(run["summary"][key]) == plain(value), key
    assert run["config"]["conditions"] == on_disk["conditions"]
    assert run["summary"]["status"] == "finished" and run["exit_code"] == 0
    assert [run["summary"]["speedup_ci_low"], run["summary"]["speedup_ci_high"]] == plain(on_disk["speedup_ci"])
    assert set(tracking.METRICS) <= set(run["summary"])  # every documented metric is a summary key
    assert not [key for key in run["summary"] if key.startswith("prompt/")]  # per-prompt curves are history only

    media = run["summary"]
    assert media["tables/prompts"]["_type"] == "table-file" and media["tables/prompts"]["nrows"] == 3
    assert media["tables/categories"]["nrows"] == len(on_disk["categories"])
    position_chart = run["config"]["_wandb"]["visualize"]["charts/position_acceptance"]
    assert position_chart["panel_config"]["panelDefId"] == "wandb/line/v0"
    assert run["config"]["_wandb"]["visualize"]["charts/accept_hist"]["panel_config"]["panelDefId"] == "wandb/bar/v0"
    per_prompt = [row for row in run["history"] if "prompt/speedup" in row]
    records = [json.loads(line) for line in (cell / "prompts.jsonl").read_text().splitlines()]
    assert [row["prompt/speedup"] for row in per_prompt] == [r["speedup"] for r in records]
    (results,) = [a for a in run["artifacts"] if a[1] == "cell-results"]
    assert results[0] == f"cell-{cell.name}" and set(results[2]) == {"prompts.jsonl", "summary.json", "config.yaml"}

    # Every result the cell wrote says its schema, when its run started (UTC) and on what machine.
    status = json.loads((cell / "status.json").read_text())
    for result in (on_disk, status, *records):
        assert (result["schema_version"], result["started_utc"]) == (SCHEMA_VERSION, on_disk["started_utc"])
    assert datetime.fromisoformat(on_disk["started_utc"]).utcoffset() == timedelta(0)
    assert on_disk["conditions"]["machine"] == status["machine"] == records[0]["machine"] == machine()


def test_a_resumed_cell_logs_each_prompt_at_its_place(tmp_path, offline):
    """A run resumed after prompts 0 and 1 logs prompt/n 3 and 4 for prompts 2 and 3, not 1 and 2."""

    def record(index: int) -> dict:
        return {
            "index": index,
            "speedup": 1.0 + index,
            "spec": {"accepted": 1, "drafted": 2, "committed": 3, "cycles": 1, "new_tokens": 3},
        }

    tracker = tracking.start(composed(["wandb.mode=offline"]), tmp_path / "cell")
    for index in (2, 3):
        tracker.log_prompt(record(index))
    tracker.finish({"speedup": 1.0}, [])
    (run,) = runs_in(tmp_path / "wandb")
    assert [(row["prompt/n"], row["prompt/speedup"]) for row in run["history"] if "prompt/speedup" in row] == [(3, 3.0), (4, 4.0)]


@pytest.mark.parametrize("error, status", [(RuntimeError("disk full"), "failed"), (SystemExit(-1), "interrupted")])
def test_a_cell_that_stops_after_its_prompts_says_so(tiny_pair, tmp_path, offline, monkeypatch, error, status):
    """A failure while summarising (a full disk, say) or a SLURM requeue's SystemExit: the W&B run and
    status.json say failed / interrupted, with the prompts' numbers, rather than a run left open."""
    import harness.runner.cell as run

    def stops(*args, **kwargs):
        raise error

    monkeypatch.setattr(run, "conditions", stops)  # after the last prompt, before summary.json
    with pytest.raises(type(error)):
        run.run_cell(composed(tiny(tiny_pair, "k=2")), out_dir=tmp_path, quiet=True)
    (cell,) = [d for d in tmp_path.iterdir() if (d / "status.json").exists()]
    written = json.loads((cell / "status.json").read_text())
    assert written["status"] == status and not (cell / "summary.json").exists()
    assert written["schema_version"] == SCHEMA_VERSION and written["started_utc"] and written["machine"] == machine()
    (logged,) = runs_in(tmp_path / "wandb")
    assert logged["summary"]["status"] == status and "speedup" in logged["summary"]


def test_exceptions_mark_the_run_interrupted_or_failed(tmp_path, offline):
    cfg = composed(["wandb.mode=offline"])
    for exc, status in ((KeyboardInterrupt, "interrupted"), (RuntimeError, "failed")):
        cell = tmp_path / f"cell-{status}"
        cell.mkdir()
        with pytest.raises(exc):
            with tracking.start(cfg, cell):
                raise exc()
    dangling = tracking.start(cfg, tmp_path / "cell-dangling")  # never finished: the next start closes it
    tracking.start(cfg, tmp_path / "cell-next").finish({"speedup": 1.0}, [])
    runs = {r["run"].display_name: r for r in runs_in(tmp_path / "wandb")}
    assert dangling.closed
    assert {name: (r["summary"]["status"], r["exit_code"]) for name, r in runs.items()} == {
        "cell-interrupted": ("interrupted", 1),
        "cell-failed": ("failed", 1),
        "cell-dangling": ("failed", 1),
        "cell-next": ("finished", 0),
    }


@pytest.fixture
def fresh_wandb():
    """W&B reads its environment and settings files once per process, and wandb.init then uses what it
    read: `fresh()` starts that state afresh, as a new process would, after a test changes them."""
    import wandb

    yield wandb.teardown
    wandb.teardown()  # later tests see their own environment, not this test's


def test_modes(monkeypatch, offline, tmp_path, capsys, fresh_wandb):
    from urllib.parse import urlsplit

    from wandb.sdk import wandb_setup

    def mode(wandb_mode: str = "auto") -> str:
        fresh_wandb()
        return tracking.resolve_mode(wandb_mode)

    def netrc(host: str) -> None:
        (tmp_path / "netrc").write_text(f"machine {host} login user password " + "x" * 40 + "\n")

    assert mode() == "offline" and capsys.readouterr().err == ""  # no key: offline, as documented
    assert mode("online") == "offline" and "no API key" in capsys.readouterr().err
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    netrc("api.wandb.ai")
    assert mode() == "online"
    netrc(urlsplit(wandb_setup.singleton().settings.base_url).netloc)  # W&B's default server, where `wandb login` files the key
    assert mode() == "online"
    monkeypatch.delenv("NETRC")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert mode() == "online"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 12)  # not a key W&B takes: offline, and why
    assert mode() == "offline" and "40+ characters" in capsys.readouterr().err
    monkeypatch.delenv("WANDB_API_KEY")
    netrc("wandb.corp.example")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    assert mode() == "offline"  # a key for another host than W&B's server
    (tmp_path / "wandb-config").mkdir()
    (tmp_path / "wandb-config" / "settings").write_text("[default]\nbase_url = https://wandb.corp.example\n")
    assert mode() == "online"  # `wandb login --host=https://wandb.corp.example` saved it there
    (tmp_path / "wandb-config" / "settings").write_text("[default]\nbase_url = http://localhost:8080\n")
    assert mode() == "offline"
    netrc("localhost")
    assert mode() == "offline"  # wandb itself looks up host:port only
    netrc("localhost:8080")
    assert mode() == "online"  # a server on a port: wandb files its key under host:port
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the environment pins auto (CI)
    assert mode() == "disabled" and mode("offline") == "offline"
    assert isinstance(tracking.start(composed(["wandb.mode=disabled"]), tmp_path / "c"), tracking.NoTracking)
    assert not (tmp_path / "wandb").exists()
    with pytest.raises(HarnessError, match="wandb.mode=sometimes must be one of auto, online, offline, disabled"):
        tracking.resolve_mode("sometimes")


def test_init_failure_is_one_warning_and_the_cell_goes_on(monkeypatch, offline, tmp_path, capsys):
    import wandb

    def broken(**kwargs):
        raise wandb.errors.CommError("network is unreachable")

    monkeypatch.setattr(wandb, "init", broken)
    tracker = tracking.start(composed(["wandb.mode=offline"]), tmp_path / "cell")
    assert isinstance(tracker, tracking.NoTracking)
    tracker.log_prompt({})
    tracker.finish({}, [])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: W&B:") and "network is unreachable" in err[0]


def test_online_without_network_falls_back_to_offline(monkeypatch, offline, tmp_path, capsys):
    import wandb

    real, modes = wandb.init, []

    def no_network(**kwargs):
        modes.append(kwargs["mode"])
        if kwargs["mode"] == "online":
            raise wandb.errors.CommError("run initialization has timed out after 90.0 sec")
        return real(**kwargs)

    monkeypatch.setattr(wandb, "init", no_network)
    monkeypatch.setattr(tracking, "online_failed", False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    cfg = composed(["wandb.mode=online"])
    for name in ("first", "second"):
        tracking.start(cfg, tmp_path / name).finish({"speedup": 1.0}, [])
    assert modes == ["online", "offline", "offline"]  # the server is not waited for twice
    err = capsys.readouterr().err
    assert err.count("warning: W&B") == 1 and "logging offline" in err
    assert [r["summary"]["status"] for r in runs_in(tmp_path / "wandb")] == ["finished", "finished"]


# Models load once per process.


def test_twelve_cells_of_one_pair_load_each_model_once(tiny_pair, tmp_path, monkeypatch):
    import harness.runner.cell as run
    import harness.runner.pair as pairs

    loads = []
    real = pairs.load_model
    monkeypatch.setattr(pairs, "load_model", lambda spec, *a, **kw: loads.append(a[1]) or real(spec, *a, **kw))
    monkeypatch.setattr(pairs, "loaded_pairs", {})
    # Timing the cost ratio is beside the point here and is most of a tiny cell's time.
    monkeypatch.setattr(
        run,
        "measure_costs",
        lambda pair, ids, k, sampling, **_: {
            "target_step_s": 1.0,
            "draft_step_s": 0.1,
            "cost_ratio": 0.1,
            "verify_s": [1.0] * (k + 1),
            "verify_cost": [1.0] * (k + 1),
        },
    )
    cells = set()
    for k in (1, 2, 4, 8):
        for temperature in (0.0, 0.7, 1.0):
            cfg = composed(
                tiny(
                    tiny_pair,
                    f"k={k}",
                    f"temperature={temperature}",
                    "dataset.num_prompts=1",
                    "max_new_tokens=9",
                    "wandb.mode=disabled",
                )
            )
            cells.add(run.run_cell(cfg, out_dir=tmp_path, quiet=True)["cell"])
    assert len(cells) == 12
    assert loads == ["target", "draft"]


# A real multirun: one W&B run per cell, models loaded once, aggregate, resume.

# Runs the CLI with load_model wrapped to print a line per load (harness.runner.pair
# binds load_model at import, after this patch).
COUNTING_CLI = """
import sys
import harness.models.loading as models
real = models.load_model
def counted(spec, device, role="target", *args, **kwargs):
    print(f"[load] {role} {spec.id}", file=sys.stderr, flush=True)
    return real(spec, device, role, *args, **kwargs)
models.load_model = counted
import runpy
runpy.run_module("harness", run_name="__main__", alter_sys=True)  # as `python -m harness`
"""


def multirun(tiny_pair, out: Path, sweep_dir: Path, *overrides: str, env: dict) -> subprocess.CompletedProcess:
    args = [
        "-m",
        *tiny(tiny_pair, "dataset.num_prompts=2", "max_new_tokens=6"),
        *overrides,
        f"out_dir={out}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | env | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", COUNTING_CLI, *args], capture_output=True, text=True, cwd=ROOT, env=full_env, timeout=120
    )


@pytest.mark.cli
def test_multirun_logs_one_run_per_cell_loads_once_aggregates_and_resumes(tiny_pair, tmp_path, offline):
    out, first_sweep = tmp_path / "results", tmp_path / "sweep1"
    first = multirun(tiny_pair, out, first_sweep, "k=1,2", "temperature=0.0,1.0", env=offline)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count("[load] target") == 1 and first.stderr.count("[load] draft") == 1  # 4 cells, one load
    runs = runs_in(out / "wandb")
    assert len(runs) == 4
    cells = {json.loads(p.read_text())["cell"] for p in first_sweep.glob("*/cell.json")}
    assert {r["run"].display_name for r in runs} == cells and len(cells) == 4  # named by cell key
    assert {r["run"].run_group for r in runs} == {str(first_sweep)}  # grouped by sweep
    assert all(r["summary"]["status"] == "finished" and r["exit_code"] == 0 for r in runs)
    table = (first_sweep / "aggregate.md").read_text()
    assert table in first.stdout and table.count("| finished |") == 4
    assert len((first_sweep / "aggregate.csv").read_text().splitlines()) == 5

    # Interrupt one cell after its first prompt, then run a larger sweep over the same store:
    # finished cells are skipped, the interrupted one resumes, the new cells (k=0: invalid) fail alone.
    cut = out / sorted(cells)[0]
    kept = (cut / "prompts.jsonl").read_text().splitlines()[:1]
    (cut / "prompts.jsonl").write_text(kept[0] + "\n")
    (cut / "summary.json").unlink()
    second_sweep = tmp_path / "sweep2"
    second = multirun(tiny_pair, out, second_sweep, "k=1,2,0", "temperature=0.0,1.0", env=offline)
    assert second.returncode == 1  # a cell failed: the sweep says so after its table
    assert second.stderr.count("already complete") == 3 and second.stderr.count("error: k=0 must be a positive integer") == 2
    lines = (cut / "prompts.jsonl").read_text().splitlines()
    assert len(lines) == 2 and lines[0] == kept[0]
    assert len(runs_in(out / "wandb")) == 5  # one new run: the resumed cell
    rows = (second_sweep / "aggregate.md").read_text()
    assert rows.count("| finished |") == 4 and rows.count("| failed (k=0 temperature=") == 2


def test_a_reused_sweep_dir_aggregates_only_this_multiruns_jobs(tmp_path):
    """hydra.sweep.dir=multirun/exp twice: the first sweep's jobs 2 and 3 (one failed) are not the second's."""
    from harness.cli.callbacks import POINTER, AggregateCallback, collect

    sweep = tmp_path / "sweep"

    def job(n: int, overrides: list[str], status: str = "finished") -> None:
        (sweep / str(n)).mkdir(parents=True, exist_ok=True)
        pointer = {"job": n, "overrides": overrides, "status": status, "error": None, "cell": None, "cell_dir": None}
        (sweep / str(n) / POINTER).write_text(json.dumps(pointer))

    for n, k in enumerate([1, 2, 4, 8]):  # the first multirun: k=8 failed
        job(n, [f"k={k}"], "failed" if k == 8 else "finished")
    AggregateCallback().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    for n, k in enumerate([1, 2]):
        job(n, [f"k={k}", "temperature=0.7"])
    assert [r["overrides"] for r in collect(sweep)] == ["k=1 temperature=0.7", "k=2 temperature=0.7"]


def test_a_sweep_folder_above_another_sweep_leaves_its_pointers_alone(tmp_path):
    """hydra.sweep.dir=exp/first, then hydra.sweep.dir=exp: the second multirun neither clears nor collects the
    first one's jobs (analysis.report exp reads both); pointers name their sweep folder."""
    from harness.cli.callbacks import POINTER, AggregateCallback, collect

    def job(sweep: Path, n: int, k: int, named: bool = True) -> Path:
        (sweep / str(n)).mkdir(parents=True, exist_ok=True)
        pointer = {
            "job": n,
            "overrides": [f"k={k}"],
            "status": "finished",
            "error": None,
            "cell": None,
            "cell_dir": None,
            **({"sweep_dir": str(sweep.resolve())} if named else {}),
        }
        (sweep / str(n) / POINTER).write_text(json.dumps(pointer))
        return sweep / str(n) / POINTER

    exp = tmp_path / "exp"
    first = [job(exp / "first", 0, 1), job(exp / "first", 1, 2, named=False), job(exp / "older", 0, 8, named=False)]
    AggregateCallback().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(exp)}}}))
    assert all(p.exists() for p in first)
    job(exp, 0, 4)
    assert [r["overrides"] for r in collect(exp)] == ["k=4"]
    assert [r["overrides"] for r in collect(exp / "first")] == ["k=1", "k=2"]
    shutil.copytree(exp / "first", tmp_path / "copy")  # a sweep folder copied (or reached by another path): its jobs stay its own
    assert [r["overrides"] for r in collect(tmp_path / "copy")] == ["k=1", "k=2"]
    deep = exp / "deep" / "a" / "0"  # a hydra.sweep.subdir with a slash: the pointer names its sweep folder
    deep.mkdir(parents=True)
    (deep / POINTER).write_text(
        json.dumps(
            {
                "job": 0,
                "overrides": ["k=16"],
                "status": "finished",
                "error": None,
                "cell": None,
                "cell_dir": None,
                "sweep_dir": str((exp / "deep").resolve()),
            }
        )
    )
    assert [r["overrides"] for r in collect(exp / "deep")] == ["k=16"]


# Claims on cells.


def test_a_claimed_cell_waits_for_its_holder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from harness.tracking.claims import claim\n"
            "with claim(sys.argv[1]):\n    print('held', flush=True); time.sleep(1.5)",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    claim_file = json.loads((tmp_path / ".claim").read_text())
    assert claim_file["pid"] == holder.pid
    start = time.monotonic()
    with claims.claim(tmp_path, poll_s=0.1, quiet=True):
        waited = time.monotonic() - start
        assert json.loads((tmp_path / ".claim").read_text())["pid"] == os.getpid()
    assert waited > 1.0 and not (tmp_path / ".claim").exists()  # got in only once the holder let go
    holder.wait()


def test_two_processes_never_run_one_cell_at_once(tiny_pair, tmp_path, monkeypatch):
    import threading

    import harness.runner.cell as run

    monkeypatch.setattr(claims, "CLAIM_POLL_S", 0.1)
    cfg = composed(tiny(tiny_pair, "k=2", "wandb.mode=disabled"))
    summaries = []
    workers = [
        threading.Thread(target=lambda: summaries.append(run.run_cell(cfg.copy(), out_dir=tmp_path, quiet=True)))
        for _ in range(2)
    ]  # the claim records host and pid, so two threads contend like two agents
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    cell = Path(summaries[0]["cell_dir"])
    assert len(summaries) == 2 and plain(summaries[0]) == plain(summaries[1])  # the second found the first's results
    assert len((cell / "prompts.jsonl").read_text().splitlines()) == 3  # each prompt ran once
    assert not (cell / ".claim").exists()


def test_stale_claims_are_taken_over(tmp_path):
    import socket

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for name, holder, age in (
        ("dead-pid", {"host": socket.gethostname(), "pid": int(gone.stdout)}, 0),
        ("silent-host", {"host": "elsewhere", "pid": 1}, 1000),
        ("torn", None, 60),
    ):
        cell = tmp_path / name
        cell.mkdir()
        (cell / ".claim").write_text(json.dumps(holder) if holder else "")
        os.utime(cell / ".claim", (time.time() - age,) * 2)
        start = time.monotonic()
        with claims.claim(cell, poll_s=5, stale_s=300, quiet=True):
            assert json.loads((cell / ".claim").read_text())["pid"] == os.getpid()
        assert time.monotonic() - start < 1, name
    live = tmp_path / "live"  # a live holder elsewhere, heartbeat fresh: not stale
    live.mkdir()
    (live / ".claim").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    assert not claims.is_stale(live / ".claim", {"host": "elsewhere", "pid": 1}, 300)


def test_a_fresh_claim_is_not_taken_for_the_torn_one_it_replaced(tmp_path, monkeypatch):
    """Two processes find the same torn claim; one takes it over and has created, not yet written,
    its own: the other must not take that fresh, still empty claim for the torn one and remove it."""
    import threading

    path = tmp_path / ".claim"
    path.write_text("")
    os.utime(path, (time.time() - 60,) * 2)
    real, seen = claims.is_stale, []

    def another_process_takes_over(p, holder, stale_s):
        stale = real(p, holder, stale_s)
        if not seen:  # right after this process judged the torn claim stale
            p.unlink()
            p.write_text("")  # the other's claim: created, its content not yet written
            threading.Timer(0.3, lambda: (seen.append(path.read_text()), path.unlink())).start()  # then it finishes
            seen.append("taken over")
        return stale

    monkeypatch.setattr(claims, "is_stale", another_process_takes_over)
    with claims.claim(tmp_path, poll_s=0.05, stale_s=300, quiet=True):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert seen == ["taken over", ""]  # the other's claim was still its own when it finished


# Hydra configs.


def test_slurm_launcher_and_aggregate_callback_compose():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            return_hydra_config=True,
            overrides=[
                "hydra/launcher=slurm",
                "hydra.launcher.partition=gpu",
                "+pair=llama_7b_68m",
                "pair.target.device_map=auto",
            ],
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gpu"
    assert (launcher.gpus_per_node, launcher.max_num_timeout) == (1, 3)
    assert type(instantiate(launcher)).__name__ == "SlurmLauncher"
    assert type(instantiate(cfg.hydra.callbacks.aggregate)).__name__ == "AggregateCallback"
    assert cfg.pair.target.device_map == "auto"


def test_exactness_check_is_logged_as_its_own_run(tiny_pair, tmp_path, offline):
    from harness.exactness.main import run_check

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="exactness_check",
            overrides=[
                *tiny(tiny_pair),
                "k=2",
                "temperature=1.0",
                "top_k=5",
                f"out_dir={tmp_path}",
                "device=cpu",
                "exactness.samples=200",
                "exactness.num_prompts=1",
                "exactness.length=4",
            ],
        )
    report = run_check(cfg, quiet=True)
    (run,) = runs_in(tmp_path / "wandb")
    assert run["run"].job_type == "exactness" and run["run"].display_name == Path(report["run_dir"]).name
    on_disk = json.loads((Path(report["run_dir"]) / "exactness.json").read_text())
    for key in ("passed", "family_p", "detectable_tv", "samples", "k", "temperature", "length"):
        assert plain(run["summary"][key]) == plain(on_disk[key]), key
    assert run["summary"]["exactness/passed"] == int(on_disk["passed"]) and run["exit_code"] == 0
    assert run["summary"]["tables/exactness"]["nrows"] == 4  # one prompt x (joint, first, bonus, rows: drawn 8 rows at a time)
    (results,) = [a for a in run["artifacts"] if a[1] == "cell-results"]
    assert set(results[2]) == {"exactness.json", "config.yaml"}


def test_the_histogram_chart_shows_cycles_without_a_draft_apart():
    """In bin 0 they would read as cycles whose every draft was rejected, which alpha does not count."""
    chart = tracking.media({"accept_hist": [5, 1, 2], "cycles_without_draft": 3}, [])["charts/accept_hist"]
    assert chart.table.data == [["none drafted", 3], ["0", 2], ["1", 1], ["2", 2]]
    chart = tracking.media({"accept_hist": [5, 1, 2], "cycles_without_draft": 0}, [])["charts/accept_hist"]
    assert chart.table.data == [["0", 5], ["1", 1], ["2", 2]]


def test_a_cost_only_cell_charts_its_predicted_grid_not_its_acceptance():
    grid = {"alpha": [0.5, 0.9], "k": [1, 2], "speedup": [[1.1, 1.0], [1.4, 1.6]], "best_k": [1, 2]}
    logged = tracking.media({"accept_hist": [5, 0], "cost_only": "random weights", "predicted_grid": grid}, [])
    assert "charts/accept_hist" not in logged and "charts/predicted_grid" in logged
    assert logged["tables/predicted_grid"].data == [[0.5, 1, 1.1], [0.5, 2, 1.0], [0.9, 1, 1.4], [0.9, 2, 1.6]]


@pytest.mark.parametrize(
    "tags, expected", [("baseline", ["baseline"]), (["ci", "tiny"], ["ci", "tiny"]), (7, ["7"]), (None, None), ([], None)]
)
def test_a_single_tag_is_one_tag_not_one_per_character(tags, expected):
    assert tracking.run_tags(tags) == expected


def test_a_jobs_pointer_holds_its_cell_as_an_absolute_path(tmp_path, monkeypatch):
    """out_dir=results is relative to where the sweep ran; the report may run from anywhere."""
    from harness.cli import callbacks

    job_dir = tmp_path / "sweep" / "0"
    job_dir.mkdir(parents=True)
    hydra_cfg = OmegaConf.create({"job": {"num": 0}, "overrides": {"task": ["k=2"]}, "runtime": {"output_dir": str(job_dir)}})
    monkeypatch.setattr(callbacks.HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(callbacks.HydraConfig, "get", staticmethod(lambda: hydra_cfg))
    monkeypatch.chdir(tmp_path)
    callbacks.record_job({"cell": "c1", "cell_dir": "results/c1"})
    pointer = json.loads((job_dir / callbacks.POINTER).read_text())
    assert pointer["cell_dir"] == str((tmp_path / "results" / "c1").resolve()) and pointer["status"] == "finished"


def test_a_multirun_without_benchmark_jobs_prints_no_table(tmp_path, capsys):
    """`python -m harness.exactness -m ...` composes the same config, callback included, and records no cell:
    no '0 cells' table, no aggregate files."""
    from harness.cli.callbacks import AggregateCallback

    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    AggregateCallback().on_multirun_end(config)
    assert "cells in" not in capsys.readouterr().out and not (sweep / "aggregate.md").exists()


def test_a_draft_length_policy_charts_its_lengths_and_calibration():
    calibration = [{"bin": [0.3, 0.4], "tested": 9, "predicted": 0.35, "observed": 0.2}]
    summary = {"accept_hist": [5, 1], "drafted_hist": [2, 4], "draft_length": {"policy": "cost", "calibration": calibration}}
    logged = tracking.media(summary, [])
    assert logged["charts/drafted_hist"].table.data == [["0", 2], ["1", 4]]
    assert logged["charts/calibration"].table.data == [[0.3, 0.35, 0.2, 9]]
    assert "charts/drafted_hist" not in tracking.media({**summary, "draft_length": {"policy": "constant"}}, [])
