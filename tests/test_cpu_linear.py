"""harness.models.cpu_linear: a step's few rows through the linear layers as W @ x.T, and the
choice between that product and torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.core.drafters import ModelDrafter
from harness.core.loop import autoregressive_decode, speculative_decode
from harness.core.sampling import Sampling
from harness.errors import HarnessError
from harness.models import cpu_linear
from harness.models.cached import CachedLM
from harness.models.cpu_linear import TransposedLinear, choose, transposed_linear
from harness.models.lean import LeanLlama
from harness.models.loading import ModelSpec, load_model
from harness.models.shared_draft import build_shared_draft

CPU = torch.device("cpu")
GREEDY = Sampling(0.0)


def fresh(tiny_pair, role="target"):
    """A model of its own: choose() changes modules, which other tests' fixtures must not see."""
    return load_model(ModelSpec(str(tiny_pair[role])), CPU, role)


def linear_types(model) -> set[type]:
    return {type(m) for m in model.modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 48),
        (1, 2, 48),
        (1, 5, 48),
        (3, 5, 48),
        (48,),
        (0, 48),
        (1, cpu_linear.FEW_ROWS, 48),
        (1, cpu_linear.FEW_ROWS + 1, 48),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_transposed_product_is_torch_s_up_to_rounding(shape, bias, dtype):
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=gen).to(dtype)  # [..., K]
    weight = torch.randn(40, 48, generator=gen).to(dtype)  # [N, K]
    b = torch.randn(40, generator=gen).to(dtype) if bias else None
    out = transposed_linear(x, weight, b)
    assert out.shape == (*shape[:-1], 40) and out.is_contiguous() and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, weight, b))


