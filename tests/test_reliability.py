"""Bad input fails in one line; an interrupted sweep loses nothing and resumes; results on disk are
written whole and say when and on what machine they were measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_cli import ROOT, harness, tiny_args

from harness.errors import HarnessError


@pytest.mark.cli
@pytest.mark.parametrize(
    "args, message",
    [
        (["+pair=llama_7b_86m"], "did you mean +pair=llama_7b_68m?"),
        (["-m", "+pair=smollm2,smollm_ngram"], "did you mean +pair=smollm2_ngram?"),
        (["dataset=gsm9k"], "did you mean dataset=gsm8k?"),
        (["tempreature=1.0"], "unknown setting 'tempreature': did you mean temperature?"),
        (["-m", "k=1,2", "dataset.num_promts=3"], "unknown setting 'dataset.num_promts': did you mean dataset.num_prompts?"),
        (["+pair=smollm2_ngram", "pair.draft.lenght=cost_aware"], "did you mean pair.draft.length?"),
        (["wandb.mdoe=disabled"], "did you mean wandb.mode?"),
        (["banana=1"], "unknown setting 'banana': no config has it (--cfg job prints them all)"),
        (
            ["+temprature=0.7"],
            "unknown setting 'temprature': did you mean temperature?",
        ),  # added, read by nothing: a new cell key
        (["~dataset"], "~dataset: every run needs dataset; choose a prompt set"),  # validate crashed on it
        (
            ["hydra.job.chdir=true"],
            "hydra.job.chdir=true runs each job in its own folder, where out_dir=results",
        ),  # never resumed
        (["~dataset.num_prompts"], "~dataset.num_prompts: every run needs dataset.num_prompts"),
        (["dataset.path=x.jsonl"], "unknown setting 'dataset.path' for dataset=builtin, whose keys are category,"),
        (
            ["+pair=smollm2", "pair.draft.length=cost_aware"],
            "unknown setting 'pair.draft.length' for +pair=smollm2: use one that takes it, e.g. +pair=smollm2_ngram",
        ),
        (["pair.draft.max_ngram=4"], "pair.draft.max_ngram=4 sets the pair, so choose the pair first"),
        (["-m", "k=1,2", "--cfg", "job"], "error: -m runs the cells and --cfg only prints: give one of them"),
        (
            ["-m", "+pair=smollm2,llama_7b_68m", "~pair.draft.revision"],
            "~pair.draft.revision cannot go with a sweep over pairs (+pair=smollm2,llama_7b_68m): sweep one pair per command",
        ),
        (
            ["-m", "+pair=smollm2,llama_7b_68m", "pair.target.id=/m"],
            "pair.target.id=/m cannot go with a sweep over pairs (+pair=smollm2,llama_7b_68m): write it ++pair.target.id=/m",
        ),
        (
            ["-m", "+pair=smollm2,smollm2_ngram", "pair.draft.max_ngram=2"],  # ++ would reach smollm2's model draft too
            "pair.draft.max_ngram=2 cannot go with a sweep over pairs (+pair=smollm2,smollm2_ngram): sweep one pair per command",
        ),
        (
            ["dataset=local", "dataset.path=/tmp/spü.jsonl"],
            """quote the value inside the shell's quotes, e.g. 'dataset.path="/tmp/spü.jsonl"'""",
        ),
        (["pair=smollm2_ngram"], "pair=smollm2_ngram: the pair is chosen with a '+': +pair=smollm2_ngram"),
        (
            ["hydra.run.dir=/etc/passwd/x"],
            "hydra.run.dir=/etc/passwd/x: /etc/passwd is a file, not a folder",
        ),  # Hydra: a traceback
        (["-m", "k=1,2", "hydra.sweep.dir=/etc/passwd/x"], "hydra.sweep.dir=/etc/passwd/x: /etc/passwd is a file, not a folder"),
        (["k=1,2"], "k=1,2 lists several values: add -m to run one cell each"),
        (
            ["dataset=local", "dataset.path=x.jsonl", "dataset.template=Summarize: {text}"],  # Hydra's grammar: 3 lines
            """quote the value inside the shell's quotes, e.g. 'dataset.template="Summarize: {text}"'""",
        ),
        (["+pair=smollm2", "pair.draft.max_ngram=4"], "unknown setting 'pair.draft.max_ngram' for +pair=smollm2"),
        (["k", "4"], "cannot read 'k': an override is KEY=VALUE, e.g. k=4"),
        (["+k=4"], "+k=4: k is already a setting, so drop the '+': k=4"),
        (["~k"], "~k: every run needs k; set it instead"),
        (["wandb.mod=offline"], "did you mean wandb.mode? wandb has dir, entity, group, job_type, mode, name, project, tags"),
        (["--cfg", "job", "k=3", "banana=1"], "unknown setting 'banana'"),  # a flag's value is not a stray word
    ],
)
def test_unknown_names_suggest_the_closest(args, message):
    out = harness(*args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.cli
@pytest.mark.parametrize("args", [["++k=7"], ["--cf", "job", "k=7"], ["--config-n", "config", "k=7"]])
def test_hydra_forms_the_checks_leave_alone(args):
    """Hydra's add-or-set (++key=) and its flags shortened as argparse allows are not stray words or appends."""
    out = harness(*args, *(["--cfg", "job"] if "--cf" not in args else []))
    assert out.returncode == 0 and "k: 7" in out.stdout, out.stderr


@pytest.mark.parametrize(
    "args, bad",
    [
        (["dataset.path=x.jsonl"], "builtin"),  # the default dataset
        (["+dataset.path=x.jsonl"], "builtin"),  # what Hydra's own message suggests: builtin would ignore it
        (["-m", "dataset=builtin,local", "dataset.path=x.jsonl"], "builtin"),
        (["dataset=local", "dataset.hf_id=org/set"], "local"),
        (["dataset=local", "dataset.path=x.jsonl"], None),
        (["dataset.path=x.jsonl", "dataset=gsm8k"], None),
    ],
)
def test_dataset_settings_are_checked_against_the_chosen_dataset(args, bad, capsys):
    from harness.config.checks import check_choices

    if bad is None:
        check_choices(args)
        return
    with pytest.raises(SystemExit) as exit:
        check_choices(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and err[0].startswith("error: unknown setting 'dataset.")
    assert f"for dataset={bad}, whose keys are" in err[0] and "num_prompts" in err[0]  # the keys it does take
    assert ("e.g. dataset=local dataset.path=" if "path" in args[-1] else "e.g. dataset=cnn_dailymail dataset.hf_id=") in err[0]


@pytest.mark.parametrize("override", ["+dataset.text_feild=q", "dataset.text_feild=q"])
def test_a_dataset_key_no_prompt_set_reads_is_refused(override, capsys):
    """Added with '+' it would be silently ignored (a prompt set reads only its configs' keys)."""
    from harness.config.checks import check_choices

    with pytest.raises(SystemExit) as exit:
        check_choices(["dataset=local", "dataset.path=x.jsonl", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and err == [
        "error: unknown setting 'dataset.text_feild': did you mean dataset.text_field? "
        "(no prompt set reads it; --cfg job prints the settings)"
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "+pair=choice(smollm2,smollm2_ngram)"],  # Hydra's sweep functions are Hydra's to read
        ["-m", "dataset=glob(b*)", "dataset.num_prompts=2"],
        ["-m", "k=range(1,3)"],
        ["-m", "+pair=smollm2,smollm2_ngram", "k=1,2"],
        ["+pair=smollm2_ngram", "pair.draft.length=cost_aware"],
        ["+pair=smollm2_ngram", "+pair.target.device_map=auto", "+pair.target.revision=abc"],  # keys a pair may add
        ["k=1,2", "hydra.mode=MULTIRUN"],
        ["--multi", "k=1,2"],
        ["--m", "k=1,2"],  # other ways to ask for a multirun
        ["k=1,2", "++hydra.mode=RunMode.MULTIRUN"],
        ["k=1,2", "hydra.mode='MULTIRUN'"],
        ["k=1,2", "hydra.mode=2"],
        ["wandb.name=run\\,1"],  # an escaped comma is one value
    ],
)
def test_sweep_syntax_and_settings_the_chosen_option_has_pass(args):
    from harness.config.checks import check_choices

    check_choices(args)


def test_the_bench_runs_one_value_each_even_with_hydra_mode_multirun(capsys):
    from harness.config.checks import check_choices

    with pytest.raises(SystemExit):
        check_choices(["hydra.mode=MULTIRUN", "temperature=0,1"], sweeps=False)
    assert "this command runs one of each" in capsys.readouterr().err


def test_records_cut_by_a_kill_are_trimmed_before_a_resumed_run_appends(tmp_path):
    from harness.runner.store import read_records

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b", "sp')  # the second line cut mid-write
    assert read_records(path) == [{"id": "a"}] and path.read_text().endswith('"sp')  # reading alone changes nothing
    assert read_records(path, trim=True) == [{"id": "a"}] and path.read_text() == '{"id": "a"}\n'
    path.write_text('{"id": "a"}\n{"id": "b"}')  # whole, but the newline was not written
    assert read_records(path, trim=True) == [{"id": "a"}, {"id": "b"}] and path.read_text() == '{"id": "a"}\n{"id": "b"}\n'


def test_atomic_writes_replace_the_file_whole_and_leave_no_temporary(tmp_path):
    from harness.base.files import write_json_atomic, write_text_atomic

    path = tmp_path / "status.json"
    write_json_atomic(path, {"status": "running"})
    write_json_atomic(path, {"status": "finished", "done": 2})
    assert json.loads(path.read_text()) == {"status": "finished", "done": 2} and path.read_text().endswith("\n")
    write_text_atomic(tmp_path / "aggregate.md", "| a |\n")
    assert (tmp_path / "aggregate.md").read_text() == "| a |\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aggregate.md", "status.json"]


def test_the_results_store_loads_without_torch():
    """What only reads or writes results (the sweep aggregate, the analysis) does not pay for torch."""
    script = (
        "import sys, harness.runner.store\nprint(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_stamped_results_lead_with_the_schema_version_and_start_time():
    from harness.runner.provenance import utc_now
    from harness.runner.store import SCHEMA_VERSION, stamped

    started = utc_now()
    when = datetime.fromisoformat(started)
    assert when.utcoffset() == timedelta(0) and abs((datetime.now(timezone.utc) - when).total_seconds()) < 60
    result = stamped({"status": "finished", "done": 3}, started)
    assert list(result)[:2] == ["schema_version", "started_utc"] and SCHEMA_VERSION == 1
    assert result == {"schema_version": SCHEMA_VERSION, "started_utc": started, "status": "finished", "done": 3}


def test_the_machine_description_counts_cores_apart_from_threads(tmp_path, monkeypatch):
    import harness.runner.provenance as provenance

    described = provenance.machine()
    assert set(described) == {"cpu", "cores", "threads", "gpu", "gpus", "memory_gb"}
    assert described["cpu"] == provenance.device_name(torch.device("cpu")) and 1 <= described["cores"] <= described["threads"]
    assert described["memory_gb"] > 0 and json.loads(json.dumps(described)) == described
    if not torch.cuda.is_available():
        assert (described["gpu"], described["gpus"]) == (None, 0)
    # Two hardware threads of one core (SMT), and a third CPU this process may not use.
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "".join(
            f"processor\t: {n}\nmodel name\t: Test CPU 9000\nphysical id\t: 0\ncore id\t\t: {core}\n\n"
            for n, core in ((0, 0), (1, 0), (2, 1))
        )
    )
    import harness.base.device

    monkeypatch.setattr(harness.base.device, "CPUINFO", cpuinfo)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    described = provenance.machine()
    assert (described["cpu"], described["cores"], described["threads"]) == ("Test CPU 9000", 1, 2)


@pytest.mark.parametrize(
    "err, plain, typed",
    [
        (ValueError("\n  first line  \nsecond"), "first line", "ValueError: first line"),
        (KeyboardInterrupt(), "KeyboardInterrupt", "KeyboardInterrupt"),
        (OSError("   \n"), "OSError", "OSError"),
    ],
)
def test_an_error_as_one_line(err, plain, typed):
    from harness.errors import one_line

    assert one_line(err) == plain and one_line(err, with_type=True) == typed


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc")
def test_peak_memory_is_the_cells_own():
    """A multirun's later cell must not report an earlier cell's peak."""
    from harness.runner.provenance import peak_rss_mb, reset_peak_rss

    big = torch.ones(64 * 2**20)  # 256 MB, touched
    before, _ = peak_rss_mb(True)
    del big
    assert reset_peak_rss()
    after, over = peak_rss_mb(True)
    assert over == "cell" and after < before - 200
    assert peak_rss_mb(False)[1] == "process"  # a reset that failed: the process's peak, labelled so


def test_a_failed_cell_is_named_in_the_sweep_table():
    from harness.cli.callbacks import COLUMNS, to_markdown

    row = {name: None for name, _, _ in COLUMNS}
    table = to_markdown(
        [
            {**row, "job": 0, "status": "finished", "overrides": "+pair=smollm2 k=1 out_dir=/r"},
            {**row, "job": 1, "status": "failed", "overrides": "+pair=smollm2 k=0 out_dir=/r"},
        ]
    )
    assert "| failed (k=0) |" in table  # the overrides that tell it apart from the sweep's other jobs


def test_a_gpu_index_past_the_visible_ones_is_one_line(monkeypatch):
    from harness.errors import HarnessError
    from harness.models.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(HarnessError, match=r"device=cuda:1 was asked for but this process sees 1 GPU\(s\), cuda:0 to cuda:0"):
        resolve_device("cuda:1")
    with pytest.raises(HarnessError, match="device=mps is not supported: the harness runs on cpu or cuda devices"):
        resolve_device("mps")  # no float64 there


def test_every_setting_the_configs_offer_is_known():
    import dataclasses

    from hydra import compose

    import harness.exactness.main  # noqa: F401 - registers exactness_check
    from harness.config.checks import CONF_DIR, check_command_line, hydra_on_conf

    for argv in (
        [
            "k=2",
            "temperature=0.7",
            "dataset.num_prompts=3",
            "wandb.mode=disabled",
            "prompts.template=raw",
            "out_dir=/tmp/x",
            "++k=7",
            "+hydra.job.name=x",
            "hydra.verbose=true",
            "hydra/launcher=basic",
            "+experiment=short",
        ],
        ["dataset=local", "dataset.path=x.jsonl"],
        ["--cfg", "job", "k=2"],
        ["-m", "k=1,2"],
        ["+pair=llama_7b_68m", "pair.target.id=/m", "pair.target.device_map=auto", "+pair.target.trust_remote_code=true"],
        ["+pair=smollm2_ngram", "pair.draft.length=cost_aware", "pair.draft.max_ngram=4"],
        ["hydra.job.chdir=true", "out_dir=/tmp/abs"],
    ):  # absolute: every job finds its cells
        check_command_line(argv)
    check_command_line(["exactness.num_prompts=1"], config_name="exactness_check")
    for path in (CONF_DIR / "dataset").glob("*.yaml"):  # every key of every option is a setting of its schema
        with hydra_on_conf():
            schema = OmegaConf.get_type(compose("config", [f"dataset={path.stem}"]).dataset)
        assert set(OmegaConf.load(path)) - {"defaults"} <= {f.name for f in dataclasses.fields(schema)}
    for argv, message in (
        (["exactness.num_promts=1"], "did you mean exactness.num_prompts?"),
        (["+temprature=0.7"], "unknown setting 'temprature'"),  # added, read by nothing: a new cell key
        (["+wandb.tag=x"], "unknown setting 'wandb.tag'"),
        (["~dataset.num_prompts"], "every run needs dataset.num_prompts"),
        (["~dataset.id_field"], "every run needs dataset.id_field"),  # a schema's key: set it to null instead
        (["hydra.job.chdir=True"], "never resume"),
    ):
        with pytest.raises(HarnessError, match=message):
            check_command_line(argv, config_name="exactness_check" if "exactness" in argv[0] else "config")


@pytest.mark.cli
@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset.num_prompts=0", "must be a positive integer or null"),
        ("k=2.5", "k=2.5 must be a positive integer"),
        ("max_new_tokens=600", "max_new_tokens=600 leaves no room for a prompt in the pair's 512-token context"),
        ("wandb.mode=sometimes", "wandb.mode=sometimes must be one of"),
        ("force=maybe", "force=maybe must be true or false"),  # Hydra reads off as a string: truthy, it would redo the cell
        ("prompts.shuffle=sometimes", "prompts.shuffle=sometimes must be true or false"),
        ("seed=1.5", "seed=1.5 must be an integer from 0 to"),
        ("seed=abc", "seed=abc must be an integer from 0 to"),
    ],
)
def test_more_bad_values(tiny_pair, tmp_path, override, message):
    out = harness(*tiny_args(tiny_pair, tmp_path, override))
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr


