"""The CPU linear plan is reproducible: decided with a statistical margin, stored once per
machine and weight shape, shared by every pair with that shape, reused by later runs, re-probed when the machine or the setting says so."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from harness.models import cpu_linear

ROWS = tuple(range(1, cpu_linear.FEW_ROWS + 1))
CPU = torch.device("cpu")
IDENTITY = {"type": "cpu", "name": "Test CPU", "threads": 2}


def sweeps_from(true_ms: dict[str, list[float]], noise: float, seed: int, reps: int = cpu_linear.REPS) -> dict:
    """A probe's result whose sweeps scatter around true times by a multiplicative noise."""
    rng = np.random.default_rng(seed)
    sweeps = {name: [list(t * (1 + noise * rng.standard_normal(reps))) for t in times] for name, times in true_ms.items()}
    return {"rows": list(ROWS), **{name: [float(np.median(s)) for s in runs] for name, runs in sweeps.items()}, "sweeps": sweeps}


def test_differences_within_the_noise_keep_the_simpler_choice():
    """Transposed 3% faster than torch's everywhere, with 5% noise: within the noise, the simpler
    choice (torch's product; at one row, the transposed one padded to two). Twice as fast: the
    transposed product, unpadded where padding gains nothing real."""
    torch_ms = [10.0] * len(ROWS)
    close = sweeps_from({"torch_ms": torch_ms, "transposed_ms": [9.7] * len(ROWS)}, noise=0.05, seed=0)
    assert cpu_linear.plan(close) == (0, 2, *[0] * (len(ROWS) - 1))
    clear = sweeps_from({"torch_ms": torch_ms, "transposed_ms": [5.0] * len(ROWS)}, noise=0.05, seed=0)
    assert cpu_linear.plan(clear) == cpu_linear.ONE_AS_TWO


def test_padding_only_where_it_clearly_pays():
    """Three rows run as slow as six and four rows at half that: three is padded to four; a row
    count whose next one is only 2% faster is left as it is."""
    transposed = [5.0] * len(ROWS)
    transposed[ROWS.index(3)] = 10.0
    transposed[ROWS.index(8)] = 5.1
    found = sweeps_from({"torch_ms": [20.0] * len(ROWS), "transposed_ms": transposed}, noise=0.02, seed=1)
    rows_to = cpu_linear.plan(found)
    assert rows_to[3] == 4 and rows_to[8] == 8


def test_probes_of_one_machine_agree():
    """Twenty probes of the same times, each with its own 3% noise per sweep, and differences
    within that noise at every row count (padding would gain up to 2%, and beyond 12 rows torch's
    product is within 4% of the transposed one): all twenty give one plan. (Differences right at
    a margin can still flip a probe's plan: that is what the stored plan is for.)"""
    transposed = [5.0 + 0.05 * (m % 3) for m in ROWS]
    torch_ms = [5.2 if m > 12 else 12.0 for m in ROWS]
    plans = {
        cpu_linear.plan(sweeps_from({"torch_ms": torch_ms, "transposed_ms": transposed}, noise=0.03, seed=s)) for s in range(20)
    }
    assert plans == {(0, 2, *range(2, 13), *[0] * (len(ROWS) - 12))}


def steady_sweeps(true_ms: dict[str, list[float]], reps: int = cpu_linear.REPS) -> dict:
    """A probe's result whose sweeps scatter by 1% around true times, in a fixed pattern: the
    sweeps of every row count and product are true time x (0.99, 0.9933, ..., 1.01)."""
    factors = np.linspace(0.99, 1.01, reps)
    sweeps = {name: [list(t * factors) for t in times] for name, times in true_ms.items()}
    return {"rows": list(ROWS), **{name: [float(np.median(s)) for s in runs] for name, runs in sweeps.items()}, "sweeps": sweeps}


def disturb(found: dict, name: str, m: int, factor: float, sweep: int = 0) -> dict:
    """The probe `found` with one sweep of product `name` at `m` rows taken `factor` times as long."""
    sweeps = {key: [list(s) for s in runs] for key, runs in found["sweeps"].items()}
    sweeps[name][ROWS.index(m)][sweep] *= factor
    return {**found, "sweeps": sweeps}


def extremes_say_clearly_faster(fast: list[float], slow: list[float], margin: float) -> bool:
    """The comparison on the sweeps' extremes: the slowest of one against the fastest of the other."""
    return max(fast) < margin * min(slow)


