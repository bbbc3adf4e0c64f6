"""The cost model's inputs timed inside a run (harness.runner.costs.Clock, metrics.in_run_costs)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_cached_pair
from omegaconf import OmegaConf

from harness.core.metrics import in_run_costs
from harness.core.sampling import Sampling
from harness.runner.cell import run_prompt
from harness.runner.costs import Clock

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors on one thread


def test_a_prompt_record_times_the_passes_after_its_first_yield(tiny_pair):
    """Every verify pass but the prompt's, and every proposal but the first cycle's, is timed, keyed
    by the positions it fed; the baseline's one-position steps likewise; the instances get their own
    methods back afterwards."""
    target, drafter, prompt = tiny_cached_pair(tiny_pair)
    pair = SimpleNamespace(target=target, drafter=drafter, eos_ids=set(), device=torch.device("cpu"))
    cfg = OmegaConf.create({"seed": 0, "k": 3, "max_new_tokens": 12})
    record = run_prompt(pair, {"id": "p", "category": "c"}, prompt, 0, cfg, Sampling(1.0))
    spec, base = record["spec"], record["base"]
    verifies = {int(key.split("@")[1]): calls for key, (_, calls) in spec["clock"].items() if key.startswith("verify@")}
    assert sum(verifies.values()) == spec["cycles"] - 1 and spec["clock"]["draft"][1] == spec["cycles"] - 1
    assert sum((n - 1) * calls for n, calls in verifies.items()) == spec["drafted"] - spec["first_drafted"]
    assert max(verifies) <= cfg.k + 1  # the prompt's pass (6 positions and the drafts) is not among them
    assert list(base["clock"]) == ["verify@1"] and base["clock"]["verify@1"][1] == base["new_tokens"] - 1
    assert all(seconds > 0 for seconds, _ in [*spec["clock"].values(), *base["clock"].values()])
    assert not {"forward", "forward_features"} & set(vars(target)) and "propose" not in vars(drafter)


def test_the_clock_gives_back_an_instances_own_override():
    """A method an instance already overrides (the bench's timed wrappers, the exactness check's broken
    variants) is that override again after the clock, not the class's."""

    class LM:
        def forward(self, ids, num_logits=1):
            return "class"

    lm = LM()
    lm.forward = lambda ids, num_logits=1: "own"
    clock = Clock(torch.device("cpu"))
    with clock.watching(lm):
        clock.on = True
        assert lm.forward(torch.zeros(2)) == "own"
    assert lm.forward(torch.zeros(2)) == "own" and list(clock.tally()) == ["verify@2"]


def test_in_run_costs_price_steps_proposals_and_verifies():
    """c: proposal seconds per drafted token after the first cycle, over the baseline's step; v(n):
    verify seconds over n positions per pass, over the step; nan for an n the run never verified."""
    records = [
        {
            "spec": {"drafted": 7, "first_drafted": 3, "clock": {"draft": [0.4, 2], "verify@3": [0.3, 1], "verify@2": [0.25, 1]}},
            "base": {"clock": {"verify@1": [0.6, 6]}},
        },
        {"spec": {"drafted": 0, "first_drafted": 0, "clock": {}}, "base": {"clock": {"verify@1": [0.4, 4]}}},
    ]
    costs = in_run_costs(records, k=3)
    assert costs["target_step_s"] == pytest.approx(0.1)
    assert costs["cost_ratio"] == pytest.approx(0.4 / 4 / 0.1)
    v = costs["verify_cost"]
    assert math.isnan(v[0]) and v[1] == pytest.approx(2.5) and v[2] == pytest.approx(3.0) and math.isnan(v[3])
