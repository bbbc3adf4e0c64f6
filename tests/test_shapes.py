"""Shape pairs: models of a named architecture with random weights, cost-only cells, the bandwidth limit."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

import harness.runner.cell as run
from harness.base import bandwidth
from harness.cli.summary import format_summary
from harness.config.checks import CONF_DIR
from harness.core.metrics import predicted_grid, predicted_speedup
from harness.errors import HarnessError
from harness.models.shapes import SHIPPED, ShapesTokenizer, random_model, shapes_config
from harness.runner.costs import step_bytes
from harness.runner.pair import loaded_pairs

CPU = torch.device("cpu")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_shipped_architectures_are_the_published_shapes():
    """The numbers behind the pairs: parameter counts of the published models, from the configs alone."""
    expected = {"llama2_7b": 6.74e9, "llama_68m": 6.8e7, "llama31_8b": 8.03e9, "llama32_1b": 1.24e9, "smollm2_135m": 1.35e8}
    for name, params in expected.items():
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(shapes_config(f"shapes:{name}"))
        count = sum(p.numel() for p in model.parameters())  # a tied LM head once
        assert count == pytest.approx(params, rel=0.02), name
    assert {p.stem for p in SHIPPED.glob("*.json")} >= set(expected)


def test_random_weights_are_seeded_and_leave_the_run_s_generator_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = random_model("shapes:llama_68m", CPU, torch.bfloat16, seed=0, overrides={**TINY, "vocab_size": 300})
    assert torch.equal(torch.random.get_rng_state(), before)
    b = random_model("shapes:llama_68m", CPU, torch.bfloat16, seed=0, overrides={**TINY, "vocab_size": 300})
    c = random_model("shapes:llama_68m", CPU, torch.bfloat16, seed=1, overrides={**TINY, "vocab_size": 300})
    assert a.dtype == torch.bfloat16 and a.config.num_hidden_layers == 2 and a.lm_head.weight.shape == (300, 64)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.generation_config.eos_token_id is None  # a cost-only run decodes every token asked for


def test_an_unknown_architecture_is_one_line():
    with pytest.raises(HarnessError, match=r"shapes:nope: no such architecture .*use one of .*llama2_7b"):
        shapes_config("shapes:nope")


def test_the_tokenizer_wraps_ids_into_the_model_s_vocabulary(tiny_pair):
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(tiny_pair["target"])
    wrapped = ShapesTokenizer(base, 7)
    ids = wrapped("hello there")["input_ids"]
    assert ids == [i % 7 for i in base("hello there")["input_ids"]] and max(ids) < 7
    assert len(wrapped) == 7 and wrapped.eos_token_id is None and wrapped.chat_template == base.chat_template


def test_the_grid_is_the_cost_model_at_each_rate_and_k():
    costs = {"cost_ratio": 0.2, "verify_cost": [1.0, 1.05, 1.1, 1.3, 1.6]}
    grid = predicted_grid(costs, alphas=(0.5, 0.9))
    assert grid["k"] == [1, 2, 3, 4]
    assert grid["speedup"][1][2] == predicted_speedup(0.9, 3, 0.2, 1.3)
    assert grid["best_k"] == [
        max(grid["k"], key=lambda k: predicted_speedup(a, k, 0.2, costs["verify_cost"][k])) for a in (0.5, 0.9)
    ]


def test_step_bytes_counts_weights_once_and_the_cache():
    untied = random_model("shapes:llama_68m", CPU, torch.float32, overrides={**TINY, "vocab_size": 300})
    tied = random_model("shapes:smollm2_135m", CPU, torch.float32, overrides={**TINY, "vocab_size": 300})
    params = lambda m: sum(p.numel() for p in m.parameters()) * 4  # noqa: E731  (each tensor once: tied counted once)
    kv = 2 * 2 * 2 * 16 * 10 * 3 * 4  # keys and values, 2 layers, 2 kv heads, head dim 16, 10 positions, 3 rows
    assert step_bytes(untied, 10, 3) == params(untied) - 300 * 64 * 4 + kv  # the input table is not read whole
    assert step_bytes(tied, 10, 3) == params(tied) + kv  # it is, as the LM head


def test_bandwidth_is_measured_once_and_a_noisy_probe_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_BANDWIDTH", str(tmp_path))
    monkeypatch.setattr(bandwidth, "COPY_BYTES", 2**20)
    identity = {"type": "cpu", "name": "Test CPU", "threads": 2}
    first = bandwidth.measured(CPU, identity)
    assert first["gb_per_s"] > 0 and len(first["samples"]) == bandwidth.REPS
    if first["source"] == "probed":
        assert bandwidth.measured(CPU, identity)["source"] == "stored"
    monkeypatch.setattr(bandwidth, "probe", lambda device: {"gb_per_s": 1.0, "spread": 2.0, "samples": [1.0], "bytes": 1})
    other = bandwidth.measured(CPU, {**identity, "threads": 4})
    assert other["source"].startswith("probed, not stored") and not (tmp_path / other["file"]).exists()
    assert bandwidth.limit_ratio(0.02, 1e9, 100.0) == pytest.approx(2.0)  # 20 ms against 10 ms to read 1 GB at 100 GB/s


@pytest.mark.parametrize("draft", ["model", "eagle3"])
def test_a_shape_pair_runs_cost_only(tmp_path, draft):
    """A tiny shape pair end to end: costs, v(n) up to 2k + 2, the limit and the grid are in the summary; the
    table prints no acceptance or speedup as a result."""
    head = {"draft_vocab_size": 100} if draft == "eagle3" else {}  # a head's own field
    overrides = [
        "+pair=shapes_llama31_8b_eagle3" if draft == "eagle3" else "+pair=shapes_llama2_7b_68m",
        f"+pair.target.config={json.dumps({**TINY, 'num_hidden_layers': 6, 'vocab_size': 400})}".replace('"', ""),
        f"+pair.draft.config={json.dumps({**TINY, 'num_hidden_layers': 1, 'vocab_size': 400, **head})}".replace('"', ""),
        "dataset.num_prompts=2",
        "max_new_tokens=6",
        "k=2",
        "cpu_linear=torch",
    ]
    loaded_pairs.clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = run.with_default_pair(compose(config_name="config", overrides=overrides))
    try:
        summary = run.run_cell(cfg, out_dir=tmp_path, quiet=True)
    finally:
        loaded_pairs.clear()
    assert "random weights" in summary["cost_only"] and len(summary["costs"]["verify_cost"]) == 2 * 2 + 2
    assert summary["predicted_grid"]["k"] == [1, 2, 3, 4, 5] and len(summary["predicted_grid"]["speedup"]) == 5
    limit = summary["costs"]["limit"]
    assert limit["target_limit_ratio"] == summary["limit_ratio"] > 0 and limit["draft_limit_ratio"] > 0
    assert summary["new_tokens"] == summary["base_new_tokens"] == 2 * 6  # no end-of-sequence: every token asked for
    table = format_summary(summary)
    assert (
        "COST-ONLY" in table
        and "predicted speedup by acceptance rate" in table
        and "acceptance rate" not in table.lower().split("cost-only")[1].split("predicted")[0]
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_hidden_layers": 0}, r"sizes that build no model \(num_hidden_layers=0\)"),
        ({"vocab_size": -5}, r"sizes that build no model \(vocab_size=-5\)"),
        ({"num_key_value_heads": 2}, r"num_attention_heads=9 not a multiple of num_key_value_heads=2"),
        ({"num_hidden_layer": 4}, r"no field num_hidden_layer in its config"),  # a typo
        ({"hidden_size": 63}, r"transformers refuses its config \(.*RoPE"),
    ],
)
def test_a_config_that_builds_no_model_is_one_line(overrides, message):
    with pytest.raises(HarnessError, match=message):
        random_model("shapes:smollm2_135m", CPU, torch.float32, overrides=overrides)


def _cell(overrides: list[str], out) -> dict:
    loaded_pairs.clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = run.with_default_pair(compose(config_name="config", overrides=overrides))
    try:
        return run.run_cell(cfg, out_dir=out, quiet=True)
    finally:
        loaded_pairs.clear()


def test_a_cost_only_cell_joins_the_real_weights_of_its_shapes(tmp_path, tiny_pair):
    """The report prices a real-weights draft's measured alpha at the costs of a cost-only cell of the same
    shapes (shapes:<its folder>), and of no cell of other shapes; the multirun table prints none of a
    cost-only cell's acceptance or speedup."""
    from analysis.report import DEFAULTS, build
    from harness.cli.callbacks import _row, to_markdown

    common = ["dataset.num_prompts=3", "max_new_tokens=8", "k=2", "cpu_linear=torch", "temperature=0"]
    real = _cell(
        ["+pair=smollm2", f"pair.target.id={tiny_pair['target']}", f"pair.draft.id={tiny_pair['draft']}", "pair.name=tiny"]
        + common,
        tmp_path / "out",
    )
    shaped = [
        "+pair=shapes_llama2_7b_68m",
        f"pair.target.id=shapes:{tiny_pair['target']}",
        f"pair.draft.id=shapes:{tiny_pair['draft']}",
    ]
    same = _cell(shaped + common, tmp_path / "out")
    other = _cell(shaped + ["+pair.target.config={num_hidden_layers:1}", "seed=1"] + common, tmp_path / "out")
    assert same["architectures"] == real["architectures"] != other["architectures"]

    document = build(tmp_path / "out", tmp_path / "report", {**DEFAULTS, "wandb_log": False, "n_resamples": 100})
    assert document["decisions"]  # the real cell is decided on; the cost-only ones are not in it
    joined = __import__("pandas").read_csv(tmp_path / "report" / "shapes_joined.csv")
    assert len(joined) == 1 and joined["costs_of"][0] == same["cell"]
    assert joined["cost_ratio"][0] == pytest.approx(same["cost_ratio"])
    assert joined["alpha"][0] == pytest.approx(real["alpha"], abs=1e-9)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "At real scale" in report and "predicted_at_scale.png" in report

    rows = [_row({"status": "finished", "cell": s["cell"], "cell_dir": s["cell_dir"]}) for s in (real, same)]
    table = to_markdown(rows).splitlines()
    assert "cost-only" not in table[2] and f"{real['speedup']:.3f}" in table[2]
    assert "cost-only" in table[3] and f"{same['speedup']:.3f}" not in table[3]


@pytest.mark.parametrize(
    "target, head, message",
    [
        (
            {**TINY, "vocab_size": 400},
            {**TINY, "num_hidden_layers": 1, "vocab_size": 400, "draft_vocab_size": 100},
            "target has 2",
        ),
        (
            {**TINY, "num_hidden_layers": 3, "vocab_size": 400},
            {**TINY, "num_hidden_layers": 1, "vocab_size": 400},
            "draft_vocab_size=32000",
        ),
    ],
)
def test_a_head_its_target_cannot_feed_is_one_line(target, head, message):
    from harness.models.shapes import random_head

    model = random_model("shapes:llama31_8b", CPU, torch.float32, overrides=target)
    with pytest.raises(HarnessError, match=message):
        random_head("shapes:eagle3_llama31_8b", "eagle3", model, torch.float32, overrides=head)
