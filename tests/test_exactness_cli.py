"""`python -m harness.exactness acceptance=true`: the teacher-forced acceptance check from the command
line, in process (harness.exactness.main.cli), on the tiny pair from conftest: it passes for the pair's
own drafter and fails, exit 1, for a drafter whose context differs from the committed tokens."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
from conftest import exactness_args

import harness.runner.pair as pair_module
from harness.exactness import main as exactness
from tests.test_acceptance import StaleDrafter

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors on one thread


def run_cli(monkeypatch, capsys, tiny_pair, out, *overrides: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m harness.exactness` with these overrides, in this process."""
    argv = exactness_args(tiny_pair, out, "wandb.mode=disabled", *overrides)
    monkeypatch.setattr(sys, "argv", ["harness.exactness", *argv])
    with pytest.raises(SystemExit) as exit_info:
        exactness.cli()
    captured = capsys.readouterr()
    return exit_info.value.code or 0, captured.out, captured.err


# Raw prompts: under the chat template the tiny pair agrees on every draft, and a check needs rejections too.
ARGS = ("acceptance=true", "k=2", "max_new_tokens=24", "exactness.num_prompts=3", "prompts.template=raw")


def position_rows(out: str, k: int) -> list[list[str]]:
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("position"))
    return [line.split() for line in lines[header + 1 : header + 1 + k]]


def test_the_acceptance_check_passes_for_the_pairs_own_drafter(monkeypatch, capsys, tiny_pair, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, tiny_pair, tmp_path, *ARGS)
    assert code == 0, out + err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["check"] == "acceptance" and report["passed"] and report["k"] == 2
    positions = report["positions"]
    assert len(positions) == 2 and positions[0]["tested"] >= positions[1]["tested"] > 0  # position 2 only after 1 accepted
    for row in positions:  # the drafter's own: reported and teacher-forced agree position by position
        assert row["reported_accepted"] == row["teacher_forced_agrees"] and row["disagree"] == 0 and row["ties"] == 0
    assert sum(row["reported_accepted"] for row in positions) < sum(row["tested"] for row in positions)  # rejections too
    rows = position_rows(out, 2)
    assert [row[:2] for row in rows] == [["1", str(positions[0]["tested"])], ["2", str(positions[1]["tested"])]]
    assert "PASS: the acceptance the loop reports is the draft's own" in out
    saved = json.loads((tmp_path / report["run_dir"].split("/")[-1] / "acceptance.json").read_text())
    assert saved["positions"] == positions and report["run_dir"].split("/")[-1].startswith("acceptance-")


def test_the_acceptance_check_fails_for_a_drafter_with_the_wrong_context(monkeypatch, capsys, tiny_pair, tmp_path):
    """The pair's drafter replaced by one that keeps a rejected draft in its context: greedy output and
    the exactness law are the target's, but its reported acceptance is not the draft's own."""
    real = pair_module.load_pair

    def with_a_stale_draft(*args, **kwargs):
        pair = real(*args, **kwargs)  # cached for other tests: a copy gets the broken drafter
        return dataclasses.replace(pair, drafter=StaleDrafter(pair.drafter.lm))

    monkeypatch.setattr(pair_module, "load_pair", with_a_stale_draft)
    code, out, err = run_cli(monkeypatch, capsys, tiny_pair, tmp_path, *ARGS)
    assert code == 1, out + err
    report = json.loads(out.strip().splitlines()[-1])
    assert not report["passed"] and sum(row["disagree"] for row in report["positions"]) > 0
    assert any(row["reported_accepted"] != row["teacher_forced_agrees"] for row in report["positions"])
    assert "FAIL: reported acceptance is not the draft's own" in out
    assert "reported acceptance is not the draft's own (model: one teacher-forced draft pass)" in out  # a prompt's first


def test_acceptance_needs_greedy_decoding(monkeypatch, capsys, tiny_pair, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, tiny_pair, tmp_path, "acceptance=true", "temperature=1.0")
    assert code == 2 and err.strip().splitlines()[-1] == (
        "error: acceptance=true checks greedy decoding (the draft's proposals replayed at temperature 0): "
        "temperature=1.0 must be 0"
    )
    assert not (tmp_path / "hydra").exists() or not any(p.name.startswith("acceptance-") for p in tmp_path.iterdir())
