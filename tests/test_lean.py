"""forward=lean (harness/lean.py): HF's logits, the loop's tokens, refusals, and exactness."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import FAMILY_ALPHA, TINY_CHECK, compose_check, missing_rollback_report, tiny_cached_pair, tiny_config, tiny_model
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict
from transformers import DynamicCache, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import harness.models.kv_store
from harness.config.checks import CONF_DIR, validate, with_default_pair
from harness.core.loop import speculative_decode
from harness.core.sampling import Sampling
from harness.errors import HarnessError
from harness.exactness.main import format_report, run_check
from harness.models.cached import CachedLM
from harness.models.lean import LeanLlama
from harness.runner.store import cell_key

VOCAB = 98


def llama(**settings) -> LlamaForCausalLM:
    """A tiny Llama model with HF's own initialisation (scale 1.0: no peaked head)."""
    return tiny_model(LlamaForCausalLM, VOCAB, seed=0, scale=1.0, max_position_embeddings=1024, **settings)


def qwen() -> Qwen2ForCausalLM:
    """Another architecture than Llama's."""
    return Qwen2ForCausalLM(tiny_config(Qwen2Config, VOCAB, layers=1)).eval()


def hf_steps(model, chunks: list[torch.Tensor], crops: dict[int, int]) -> list[torch.Tensor]:
    """HF's own forward over chunks of ids with a DynamicCache; crops[i]: tokens dropped after chunk i."""
    cache, out = DynamicCache(config=model.config), []
    with torch.inference_mode():
        for i, chunk in enumerate(chunks):
            out.append(model(input_ids=chunk[None], cache=cache, use_cache=True).logits[0])
            if i in crops:
                cache.crop(-crops[i])
    return out


def lean_steps(lm: CachedLM, chunks: list[torch.Tensor], crops: dict[int, int]) -> list[torch.Tensor]:
    out = []
    lm.reset()
    for i, chunk in enumerate(chunks):
        out.append(lm.forward(chunk, num_logits=chunk.shape[0]))
        if i in crops:
            lm.rollback(lm.length - crops[i])
    return out


CHUNKS = [torch.arange(3, 13), torch.tensor([20]), torch.tensor([30, 31, 32]), torch.tensor([40, 41]), torch.tensor([50])]
CROPS = {2: 2, 3: 1}  # a verify of 3 with 2 rejected, then one of 2 with 1 rejected


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"attention_bias": True, "mlp_bias": True},
        {"num_key_value_heads": 4},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ],
    ids=["gqa", "biases", "mha", "scaled-rope"],
)
def test_lean_logits_are_hfs_through_prompt_steps_verifies_and_rollbacks(settings):
    model = llama(**settings)
    expected = hf_steps(model, CHUNKS, CROPS)
    lm = CachedLM(model, VOCAB, forward="lean")
    assert lm.lean is not None
    for got, want in zip(lean_steps(lm, CHUNKS, CROPS), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert lm.length == 10 + 1 + 3 - 2 + 2 - 1 + 1


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-3), (torch.float16, 1e-4)], ids=["bf16", "fp16"])
def test_lean_rounds_the_norms_as_hf_does_in_16_bit(dtype, tolerance):
    """HF's RMSNorm normalises in float32, casts, then scales in 16 bits. Scaled inside one
    rounding instead, these logits moved by 5e-3 (bf16) and 6e-4 to 1e-3 (fp16) of the largest
    one; rounded as HF rounds, they were HF's bits here. Norm weights away from 1, where the
    order of the scaling shows."""
    model = llama()
    torch.manual_seed(1)
    for name, weight in model.named_parameters():
        if "norm" in name:
            weight.data.normal_(1.0, 0.5)
    model = model.to(dtype)
    expected = hf_steps(model, CHUNKS, CROPS)
    got = lean_steps(CachedLM(model, VOCAB, forward="lean"), CHUNKS, CROPS)
    scale = max(want.float().abs().max().item() for want in expected)
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, expected, strict=True))
    assert worst <= tolerance * scale


def test_fused_weights_are_views_and_hfs_forward_is_unchanged():
    """The bench's HF contenders run the same modules on the same memory."""
    model = llama()
    before = hf_steps(model, CHUNKS, CROPS)
    lean = LeanLlama(model)
    (qkv, _), (gate_up, _) = lean.fused[0]
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.k_proj.weight.data_ptr() == qkv[attn.q_proj.weight.shape[0] :].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gate_up[mlp.gate_proj.weight.shape[0] :].data_ptr()
    for got, want in zip(hf_steps(model, CHUNKS, CROPS), before, strict=True):
        assert torch.equal(got, want)
    assert LeanLlama(model).fused is lean.fused  # fused once per model