# The context budget: prompt + max_new_tokens - 1 positions, in both models, at every k.


def context_pair(target_context: int, draft_context: int):
    """The tiny target and draft (static caches) with the given context lengths."""
    from conftest import make_model, make_tokenizer, perturbed

    from harness.core.drafters import ModelDrafter
    from harness.models.cached import CachedLM
    from harness.runner.pair import Pair

    tok = make_tokenizer()
    target = make_model(len(tok), seed=1)
    draft = perturbed(target, noise=0.3, seed=2)
    target.config.max_position_embeddings, draft.config.max_position_embeddings = target_context, draft_context
    lms = [CachedLM(model, len(tok), "static") for model in (target, draft)]
    return Pair("p", lms[0], ModelDrafter(lms[1]), tok, set(), torch.device("cpu"))


def peak_lengths(pair) -> dict:
    """The most positions each model's cache holds from now on."""
    peak = {"target": 0, "draft": 0}
    for role, lm in (("target", pair.target), ("draft", pair.drafter.lm)):

        def forward(*args, lm=lm, role=role, real=lm.forward, **kwargs):
            out = real(*args, **kwargs)
            peak[role] = max(peak[role], lm.length)
            return out

        lm.forward = forward
    return peak


@pytest.mark.parametrize("k", [1, 4])
def test_a_prompt_that_fills_the_context_exactly_runs_at_every_k(k):
    """prompt + max_new_tokens - 1 == context: the budget keeps the whole prompt whatever k,
    and the static caches `reserve` sizes hold both models' sequences."""
    from harness.core.loop import autoregressive_decode, speculative_decode
    from harness.core.sampling import Sampling

    context, new = 64, 8
    pair = context_pair(context, context)
    assert pair.prompt_budget(new) == context - new + 1
    ids = torch.randint(3, pair.target.vocab_size, (context - new + 1,), generator=torch.Generator().manual_seed(k))
    assert ids.shape[0] <= pair.prompt_budget(new)  # kept whole, not skipped or cut
    pair.reserve(ids.shape[0], new, k)
    assert pair.target.capacity == pair.drafter.lm.capacity == context
    peak = peak_lengths(pair)
    for temperature in (0.0, 1.0):
        cycles = list(
            speculative_decode(
                pair.target, pair.drafter, ids, k, Sampling(temperature, 0, 1.0), new, set(), torch.Generator().manual_seed(0)
            )
        )
        assert sum(len(c.tokens) for c in cycles) == new
    assert peak["target"] == context and peak["draft"] <= context  # the last slot used, none beyond
    assert len(list(autoregressive_decode(pair.target, ids, Sampling(0.0, 0, 1.0), new, set(), None))) == new


