"""W&B sweep files: the command `wandb agent` builds from each composes into the intended cell.

The command is expanded by wandb's own agent code (`Agent._command_run`,
which calls `create_sweep_command` / `create_sweep_command_args`), with the
process launch replaced by a recorder; nothing touches the network.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from harness.config.checks import CONF_DIR, check_command_line, validate, with_default_pair
from harness.runner.store import cell_key
from harness.tracking.tracker import METRICS

ROOT = Path(__file__).parent.parent
SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))
GROUPS = {"pair", "dataset"}  # Hydra config groups: the swept value is the option's name
PUBLISHED = {"llama_7b_68m", "vicuna_7b_68m", "llama31_8b_32_1b", "qwen25_7b_05b"}


def grid(parameters: dict) -> list[dict]:
    """Every combination a grid sweep runs (a fixed `value` counts as one choice)."""
    names = list(parameters)
    choices = [parameters[n]["values"] if "values" in parameters[n] else [parameters[n]["value"]] for n in names]
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


def agent_command(sweep: dict, values: dict, monkeypatch, tmp_path, run_id: str) -> list[str]:
    """The command line `wandb agent` would start for one run of `sweep`."""
    from wandb import wandb_agent

    started = []

    class Recorder:  # stands in for AgentProcess: records the command instead of running it
        def __init__(self, command=None, **kwargs):
            started.append(command)

    monkeypatch.setattr(wandb_agent, "AgentProcess", Recorder)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # the agent writes the run's parameters there
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep0")
    monkeypatch.setenv("WANDB_RUN_ID", "none")  # _command_run sets these two: restored after the test
    monkeypatch.setenv("WANDB_SWEEP_PARAM_PATH", "none")
    agent = wandb_agent.Agent(api=None, queue=None, sweep_id="sweep0")
    agent._sweep_command = sweep["command"]
    agent._command_run({"run_id": run_id, "program": sweep.get("program"), "args": {k: {"value": v} for k, v in values.items()}})
    return started[0]


def test_the_three_sweeps_exist():
    swept = {
        p.stem: {n.lstrip("+") for n, spec in yaml.safe_load(p.read_text())["parameters"].items() if "values" in spec}
        for p in SWEEPS
    }
    assert swept.get("k_temperature") == {"k", "temperature"}
    assert swept.get("pair_k") == {"pair", "k"}
    assert swept.get("dataset_pair") == {"dataset", "pair"}
    pairs = yaml.safe_load((ROOT / "sweeps" / "pair_k.yaml").read_text())["parameters"]["+pair"]["values"]
    assert set(pairs) == PUBLISHED
    datasets = yaml.safe_load((ROOT / "sweeps" / "dataset_pair.yaml").read_text())["parameters"]["dataset"]["values"]
    assert set(datasets) == {p.stem for p in (CONF_DIR / "dataset").glob("*.yaml")} - {"local"}  # every named prompt set


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_sweep_commands_compose_into_the_swept_cells(path, monkeypatch, tmp_path):
    sweep = yaml.safe_load(path.read_text())
    assert sweep["method"] == "grid" and sweep["metric"]["name"] in METRICS  # a summary key of every run
    assert sweep["command"][:5] == ["${env}", "${interpreter}", "-m", "harness", "${args_no_hyphens}"]
    keys = set()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for i, values in enumerate(grid(sweep["parameters"])):
            command = agent_command(sweep, values, monkeypatch, tmp_path, run_id=f"run{i}")
            assert command[:4] == ["/usr/bin/env", "python", "-m", "harness"]
            overrides = command[4:]
            assert (
                "+pair=" + str(values["+pair"]) in overrides
            )  # with its '+', as Hydra needs it (pair is not in the defaults list)
            if i == 0:
                check_command_line(overrides)  # as `python -m harness` checks its command line
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            assert cfg.hydra.run.dir == f"outputs/wandb-sweeps/sweep0/run{i}"  # one directory per run
            with open_dict(cfg):
                del cfg["hydra"]
            cfg = with_default_pair(cfg)
            OmegaConf.resolve(cfg)
            validate(cfg)
            for name, value in values.items():
                name = name.lstrip("+")
                got = cfg[name].name if name in GROUPS else OmegaConf.select(cfg, name)
                assert got == value and type(got) is type(value), (name, got, value)
            keys.add(cell_key(cfg))
    assert len(keys) == len(grid(sweep["parameters"]))  # every run is its own cell in the results store


def test_an_agent_run_logs_the_sweep_and_the_full_config(monkeypatch, tmp_path):
    """As under `wandb agent` (offline here): the run joins the sweep, keeps the swept values, and
    the resolved Hydra config stays complete even where the sweep shadows a group by its name."""
    from test_tracking import read_run

    import harness.tracking.tracker as tracking

    sweep = yaml.safe_load((ROOT / "sweeps" / "dataset_pair.yaml").read_text())
    values = grid(sweep["parameters"])[0]
    command = agent_command(sweep, values, monkeypatch, tmp_path, run_id="run0")  # sets the agent's env
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = with_default_pair(compose(config_name="config", overrides=[*command[4:-1], "wandb.mode=offline"]))
    import wandb

    wandb.teardown()  # a fresh W&B process state reads the agent's environment, as in the agent's child
    try:
        tracking.start(cfg, tmp_path / "results" / cell_key(cfg)).finish({"speedup": 1.0}, [])
    finally:
        wandb.teardown()  # and later tests do not inherit the sweep
    (run_dir,) = (tmp_path / "results" / "wandb").glob("offline-run-*")
    run = read_run(run_dir)
    assert (run["run"].sweep_id, run["run"].run_id) == ("sweep0", "run0")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert run["config"]["+pair"] == values["+pair"] and run["config"]["pair"] == resolved["pair"]
    assert run["config"]["dataset"] == values["dataset"] and run["config"]["dataset_config"] == resolved["dataset"]
    assert run["config"]["k"] == values["k"]


def test_an_agent_run_of_a_complete_cell_logs_the_stored_results(monkeypatch, tmp_path):
    """Two sweeps sharing a results store may both list a cell: the second sweep's run finds it
    complete and does not recompute it, but still logs its stored numbers, so that the sweep's
    metric and its report have every cell."""
    import json

    import wandb
    from test_tracking import read_run

    from harness.runner.cell import run_cell

    sweep = yaml.safe_load((ROOT / "sweeps" / "pair_k.yaml").read_text())
    values = grid(sweep["parameters"])[0]
    command = agent_command(sweep, values, monkeypatch, tmp_path, run_id="run1")
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = with_default_pair(compose(config_name="config", overrides=[*command[4:-1], "wandb.mode=offline"]))
    cell_dir = tmp_path / "results" / cell_key(cfg)
    cell_dir.mkdir(parents=True)
    (cell_dir / "summary.json").write_text(json.dumps({"speedup": 1.25, "k": cfg.k, "status": "finished"}))
    (cell_dir / "prompts.jsonl").write_text("")
    wandb.teardown()
    try:
        summary = run_cell(cfg, out_dir=tmp_path / "results", quiet=True)
    finally:
        wandb.teardown()
    assert summary["speedup"] == 1.25
    (run_dir,) = (tmp_path / "results" / "wandb").glob("offline-run-*")
    run = read_run(run_dir)
    assert (run["run"].sweep_id, run["run"].run_id) == ("sweep0", "run1")
    assert run["summary"]["speedup"] == 1.25 and run["summary"]["reused"] is True and run["summary"]["status"] == "finished"
    monkeypatch.delenv("WANDB_SWEEP_ID")  # outside a sweep a complete cell makes no run
    run_cell(cfg, out_dir=tmp_path / "results", quiet=True)
    assert len(list((tmp_path / "results" / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.cli
def test_an_agent_run_whose_cell_fails_before_it_starts_still_reports_the_failure(tiny_pair, tmp_path):
    """Under `wandb agent`, a cell that stops before its run opens (here a prompt file that is not there)
    gets a run all the same, failed, with the error line, so that the sweep's dashboard says why."""
    import os
    import subprocess
    import sys

    from test_tracking import runs_in

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {
        "WANDB_SWEEP_ID": "sweep0",
        "WANDB_RUN_ID": "run7",
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        **{name: str(tmp_path / name) for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_DIR")},
    }
    missing = tmp_path / "questions.jsonl"
    args = [
        "+pair=llama_7b_68m",
        f"pair.target.id={tiny_pair['target']}",
        f"pair.draft.id={tiny_pair['draft']}",
        "dataset=local",
        f"dataset.path={missing}",
        f"out_dir={tmp_path / 'results'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    (run,) = runs_in(tmp_path / "results" / "wandb")
    assert (run["run"].sweep_id, run["run"].run_id) == ("sweep0", "run7")
    assert run["summary"]["status"] == "failed" and run["summary"]["error"] == error.removeprefix("error: ")
    assert run["exit_code"] == 1 and run["artifacts"] == []  # the cell wrote nothing to keep
    assert not list((tmp_path / "results").glob("llama_7b_68m*"))  # nor left an empty cell folder

    env.pop("WANDB_SWEEP_ID")  # outside a sweep, the console and the aggregate table say it: no run
    subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert len(runs_in(tmp_path / "results" / "wandb")) == 1


def test_a_cell_whose_run_opened_gets_no_second_run_for_its_failure(monkeypatch, tmp_path):
    import wandb
    from test_tracking import runs_in

    import harness.tracking.tracker as tracking

    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name))
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep0")
    monkeypatch.setenv("WANDB_RUN_ID", "run3")
    monkeypatch.setattr(tracking, "_tried", False)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = with_default_pair(compose(config_name="config", overrides=["wandb.mode=offline"]))
    cell_dir = tmp_path / "results" / cell_key(cfg)
    wandb.teardown()
    try:
        with pytest.raises(RuntimeError), tracking.start(cfg, cell_dir):  # the run opens, then the cell fails
            raise RuntimeError("mid-cell")
        tracking.record_failure(cfg, cell_dir, "RuntimeError: mid-cell")
    finally:
        wandb.teardown()
    (run,) = runs_in(tmp_path / "results" / "wandb")
    assert run["summary"]["status"] == "failed" and "error" not in run["summary"]