def test_storage_grows_past_what_was_reserved():
    model = llama()
    ids = torch.arange(300) % VOCAB
    chunks = [ids[:250], ids[250:251], *ids[251:300].split(7)]  # past ROOM = 256 positions mid-sequence
    lm = CachedLM(model, VOCAB, forward="lean")
    lm.reserve(10)
    assert lm.lean.capacity == harness.models.kv_store.ROOM
    for got, want in zip(lean_steps(lm, chunks, {}), hf_steps(model, chunks, {}), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert lm.lean.capacity >= 300


def test_a_copy_writes_storage_of_its_own():
    """The draft-is-target control drafts with a copy of the target, and the bench times one."""
    model = llama()
    lm = CachedLM(model, VOCAB, forward="lean")
    other = copy.copy(lm)
    assert (
        other.lean is not lm.lean and other.lean.store.keys[0] is not lm.lean.store.keys[0] and other.lean.fused is lm.lean.fused
    )
    lm.forward(CHUNKS[0])
    other.forward(torch.arange(50, 60))  # would overwrite lm's positions if shared
    torch.testing.assert_close(lm.forward(CHUNKS[1]), hf_steps(model, CHUNKS[:2], {})[1], rtol=1e-5, atol=1e-5)


def test_forward_pre_hooks_see_each_lean_pass():
    """The bench counts target passes with a pre-hook on the model."""
    model = llama()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    lm = CachedLM(model, VOCAB, forward="lean")
    calls.clear()  # the load check ran HF's forward twice
    lean_steps(lm, CHUNKS, CROPS)
    assert len(calls) == len(CHUNKS)


@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(1.0, top_k=5)], ids=["greedy", "sampled"])
def test_the_loop_commits_the_same_tokens_with_either_forward(tiny_pair, sampling):
    def run(forward):
        lm, drafter, _ = tiny_cached_pair(tiny_pair, forward)
        tokens = []
        for prompt in ([1, 40, 60, 70, 80, 90], [1, 33, 34]):
            gen = torch.Generator().manual_seed(7)
            for cycle in speculative_decode(lm, drafter, torch.tensor(prompt), 3, sampling, 24, set(), gen):
                tokens += cycle.tokens
        return tokens

    assert run("lean") == run("hf")


def test_other_architectures_are_refused_in_one_line():
    other = qwen()
    with pytest.raises(
        HarnessError, match=r"forward=lean runs Llama-architecture models only: Qwen2ForCausalLM .*use forward=hf"
    ):
        CachedLM(other, VOCAB, forward="lean")
    assert CachedLM(other, VOCAB).lean is None  # forward=hf (the default) runs it


def test_a_forward_that_differs_from_hfs_is_refused(monkeypatch):
    """The load check: here the lean forward forgets RoPE."""
    monkeypatch.setattr(harness.models.lean, "rotate", lambda x, cos, sin: x)
    with pytest.raises(HarnessError, match=r"forward=lean does not reproduce LlamaForCausalLM's logits .*use forward=hf"):
        CachedLM(llama(), VOCAB, forward="lean")


def test_lean_needs_the_dynamic_cache_and_eager_steps():
    with pytest.raises(HarnessError, match="forward=lean keeps KV storage of its own"):
        CachedLM(llama(), VOCAB, cache="static", forward="lean")


def test_auto_is_lean_where_it_runs_and_hfs_forward_elsewhere(monkeypatch, capsys):
    """forward=auto (the default): lean for a Llama model on the CPU with the dynamic cache, eager;
    HF's forward, without a word, for another architecture or a static cache, and with a warning
    for a Llama model whose logits the lean forward would not reproduce."""
    assert CachedLM(llama(), VOCAB, forward="auto").lean is not None
    other = qwen()
    assert CachedLM(other, VOCAB, forward="auto").lean is None
    assert CachedLM(llama(), VOCAB, cache="static", forward="auto").lean is None
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(harness.models.lean, "rotate", lambda x, cos, sin: x)
    model = llama()
    expected = model(input_ids=torch.arange(3, 13)[None]).logits[0, -1]
    lm = CachedLM(model, VOCAB, forward="auto")
    assert lm.lean is None and "warning: forward=auto runs HF's forward for LlamaForCausalLM" in capsys.readouterr().err
    lm.reset()
    assert torch.allclose(lm.forward(torch.arange(3, 13))[0], expected, atol=1e-5)  # HF's modules, on the fused views


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = with_default_pair(compose(config_name="config", overrides=list(overrides)))
    OmegaConf.resolve(cfg)
    return cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["forward=fast"], "forward=fast must be auto, hf or lean"),
        (["forward=lean", "cache=static"], "forward=lean keeps KV storage of its own: use cache=dynamic"),
        (["forward=lean", "cache=static", "compile=true"], "forward=lean keeps KV storage of its own: use cache=dynamic"),
        (["forward=hf", "compile=true"], "compile=true on HF's forward needs fixed shapes: add cache=static"),
    ],
)
def test_bad_forward_settings_are_one_line(overrides, message):
    with pytest.raises(HarnessError, match=message):
        validate(composed(*overrides))


def test_hfs_forward_keeps_the_cells_it_had_and_lean_and_auto_get_their_own(monkeypatch):
    plain = composed("forward=hf")
    validate(composed("forward=lean"))
    without = copy.deepcopy(plain)
    with open_dict(without):
        del without["forward"]  # a config from before the setting existed
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert cell_key(plain, cpu) == cell_key(without, cpu)
    assert len({cell_key(composed(f"forward={f}"), cpu) for f in ("hf", "lean", "auto")}) == 3
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert cell_key(composed("forward=auto"), gpu) == cell_key(plain, gpu)  # off the CPU auto is HF's forward


# ---------------------------------------------------------------- exactness with the lean forward


def test_exactness_check_passes_with_the_lean_forward(tiny_pair, tmp_path):
    cfg = compose_check(tiny_pair, tmp_path, "forward=lean", *TINY_CHECK)
    report = run_check(cfg, quiet=True)
    assert report["passed"], format_report(report)
    assert json.loads((tmp_path / report["run_dir"].split("/")[-1] / "exactness.json").read_text())["passed"]


def test_exactness_check_catches_a_missing_rollback_with_the_lean_forward(tiny_pair):
    """The same check, shown to fail: lean storage that is not rolled back (stale keys, shifted positions)."""
    report = missing_rollback_report(tiny_pair, "lean")
    assert report["testable"] and report["family_p"] < FAMILY_ALPHA, format_report(report)
