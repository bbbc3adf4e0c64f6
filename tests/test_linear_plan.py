"""The CPU linear plan is reproducible: decided with a statistical margin, stored once per
machine and model shape, reused by later runs, re-probed when the machine or the setting says so."""

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
    """Transposed 3% faster than torch's everywhere, with 5% noise: within the noise, torch's product.
    Twice as fast: the transposed product, unpadded where padding gains nothing real."""
    torch_ms = [10.0] * len(ROWS)
    close = sweeps_from({"torch_ms": torch_ms, "transposed_ms": [9.7] * len(ROWS)}, noise=0.05, seed=0)
    assert cpu_linear.plan(close) is None
    clear = sweeps_from({"torch_ms": torch_ms, "transposed_ms": [5.0] * len(ROWS)}, noise=0.05, seed=0)
    assert cpu_linear.plan(clear) == (0, *ROWS)


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
    assert plans == {(0, *range(1, 13), *[0] * (len(ROWS) - 12))}


@pytest.fixture
def layers(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_PLANS", str(tmp_path / "plans"))
    calls = []
    found = sweeps_from({"torch_ms": [10.0] * len(ROWS), "transposed_ms": [4.0] * len(ROWS)}, noise=0.02, seed=2)

    def fake_probe(models):
        calls.append(1)
        return {**found, "seconds": 0.1}

    monkeypatch.setattr(cpu_linear, "probe", fake_probe)
    return [nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))], calls


def test_a_stored_plan_is_reused_and_a_changed_fingerprint_probes_again(layers):
    models, calls = layers
    first = cpu_linear.choose("auto", models, CPU, IDENTITY)
    assert len(calls) == 1 and first["plan"]["source"] == "probed"
    stored = json.loads(open(first["plan"]["file"]).read())
    assert stored["rows_to"] == first["rows_to"] and stored["key"]["device"] == IDENTITY

    again = cpu_linear.choose("auto", models, CPU, IDENTITY)
    assert len(calls) == 1 and again["plan"] == {**first["plan"], "source": "stored"}
    assert again["rows_to"] == first["rows_to"]

    cpu_linear.choose("auto", models, CPU, {**IDENTITY, "threads": 4})  # other threads: another machine, to the plan
    assert len(calls) == 2
    cpu_linear.choose("auto", [nn.Linear(16, 48)], CPU, IDENTITY)  # other shapes
    assert len(calls) == 3
    forced = cpu_linear.choose("probe", models, CPU, IDENTITY)  # the setting that re-probes
    assert len(calls) == 4 and forced["plan"]["source"] == "probed" and forced["plan"]["file"] == first["plan"]["file"]


def test_a_file_that_is_not_a_plan_is_probed_over(layers):
    models, calls = layers
    key = cpu_linear.plan_key(models, IDENTITY)
    path = cpu_linear.plan_path(key)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert cpu_linear.choose("auto", models, CPU, IDENTITY)["plan"]["source"] == "probed" and len(calls) == 1
    assert cpu_linear.stored_plan(key)["rows_to"] is not None


def test_a_noisy_probe_is_used_but_not_stored(layers, monkeypatch):
    """A probe whose sweeps disagree (another process on the cores) must not fix the plan of every
    later run: it serves this run, and the next run probes again."""
    models, calls = layers
    noisy = {**cpu_linear.probe(models), "spread": 2 * cpu_linear.NOISY}
    monkeypatch.setattr(cpu_linear, "probe", lambda models: calls.append(1) or noisy)
    first = cpu_linear.choose("auto", models, CPU, IDENTITY)
    assert first["plan"]["source"].startswith("probed, not stored") and first["rows_to"]
    assert cpu_linear.stored_plan(cpu_linear.plan_key(models, IDENTITY)) is None
    cpu_linear.choose("auto", models, CPU, IDENTITY)
    assert len(calls) == 3  # the fixture's probe once, then one probe a run