def test_the_budget_is_the_shorter_context_of_target_and_draft():
    from harness.core.loop import speculative_decode
    from harness.core.sampling import Sampling

    pair = context_pair(512, 64)  # e.g. Llama-2-7b (4096) with llama-68m (2048)
    budget = pair.prompt_budget(8)
    assert budget == 64 - 8 + 1
    ids = torch.arange(3, 98)[:budget]  # a prompt as long as the budget allows
    pair.reserve(ids.shape[0], 8, 4)
    peak = peak_lengths(pair)
    for k in (1, 4):
        assert (
            sum(
                len(c.tokens)
                for c in speculative_decode(
                    pair.target, pair.drafter, ids, k, Sampling(0.0, 0, 1.0), 8, set(), torch.Generator().manual_seed(0)
                )
            )
            == 8
        )
    assert peak["draft"] <= 64 and pair.drafter.lm.capacity == 64


@pytest.fixture(scope="module")
def context_64_pair(tmp_path_factory) -> dict[str, Path]:
    """conftest's tiny pair, saved with a 64-token context."""
    pair, root = context_pair(64, 64), tmp_path_factory.mktemp("ctx64")
    paths = {"target": root / "target", "draft": root / "draft"}
    for role, lm in (("target", pair.target), ("draft", pair.drafter.lm)):
        lm.model.save_pretrained(paths[role])
        pair.tokenizer.save_pretrained(paths[role])
    return paths