@pytest.mark.parametrize("rows", [1, 3, 5, cpu_linear.FEW_ROWS - 1])
@pytest.mark.parametrize("bias", [False, True])
def test_padded_rows_give_the_same_product(rows, bias, monkeypatch):
    """A plan padding every row count to FEW_ROWS: the BLAS really computes FEW_ROWS rows, and the
    real ones come out as torch's up to rounding."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(1, rows, 48, generator=gen), torch.randn(40, 48, generator=gen)  # [1, M, K], [N, K]
    b = torch.randn(40, generator=gen) if bias else None
    padded = (0,) + (cpu_linear.FEW_ROWS,) * cpu_linear.FEW_ROWS
    computed = []
    for name in ("mm", "addmm"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, real=real: computed.append(args[-1].shape[1]) or real(*args))
    out = transposed_linear(x, weight, b, padded)
    monkeypatch.undo()
    assert computed == [cpu_linear.FEW_ROWS] and out.shape == (1, rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b))


def ms(times: dict[int, float]) -> list[float]:
    return [times.get(m, 1.0) for m in range(1, cpu_linear.FEW_ROWS + 1)]


def test_a_plan_pads_a_row_count_to_a_faster_one_and_leaves_torch_where_it_wins():
    """torch's product at 1 ms for every row count; the transposed one mostly 0.5 ms, but 0.7 at
    3 rows (4 is faster: padded), 0.51 at 5 (6 is faster, within NEAR: not padded), 0.95 at 9
    to 11 (not under MARGIN alone, but 12 is faster: padded to 12) and 2.0 from 13 on (torch's).
    One row runs padded to two unless torch's product is clearly faster than that."""
    transposed = {m: 0.5 for m in range(1, 13)} | {3: 0.7, 5: 0.51, 9: 0.95, 10: 0.95, 11: 0.95} | {m: 2.0 for m in range(13, 18)}
    found = {"rows": list(range(1, cpu_linear.FEW_ROWS + 1)), "torch_ms": ms({}), "transposed_ms": ms(transposed)}
    rows_to = cpu_linear.plan(found)
    assert rows_to[1:] == (2, 2, 4, 4, 5, 6, 7, 8, 12, 12, 12, 12, 0, 0, 0, 0, 0)
    assert (
        cpu_linear.describe(rows_to)
        == "W @ x.T, rows padded 1->2, 3->4, 9->12, 10->12, 11->12; torch's product at 13, 14, 15, 16, 17 rows"
    )
    equal = cpu_linear.plan({**found, "transposed_ms": ms({m: 0.5 for m in range(1, 18)})})
    assert equal == cpu_linear.ONE_AS_TWO  # among equal times, the fewest rows: no padding but one row's
    within = cpu_linear.plan({**found, "transposed_ms": ms({m: 0.95 for m in range(1, 18)})})
    assert within == (0, 2, *[0] * 16)  # torch's everywhere but at one row
    slower = cpu_linear.plan({**found, "transposed_ms": ms({m: 2.0 for m in range(1, 18)})})
    assert slower is None  # torch's product clearly faster than one row padded to two: torch's everywhere
    assert cpu_linear.describe(None) == cpu_linear.describe({}) == "torch's product"
    assert cpu_linear.describe({"4x8 float32": rows_to, "8x4 float32": None}) == (
        f"4x8: {cpu_linear.describe(rows_to)}; 8x4: torch's product"
    )


def test_a_strided_input_gives_the_same_product():
    x = torch.randn(1, 48, 5).transpose(1, 2)  # [1, 5, 48], not contiguous
    weight = torch.randn(40, 48)
    torch.testing.assert_close(transposed_linear(x, weight), F.linear(x, weight))


def test_the_layers_really_take_the_transposed_product(tiny_pair, monkeypatch):
    """The wiring, not only the arithmetic: after choose("transposed") every linear layer of a
    forward, the draft's subset head included, goes through transposed_linear; after "torch" none."""
    target = fresh(tiny_pair)
    draft = build_shared_draft(target, 1, torch.arange(60))
    calls = []
    real = cpu_linear.transposed_linear
    monkeypatch.setattr(
        cpu_linear, "transposed_linear", lambda x, w, b=None, plan=cpu_linear.ONE_AS_TWO: calls.append(w) or real(x, w, b, plan)
    )
    ids = torch.arange(5, 9)[None]  # [1, 4]
    choose("transposed", [target, draft], CPU)
    target(ids), draft(ids)
    linears = cpu_linear._linears([target, draft])
    assert {id(w) for w in calls} == {id(m.weight) for m in linears} and len(calls) == len(linears)
    calls.clear()
    choose("torch", [target, draft], CPU)
    target(ids), draft(ids)
    assert calls == []


def test_choosing_a_product_sets_every_linear_layer_and_keeps_the_logits(tiny_pair):
    target = fresh(tiny_pair)
    draft = build_shared_draft(target, 1, torch.arange(60))  # its subset head is not an nn.Linear: it has a plan
    ids = torch.arange(5, 17)[None]  # [1, 12]
    before = [m(ids).logits for m in (target, draft)]
    assert choose("transposed", [target, draft], CPU) == {
        "mode": "transposed",
        "product": "transposed",
        "plans": {cpu_linear.EVERY_SHAPE: list(cpu_linear.ONE_AS_TWO)},
    }
    assert linear_types(target) == {TransposedLinear} and draft.lm_head.rows_to == cpu_linear.ONE_AS_TWO
    for model, logits in zip((target, draft), before):
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(model(ids[:, :1]).logits, logits[:, :1], rtol=1e-4, atol=1e-3)  # one row: padded to two
    assert choose("torch", [target, draft], CPU)["product"] == "torch"
    assert linear_types(target) == {nn.Linear} and draft.lm_head.rows_to is None


def test_greedy_speculation_with_the_transposed_product_is_the_target_s_greedy(tiny_pair):
    """The loop's exactness does not depend on the product: greedy speculative tokens are the
    target-only greedy tokens with either (across products they may part at a near-tie)."""
    target, draft = fresh(tiny_pair), fresh(tiny_pair, "draft")
    prompt = torch.arange(5, 25)

    def tokens():
        base = list(autoregressive_decode(CachedLM(target, 98), prompt, GREEDY, 30, set(), torch.Generator()))
        cycles = speculative_decode(
            CachedLM(target, 98), ModelDrafter(CachedLM(draft, 98)), prompt, 4, GREEDY, 30, set(), torch.Generator()
        )
        return base, [t for c in cycles for t in c.tokens]

    torch_base, torch_spec = tokens()
    choose("transposed", [target, draft], CPU)
    base, spec = tokens()
    assert spec == base and torch_spec == torch_base and len(base) == 30


def test_auto_times_every_product_a_step_runs_by_shape(tiny_pair, monkeypatch):
    """The probe times each shape's weights on their own within a pass through every shape, each
    weight once a pass, over every row count in each sweep; the lean forward's fused products are
    shapes of their own."""
    target = fresh(tiny_pair)
    weights = cpu_linear.step_weights([target, target])  # a module shared by two models counts once
    assert sum(map(len, weights.values())) == sum(isinstance(m, nn.Linear) for m in target.modules())
    LeanLlama(target)  # fuses q/k/v and gate/up: two more products a layer
    fused = cpu_linear.step_weights([target])
    assert set(weights) <= set(fused)
    assert sum(map(len, fused.values())) == sum(map(len, weights.values())) + 2 * target.config.num_hidden_layers
    calls, plans, timing, order = [], set(), [], []

    def transposed(x, w, b, plan):
        if timing:  # not the warm-up
            calls.append(cpu_linear.shape_of(w)), plans.add(plan), order.append(x.shape[0])
        return F.linear(x, w)

    def one_pass(fn):
        timing.append(True)
        fn()
        timing.pop()
        return 1.0

    monkeypatch.setattr(cpu_linear, "transposed_linear", transposed)
    monkeypatch.setattr(cpu_linear, "_ms", one_pass)
    monkeypatch.setattr(cpu_linear, "MIN_PASS_BYTES", 0)  # the weights as they are, not repeated
    found = cpu_linear.probe(fused)
    rows = list(range(1, cpu_linear.FEW_ROWS + 1))  # every row count a step can have
    assert set(found["shapes"]) == set(fused)
    for shape, one in found["shapes"].items():
        assert one["rows"] == rows and one["weights"] == len(fused[shape])
        assert one["torch_ms"] == one["transposed_ms"] == [1.0 / len(fused[shape])] * len(rows)  # per weight
        assert calls.count(shape) == len(fused[shape]) * len(rows) * cpu_linear.REPS  # each weight once a pass, each sweep
    assert [m for i, m in enumerate(order) if i == 0 or order[i - 1] != m] == rows * cpu_linear.REPS  # sweeps over the row counts
    assert plans == {cpu_linear.AS_IS}  # the transposed product timed unpadded at each row count
    outlier = iter([50.0] + [1.0] * 100000)  # a disturbance in the first sweep's first pass
    monkeypatch.setattr(cpu_linear, "_ms", lambda fn: next(outlier))
    first = next(iter(cpu_linear.probe(fused)["shapes"].values()))
    assert first["torch_ms"][0] == first["torch_ms"][1]  # the median of the sweeps leaves it out
    monkeypatch.setattr(cpu_linear, "_ms", one_pass)
    monkeypatch.setattr(cpu_linear, "PROBE_BYTES", 1)  # past the cap: one weight of each shape
    calls.clear()
    found = cpu_linear.probe(fused, rows=(1,), reps=1)
    assert sorted(calls) == sorted(fused) and all(one["weights"] == 1 for one in found["shapes"].values())
    monkeypatch.setattr(cpu_linear, "PROBE_BYTES", 2**40)
    monkeypatch.setattr(cpu_linear, "MIN_PASS_BYTES", 2**40)  # a small model: each shape repeated, up to MAX_REPEAT
    found = cpu_linear.probe(fused, rows=(1,), reps=1)
    assert all(one["weights"] == cpu_linear.MAX_REPEAT * len(fused[s]) for s, one in found["shapes"].items())
    monkeypatch.undo()


ONE_ROW_ONLY = [0, 2, *[0] * (cpu_linear.FEW_ROWS - 1)]


@pytest.mark.parametrize(
    "transposed_ms, rows_to",
    [(0.5, list(cpu_linear.ONE_AS_TWO)), (0.95, ONE_ROW_ONLY), (2.0, None)],
)
def test_auto_keeps_the_transposed_product_only_when_clearly_faster(tiny_pair, tmp_path, monkeypatch, transposed_ms, rows_to):
    """torch's product timed at 1 ms a pass, the transposed one at `transposed_ms`: auto takes the
    transposed product under MARGIN (0.9) of torch's time, and torch's otherwise, but at one row,
    which runs padded to two unless torch's product is clearly faster."""
    monkeypatch.setenv("SPECBENCH_PLANS", str(tmp_path))  # no plan stored for these shapes yet: auto probes
    target = fresh(tiny_pair)
    used = set()
    real = cpu_linear.transposed_linear
    monkeypatch.setattr(cpu_linear, "transposed_linear", lambda x, w, b, plan: used.add("t") or real(x, w, b, plan))

    def timed(fn):
        used.clear()
        fn()
        return transposed_ms if used else 1.0

    monkeypatch.setattr(cpu_linear, "_ms", timed)
    monkeypatch.setattr(cpu_linear, "MIN_PASS_BYTES", 0)
    record = choose("auto", [target], CPU)
    shapes = set(cpu_linear.step_weights([target]))
    assert set(record["probe"]) == set(record["plans"]) == shapes and set(record["plan"]["probed"]) == shapes
    for shape, found in record["probe"].items():
        assert found["transposed_ms"] == [transposed_ms / found["weights"]] * cpu_linear.FEW_ROWS
        assert record["plans"][shape] == rows_to
    assert record["product"] == ("transposed" if rows_to else "torch")
    assert linear_types(target) == {TransposedLinear if rows_to else nn.Linear}


def test_off_the_cpu_nothing_is_timed_or_changed(tiny_pair):
    target = fresh(tiny_pair)
    record = choose("auto", [target], torch.device("cuda"))
    assert record["product"] == "torch" and "probe" not in record and linear_types(target) == {nn.Linear}


def test_what_choose_leaves_alone_and_refuses(tiny_pair):
    target = fresh(tiny_pair)
    hooked = target.model.layers[0].mlp.down_proj
    hooked.forward = lambda x: F.linear(x, hooked.weight)  # as accelerate's offloading hooks replace it
    choose("transposed", [target], CPU)
    assert type(hooked) is nn.Linear and hooked not in cpu_linear._linears([target])
    assert choose("auto", [nn.Sequential(nn.ReLU())], CPU) == {"mode": "auto", "product": "torch", "plans": {}}  # nothing to time
    with pytest.raises(HarnessError, match="cpu_linear=fast must be one of auto, probe, transposed, torch"):
        choose("fast", [target], CPU)  # harness.bench does not run validate(): choose checks for itself


def plan_of(model_layers) -> set:
    """The plans a set of linear layers have (None: torch's product)."""
    return {None if type(layer) is nn.Linear else layer.rows_to for layer in model_layers}


@pytest.mark.parametrize(
    "earlier, plan",
    [
        ({"linear": "torch"}, None),
        ({"linear": "transposed", "linear_plans": {"*": list(cpu_linear.AS_IS)}}, cpu_linear.AS_IS),  # another process's plans
        (
            {"linear": "transposed", "linear_rows_to": list(cpu_linear.AS_IS)},
            cpu_linear.AS_IS,
        ),  # one plan for all shapes (older records)
    ],
    ids=["torch", "another-plan", "older-record"],
)
def test_a_resumed_cell_keeps_the_plan_its_earlier_prompts_ran_with(tiny_pair, tmp_path, monkeypatch, earlier, plan):
    """cpu_linear=auto times the products in each process; where they are close a resumed cell
    could switch and mix two timing regimes. It follows its earlier prompts' plan instead.
    The probe here finds the transposed product faster, three rows best padded to four."""
    import json
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import harness.runner.cell as run
    from harness.config.checks import CONF_DIR
    from harness.runner.pair import loaded_pairs

    rows = list(range(1, cpu_linear.FEW_ROWS + 1))
    found = {"rows": rows, "torch_ms": ms({}), "transposed_ms": ms({m: 0.5 for m in rows} | {3: 0.7}), "seconds": 0.0}
    monkeypatch.setattr(cpu_linear, "probe", lambda weights: {"shapes": {shape: found for shape in weights}, "seconds": 0.0})
    monkeypatch.setenv("SPECBENCH_PLANS", str(tmp_path / "plans"))  # no stored plan: the load probes (the fake above)
    loaded_pairs.clear()  # a pair loaded by another test was probed for real
    overrides = [
        "+pair=llama_7b_68m",
        f"pair.target.id={tiny_pair['target']}",
        f"pair.draft.id={tiny_pair['draft']}",
        "dataset.num_prompts=3",
        "max_new_tokens=8",
        "wandb.mode=disabled",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = run.with_default_pair(compose(config_name="config", overrides=overrides))
    try:
        first = run.run_cell(cfg, out_dir=tmp_path, quiet=True)
        cell = Path(first["cell_dir"])
        plans = first["conditions"]["linear"]["plans"]
        assert set(map(tuple, plans.values())) == {cpu_linear.plan(found)} and cpu_linear.plan(found)[3] == 4
        records = [json.loads(line) for line in (cell / "prompts.jsonl").read_text().splitlines()]
        assert all(r["linear_plans"] == plans for r in records)  # each record names its plans
        as_if = [{**{key: value for key, value in r.items() if not key.startswith("linear")}, **earlier} for r in records[:2]]
        (cell / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in as_if))  # as if another process ran these
        (cell / "summary.json").unlink()
        second = run.run_cell(cfg, out_dir=tmp_path, quiet=True)
        linear = second["conditions"]["linear"]
        assert linear["product"] == earlier["linear"] and "resumed" in linear["why"]
        assert linear["plans"] == ({"*": list(plan)} if plan else {})  # not the load's plans
        pair = next(iter(loaded_pairs.values()))
        assert plan_of(cpu_linear._linears(pair.models())) == {plan}
        last = json.loads((cell / "prompts.jsonl").read_text().splitlines()[-1])
        assert last["linear"] == earlier["linear"] and last.get("linear_plans", {}) == linear["plans"]
        # the next cell of the same process (a multirun reuses the loaded pair) is a new one: back to the load's plan
        third = run.run_cell(OmegaConf.merge(cfg, {"k": cfg.k + 1}), out_dir=tmp_path, quiet=True)
        assert third["conditions"]["linear"] == first["conditions"]["linear"]
        assert plan_of(cpu_linear._linears(pair.models())) == {cpu_linear.plan(found)}
    finally:
        loaded_pairs.clear()  # the cached pair now has the other product: later tests load their own


def test_a_probe_whose_sweeps_disagree_says_so(monkeypatch):
    """Another process on the cores makes the probe's sweeps disagree (measured here: slowest / fastest
    1.02-1.05 quiet, 2.0-3.8 beside one busy process, with plans that then took torch's product for one
    row): the run warns rather than trusting the plan without a word."""
    weights = cpu_linear.step_weights([torch.nn.Linear(16, 32)])
    monkeypatch.setattr(cpu_linear, "MAX_REPEAT", 1)
    sweeps = iter([1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0])  # the second sweep three times slower
    monkeypatch.setattr(cpu_linear, "_ms", lambda fn: next(sweeps))
    found = cpu_linear.probe(weights, rows=(1, 2), reps=3)["shapes"]["32x16 float32"]
    assert found["spread"] == 3.0 and "disagreed by 200%" in cpu_linear.noisy(found)
    steady = iter([1.0, 1.1] * 6)
    monkeypatch.setattr(cpu_linear, "_ms", lambda fn: next(steady))
    found = cpu_linear.probe(weights, rows=(1, 2), reps=3)["shapes"]["32x16 float32"]
    assert found["spread"] == 1.0 and cpu_linear.noisy(found) is None


def test_the_lean_forward_s_fused_products_take_their_shape_s_plan(tiny_pair, monkeypatch):
    """The lean forward's fused q/k/v product is no module's: it reads the plan of its own shape."""
    target = fresh(tiny_pair)
    lean = LeanLlama(target)
    calls = []
    real = cpu_linear.transposed_linear
    monkeypatch.setattr(
        cpu_linear, "transposed_linear", lambda x, w, b=None, plan=cpu_linear.ONE_AS_TWO: calls.append(w) or real(x, w, b, plan)
    )
    qkv = cpu_linear.shape_of(target.fused_linear_weights[0])
    cpu_linear.apply([target], {qkv: cpu_linear.AS_IS})
    lean.reserve(8)
    lean.forward(torch.arange(5, 9)[None], [0], [1])
    assert [id(w) for w in calls] == [id(w) for w in target.fused_linear_weights[::2]]  # each layer's q/k/v, nothing else
    calls.clear()
    cpu_linear.apply([target], {})
    lean.forward(torch.arange(9, 10)[None], [4], [1])
    assert calls == []
