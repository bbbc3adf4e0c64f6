"""Every config in conf/ composes, and the card's command line works as written."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.config.checks import CONF_DIR, validate, with_default_pair
from harness.runner.cell import cell_key

PAIRS = sorted(p.stem for p in (CONF_DIR / "pair").glob("*.yaml"))
PUBLISHED = {
    "llama_7b_68m": ("meta-llama/Llama-2-7b-hf", "JackFram/llama-68m"),
    "vicuna_7b_68m": ("lmsys/vicuna-7b-v1.3", "double7/vicuna-68m"),
    "llama31_8b_32_1b": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    "qwen25_7b_05b": ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
}


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("pair", PAIRS)
def test_every_pair_composes(pair):
    cfg = with_default_pair(composed([f"+pair={pair}"]))
    OmegaConf.resolve(cfg)
    validate(cfg)
    assert cfg.pair.name == pair
    assert cfg.pair.target.id and cfg.pair.draft.kind in ("model", "ngram")
    assert cell_key(cfg).startswith(pair)


def test_commands_started_in_the_same_second_get_folders_of_their_own():
    """One `python -m harness -m ...` per GPU, started by a loop: a shared sweep folder would mix their
    job folders and aggregate tables (each multirun clears the pointers it finds there)."""
    folders = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for _ in range(2):
            hydra = compose(config_name="config", return_hydra_config=True).hydra
            folders.append((hydra.sweep.dir, hydra.run.dir))
            time.sleep(0.002)
    assert folders[0][0] != folders[1][0] and folders[0][1] != folders[1][1]
    assert re.fullmatch(r"multirun/\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}\.\d{6}", folders[0][0])


def test_published_pairs_name_real_hub_ids():
    for name, (target, draft) in PUBLISHED.items():
        cfg = composed([f"+pair={name}"])
        assert (cfg.pair.target.id, cfg.pair.draft.id) == (target, draft)


def test_no_pair_means_the_embedded_default():
    cfg = with_default_pair(composed([]))
    assert cfg.pair.name == "smollm2" and cfg.pair.target.id == "embedded:smollm2"


def test_card_command_composes():
    cfg = composed(["+pair=llama_7b_68m", "k=4"])
    assert cfg.k == 4 and cfg.pair.target.id == "meta-llama/Llama-2-7b-hf"


def test_sampling_overrides_compose():
    cfg = composed(["k=8", "temperature=0.7", "top_k=50", "top_p=0.9", "max_new_tokens=16", "seed=3", "device=cpu", "dtype=float32"])
    validate(with_default_pair(cfg))
    assert (cfg.k, cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_new_tokens, cfg.seed) == (8, 0.7, 50, 0.9, 16, 3)
    assert cfg.pair.target.dtype == "float32"  # the pair follows the top-level dtype


def test_cell_key_changes_with_what_changes_results():
    base = with_default_pair(composed([]))
    assert cell_key(base) == cell_key(with_default_pair(composed(["out_dir=/elsewhere", "force=true"])))
    assert cell_key(base) != cell_key(with_default_pair(composed(["seed=1"])))
    assert cell_key(base) != cell_key(with_default_pair(composed(["temperature=1.0"])))


@pytest.mark.parametrize("dataset", ["local", "mt_bench"])  # a hub set read from a local copy too
def test_cell_key_changes_when_a_local_prompt_file_is_edited(tmp_path, dataset):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question_id": 1, "category": "qa", "turns": ["What is 2 + 2?"]}\n')

    def key():
        return cell_key(with_default_pair(composed([f"dataset={dataset}", f"dataset.path={data}"])))

    before = key()
    assert key() == before
    data.write_text('{"question_id": 1, "category": "qa", "turns": ["What is 3 + 3?"]}\n')
    assert key() != before


def test_cell_key_hashes_the_device_and_dtype_as_they_resolve(monkeypatch):
    """device=auto / dtype=auto are keyed as what they resolve to: a CPU and a GPU process sharing
    out_dir get different cells, and writing out what auto resolves to names the same cell."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    auto, cpu = with_default_pair(composed([])), torch.device("cpu")
    assert cell_key(auto, cpu) == cell_key(with_default_pair(composed(["device=cpu", "dtype=float32"])), cpu)
    on_gpu = cell_key(auto, torch.device("cuda"))
    assert on_gpu != cell_key(auto, cpu)
    assert on_gpu == cell_key(with_default_pair(composed(["device=cuda:1", "dtype=bfloat16"])), torch.device("cuda:1"))
    assert on_gpu != cell_key(with_default_pair(composed(["+pair=smollm2", "pair.target.dtype=float16"])), torch.device("cuda"))  # a pinned dtype
    assert on_gpu == cell_key(with_default_pair(composed(["cpu_linear=torch"])), torch.device("cuda"))  # CPU only: not keyed on a GPU
    assert cell_key(auto, cpu) != cell_key(with_default_pair(composed(["cpu_linear=torch"])), cpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert cell_key(auto, torch.device("cuda")) != on_gpu  # another GPU model: another cell


def test_cell_key_hashes_the_cpu_model_and_threads(monkeypatch):
    """CPU timings depend on the processor and torch's threads as a GPU's on its model: a cell
    measured on one CPU or thread count is not taken as done on another."""
    import torch

    import harness.runner.cell as run

    cfg, cpu = with_default_pair(composed(["device=cpu"])), torch.device("cpu")
    monkeypatch.setattr(run, "device_name", lambda device: "Intel(R) Xeon(R) Processor")
    intel = cell_key(cfg, cpu)
    monkeypatch.setattr(run, "device_name", lambda device: "AMD EPYC")
    amd = cell_key(cfg, cpu)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        more_threads = cell_key(cfg, cpu)
    finally:
        torch.set_num_threads(threads)
    assert len({intel, amd, more_threads}) == 3 and cell_key(cfg, cpu) == amd


@pytest.mark.parametrize("override, message", [
    ("dataset.max_rows=all", "dataset.max_rows=all must be a positive integer or null"),
    ("dataset.max_rows=0", "dataset.max_rows=0 must be a positive integer or null"),
    ("dataset.max_rows=true", "dataset.max_rows=True must be a positive integer or null"),
    ("dataset.streaming=maybe", "dataset.streaming=maybe must be true or false"),
    ("dataset.streaming=1", "dataset.streaming=1 must be true or false"),
])
def test_dataset_rows_and_streaming_are_validated(override, message):
    from harness.errors import HarnessError

    with pytest.raises(HarnessError, match=re.escape(message)):
        validate(with_default_pair(composed([override])))
    for fine in (["dataset.max_rows=null", "dataset.streaming=true"], ["dataset.max_rows=100"]):
        validate(with_default_pair(composed(fine)))


def test_cfg_job_prints_both_model_ids():
    out = subprocess.run(
        [sys.executable, "-m", "harness", "+pair=llama_7b_68m", "k=4", "--cfg", "job"],
        capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "meta-llama/Llama-2-7b-hf" in out.stdout and "JackFram/llama-68m" in out.stdout
    assert "k: 4" in out.stdout


def test_prompt_selection_is_balanced_and_seeded():
    from harness.data.prompts import load_builtin, select

    prompts = load_builtin()
    assert len(prompts) >= 48 and len({p["category"] for p in prompts}) >= 6
    first = select(prompts, 12, seed=0, shuffle=False)
    assert sorted({p["category"] for p in first}) == ["code", "conversation", "math", "qa", "summarization", "translation"]
    assert all(sum(p["category"] == c for p in first) == 2 for c in {p["category"] for p in first})
    assert select(prompts, 12, 5, True) == select(prompts, 12, 5, True)
    assert select(prompts, 12, 5, True) != select(prompts, 12, 6, True)
    assert len(select(prompts, None, 0, False)) == len(prompts)


@pytest.mark.parametrize("override, message", [
    ("top_k=true", "top_k=True must be an integer >= 0"),  # a bool is an int to Python: it would sample top-1
    ("temperature=true", "temperature=True must be a number from 0"),
    ("top_p=true", "top_p=True must be in (0, 1]"),
    ("seed=20000000000000", "seed=20000000000000 must be an integer from 0 to 18446688732643"),  # crashed after loading
    ("k=abc", "k=abc must be a positive integer"),  # messages are made before the checks: they crashed on it
    ("k=null", "k=None must be a positive integer"),
    ("max_new_tokens=abc", "max_new_tokens=abc must be a positive integer"),
    ("device=0", "device=0 must be auto, cpu, cuda or cuda:N"),  # resolve_device crashed on a number
    ("device=null", "device=None must be auto, cpu, cuda or cuda:N"),
])
def test_bools_and_overflowing_seeds_are_refused_before_loading(override, message):
    from harness.errors import HarnessError

    with pytest.raises(HarnessError, match=re.escape(message)):
        validate(with_default_pair(composed([override])))


def test_the_largest_seed_seeds_every_prompt():
    import torch

    from harness.config.checks import MAX_SEED, PROMPT_SEED_STRIDE

    validate(with_default_pair(composed([f"seed={MAX_SEED}"])))
    torch.Generator().manual_seed(MAX_SEED * PROMPT_SEED_STRIDE + 10**9)


def test_compile_refuses_a_k_whose_verify_would_run_eagerly():
    """CachedLM compiles steps of up to COMPILED_MAX_TOKENS positions and runs longer ones eagerly: a
    compiled run at k=16 timed its full verifies eager while its cell said compile=true."""
    from harness.errors import HarnessError
    from harness.models.cached import CachedLM

    top = CachedLM.COMPILED_MAX_TOKENS - 1
    validate(with_default_pair(composed(["cache=static", "compile=true", f"k={top}"])))
    validate(with_default_pair(composed(["cache=static", f"k={top + 1}"])))  # eager: any k
    with pytest.raises(HarnessError, match=re.escape(f"k={top + 1} with compile=true: compiled steps take at most {top + 1} "
                                                     f"positions and a verify takes k + 1 = {top + 2}, which would run eagerly")):
        validate(with_default_pair(composed(["cache=static", "compile=true", f"k={top + 1}"])))