def test_every_k_of_a_sweep_runs_the_same_prompts_at_full_context(context_64_pair, tmp_path):
    """run_cell end to end with static caches and prompts cut to the budget (prompt + max_new_tokens - 1
    == context), including k >= max_new_tokens, where measuring the k + 1 verify needs room too."""
    from test_config import composed

    from harness.runner.cell import run_cell

    lengths = {}
    for k in (1, 4, 8):
        cfg = composed(
            tiny_args(
                context_64_pair,
                tmp_path,
                f"k={k}",
                "cache=static",
                "max_new_tokens=8",
                "dataset.num_prompts=2",
                "wandb.mode=disabled",
            )
        )
        cell = Path(run_cell(cfg, out_dir=tmp_path, quiet=True)["cell_dir"])
        lengths[k] = [json.loads(line)["prompt_tokens"] for line in (cell / "prompts.jsonl").read_text().splitlines()]
    assert lengths[1] == lengths[4] == lengths[8] and max(lengths[1]) == 64 - 8 + 1


# Re-running a cell.


def _stored_cell(cfg, out: Path) -> Path:
    from harness.runner.store import cell_key

    cell = out / cell_key(cfg)
    cell.mkdir(parents=True)
    (cell / "summary.json").write_text(
        json.dumps({"speedup": 1.5, "cell": cell.name, "cell_dir": "/old/store/" + cell.name, "status": "finished"})
    )
    (cell / "status.json").write_text(json.dumps({"status": "finished", "done": 2, "total": 2}))
    (cell / "prompts.jsonl").write_text("".join(json.dumps({"id": f"p{i}"}) + "\n" for i in range(2)))
    return cell


