"""scripts/gpu_check.sh and scripts/gpu_payload.sh: the commands they run are ones the harness accepts, the
payload arrives whole, and the check's rehearsal on the CPU writes every part's results."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

import harness.bench.main as bench
from harness.config.checks import CONF_DIR, check_command_line, validate, with_default_pair

SCRIPTS = Path(__file__).parents[1] / "scripts"
SHAPE_PAIRS = ("shapes_llama2_7b_68m", "shapes_llama31_8b_1b", "shapes_llama31_8b_eagle3")

# A stand-in for the interpreter the GPU scripts run (they take it from $PYTHON): it records each
# command line, with the commit and PYTHONPATH the environment names, in $CALLS; packs and unpacks the
# payload's packages with the real interpreter; answers the two questions the payload script asks;
# and makes a wheel (a zip with a module, its metadata and a script) where pip would download or build one.
FAKE_PYTHON = """#!{python}
import json, os, sys, zipfile
args = sys.argv[1:]
with open(os.environ["CALLS"], "a") as calls:
    env = {{"commit": os.environ.get("SPECBENCH_COMMIT"), "pythonpath": os.environ.get("PYTHONPATH")}}
    calls.write(json.dumps({{"argv": args, **env}}) + "\\n")
if args[:1] == ["-c"] and "tarfile" in args[1]:
    os.execv(sys.executable, [sys.executable, *args])
elif args[:1] == ["-c"] and "importlib.metadata" in args[1]:
    print("transformers==5.25.0 huggingface-hub==2.4.0")
elif args[:1] == ["-c"] and "find_gguf" in args[1]:
    print(os.environ["FAKE_GGUF"])
elif args[:3] in (["-m", "pip", "download"], ["-m", "pip", "wheel"]):
    folder = args[args.index("-d" if "-d" in args else "-w") + 1]
    os.makedirs(folder, exist_ok=True)
    name = "fake_" + args[2]
    with zipfile.ZipFile(os.path.join(folder, name + "-0-py3-none-any.whl"), "w") as wheel:
        wheel.writestr(name + "/__init__.py", "")
        wheel.writestr(name + "-0.dist-info/METADATA", "Metadata-Version: 2.1\\nName: " + name + "\\nVersion: 0\\n")
        wheel.writestr(name + "-0.data/scripts/" + name, "#!python\\n")
"""


def run_script(script: Path, tmp_path: Path, *args: str, **env: str) -> list[dict]:
    """Run a GPU script with the recording interpreter; every interpreter call it made, in order."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    calls.unlink(missing_ok=True)
    environ = {
        **os.environ,
        "PYTHON": str(fake),
        "CALLS": str(calls),
        "OUT": str(tmp_path / "out"),
        "SPECBENCH_PAYLOAD": str(tmp_path / "stash"),
        "SPECBENCH_SITE": str(tmp_path / "site"),
        "SPECBENCH_CACHE": str(tmp_path / "cache"),
        **env,
    }
    environ.pop("SPECBENCH_COMMIT", None)
    done = subprocess.run(["bash", str(script), *args], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()]


def bench_calls(calls: list[dict]) -> list[list[str]]:
    return [c["argv"][2:] for c in calls if c["argv"][:2] == ["-m", "harness.bench"]]


def sweep_calls(calls: list[dict]) -> list[list[str]]:
    return [c["argv"][3:] for c in calls if c["argv"][:3] == ["-m", "harness", "-m"]]


class Parsed(Exception):
    pass


