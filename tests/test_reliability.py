"""Bad input fails in one line; an interrupted sweep loses nothing and resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import ROOT, harness, tiny_args


@pytest.mark.parametrize(
    "args, message",
    [
        (["+pair=llama_7b_86m"], "did you mean +pair=llama_7b_68m?"),
        (["-m", "+pair=smollm2,smollm_ngram"], "did you mean +pair=smollm2_ngram?"),
        (["dataset=gsm9k"], "did you mean dataset=gsm8k?"),
        (["tempreature=1.0"], "unknown setting 'tempreature': did you mean temperature?"),
        (["-m", "k=1,2", "dataset.num_promts=3"], "unknown setting 'dataset.num_promts': did you mean dataset.num_prompts?"),
        (["+pair=smollm2_ngram", "pair.draft.lenght=cost_aware"], "did you mean pair.draft.length?"),
        (["wandb.mdoe=disabled"], "did you mean wandb.mode?"),
        (["banana=1"], "unknown setting 'banana': (--cfg job prints them all; +banana=... adds a new key)"),
    ],
)
def test_unknown_names_suggest_the_closest(args, message):
    out = harness(*args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_every_setting_the_configs_offer_is_known():
    from omegaconf import OmegaConf

    from harness import exactness
    from harness.run import CONF_DIR, known_settings, unknown_setting

    known = known_settings({"exactness": exactness.DEFAULTS})
    for override in ["k=2", "temperature=0.7", "dataset.num_prompts=3", "dataset.path=x.jsonl", "pair.target.id=/m",
                     "pair.target.device_map=auto", "pair.draft.length=cost_aware", "pair.draft.max_ngram=4",
                     "wandb.mode=disabled", "prompts.template=raw", "exactness.num_prompts=1", "out_dir=/tmp/x",
                     "+new_key=1", "~seed", "hydra.verbose=true", "hydra/launcher=slurm", "--cfg", "job", "-m"]:
        assert unknown_setting(override, known) is None, override
    for path in (CONF_DIR / "dataset").glob("*.yaml"):  # every key of every option, under its group
        for key in OmegaConf.load(path):
            assert f"dataset.{key}" in known
    assert unknown_setting("exactness.num_promts=1", known) is not None


@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset.num_prompts=0", "must be a positive integer or null"),
        ("k=2.5", "k=2.5 must be a positive integer"),
        ("max_new_tokens=600", "leave no room for a prompt"),
        ("wandb.mode=sometimes", "wandb.mode=sometimes must be one of"),
    ],
)
def test_more_bad_values(tiny_pair, tmp_path, override, message):
    out = harness(*tiny_args(tiny_pair, tmp_path, override))
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr


def test_every_prompt_too_long_and_unwritable_out_dir(tiny_pair, tmp_path):
    out = harness(*tiny_args(tiny_pair, tmp_path, "max_new_tokens=495", "prompts.overlong=skip"))
    assert out.returncode != 0 and "every prompt is longer than the context budget" in out.stderr
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    out = harness(*tiny_args(tiny_pair, blocked))
    assert out.returncode != 0 and "cannot write results" in out.stderr and "Traceback" not in out.stderr


def test_missing_dataset_file(tiny_pair, tmp_path):
    out = harness(*tiny_args(tiny_pair, tmp_path, "dataset=local", f"dataset.path={tmp_path / 'nope.jsonl'}"))
    assert out.returncode != 0 and "nope.jsonl" in out.stderr and "Traceback" not in out.stderr


def test_sigterm_while_the_models_load_ends_the_run_as_ctrl_c(tiny_pair, tmp_path, monkeypatch):
    """Before any prompt runs (loading, warm-up), SIGTERM still becomes the interruption
    `python -m harness` turns into exit 130, and the cell's claim is released."""
    from test_config import composed

    from harness import run

    def killed_while_loading(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM was not turned into an interruption")

    def outside(signum, frame):  # without run_cell's own handler, the signal lands here (not on pytest)
        raise AssertionError("SIGTERM during loading was not turned into an interruption")

    monkeypatch.setattr(run, "load_pair", killed_while_loading)
    cfg = composed(tiny_args(tiny_pair, tmp_path)[:-1] + ["wandb.mode=disabled"])
    previous = signal.signal(signal.SIGTERM, outside)
    try:
        with pytest.raises(KeyboardInterrupt):
            run.run_cell(cfg, out_dir=tmp_path)
        assert signal.getsignal(signal.SIGTERM) is outside  # restored afterwards
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not list(tmp_path.glob("*/.claim"))


def test_sigterm_mid_sweep_then_resume_completes_without_duplicates(tiny_pair, tmp_path):
    args = ["-m", *tiny_args(tiny_pair, tmp_path, "k=1,2", "temperature=1.0", "max_new_tokens=48"),
            "dataset.num_prompts=30", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    lines: list[Path] = []
    while time.time() < deadline:  # wait until the first cell has a few prompts on disk
        lines = list(tmp_path.glob("*/prompts.jsonl"))
        if lines and len(lines[0].read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and "Traceback" not in stderr
    cell = lines[0].parent
    status = json.loads((cell / "status.json").read_text())
    assert status["status"] == "interrupted" and 3 <= status["done"] < 30
    assert not (cell / "summary.json").exists()
    kept = [json.loads(line)["id"] for line in (cell / "prompts.jsonl").read_text().splitlines()]

    rerun = harness(*args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    cells = sorted(tmp_path.glob("*/summary.json"))
    assert len(cells) == 2  # both cells of the sweep are complete
    for summary_path in cells:
        ids = [json.loads(line)["id"] for line in (summary_path.parent / "prompts.jsonl").read_text().splitlines()]
        assert len(ids) == 30 == len(set(ids))  # complete, no duplicated rows
        assert json.loads((summary_path.parent / "status.json").read_text())["status"] == "finished"
    resumed = [json.loads(line)["id"] for line in (cell / "prompts.jsonl").read_text().splitlines()]
    assert resumed[: len(kept)] == kept  # prompts finished before the interruption were not redone


def test_directory_that_is_not_a_model_and_bad_dataset_files(tiny_pair, tmp_path):
    empty_dir = tmp_path / "not_a_model"
    empty_dir.mkdir()
    out = harness(*tiny_args(tiny_pair, tmp_path, f"pair.draft.id={empty_dir}"))
    assert out.returncode != 0 and "not a saved model" in out.stderr and "Traceback" not in out.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = harness(*tiny_args(tiny_pair, tmp_path, "dataset=local", f"dataset.path={empty}"))
    assert out.returncode != 0 and "empty.jsonl" in out.stderr and "Traceback" not in out.stderr
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"question": "hi", "category": "qa"}\n')
    out = harness(*tiny_args(tiny_pair, tmp_path, "dataset=local", f"dataset.path={no_field}", "dataset.text_field=prompt"))
    assert out.returncode != 0 and "Traceback" not in out.stderr and "prompt" in out.stderr


OOM_CLI = """
import torch
import harness.run as run
real = run.run_prompt
def run_prompt(pair, prompt, ids, index, cfg, sampling):
    if cfg.k == 2 and index == 1:  # this cell runs out of memory on its second prompt
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
    return real(pair, prompt, ids, index, cfg, sampling)
run.run_prompt = run_prompt
import runpy
runpy.run_module("harness", run_name="__main__", alter_sys=True)  # as `python -m harness`
"""


def test_a_cell_out_of_memory_is_recorded_and_the_sweep_goes_on(tiny_pair, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *tiny_args(tiny_pair, tmp_path, "k=1,2,3", "dataset.num_prompts=3", "max_new_tokens=8"),
            f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", OOM_CLI, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]  # the sweep ran to its end, then says a cell failed
    assert "error: out of memory: CUDA out of memory" in out.stderr and "Traceback" not in out.stderr
    rows = (sweep / "aggregate.md").read_text()
    assert rows.count("| finished |") == 2 and rows.count("| failed |") == 1
    assert "out of memory: CUDA out of memory" in (sweep / "aggregate.csv").read_text()  # the error, per failed cell
    cells = {}
    for status in tmp_path.glob("*/status.json"):
        config = (status.parent / "config.yaml").read_text()
        k = next(int(line.split(":")[1]) for line in config.splitlines() if line.startswith("k:"))
        cells[k] = (status.parent, json.loads(status.read_text()))
    assert cells[1][1]["status"] == cells[3][1]["status"] == "finished"
    failed_dir, failed = cells[2]
    assert failed["status"] == "failed" and "OutOfMemoryError" in failed["error"] and failed["done"] == 1
    assert len((failed_dir / "prompts.jsonl").read_text().splitlines()) == 1  # the prompt before the failure is kept
    assert not (failed_dir / "summary.json").exists()
