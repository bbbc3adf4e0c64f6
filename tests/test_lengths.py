"""Draft-length policies (harness.core.lengths) on their own: what each decides from what it was told."""

from __future__ import annotations

import pytest

from harness.core.lengths import EXPLORE, make_policy, roc_threshold


def test_heuristic_adds_two_after_a_full_acceptance_and_drops_one_otherwise():
    policy = make_policy("heuristic")
    policy.start(2)
    assert policy.budgets([4, 4]) == [4, 4]  # the cap until a first outcome
    policy.outcome([4, 4], [4, 1])
    assert policy.budgets([8, 8]) == [6, 3]
    policy.outcome([6, 3], [2, 0])
    assert policy.budgets([8, 8]) == [5, 2]
    policy.outcome([1, 1], [0, 0])
    assert policy.budgets([8, 8]) == [1, 1]  # never below 1


def test_confidence_stops_below_its_threshold_and_auto_refits_it_from_outcomes():
    fixed = make_policy("confidence", threshold=0.4)
    fixed.start(1)
    assert fixed.go_on(0, 0.5) and not fixed.go_on(0, 0.3)
    auto = make_policy("confidence", threshold="auto")
    auto.start(1)
    for p, accepted in [(0.9, 1), (0.8, 1), (0.2, 0), (0.3, 0), (0.7, 1), (0.25, 0)]:
        auto.go_on(0, p)
        auto.outcome([1], [accepted])
    assert auto.threshold == pytest.approx(0.7)  # separates the accepted (>= 0.7) from the rejected
    assert roc_threshold([(0.5, True)], 0.4) == 0.4  # one outcome kind only: kept


def test_by_batch_takes_the_largest_size_not_above_the_batch():
    policy = make_policy("by_batch", table={1: 4, 8: 2, 32: 0})
    assert policy.budgets([3]) == [3] and policy.budgets([4] * 8) == [2] * 8 and policy.budgets([4] * 40) == [0] * 40


def test_cost_drafts_nothing_where_no_draft_pays_but_explores_after_idle_cycles():
    policy = make_policy("cost")
    policy.use_costs({"cost_ratio": 0.3, "verify_cost": [1.0, 1.1, 1.2]})
    policy.start(1)
    for _ in range(6):  # every first draft rejected: acceptance falls below c + v(2) - v(1) = 0.4
        policy.go_on(0, 0.5)
        policy.outcome([1], [0])
    budgets = []
    for _ in range(EXPLORE + 1):
        budgets.append(policy.budgets([2])[0])
        policy.outcome([budgets[-1]], [0])
    assert budgets == [0] * EXPLORE + [1]  # the run keeps measuring the draft, one token in EXPLORE + 1 cycles