def test_force_keeps_the_old_results_until_the_redo_can_start(tmp_path, monkeypatch):
    """force=true whose prompts or models do not load (a moved file, Ctrl-C while loading) keeps the
    finished cell; once they have loaded, the old results go before any new one, so a redo stopped
    from then on leaves nothing that marks the cell complete: the next plain run redoes it."""
    from types import SimpleNamespace

    from test_config import composed

    import harness.runner.cell as run
    from harness.errors import HarnessError

    cell = _stored_cell(run.with_default_pair(composed(["wandb.mode=disabled"])), tmp_path)
    stored = {name: (cell / name).read_text() for name in ("summary.json", "status.json", "prompts.jsonl")}

    def raising(error):
        def fail(*args, **kwargs):
            raise error

        return fail

    forced = run.with_default_pair(composed(["wandb.mode=disabled", "force=true"]))
    for step, error in (("load_prompts", HarnessError("dataset.path=x does not exist")), ("load_pair", KeyboardInterrupt())):
        with monkeypatch.context() as patch:
            patch.setattr(run, step, raising(error))
            with pytest.raises(type(error)):
                run.run_cell(forced, out_dir=tmp_path, quiet=True)
        assert {name: (cell / name).read_text() for name in stored} == stored

    monkeypatch.setattr(
        run, "load_pair", lambda *args, **kwargs: SimpleNamespace(prompt_budget=lambda new_tokens: 100, tokenizer=None)
    )
    monkeypatch.setattr(run, "encode", lambda tokenizer, prompt, template: [1, 2, 3])
    monkeypatch.setattr(run, "read_records", raising(KeyboardInterrupt))  # the first step after the removal
    with pytest.raises(KeyboardInterrupt):
        run.run_cell(forced, out_dir=tmp_path, quiet=True)
    assert not any((cell / name).exists() for name in stored)
    with pytest.raises(KeyboardInterrupt):  # not "already complete": it works on the cell again
        run.run_cell(run.with_default_pair(composed(["wandb.mode=disabled"])), out_dir=tmp_path, quiet=True)