def test_one_disturbed_sweep_does_not_flip_the_product():
    """At three rows the transposed product takes 6 ms and torch's 10: clearly the transposed one. One
    sweep of it taken 2x as long (another process woke up), or one sweep of torch's taken 0.5x (a
    timer read early), moves the extremes past the margin, and the plan stays. The same at one
    row, where the transposed product is padded to two."""
    true = {"torch_ms": [10.0] * len(ROWS), "transposed_ms": [6.0] * len(ROWS)}
    quiet = steady_sweeps(true)
    assert cpu_linear.plan(quiet) == cpu_linear.ONE_AS_TWO
    for m, name, factor in ((3, "transposed_ms", 2.0), (3, "torch_ms", 0.5), (2, "transposed_ms", 2.0), (1, "torch_ms", 0.5)):
        found = disturb(quiet, name, m, factor)
        transposed = found["sweeps"]["transposed_ms"][ROWS.index(max(m, 2))]  # one row runs as two
        torch_sweeps = found["sweeps"]["torch_ms"][ROWS.index(m)]
        assert not extremes_say_clearly_faster(transposed, torch_sweeps, cpu_linear.MARGIN)  # the extremes would flip it
        assert cpu_linear.plan(found) == cpu_linear.ONE_AS_TWO, (m, name)
    both = disturb(disturb(quiet, "transposed_ms", 3, 2.0), "torch_ms", 3, 0.5, sweep=3)  # one on each side
    assert cpu_linear.plan(both) == cpu_linear.ONE_AS_TWO


def test_one_disturbed_sweep_does_not_flip_a_padding():
    """Three rows run at 10 ms and four at 5 (torch's product: 20 everywhere): three is padded to four.
    One sweep at four rows taken 3x as long does not undo the padding; one sweep at three rows taken
    0.4x as long does not either; nor does a 3x sweep at five rows pad three to five."""
    transposed = [5.0] * len(ROWS)
    transposed[ROWS.index(3)] = 10.0
    true = {"torch_ms": [20.0] * len(ROWS), "transposed_ms": transposed}
    quiet = steady_sweeps(true)
    assert cpu_linear.plan(quiet)[3] == 4
    for m, factor in ((4, 3.0), (3, 0.4)):
        found = disturb(quiet, "transposed_ms", m, factor)
        at = found["sweeps"]["transposed_ms"]
        assert not extremes_say_clearly_faster(at[ROWS.index(4)], at[ROWS.index(3)], 1 / cpu_linear.NEAR)
        assert cpu_linear.plan(found) == cpu_linear.plan(quiet), (m, factor)
    assert cpu_linear.plan(disturb(quiet, "transposed_ms", 5, 3.0)) == cpu_linear.plan(quiet)


def test_a_clear_difference_still_decides():
    """What one sweep cannot do, a difference in every sweep does: torch's product at one row where
    it is truly faster, a padding where the padded count is truly faster; the same with a disturbed
    sweep on top. A difference in all sweeps but one decides too; one within the margin does not."""
    torch_ms, transposed = [10.0] * len(ROWS), [6.0] * len(ROWS)
    torch_ms[ROWS.index(1)] = 4.0  # one row: torch's product is faster than any transposed one
    transposed[ROWS.index(6)] = 9.0  # six rows: seven (6 ms) is clearly faster
    quiet = steady_sweeps({"torch_ms": torch_ms, "transposed_ms": transposed})
    want = (0, 0, *range(2, 6), 7, *range(7, len(ROWS) + 1))
    assert cpu_linear.plan(quiet) == want
    assert cpu_linear.plan(disturb(quiet, "torch_ms", 1, 2.0)) == want  # one slow sweep of torch's: still torch's
    assert cpu_linear.plan(disturb(quiet, "transposed_ms", 7, 2.0)) == want  # one slow sweep at 7: still padded
    # All but one sweep of torch's product at one row 3x as slow (12 ms): the transposed product, padded to two, wins there.
    slower = {key: [list(s) for s in runs] for key, runs in quiet["sweeps"].items()}
    slower["torch_ms"][0] = [3 * t for t in slower["torch_ms"][0][:-1]] + slower["torch_ms"][0][-1:]
    assert cpu_linear.plan({**quiet, "sweeps": slower})[1] == 2
    # Transposed 5% faster at every row count, in every sweep: within MARGIN, torch's product.
    assert cpu_linear.plan(steady_sweeps({"torch_ms": torch_ms, "transposed_ms": [9.5] * len(ROWS)})) is None