@pytest.mark.parametrize("mode", ["shapes", "embedded"])
def test_the_gpu_check_gives_the_bench_sizes_it_accepts(tmp_path, monkeypatch, mode):
    """Every bench command scripts/gpu_check.sh runs (on the GPU and in its rehearsal, on the shape pairs by
    default and on the embedded pairs with --embedded) passes the bench's own checks, and every sweep composes
    and validates as python -m harness would: a refused one would stop that part on the GPU machine, where
    it cannot be rerun."""
    extra = ("--embedded",) if mode == "embedded" else ()
    gpu_calls = run_script(SCRIPTS / "gpu_check.sh", tmp_path, *extra)
    rehearsal_calls = run_script(SCRIPTS / "gpu_check.sh", tmp_path, *extra, "--rehearse")
    gpu, rehearsal = bench_calls(gpu_calls), bench_calls(rehearsal_calls)
    gpu_sweeps, rehearsal_sweeps = sweep_calls(gpu_calls), sweep_calls(rehearsal_calls)
    if mode == "shapes":
        assert len(gpu) == len(rehearsal) == 1  # ours against HF's assisted generate(), on random weights
        assert all("+pair=shapes_llama2_7b_68m" in args for args in gpu + rehearsal)
        assert len(gpu_sweeps) == len(rehearsal_sweeps) == 2  # the target alone, then the three pairs
        target, pairs = gpu_sweeps
        assert {"+pair=shapes_llama31_8b_1b", "batch_size=1,8,32", "compile=false,true", "k=1"} <= set(target)
        assert {f"+pair={','.join(SHAPE_PAIRS)}", "batch_size=1,8", "compile=true", "k=4"} <= set(pairs)
        assert "compile=false,true" in rehearsal_sweeps[0]
        assert not any(a.startswith("++pair.") for a in gpu[0] + target + pairs)  # the shapes' own sizes on the GPU
        assert all(any(a.startswith("++pair.target.config.") for a in args) for args in rehearsal + rehearsal_sweeps)
    else:
        assert len(gpu) == len(rehearsal) == 3  # the head, the model draft eager, compiled
        assert ["+pair=smollm2_eagle" in args for args in gpu] == [True, False, False]
        assert len(gpu_sweeps) == len(rehearsal_sweeps) == 1 and "batch_size=1,8" in gpu_sweeps[0]
    assert all("device=cuda" in args for args in gpu + gpu_sweeps)
    assert all("device=cpu" in args for args in rehearsal + rehearsal_sweeps)
    monkeypatch.setattr(bench, "check_choices", lambda *a, **k: (_ for _ in ()).throw(Parsed()))
    for args in gpu + rehearsal:
        with pytest.raises(Parsed):
            bench.main(args)
    for args in gpu_sweeps + rehearsal_sweeps:
        overrides = [a for a in args if not a.startswith("hydra.")]
        check_command_line(["-m", *overrides])
        lists = [a.split("=", 1) for a in overrides if "," in a]
        assert {key for key, _ in lists} <= {"batch_size", "+pair", "compile"}
        single = [a for a in overrides if "," not in a]
        for values in itertools.product(*[v.split(",") for _, v in lists]):
            cell = single + [f"{key}={value}" for (key, _), value in zip(lists, values)]
            check_command_line(cell)
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                validate(with_default_pair(compose(config_name="config", overrides=cell)))