def test_a_skipped_cell_reports_where_it_is_now(tmp_path):
    """A complete cell in a results store that moved since it ran: the summary names its current place."""
    from test_config import composed

    import harness.runner.cell as run
    from harness.runner.store import cell_key

    cfg = run.with_default_pair(composed(["wandb.mode=disabled"]))
    cell = _stored_cell(cfg, tmp_path / "moved")
    summary = run.run_cell(cfg, out_dir=tmp_path / "moved", quiet=True)
    assert (summary["cell"], summary["cell_dir"], summary["speedup"]) == (cell_key(cfg), str(cell), 1.5)


@pytest.mark.cli
def test_every_prompt_too_long_and_unwritable_out_dir(tiny_pair, tmp_path):
    out = harness(*tiny_args(tiny_pair, tmp_path, "max_new_tokens=495", "prompts.overlong=skip"))
    assert out.returncode != 0 and "every prompt is longer than the context budget" in out.stderr
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    out = harness(*tiny_args(tiny_pair, blocked))
    assert out.returncode != 0 and "cannot write results" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.cli
def test_missing_dataset_file(tiny_pair, tmp_path):
    out = harness(*tiny_args(tiny_pair, tmp_path / "results", "dataset=local", f"dataset.path={tmp_path / 'nope.jsonl'}"))
    assert out.returncode != 0 and "nope.jsonl" in out.stderr and "Traceback" not in out.stderr
    assert not list((tmp_path / "results").iterdir())  # a run that could not start leaves no empty cell folder


def test_a_run_that_cannot_start_leaves_no_cell_but_keeps_one_that_was_there(tmp_path, monkeypatch):
    """Nothing written (the dataset offline, the model missing, Ctrl-C while loading): the cell folder this
    run made goes, so sweeps do not fill the store with folders holding a config and no result."""
    from test_config import composed

    import harness.runner.cell as run
    from harness.errors import HarnessError
    from harness.runner.store import cell_key

    def offline(*args, **kwargs):
        raise HarnessError("dataset gsm8k is not cached and the hub is not reachable")

    monkeypatch.setattr(run, "load_prompts", offline)
    cfg = run.with_default_pair(composed(["wandb.mode=disabled"]))
    with pytest.raises(HarnessError):
        run.run_cell(cfg, out_dir=tmp_path, quiet=True)
    assert not list(tmp_path.iterdir())
    (tmp_path / cell_key(cfg)).mkdir()  # empty, as a run that waited for the claim finds it: it goes too
    with pytest.raises(HarnessError):
        run.run_cell(cfg, out_dir=tmp_path, quiet=True)
    assert not list(tmp_path.iterdir())
    (tmp_path / cell_key(cfg)).mkdir()
    (tmp_path / cell_key(cfg) / "notes.txt").write_text("the user's")
    with pytest.raises(HarnessError):
        run.run_cell(cfg, out_dir=tmp_path, quiet=True)
    assert (tmp_path / cell_key(cfg) / "notes.txt").exists()