def test_the_comparison_uses_the_second_extremes():
    assert cpu_linear.inner_range([5.0, 1.0, 9.0, 2.0, 3.0]) == (2.0, 5.0)
    assert cpu_linear.inner_range([4.0, 1.0]) == (1.0, 4.0)  # too few sweeps to leave one out
    assert cpu_linear.inner_range([7.0]) == (7.0, 7.0)  # a probe stored with medians only
    assert cpu_linear.clearly_faster([1.0, 1.0, 5.0], [2.0, 2.0, 0.1], 0.9)
    assert not cpu_linear.clearly_faster([1.0, 1.9, 5.0], [2.0, 2.0, 0.1], 0.9)


@pytest.fixture
def layers(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_PLANS", str(tmp_path / "plans"))
    calls = []  # the shapes each probe timed
    found = sweeps_from({"torch_ms": [10.0] * len(ROWS), "transposed_ms": [4.0] * len(ROWS)}, noise=0.02, seed=2)

    def fake_probe(weights):
        calls.append(sorted(weights))
        return {"shapes": {shape: found for shape in weights}, "seconds": 0.1}

    monkeypatch.setattr(cpu_linear, "probe", fake_probe)
    return [nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))], calls


def test_stored_plans_are_reused_by_shape_and_a_changed_machine_probes_again(layers):
    models, calls = layers
    first = cpu_linear.choose("auto", models, CPU, IDENTITY)
    assert calls == [["16x32 float32", "32x16 float32"]] and first["plan"]["source"] == "probed"
    stored = json.loads(open(first["plan"]["file"]).read())
    assert {s: e["rows_to"] for s, e in stored["shapes"].items()} == first["plans"] and stored["key"]["device"] == IDENTITY

    again = cpu_linear.choose("auto", models, CPU, IDENTITY)
    assert len(calls) == 1 and again["plan"] == {**first["plan"], "source": "stored", "probed": [], "seconds": 0.0}
    assert again["plans"] == first["plans"] and "probe" not in again

    cpu_linear.choose("auto", models, CPU, {**IDENTITY, "threads": 4})  # other threads: another machine, to the plan
    assert len(calls) == 2
    other = cpu_linear.choose("auto", [nn.Linear(16, 48), nn.Linear(16, 32)], CPU, IDENTITY)  # one shape new, one stored
    assert calls[-1] == ["48x16 float32"] and other["plans"]["32x16 float32"] == first["plans"]["32x16 float32"]
    assert set(json.loads(open(first["plan"]["file"]).read())["shapes"]) == {"16x32 float32", "32x16 float32", "48x16 float32"}
    forced = cpu_linear.choose("probe", models, CPU, IDENTITY)  # the setting that re-probes
    assert calls[-1] == calls[0] and forced["plan"]["source"] == "probed" and forced["plan"]["file"] == first["plan"]["file"]


def test_a_file_that_is_not_a_plan_is_probed_over(layers):
    models, calls = layers
    key = cpu_linear.machine_key(IDENTITY)
    path = cpu_linear.plan_path(key)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert cpu_linear.choose("auto", models, CPU, IDENTITY)["plan"]["source"] == "probed" and len(calls) == 1
    assert cpu_linear.stored_plans(key)["32x16 float32"]["rows_to"] is not None


def test_a_noisy_probe_is_used_but_not_stored(layers, monkeypatch):
    """A probe whose sweeps disagree (another process on the cores) must not fix the plan of every
    later run: it serves this run, and the next run probes again."""
    models, calls = layers
    probed = cpu_linear.probe(cpu_linear.step_weights(models))
    noisy = {shape: {**found, "spread": 2 * cpu_linear.NOISY} for shape, found in probed["shapes"].items()}
    monkeypatch.setattr(cpu_linear, "probe", lambda weights: calls.append(1) or {"shapes": noisy, "seconds": 0.1})
    first = cpu_linear.choose("auto", models, CPU, IDENTITY)
    assert first["plan"]["source"].startswith("probed, not stored") and any(first["plans"].values())
    assert cpu_linear.stored_plans(cpu_linear.machine_key(IDENTITY)) == {}
    cpu_linear.choose("auto", models, CPU, IDENTITY)
    assert len(calls) == 3  # the fixture's probe once, then one probe a run