def _tree_and_machine(tmp_path: Path) -> tuple[Path, Path, str]:
    """A git tree holding the GPU scripts, the copy of it a GPU machine gets (no .git), and the tree's commit."""
    tree, machine = tmp_path / "tree", tmp_path / "machine"
    for root in (tree, machine):
        (root / "scripts").mkdir(parents=True)
        for script in ("gpu_check.sh", "gpu_payload.sh"):
            (root / "scripts" / script).write_text((SCRIPTS / script).read_text())
    git = ["git", "-C", str(tree), "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "tree"]):
        subprocess.run(git + command, check=True, capture_output=True)
    commit = subprocess.run(
        git + ["describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True
    ).stdout.strip()
    assert len(commit) == 12
    return tree, machine, commit


def test_a_tree_without_git_names_its_commit_from_the_payload(tmp_path, monkeypatch):
    """The GPU machine gets the working tree without .git: the payload, one folder, carries the commit it was
    packed at and the packages' files in one archive; gpu_check.sh --stash .gpu/1 --run unpacks them onto
    PYTHONPATH, exports the commit to every part, and harness_commit reads it from there."""
    from harness.runner.provenance import harness_commit

    monkeypatch.delenv("SPECBENCH_COMMIT", raising=False)
    assert harness_commit(tmp_path) is None
    monkeypatch.setenv("SPECBENCH_COMMIT", "0123456789ab")
    harness_commit.cache_clear()  # memoised: the environment is read once per process
    assert harness_commit(tmp_path) == "0123456789ab"

    tree, machine, commit = _tree_and_machine(tmp_path)
    run_script(tree / "scripts" / "gpu_payload.sh", tmp_path)
    (payload,) = (tree / ".gpu").iterdir()  # one folder: the shape pairs need no GGUF file
    assert payload.name == "1" and sorted(p.name for p in payload.iterdir()) == ["COMMIT", "site.tar.xz"]
    with tarfile.open(payload / "site.tar.xz") as site:
        names = site.getnames()
    assert "fake_download/__init__.py" in names and "fake_wheel-0.dist-info/METADATA" in names
    assert not any(".data/" in name for name in names)  # a wheel's scripts: not what the check imports
    calls = run_script(machine / "scripts" / "gpu_check.sh", tmp_path, "--stash", str(payload), "--run", "--rehearse")
    runs = [c for c in calls if c["argv"][:2] in (["-m", "harness.bench"], ["-m", "harness"])]
    assert len(runs) == 3  # the target's sweep, the pairs' sweep, the bench
    site = tmp_path / "site"
    assert all(c["commit"] == commit and c["pythonpath"].split(":")[0] == str(site) for c in runs)
    assert (site / "fake_download" / "__init__.py").exists() and (site / "fake_wheel-0.dist-info" / "METADATA").exists()


def test_the_embedded_payload_comes_in_parts_the_check_assembles(tmp_path):
    """gpu_payload.sh --embedded adds the GGUF file in parts .gpu/2 ... .gpu/N: each command but the last stashes
    its folder and runs nothing, the last joins the file, checks its SHA-256 and runs the embedded parts."""
    tree, machine, commit = _tree_and_machine(tmp_path)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(bytes(range(256)) * 40)
    run_script(tree / "scripts" / "gpu_payload.sh", tmp_path, "--embedded", FAKE_GGUF=str(gguf), PART_BYTES="4000")
    parts = sorted((tree / ".gpu").iterdir(), key=lambda p: int(p.name))
    assert [p.name for p in parts] == ["1", "2", "3", "4"]  # the packages, then 10,240 bytes in parts of 4,000
    assert sorted(p.name for p in parts[0].iterdir()) == ["COMMIT", "SHA256SUMS", "site.tar.xz"]
    for part in parts[:-1]:
        calls = run_script(machine / "scripts" / "gpu_check.sh", tmp_path, "--stash", str(part))
        assert not [c for c in calls if c["argv"][:2] in (["-m", "harness.bench"], ["-m", "harness"])]
    calls = run_script(
        machine / "scripts" / "gpu_check.sh", tmp_path, "--stash", str(parts[-1]), "--run", "--embedded", "--rehearse"
    )
    runs = [c["commit"] for c in calls if c["argv"][:2] in (["-m", "harness.bench"], ["-m", "harness"])]
    assert runs == [commit] * 4  # three bench parts and the batch sweep
    assert (tmp_path / "cache" / "gguf" / "model.gguf").read_bytes() == gguf.read_bytes()  # the parts assembled, checked


def test_the_gpu_check_distil_part_gives_the_distillation_command_it_accepts(tmp_path):
    """scripts/gpu_check.sh --distill runs python -m harness.distill alone (no bench part), with options that parse
    and pass its checks, on the GPU and in the rehearsal."""
    from harness.distill.main import parse_args

    for extra, device in (((), "cuda"), (("--rehearse",), "cpu")):
        calls = run_script(SCRIPTS / "gpu_check.sh", tmp_path, "--distill", *extra)
        assert bench_calls(calls) == [] and sweep_calls(calls) == []
        distils = [c["argv"][2:] for c in calls if c["argv"][:2] == ["-m", "harness.distill"]]
        assert len(distils) == 1
        args = parse_args(distils[0])
        assert args.kind == "eagle3" and args.one_pass and args.device == device
        assert args.out == Path(tmp_path / "out" / "smollm2_eagle")


def _cells(packed: Path, folder: str) -> list[tuple[dict, dict]]:
    """The finished cells a packed sweep holds: (summary.json, config.yaml) each."""
    with tarfile.open(packed) as tar:
        read = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    cells = [name.rpartition("/")[0] for name in read if name.endswith("/summary.json") and name.startswith(f"{folder}/")]
    return [(json.loads(read[f"{c}/summary.json"]), yaml.safe_load(read[f"{c}/config.yaml"])) for c in cells]


def test_the_gpu_check_rehearsal_writes_every_part(tmp_path):
    """scripts/gpu_check.sh --rehearse with the real interpreter, on the CPU at tiny sizes: every part writes its
    results. The target's sweep and the pairs' hold finished cost-only cells (limit_ratio measured) at each
    batch size, eager and compiled; the bench compares our loop with HF's assisted generate() on one output."""
    out = tmp_path / "out"
    environ = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "WANDB_MODE": "disabled"}
    environ["SPECBENCH_PAYLOAD"] = str(tmp_path / "no-payload")  # nothing stashed: the installed packages
    environ.pop("SPECBENCH_COMMIT", None)
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), "--rehearse"], env=environ, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]

    target = _cells(out / "gpu_shapes_target.tar.gz", "gpu_shapes_target")
    for summary, _ in target:
        assert summary["status"] == "finished" and summary["cost_only"] and summary["pair"] == "shapes_llama31_8b_1b"
        assert isinstance(summary["limit_ratio"], float) and summary["limit_ratio"] > 0
    assert sorted((c["batch_size"], c["compile"]) for _, c in target) == [(1, False), (1, True), (2, False), (2, True)]

    pairs = _cells(out / "gpu_shapes_pairs.tar.gz", "gpu_shapes_pairs")
    assert all(s["status"] == "finished" and s["cost_only"] and s["limit_ratio"] > 0 for s, _ in pairs)
    assert sorted((s["pair"], c["batch_size"]) for s, c in pairs) == sorted(itertools.product(SHAPE_PAIRS, (1, 2)))
    assert all(s["predicted_grid"]["speedup"] for s, _ in pairs)

    figures = json.loads((out / "gpu_shapes_bench.json").read_text())
    assert figures["setup"]["pair"] == "shapes_llama2_7b_68m"
    assert figures["ratios"]["ours_spec_k1 / hf_assisted_k1"] > 0
    assert "ours_spec_k1 / hf_assisted_k1" in figures["same_output_as_hf"]
    assert "torch" in (out / "versions.txt").read_text() and (out / "gpu_check.log").stat().st_size > 0