def test_a_claim_on_a_cell_folder_removed_meanwhile_makes_it_again(tmp_path):
    """A run waiting for a claim whose holder stopped before writing anything (and removed the empty
    folder) takes the claim in a new folder instead of failing."""
    from harness.tracking.claims import claim

    with claim(tmp_path / "gone" / "cell", quiet=True) as path:
        assert path.exists() and path.parent.is_dir()


def test_sigterm_while_the_models_load_ends_the_run_as_ctrl_c(tiny_pair, tmp_path, monkeypatch):
    """Before any prompt runs (loading, warm-up), SIGTERM still becomes the interruption
    `python -m harness` turns into exit 130, and the cell's claim is released."""
    from test_config import composed

    import harness.runner.cell as run

    def killed_while_loading(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM was not turned into an interruption")

    def outside(signum, frame):  # without run_cell's own handler, the signal lands here (not on pytest)
        raise AssertionError("SIGTERM during loading was not turned into an interruption")

    monkeypatch.setattr(run, "load_pair", killed_while_loading)
    cfg = composed(tiny_args(tiny_pair, tmp_path)[:-1] + ["wandb.mode=disabled"])
    previous = signal.signal(signal.SIGTERM, outside)
    try:
        with pytest.raises(KeyboardInterrupt):
            run.run_cell(cfg, out_dir=tmp_path)
        assert signal.getsignal(signal.SIGTERM) is outside  # restored afterwards
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not list(tmp_path.glob("*/.claim"))


def test_a_submitit_task_keeps_submitits_sigterm_handling(monkeypatch):
    """submitit ignores SIGTERM on purpose (SLURM sends it on preemption) and requeues on its own
    signal; turning SIGTERM into an interruption there would end the task before the requeue."""
    from harness.runner.signals import sigterm_as_interrupt

    class SignalHandler:  # as submitit.core.job_environment installs it
        def bypass(self, signum, frame):
            pass

    SignalHandler.__module__ = "submitit.core.job_environment"
    submitits = SignalHandler().bypass

    def a_parents(signum, frame):  # a process the task started (a `wandb agent`'s harness) has no submitit handler
        pass

    previous = signal.signal(signal.SIGTERM, submitits)
    try:
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) == submitits
        signal.signal(signal.SIGTERM, a_parents)
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) is not a_parents
        monkeypatch.delenv("SUBMITIT_EXECUTOR")
        signal.signal(signal.SIGTERM, submitits)
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) != submitits
        assert signal.getsignal(signal.SIGTERM) == submitits
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.cli
def test_sigterm_mid_sweep_then_resume_completes_without_duplicates(tiny_pair, tmp_path):
    args = [
        "-m",
        *tiny_args(tiny_pair, tmp_path, "k=1,2", "temperature=1.0", "max_new_tokens=48"),
        "dataset.num_prompts=30",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    lines: list[Path] = []
    while time.time() < deadline:  # wait until the first cell has a few prompts on disk
        lines = list(tmp_path.glob("*/prompts.jsonl"))
        if lines and len(lines[0].read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and "Traceback" not in stderr
    cell = lines[0].parent
    status = json.loads((cell / "status.json").read_text())
    assert status["status"] == "interrupted" and 3 <= status["done"] < 30
    assert not (cell / "summary.json").exists()
    pointer = json.loads((tmp_path / "sweep" / "0" / "cell.json").read_text())  # the sweep's table lists it already
    assert (pointer["status"], pointer["cell_dir"]) == ("interrupted", str(cell))
    assert "| interrupted" in (tmp_path / "sweep" / "aggregate.md").read_text()
    kept = [json.loads(line)["id"] for line in (cell / "prompts.jsonl").read_text().splitlines()]

    rerun = harness(*args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    cells = sorted(tmp_path.glob("*/summary.json"))
    assert len(cells) == 2  # both cells of the sweep are complete
    for summary_path in cells:
        ids = [json.loads(line)["id"] for line in (summary_path.parent / "prompts.jsonl").read_text().splitlines()]
        assert len(ids) == 30 == len(set(ids))  # complete, no duplicated rows
        assert json.loads((summary_path.parent / "status.json").read_text())["status"] == "finished"
    resumed = [json.loads(line)["id"] for line in (cell / "prompts.jsonl").read_text().splitlines()]
    assert resumed[: len(kept)] == kept  # prompts finished before the interruption were not redone


@pytest.mark.cli
def test_directory_that_is_not_a_model_and_bad_dataset_files(tiny_pair, tmp_path):
    empty_dir = tmp_path / "not_a_model"
    empty_dir.mkdir()
    out = harness(*tiny_args(tiny_pair, tmp_path, f"pair.draft.id={empty_dir}"))
    assert out.returncode != 0 and "not a saved model" in out.stderr and "Traceback" not in out.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = harness(*tiny_args(tiny_pair, tmp_path, "dataset=local", f"dataset.path={empty}"))
    assert out.returncode != 0 and "empty.jsonl" in out.stderr and "Traceback" not in out.stderr
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"question": "hi", "category": "qa"}\n')
    out = harness(*tiny_args(tiny_pair, tmp_path, "dataset=local", f"dataset.path={no_field}", "dataset.text_field=prompt"))
    assert out.returncode != 0 and "Traceback" not in out.stderr and "prompt" in out.stderr


OOM_CLI = """
import torch
import harness.runner.cell as run
real = run.run_batch
def run_batch(pair, rows, batch, cfg, sampling):
    if cfg.k == 2 and rows[0][2] == 1:  # this cell runs out of memory on its second prompt
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
    return real(pair, rows, batch, cfg, sampling)
run.run_batch = run_batch
import runpy
runpy.run_module("harness", run_name="__main__", alter_sys=True)  # as `python -m harness`
"""


@pytest.mark.cli
def test_a_cell_out_of_memory_is_recorded_and_the_sweep_goes_on(tiny_pair, tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *tiny_args(tiny_pair, tmp_path, "k=1,2,3", "dataset.num_prompts=3", "max_new_tokens=8"),
        f"hydra.sweep.dir={sweep}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", OOM_CLI, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]  # the sweep ran to its end, then says a cell failed
    assert "error: out of memory: CUDA out of memory" in out.stderr and "Traceback" not in out.stderr
    rows = (sweep / "aggregate.md").read_text()
    assert rows.count("| finished |") == 2 and rows.count("| failed (k=") == 1
    assert "out of memory: CUDA out of memory" in (sweep / "aggregate.csv").read_text()  # the error, per failed cell
    cells = {}
    for status in tmp_path.glob("*/status.json"):
        config = (status.parent / "config.yaml").read_text()
        k = next(int(line.split(":")[1]) for line in config.splitlines() if line.startswith("k:"))
        cells[k] = (status.parent, json.loads(status.read_text()))
    assert cells[1][1]["status"] == cells[3][1]["status"] == "finished"
    failed_dir, failed = cells[2]
    assert failed["status"] == "failed" and "OutOfMemoryError" in failed["error"] and failed["done"] == 1
    assert len((failed_dir / "prompts.jsonl").read_text().splitlines()) == 1  # the prompt before the failure is kept
    assert not (failed_dir / "summary.json").exists()


def test_the_output_folder_check_leaves_printing_alone_and_checks_the_folder_hydra_makes(monkeypatch):
    from harness.config.checks import check_command_line

    with pytest.raises(HarnessError, match=r"^hydra.run.dir=/etc/passwd/x: /etc/passwd is a file"):
        check_command_line(["hydra.run.dir=/etc/passwd/x"])
    check_command_line(["hydra.run.dir=/etc/passwd/x", "--cfg", "job"])  # Hydra only prints
    with pytest.raises(HarnessError, match="is a file"):
        check_command_line(["-cn", "config", "hydra.run.dir=/etc/passwd/x"])  # -cn: a config name, not an override
    with pytest.raises(HarnessError, match="is a file"):
        check_command_line(["hydra.run.dir=/etc/passwd/${now:%Y}"])  # resolved as Hydra will
    monkeypatch.setattr("os.access", lambda *a: False)  # as in a read-only current folder
    with pytest.raises(HarnessError, match="is not writable"):
        check_command_line([])


@pytest.mark.cli
@pytest.mark.parametrize(
    "force, advice",
    [
        ("false", "run the same command again to resume"),
        ("true", "run it again with force=false to resume (force=true starts the cell over)"),
    ],
)
def test_the_interrupt_message_says_how_to_resume(force, advice, tmp_path):
    """force=true redoes a cell from the start, so "the same command" would not resume it."""
    script = (
        "import harness.runner.cell as run\n"
        "def interrupted(*a, **k):\n    raise KeyboardInterrupt\n"
        "run.run_cell = interrupted\n"
        "import runpy\nrunpy.run_module('harness', run_name='__main__', alter_sys=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, f"force={force}", f"out_dir={tmp_path}", f"hydra.run.dir={tmp_path}/h"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "WANDB_MODE": "disabled"},
        timeout=120,
    )
    assert out.returncode == 130 and f"interrupted: finished prompts are saved; {advice}" in out.stderr, out.stderr
