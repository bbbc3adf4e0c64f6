"""Every config in conf/ composes against the schema, the documented command line works as written, and a
setting refused is one line: by Hydra's composition (its type) or by validate (its range)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.config.checks import CONF_DIR, check_command_line, validate, with_default_pair
from harness.config.settings import DRAFT_KINDS
from harness.errors import HarnessError
from harness.runner.store import cell_key

PAIRS = sorted(p.stem for p in (CONF_DIR / "pair").glob("*.yaml"))
PUBLISHED = {
    "llama_7b_68m": ("meta-llama/Llama-2-7b-hf", "JackFram/llama-68m"),
    "vicuna_7b_68m": ("lmsys/vicuna-7b-v1.3", "double7/vicuna-68m"),
    "llama31_8b_32_1b": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    "qwen25_7b_05b": ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    "vicuna_7b_eagle": ("lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3"),
    "llama31_8b_eagle3": ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
}


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def refusal(overrides: list[str]) -> str:
    """The one line a command line is refused with: by Hydra's composition against the schema (a
    type, a name), else by validate (a range)."""
    with pytest.raises(HarnessError) as err:
        check_command_line(overrides)
        validate(with_default_pair(composed(overrides)))
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("pair", PAIRS)
def test_every_pair_composes(pair):
    cfg = with_default_pair(composed([f"+pair={pair}"]))
    OmegaConf.resolve(cfg)
    validate(cfg)
    assert cfg.pair.name == pair
    assert cfg.pair.target.id and cfg.pair.draft.kind in DRAFT_KINDS
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
    assert cfg.pair.name == "smollm2_eagle" and cfg.pair.target.id == "embedded:smollm2"


def test_documented_command_composes():
    cfg = composed(["+pair=llama_7b_68m", "k=4"])
    assert cfg.k == 4 and cfg.pair.target.id == "meta-llama/Llama-2-7b-hf"


def test_sampling_overrides_compose():
    cfg = composed(
        ["k=8", "temperature=0.7", "top_k=50", "top_p=0.9", "max_new_tokens=16", "seed=3", "device=cpu", "dtype=float32"]
    )
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
    assert on_gpu != cell_key(
        with_default_pair(composed(["+pair=smollm2", "pair.target.dtype=float16"])), torch.device("cuda")
    )  # a pinned dtype
    assert on_gpu == cell_key(
        with_default_pair(composed(["cpu_linear=torch"])), torch.device("cuda")
    )  # CPU only: not keyed on a GPU
    assert cell_key(auto, cpu) != cell_key(with_default_pair(composed(["cpu_linear=torch"])), cpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert cell_key(auto, torch.device("cuda")) != on_gpu  # another GPU model: another cell


def test_cell_key_hashes_the_cpu_model_and_threads(monkeypatch):
    """CPU timings depend on the processor and torch's threads as a GPU's on its model: a cell
    measured on one CPU or thread count is not taken as done on another."""
    import torch

    import harness.base.device as run

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


@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset.max_rows=all", "dataset.max_rows=all must be a positive integer or null"),
        ("dataset.max_rows=0", "dataset.max_rows=0 must be a positive integer or null"),
        ("dataset.max_rows=true", "dataset.max_rows=True must be a positive integer or null"),
        ("dataset.streaming=maybe", "dataset.streaming=maybe must be true or false"),
        ("dataset.streaming=1.5", "dataset.streaming=1.5 must be true or false"),
    ],
)
def test_dataset_rows_and_streaming_are_validated(override, message):
    assert message in refusal([override])
    for fine in (["dataset.max_rows=null", "dataset.streaming=true"], ["dataset.max_rows=100"]):
        check_command_line(fine)
        validate(with_default_pair(composed(fine)))


@pytest.mark.parametrize(
    "override, value",
    [
        ("dataset.streaming=no", False),
        ("dataset.streaming=1", True),
        ("force=off", False),
        ("prompts.shuffle=yes", True),
        ("compile=0", False),
    ],
)
def test_a_switch_written_as_a_word_or_a_number_is_a_bool(override, value):
    """The schema types each switch: Hydra's string `off` (truthy) would have redone every cell."""
    key = override.partition("=")[0]
    assert OmegaConf.select(composed([override]), key) is value


