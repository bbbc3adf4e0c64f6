"""`python -m harness` end to end on the tiny pair, and its one-line errors."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from harness.config.settings import CPU_LINEAR_MODES

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.cli  # every test here starts `python -m harness`


def harness(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def tiny_args(tiny_pair, out: Path, *extra: str) -> list[str]:
    return [
        "+pair=llama_7b_68m",
        f"pair.target.id={tiny_pair['target']}",
        f"pair.draft.id={tiny_pair['draft']}",
        "dataset.num_prompts=12",
        "max_new_tokens=20",
        f"out_dir={out}",
        *extra,
    ]


def test_cli_end_to_end_on_tiny_pair(tiny_pair, tmp_path):
    out = harness(*tiny_args(tiny_pair, tmp_path, "k=3", "cpu_linear=transposed"))
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("acceptance_rate", "tokens_per_cycle", "speedup", "speedup_ci", "predicted_speedup", "efficiency", "conditions"):
        assert key in last
    assert last["peak_rss_over"] == "cell" and "harness_commit" in last["conditions"] and last["dataset_sha256"] is None
    assert 0 < last["acceptance_rate"] < 1
    assert "acceptance rate" in out.stdout and "speedup" in out.stdout  # the readable table
    cell = Path(last["cell_dir"])
    records = [json.loads(line) for line in (cell / "prompts.jsonl").read_text().splitlines()]
    assert len(records) == 12
    assert {r["category"] for r in records} == {"conversation", "translation", "summarization", "qa", "math", "code"}  # 2 each
    for r in records:  # greedy: speculative output is the target's own output
        assert r["spec"]["tokens"] == r["base"]["tokens"]
    summary = json.loads((cell / "summary.json").read_text())
    assert summary["acceptance_rate"] == last["acceptance_rate"]
    assert summary["conditions"]["torch"] and summary["conditions"]["threads"] >= 1
    assert summary["conditions"]["linear"] == {
        "mode": "transposed",
        "product": "transposed",
        "plans": {"*": [0, 2, *range(2, 18)]},
    }
    assert (
        summary["conditions"]["forward"] == summary["conditions"]["draft_forward"] == "lean"
    )  # forward=auto, Llama models on the CPU
    assert "threads, linear W @ x.T, lean forward, torch" in out.stdout  # the conditions line of the table
    assert {r["linear"] for r in records} == {"transposed"}  # each prompt's record names its product
    assert len(summary["categories"]) == 6


def test_cli_resumes_and_skips_finished_cells(tiny_pair, tmp_path):
    args = tiny_args(tiny_pair, tmp_path, "temperature=1.0", "dataset.num_prompts=6")
    first = harness(*args)
    assert first.returncode == 0, first.stderr
    cell = Path(json.loads(first.stdout.strip().splitlines()[-1])["cell_dir"])
    # Simulate an interrupted run: drop the summary and the last two prompts.
    lines = (cell / "prompts.jsonl").read_text().splitlines()
    (cell / "prompts.jsonl").write_text("\n".join(lines[:2]) + "\n")
    # Two prompts from another process on another host (its memory, its machine), then a line cut by a kill mid-write.
    doctored = [
        json.dumps(
            {
                **json.loads(line),
                "rss_mb": 1e6,
                "host": "node-07",
                "harness_commit": "0123abc",
                "libraries": "torch 2.6.0, transformers 5.24.0",
            }
        )
        for line in lines[2:4]
    ]
    with (cell / "prompts.jsonl").open("a") as out:
        out.write("\n".join(doctored) + "\n" + lines[4][:100])
    (cell / "summary.json").unlink()
    second = harness(*args)
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert "rss_first_mb" not in summary  # 2 prompts ran in this process: too few to fit a growth
    assert json.loads((cell / "summary.json").read_text()).get("rss_last_mb", 0) < 1e6
    assert (
        summary["conditions"]["hostnames"] == sorted({"node-07", platform.node()})
        and "ran under several host names" in second.stderr
    )
    now = summary["conditions"]["harness_commit"] or "unknown"
    assert summary["conditions"]["harness_commits"] == sorted({"0123abc", now})  # and the first two prompts' (this code's)
    assert "measured by several harness versions" in second.stderr
    assert "torch 2.6.0, transformers 5.24.0" in summary["conditions"]["libraries_mixed"]
    assert "measured with several library versions (" in second.stderr and "; torch 2.6.0, transformers 5.24.0" in second.stderr
    ids = [json.loads(line)["id"] for line in (cell / "prompts.jsonl").read_text().splitlines()]  # every line parses
    assert len(ids) == 6 == len(set(ids))
    assert ids[:4] == [json.loads(line)["id"] for line in lines[:4]]  # finished prompts were kept, not redone
    third = harness(*args)
    assert third.returncode == 0 and "already complete" in third.stderr and "was measured by harness commit" not in third.stderr
    stored = json.loads((cell / "summary.json").read_text())
    stored["conditions"]["harness_commit"] = "0123abc"  # finished by other code: kept, and said so
    (cell / "summary.json").write_text(json.dumps(stored))
    fourth = harness(*args)
    assert fourth.returncode == 0 and "already complete" in fourth.stderr
    assert ("was measured by harness commit 0123abc" in fourth.stderr) == (now != "unknown")


@pytest.mark.parametrize(
    "override, message",
    [
        ("k=0", "k=0 must be a positive integer"),
        ("temperature=-1", "must be a number from 0 (greedy) to 3.4e+38"),
        ("temperature=inf", "temperature=inf must be a number from 0"),
        ("temperature=1e39", "temperature=1e+39 must be a number from 0 (greedy) to 3.4e+38 (float32's largest)"),
        ("k=21", "k=21 is more than max_new_tokens=20, and a cycle drafts at most 19: lower k or raise max_new_tokens"),
        ("pair.name=../x", "pair.name=../x must be a plain name"),
        (
            "wandb=disabled",
            "wandb is a section, not a setting: set one of its keys (dir, entity, group, job_type, mode, "
            "name, project, tags), e.g. wandb.mode=disabled",
        ),
        ("pair.target=foo", "pair.target is a section, not a setting"),
        ("temperature=1e-46", "is greedy in all but name"),
        ("top_p=1.5", "must be in (0, 1]"),
        ("top_k=-2", "must be an integer >= 0"),
        ("max_new_tokens=0", "must be a positive integer"),
        ("device=cuda", "CUDA is not available"),
        ("cpu_linear=fast", f"cpu_linear=fast must be one of {', '.join(CPU_LINEAR_MODES)}"),
        ("+pair.draft.length=longest", "pair.draft.length=longest must be match"),
        ("+pair.draft.length=cost_aware", "pair.draft.length=cost_aware is draft_length=cost now"),
        ("dataset.max_rows=all", "dataset.max_rows=all must be a positive integer or null"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(tiny_pair, tmp_path, override, message):
    out = harness(*tiny_args(tiny_pair, tmp_path, override))
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert message in out.stderr
    assert len([line for line in out.stderr.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.parametrize("override", ["tempreature=1.0", "k=0", "+pair=smollm3", "k=abc", "force=maybe"])
def test_a_setting_refused_is_reported_before_torch_loads(tmp_path, override):
    """Hydra's composition of the command line and validate() run before torch and transformers are
    imported (about 10 s on a 2-core machine), so a typo costs a second; -X importtime lists every module imported."""
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "harness", override, f"out_dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    imported = {line.rpartition("|")[2].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "hydra" in imported and not imported & {"torch", "transformers", "scipy", "wandb", "datasets"}


def test_missing_model_path_and_unavailable_hub_id(tiny_pair, tmp_path):
    out = harness("+pair=llama_7b_68m", f"pair.target.id={tmp_path / 'nope'}", f"out_dir={tmp_path}")
    assert out.returncode != 0 and "does not exist" in out.stderr and "Traceback" not in out.stderr
    out = harness("+pair=llama_7b_68m", f"out_dir={tmp_path}")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "meta-llama/Llama-2-7b-hf" in out.stderr and "HF_HOME" in out.stderr


def test_different_tokenizers_are_refused(tiny_pair, tmp_path):
    from conftest import make_model, make_tokenizer

    other = tmp_path / "other"
    tok = make_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 ")
    make_model(len(tok), seed=5).save_pretrained(other)
    tok.save_pretrained(other)
    out = harness("+pair=llama_7b_68m", f"pair.target.id={tiny_pair['target']}", f"pair.draft.id={other}", f"out_dir={tmp_path}")
    assert out.returncode != 0 and "different tokenizers" in out.stderr and "Traceback" not in out.stderr
