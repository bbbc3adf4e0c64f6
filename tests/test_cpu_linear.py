"""harness.cpu_linear: a step's few rows through the linear layers as W @ x.T, and the
choice between that product and torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import cpu_linear
from harness.cpu_linear import TransposedLinear, choose, transposed_linear
from harness.draft_model import build_shared_draft
from harness.drafters import ModelDrafter
from harness.loop import autoregressive_decode, speculative_decode
from harness.models import CachedLM, ModelSpec, load_model
from harness.sampling import Sampling

CPU = torch.device("cpu")
GREEDY = Sampling(0.0)


def fresh(tiny_pair, role="target"):
    """A model of its own: choose() changes modules, which other tests' fixtures must not see."""
    return load_model(ModelSpec(str(tiny_pair[role])), CPU, role)


def linear_types(model) -> set[type]:
    return {type(m) for m in model.modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("rows", [1, 2, 5, cpu_linear.FEW_ROWS, cpu_linear.FEW_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_the_transposed_product_is_torch_s_up_to_rounding(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 48, generator=gen)  # [B, T, K]
    weight = torch.randn(40, 48, generator=gen)  # [N, K]
    b = torch.randn(40, generator=gen) if bias else None
    out = transposed_linear(x, weight, b)
    assert out.shape == (1, rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b))


def test_choosing_a_product_sets_every_linear_layer_and_keeps_the_logits(tiny_pair):
    target = fresh(tiny_pair)
    draft = build_shared_draft(target, 1, torch.arange(60))  # its subset head is not an nn.Linear: it has a flag
    ids = torch.arange(5, 17)[None]  # [1, 12]
    before = [m(ids).logits for m in (target, draft)]
    assert choose("transposed", [target, draft], CPU) == {"mode": "transposed", "product": "transposed"}
    assert linear_types(target) == {TransposedLinear} and draft.lm_head.transposed_product
    for model, logits in zip((target, draft), before):
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(model(ids[:, :1]).logits, logits[:, :1], rtol=1e-4, atol=1e-3)  # one row: padded to two
    assert choose("torch", [target, draft], CPU)["product"] == "torch"
    assert linear_types(target) == {nn.Linear} and not draft.lm_head.transposed_product


def test_greedy_speculation_with_the_transposed_product_is_the_target_s_greedy(tiny_pair):
    """The loop's exactness does not depend on the product: greedy speculative tokens are the
    target-only greedy tokens, and the same as with torch's product on this pair."""
    target, draft = fresh(tiny_pair), fresh(tiny_pair, "draft")
    prompt = torch.arange(5, 25)

    def tokens():
        base = list(autoregressive_decode(CachedLM(target, 98), prompt, GREEDY, 30, set(), torch.Generator()))
        cycles = speculative_decode(CachedLM(target, 98), ModelDrafter(CachedLM(draft, 98)), prompt, 4, GREEDY, 30, set(),
                                    torch.Generator())
        return base, [t for c in cycles for t in c.tokens]

    torch_base, torch_spec = tokens()
    choose("transposed", [target, draft], CPU)
    base, spec = tokens()
    assert spec == base == torch_base == torch_spec and len(base) == 30


def test_auto_times_a_step_through_every_layer_and_keeps_the_faster(tiny_pair, monkeypatch):
    target = fresh(tiny_pair)
    layers = cpu_linear._linears([target, target])  # a module shared by two models counts once
    assert len(layers) == sum(isinstance(m, nn.Linear) for m in target.modules())
    calls = []
    monkeypatch.setattr(cpu_linear, "transposed_linear", lambda x, w: calls.append(w) or F.linear(x, w))
    monkeypatch.setattr(cpu_linear, "_median_ms", lambda fn, reps: fn() and 1.0)  # one pass each
    found = cpu_linear.probe([target])
    assert found["torch_ms"] == found["transposed_ms"] == [1.0] * len(cpu_linear.PROBE_ROWS)
    assert [id(w) for w in calls] == [id(layer.weight) for layer in layers] * len(cpu_linear.PROBE_ROWS)  # every weight, once a pass
    monkeypatch.setattr(cpu_linear, "PROBE_BYTES", -(-sum(l.weight.numel() * 4 for l in layers) // 3))  # a cap: every 3rd, scaled up
    calls.clear()
    found = cpu_linear.probe([target], rows=(1,))
    assert len(calls) == len(layers[::3]) and found["torch_ms"][0] == pytest.approx(
        sum(l.weight.numel() for l in layers) / sum(l.weight.numel() for l in layers[::3]))
    monkeypatch.undo()

    record = choose("auto", [target], CPU)  # measured: whichever is faster by the margin
    probe = record["probe"]
    faster = sum(probe["transposed_ms"]) < cpu_linear.MARGIN * sum(probe["torch_ms"])
    assert record["product"] == ("transposed" if faster else "torch")
    assert linear_types(target) == {TransposedLinear if faster else nn.Linear}

    slow = cpu_linear.transposed_linear  # a transposed product made slow must lose
    monkeypatch.setattr(cpu_linear, "transposed_linear", lambda *a: (torch.ones(20_000, 2000).sum(), slow(*a))[1])
    assert choose("auto", [target], CPU)["product"] == "torch" and linear_types(target) == {nn.Linear}


def test_off_the_cpu_nothing_is_timed_or_changed(tiny_pair):
    target = fresh(tiny_pair)
    record = choose("auto", [target], torch.device("cuda"))
    assert record["product"] == "torch" and "probe" not in record and linear_types(target) == {nn.Linear}