@pytest.mark.cli
def test_cfg_job_prints_both_model_ids():
    out = subprocess.run(
        [sys.executable, "-m", "harness", "+pair=llama_7b_68m", "k=4", "--cfg", "job"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=120,
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


@pytest.mark.parametrize(
    "override, message",
    [
        ("top_k=true", "top_k=True must be an integer >= 0"),  # a bool is an int to Python: it would sample top-1
        ("top_k=1.5", "top_k=1.5 must be an integer >= 0"),
        ("temperature=true", "temperature=True must be a number from 0"),
        ("top_p=true", "top_p=True must be in (0, 1]"),
        ("top_p=2", "top_p=2.0 must be in (0, 1]"),
        ("seed=20000000000000", "seed=20000000000000 must be an integer from 0 to 18446688732643"),  # crashed after loading
        ("k=abc", "k=abc must be a positive integer"),
        ("k=null", "k=None must be a positive integer"),
        ("max_new_tokens=abc", "max_new_tokens=abc must be a positive integer"),
        ("device=0", "device=0 must be auto, cpu, cuda or cuda:N"),  # resolve_device crashed on a number
        ("device=null", "device=None must be auto, cpu, cuda or cuda:N"),
        ("force=maybe", "force=maybe must be true or false"),
        ("pair.draft.length=longest", "pair.draft.length=longest must be match"),
        ("pair.draft.length=cost_aware", "pair.draft.length=cost_aware is draft_length=cost now"),
    ],
)
def test_bools_and_overflowing_seeds_are_refused_before_loading(override, message):
    overrides = ["+pair=smollm2_ngram", override] if override.startswith("pair.") else [override]
    assert message in refusal(overrides)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["temprature=1"], "unknown setting 'temprature': did you mean temperature?"),
        (["+pair=smolm2"], "unknown pair 'smolm2': did you mean +pair=smollm2?"),
        (["dataset=nope"], "unknown dataset 'nope': available: builtin, cnn_dailymail, gsm8k,"),
        (["-m", "k=1,x"], "k=x must be a positive integer"),  # each swept value is composed
        (["-m", "+pair=smollm2_ngram", "pair.draft.max_ngram=2,x"], "pair.draft.max_ngram=x must be an integer"),
        (["exactness.samples=10"], "unknown setting 'exactness.samples'"),  # another entry point's section
        (["wandb.tags=x"], "wandb.tags=x"),
    ],
)
def test_hydra_decides_and_the_check_says_it_in_one_line(argv, message):
    assert message in refusal(argv)


def test_the_exactness_config_extends_the_schema_with_its_section():
    import harness.exactness.main  # noqa: F401 - registers exactness_check

    check_command_line(["exactness.samples=40", "exactness.alpha=0.01"], config_name="exactness_check")
    with pytest.raises(HarnessError, match=r"exactness.samples=abc must be an integer"):
        check_command_line(["exactness.samples=abc"], config_name="exactness_check")
    with pytest.raises(
        HarnessError, match=r"did you mean exactness.num_prompts\? exactness has alpha, detect_tv, length, max_cells"
    ):
        check_command_line(["exactness.num_promts=1"], config_name="exactness_check")


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF_DIR / "dataset").glob("*.yaml")))
def test_every_prompt_set_is_typed_by_the_schema(option):
    from harness.config.settings import HubPromptSet, LocalPromptSet, PromptSet

    schema = OmegaConf.get_type(composed([f"dataset={option}"]).dataset)
    assert schema is {"builtin": PromptSet, "local": LocalPromptSet}.get(option, HubPromptSet)


def test_the_default_pair_is_typed_as_a_chosen_one():
    from harness.config.settings import EmbeddedPair, LookupPair

    assert OmegaConf.get_type(with_default_pair(composed([])).pair) is EmbeddedPair
    assert OmegaConf.get_type(composed(["+pair=smollm2_ngram"]).pair) is LookupPair
    with pytest.raises(HarnessError, match="default_pair=nope has no conf/pair/nope.yaml"):
        with_default_pair(composed(["default_pair=nope"]))


def test_the_largest_seed_seeds_every_prompt():
    import torch

    from harness.config.settings import MAX_SEED, PROMPT_SEED_STRIDE

    validate(with_default_pair(composed([f"seed={MAX_SEED}"])))
    torch.Generator().manual_seed(MAX_SEED * PROMPT_SEED_STRIDE + 10**9)


def test_compile_refuses_a_k_whose_verify_would_run_eagerly():
    """CachedLM compiles steps of up to COMPILED_MAX_TOKENS positions and runs longer ones eagerly: a
    compiled run at k=16 timed its full verifies eager while its cell said compile=true."""
    from harness.models.cached import CachedLM

    top = CachedLM.COMPILED_MAX_TOKENS - 1
    validate(with_default_pair(composed(["cache=static", "compile=true", f"k={top}"])))
    validate(with_default_pair(composed(["cache=static", f"k={top + 1}"])))  # eager: any k
    with pytest.raises(
        HarnessError,
        match=re.escape(
            f"k={top + 1} with compile=true: compiled steps take at most {top + 1} "
            f"positions and a verify takes k + 1 = {top + 2}, which would run eagerly"
        ),
    ):
        validate(with_default_pair(composed(["cache=static", "compile=true", f"k={top + 1}"])))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["draft_length=confidence", "draft_length.threshold=1.5"],
            r"draft_length.threshold=1.5 must be a number in \(0, 1\) or auto",
        ),
        (["draft_length=confidence", "+pair=smollm2_ngram"], "draft_length=confidence needs the draft's probabilities"),
        (
            ["draft_length=by_batch", "draft_length.table={1: -2}"],
            r"draft_length.table=\{1: -2, 8: 2, 32: 0\} must map batch sizes",
        ),
        (["draft_length=constant", "draft_length.policy=longest"], "draft_length=longest must be one of constant, heuristic"),
    ],
)
def test_a_draft_length_that_cannot_apply_is_one_line(overrides, message):
    cfg = with_default_pair(composed(overrides))
    with pytest.raises(HarnessError, match=message):
        validate(cfg)


def test_a_draft_length_policy_is_its_own_cell_and_constant_the_old_one():
    constant, cost = (cell_key(with_default_pair(composed([f"draft_length={p}"]))) for p in ("constant", "cost"))
    assert cell_key(with_default_pair(composed([]))) == constant and "-cost-" in cost and constant != cost


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tree=[3,0]"], r"tree=\[3, 0\] must be a list of children per depth, integers >= 1"),
        (["tree=wide"], "tree=wide must be a list of children per depth"),
        (["tree=[2,1]", "batch_size=4"], r"tree=\[2, 1\]: token trees run at batch_size=1"),
        (["tree=[2,1]", "+pair=smollm2_ngram"], "prompt lookup proposes one match, not a tree"),
        (["tree=[2,1]", "compile=true"], "token trees run eager steps"),
        (["tree=[2,1]", "draft_length=cost"], "a tree's depth is k"),
        (["tree=dynamic", "tree_candidates=sampled"], "a dynamic tree keeps the draft's best candidates"),
        (["tree=dynamic", "tree_nodes=0"], "tree_nodes=0 and tree_topk=4 must be >= 1"),
        (["tree_candidates=all"], "tree_candidates=all must be top"),
    ],
)
def test_a_tree_that_cannot_run_is_one_line(overrides, message):
    cfg = with_default_pair(composed(overrides))
    with pytest.raises(HarnessError, match=message):
        validate(cfg)


def test_a_tree_is_its_own_cell_and_a_chain_the_old_one():
    keys = {tree: cell_key(with_default_pair(composed([f"tree={tree}", "k=3"]))) for tree in ("null", "[3,2,1]", "dynamic")}
    assert keys["null"] == cell_key(with_default_pair(composed(["k=3"])))
    assert "-tree3x2x1-" in keys["[3,2,1]"] and "-treedyn8-" in keys["dynamic"] and len(set(keys.values())) == 3
