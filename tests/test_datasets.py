"""Prompt sets (conf/dataset/): local files through datasets.load_dataset, the
Spec-Bench question format, every hub config composing and failing in one
line without the hub, cached hub sets offline, overlong prompts cut in the
middle of their text, and categories in results.

Nothing here reaches the network: the hub sets are either refused (offline)
or read from a cache laid out the way a connected machine leaves it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import datasets
import pandas as pd
import pytest
from conftest import make_tokenizer
from hydra import compose, initialize_config_dir

from harness.config.checks import CONF_DIR, validate, with_default_pair
from harness.data.datasets import load_prompts
from harness.data.prompts import encode, encode_within, load_builtin, select
from harness.errors import HarnessError

ROOT = Path(__file__).parent.parent
DATASETS = sorted(p.stem for p in (CONF_DIR / "dataset").glob("*.yaml"))
HUB = {  # name: (hf id, config, split, fixed category or None when the set has a category field)
    "mt_bench": ("philschmid/mt-bench", None, "train", None),
    "gsm8k": ("openai/gsm8k", "main", "test", "math"),
    "humaneval": ("openai/openai_humaneval", None, "test", "code"),
    "cnn_dailymail": ("abisee/cnn_dailymail", "3.0.0", "test", "summarization"),
    "wmt14_de_en": ("wmt/wmt14", "de-en", "test", "translation"),
}
# Spec-Bench / MT-Bench question.jsonl: integer ids, several turns, `reference` on some rows only.
SPEC_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post about Hawaii.", "Rewrite it in one line."]},
    {"question_id": 82, "category": "writing", "turns": ["Draft an email asking for feedback."]},
    {
        "question_id": 111,
        "category": "math",
        "turns": ["What is the area of a unit circle?", "And its perimeter?"],
        "reference": ["pi", "2 pi"],
    },
    {"question_id": 112, "category": "math", "turns": ["Solve 2x + 3 = 7."], "reference": ["x = 2"]},
    {"question_id": 113, "category": "math", "turns": ["What is 17 * 3?"], "reference": ["51"]},
]


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def table_prompts(table: Path) -> list[dict]:
    """The prompts of a local table whose columns are uid (the ids), task (the categories) and text."""
    return load_prompts(
        composed(
            "dataset=local",
            f"dataset.path={table}",
            "dataset.text_field=text",
            "dataset.category_field=task",
            "dataset.id_field=uid",
        ).dataset
    )


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(autouse=True)
def offline_cache(tmp_path, monkeypatch) -> Path:
    """A fresh datasets cache per test, and the hub switched off."""
    cache = tmp_path / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def fake_hub_cache(cache: Path, hf_id: str, config: str | None, split: str, rows: list[dict], work: Path) -> None:
    """Lay `rows` out as datasets caches a hub set after one online
    load_dataset(hf_id, config, split=split): <cache>/<ns>___<name>/<config>/<version>/<hash>/
    holding dataset_info.json and <name>-<split>.arrow. Copying such a cache to
    an offline machine is one of the fixes the offline message offers."""
    work.mkdir(parents=True, exist_ok=True)
    builder = datasets.load_dataset_builder(
        "json", data_files={split: str(write_jsonl(work / "rows.jsonl", rows))}, cache_dir=str(work / "build")
    )
    builder.download_and_prepare()
    namespace, name = hf_id.split("/")
    target = cache / f"{namespace}___{name}" / (config or "default") / "0.0.0" / "0123abcd"
    shutil.copytree(builder.cache_dir, target)
    (target / f"json-{split}.arrow").rename(target / f"{name}-{split}.arrow")
    info = json.loads((target / "dataset_info.json").read_text())
    info.update(config_name=config or "default", dataset_name=name, builder_name="parquet")
    (target / "dataset_info.json").write_text(json.dumps(info))


# ------------------------------------------------------------------ configs


@pytest.mark.parametrize("name", DATASETS)
def test_every_dataset_config_composes(name):
    cfg = with_default_pair(composed(f"dataset={name}"))
    validate(cfg)
    d = cfg.dataset
    assert d.name == name and d.source in ("builtin", "hub", "local")
    assert d.text_field or d.template
    assert d.category_field or d.category
    if name in HUB:
        hf_id, config, split, category = HUB[name]
        assert (d.hf_id, d.hf_config, d.split) == (hf_id, config, split)
        assert d.category == category and d.num_prompts == (80 if name == "mt_bench" else 100)
        assert "path" in d and "streaming" in d  # a local export and streaming are an override away


@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_sets_without_the_hub_fail_in_one_line(name):
    start = time.perf_counter()
    with pytest.raises(HarnessError) as err:
        load_prompts(composed(f"dataset={name}").dataset)
    message = str(err.value)
    assert time.perf_counter() - start < 5
    assert "\n" not in message
    assert HUB[name][0] in message and "HF_DATASETS_CACHE" in message and "dataset.path=" in message


# ------------------------------------------------------------- local files


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_local_files_go_through_load_dataset(fmt, tmp_path, monkeypatch):
    rows = [{"uid": f"r{i}", "task": "ab"[i % 2], "text": f"prompt number {i}"} for i in range(6)]
    path = tmp_path / f"prompts.{fmt}"
    {
        "jsonl": lambda: write_jsonl(path, rows),
        "json": lambda: path.write_text(json.dumps(rows)),
        "csv": lambda: pd.DataFrame(rows).to_csv(path, index=False),
        "parquet": lambda: pd.DataFrame(rows).to_parquet(path),
    }[fmt]()
    calls = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
    cfg = composed(
        "dataset=local", f"dataset.path={path}", "dataset.text_field=text", "dataset.category_field=task", "dataset.id_field=uid"
    )
    prompts = load_prompts(cfg.dataset)
    assert calls == [{"parquet": "parquet", "csv": "csv"}.get(fmt, "json")]
    assert prompts == [{"id": r["uid"], "category": r["task"], "prompt": r["text"]} for r in rows]


def test_spec_bench_question_file_works_as_is(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", SPEC_BENCH)
    prompts = load_prompts(composed("dataset=local", f"dataset.path={path}").dataset)
    assert [p["id"] for p in prompts] == ["81", "82", "111", "112", "113"]
    assert prompts[0] == {"id": "81", "category": "writing", "prompt": "Write a travel blog post about Hawaii."}  # first turn
    assert [p["category"] for p in select(prompts, 4, 0, False)] == ["writing", "math", "writing", "math"]
    # The mt_bench config reads the same file in place of the hub.
    assert load_prompts(composed("dataset=mt_bench", f"dataset.path={path}").dataset) == prompts


def test_builtin_set_goes_through_load_dataset():
    assert load_prompts(composed("dataset=builtin").dataset) == load_builtin()


def test_instruction_templates_and_fixed_categories(tmp_path):
    news = write_jsonl(tmp_path / "cnn.jsonl", [{"id": "a1", "article": "Rain fell.", "highlights": "Rain."}])
    [p] = load_prompts(composed("dataset=cnn_dailymail", f"dataset.path={news}").dataset)
    assert p == {
        "id": "a1",
        "category": "summarization",
        "prompt": "Summarize the following article in three sentences.\n\nRain fell.",
    }
    pairs = write_jsonl(tmp_path / "wmt.jsonl", [{"translation": {"de": "Guten Morgen.", "en": "Good morning."}}])
    [p] = load_prompts(composed("dataset=wmt14_de_en", f"dataset.path={pairs}").dataset)
    assert p == {
        "id": "wmt14_de_en-0",
        "category": "translation",
        "prompt": "Translate the following German text into English.\n\nGuten Morgen.",
    }
    # A bare list field is its first item; an indexed one picks the item.
    questions = write_jsonl(tmp_path / "question.jsonl", SPEC_BENCH[:1])
    [p] = load_prompts(
        composed("dataset=local", f"dataset.path={questions}", "dataset.template='{turns} | {turns[1]} ({category})'").dataset
    )
    assert p["prompt"] == "Write a travel blog post about Hawaii. | Rewrite it in one line. (writing)"


def test_more_prompts_than_the_set_warns_and_uses_all(tmp_path, capsys):
    path = write_jsonl(tmp_path / "question.jsonl", SPEC_BENCH)
    prompts = load_prompts(composed("dataset=local", f"dataset.path={path}", "dataset.num_prompts=50").dataset)
    assert len(prompts) == 5
    assert "warning: dataset.num_prompts=50 but local has 5 prompts" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, overrides, message",
    [
        (None, [], "does not exist"),
        ("", [], "is empty"),
        ("\n", [], "holds no rows"),
        ('{"turns": ["hi"]}\nnot json\n', [], "cannot be read as json"),
        (  # a field named is read, whatever the file has that the defaults would find
            '{"question_id": 1, "prompt": "hi", "category": "x"}\n',
            ["dataset.text_field=turns"],
            "has no field 'turns' (its fields: question_id, prompt, category)",
        ),
        (
            '{"question_id": 1, "turns": ["hi"]}\n',
            ["dataset.category_field=category"],
            "set dataset.category_field to one of them",
        ),
        (
            '{"qid": 1, "turns": ["hi"], "category": "x"}\n',
            ["dataset.id_field=question_id"],
            "has no field 'question_id' (its fields: qid, turns, category): set dataset.id_field to one of them, or dataset.id_field=null",
        ),
        ('{"turns": ["hi"], "category": "x"}\n', ["dataset.id_field=qid"], "has no field 'qid'"),
        ('{"turns": ["hi"], "category": "x"}\n', ["dataset.template='{turns.__class__}'"], "is not a row field"),
        (
            '{"question_id": 1, "turns": ["a"], "category": "x"}\n{"question_id": 1, "turns": ["b"], "category": "x"}\n',
            [],
            "appears twice",
        ),
    ],
    ids=[
        "missing",
        "empty",
        "blank",
        "malformed",
        "no-text-field",
        "no-category-field",
        "no-id-field",
        "misspelled-id-field",
        "attribute-template",
        "duplicate-ids",
    ],
)
def test_bad_local_files_are_one_line(tmp_path, content, overrides, message):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(HarnessError) as err:
        load_prompts(composed("dataset=local", f"dataset.path={path}", *overrides).dataset)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_text_field_of_messages_or_pairs_is_one_line_with_the_template_that_reads_it(tmp_path):
    """Chat messages (a list of dicts) or a translation pair (a dict) sent as their Python repr would
    be no prompt anyone meant: stop, and name the template that picks the text out of them."""
    rows = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"id": 1, "messages": [{"role": "user", "content": "Hi there"}], "translation": {"de": "Hallo", "en": "Hello"}}],
    )
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    base = ("dataset=local", f"dataset.path={rows}", "dataset.id_field=id", "dataset.category_field=null")
    for field, message in (
        (
            "messages",
            "dataset.text_field=messages of local holds dict values (keys: role, content), not text: "
            """pick a field that holds the prompt, or build it with 'dataset.template="{messages[0][content]}"'""",
        ),
        ("translation", "holds dict values (keys: de, en), not text"),
    ):
        with pytest.raises(HarnessError) as err:
            load_prompts(composed(*base, f"dataset.text_field={field}").dataset)
        assert message in str(err.value)
        suggested = shlex.split(str(err.value).rpartition("build it with ")[2])[0]  # as the shell hands it to Hydra
        assert OverridesParser.create().parse_overrides([suggested]) and suggested.startswith(
            "dataset.template="
        )  # Hydra parses it
    [p] = load_prompts(
        composed(*base, "dataset.text_field=null", "dataset.template='{messages[0][content]} / {translation[de]}'").dataset
    )
    assert p["prompt"] == "Hi there / Hallo"


def test_null_fields_and_float_ids(tmp_path):
    """A null template field is empty (not "None"), as a missing one is; a csv
    integer id column with a gap reads as floats, and its ids stay '1', not '1.0'."""
    rows = write_jsonl(
        tmp_path / "p.jsonl", [{"question_id": 1, "category": "a", "turns": ["Hi."], "hint": None, "pair": {"de": None}}]
    )
    [p] = load_prompts(
        composed("dataset=local", f"dataset.path={rows}", "dataset.template='{turns} [{hint}] [{pair[de]}]'").dataset
    )
    assert p["prompt"] == "Hi. [] []"
    table = tmp_path / "p.csv"
    table.write_text("uid,text,task\n1,hello,a\n,world,b\n3,again,a\n")
    prompts = table_prompts(table)
    assert [p["id"] for p in prompts] == ["1", "local-1", "3"]


def test_unknown_extension_is_one_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("hello\n")
    with pytest.raises(HarnessError, match="dataset.format=json"):
        load_prompts(composed("dataset=local", f"dataset.path={path}").dataset)


def test_a_file_that_is_not_utf8_is_one_line(tmp_path):
    """pyarrow reads a jsonl's bytes unchecked and decodes them per row, outside load_dataset."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"question_id": 1, "category": "a", "turns": ["h\xe9llo"]}\n'.encode("latin-1"))
    with pytest.raises(HarnessError, match="not UTF-8 .*save the file as UTF-8"):
        load_prompts(composed("dataset=local", f"dataset.path={path}").dataset)


def test_a_path_is_a_file_name_not_a_glob_pattern(tmp_path):
    """p[1].jsonl as a pattern matches p1.jsonl: the results would hash one file and hold another's prompts."""
    write_jsonl(tmp_path / "p[1].jsonl", [{"question_id": 1, "category": "a", "turns": ["the right file"]}])
    write_jsonl(tmp_path / "p1.jsonl", [{"question_id": 9, "category": "a", "turns": ["WRONG FILE"]}])
    prompts = load_prompts(composed("dataset=local", f"dataset.path='{tmp_path / 'p[1].jsonl'}'").dataset)
    assert [p["prompt"] for p in prompts] == ["the right file"]


def test_a_streamed_set_without_max_rows_is_read_to_its_end():
    """Reading only num_prompts rows of the builtin set (stored category by category) left categories out."""
    for streaming in ("false", "true"):
        cfg = composed("dataset=builtin", "dataset.num_prompts=12", f"dataset.streaming={streaming}").dataset
        chosen = select(load_prompts(cfg), cfg.num_prompts, 0, shuffle=False)
        assert len({p["category"] for p in chosen}) == 6, streaming


# --------------------------------------------------------- cached hub sets


def test_cached_hub_sets_load_offline(offline_cache, tmp_path):
    questions = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(5)]
    fake_hub_cache(offline_cache, "openai/gsm8k", "main", "test", questions, tmp_path)
    prompts = load_prompts(composed("dataset=gsm8k").dataset)
    assert [p["id"] for p in prompts] == [f"gsm8k-{i}" for i in range(5)]
    assert prompts[1] == {"id": "gsm8k-1", "category": "math", "prompt": "What is 1 + 1?"}
    # A streamed set reads only its window of max_rows (never fewer than num_prompts) from the cache.
    articles = [{"id": f"n{i}", "article": f"Story {i}.", "highlights": "."} for i in range(8)]
    fake_hub_cache(offline_cache, "abisee/cnn_dailymail", "3.0.0", "test", articles, tmp_path / "cnn")
    prompts = load_prompts(composed("dataset=cnn_dailymail", "dataset.num_prompts=2", "dataset.max_rows=3").dataset)
    assert [p["id"] for p in prompts] == ["n0", "n1", "n2"] and prompts[0]["prompt"].endswith("Story 0.")


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    "override, key, there", [("dataset.split=tset", "split", "test"), ("dataset.hf_config=mian", "hf_config", "main")]
)
def test_a_split_or_config_the_cached_set_lacks_is_named(offline_cache, tmp_path, override, key, there, streaming):
    """Not 'not in the datasets cache': the wrong value, the ones there are, and the setting to change."""
    fake_hub_cache(offline_cache, "openai/gsm8k", "main", "test", [{"question": "Q?", "answer": "A"}], tmp_path)
    with pytest.raises(HarnessError) as err:
        load_prompts(composed("dataset=gsm8k", override, f"dataset.streaming={streaming}").dataset)
    message = str(err.value)
    assert message.startswith(f"{override} is not a ") and f"are {there}; set dataset.{key} to one of them" in message
    assert "not in the datasets cache" not in message and "\n" not in message


@pytest.mark.parametrize("streaming", [False, True])
def test_a_null_split_names_the_splits(offline_cache, tmp_path, streaming):
    """split=null makes load_dataset return every split: its split names are no fields."""
    fake_hub_cache(offline_cache, "openai/gsm8k", "main", "test", [{"question": "Q?", "answer": "A"}], tmp_path)
    with pytest.raises(
        HarnessError, match="dataset.split=null reads every split of openai/gsm8k .*set dataset.split to one of test"
    ):
        load_prompts(composed("dataset=gsm8k", "dataset.split=null", f"dataset.streaming={streaming}").dataset)


def test_unreachable_hub_without_offline_variables_fails_fast(offline_cache, tmp_path):
    """No HF_*_OFFLINE set and the hub refusing connections: the cache is used
    at once, and a set not in it gets the one line in seconds, not after retries."""
    fake_hub_cache(offline_cache, "openai/gsm8k", "main", "test", [{"question": "Q?", "answer": "A"}], tmp_path)
    script = textwrap.dedent(f"""
        import time
        from hydra import compose, initialize_config_dir
        import harness.config.checks  # registers the settings' schema that conf/ extends
        from harness.data.datasets import load_prompts
        from harness.errors import HarnessError
        with initialize_config_dir(config_dir={str(CONF_DIR)!r}, version_base="1.3"):
            print(load_prompts(compose("config", overrides=["dataset=gsm8k"]).dataset))
            start = time.perf_counter()
            try:
                load_prompts(compose("config", overrides=["dataset=humaneval"]).dataset)
            except HarnessError as err:
                print(f"{{time.perf_counter() - start:.1f}}", err)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_DATASETS_CACHE=str(offline_cache))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    cached, failed = out.stdout.strip().splitlines()
    assert "'prompt': 'Q?'" in cached
    seconds, message = failed.split(" ", 1)
    assert float(seconds) < 5 and "openai/openai_humaneval" in message and "unreachable" in message


def online_hub_raising(monkeypatch, err: Exception) -> None:
    """The hub reachable (no offline flag, the connection check passing) and load_dataset raising `err`."""
    import harness.base.hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(harness.base.hub, "hub_reachable", lambda: True)

    def fail(*args, **kwargs):
        raise err

    monkeypatch.setattr(datasets, "load_dataset", fail)


@pytest.mark.parametrize(
    "make_error, says, not_says",
    [
        (
            lambda: datasets.exceptions.DatasetNotFoundError(
                "Dataset 'openai/gsm8k' doesn't exist on the Hub or cannot be accessed."
            ),
            "is not on the hub or is gated (Dataset 'openai/gsm8k' doesn't exist",
            "not in the datasets cache",
        ),
        (
            lambda: datasets.exceptions.DataFilesNotFoundError("No (supported) data files found in openai/gsm8k"),
            "has no data files that datasets can read (No (supported) data files found",
            "hub is",
        ),
        (
            lambda: datasets.data_files.EmptyDatasetError(
                "The directory at hf://datasets/openai/gsm8k doesn't contain any data files"
            ),
            "has no data files that datasets can read",
            "hub is",
        ),
        (
            lambda: ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (ConnectError)"),
            "the hub is failing (Couldn't reach 'openai/gsm8k' on the Hub (ConnectError)): cache it",
            "gated",
        ),
        (
            lambda: ValueError("Unknown split \"tset\". Should be one of ['test', 'train']."),
            "dataset.split=test is not a split of openai/gsm8k (gsm8k): its splits are test, train",
            "cache",
        ),
        (
            lambda: datasets.exceptions.DatasetGenerationError("An error occurred while generating the dataset"),
            "could not be read: An error occurred",
            "hub is",
        ),
    ],
    ids=["not-found", "no-data-files", "empty", "connection", "unknown-split", "generation"],
)
def test_a_hub_failure_is_told_by_its_exception_class(monkeypatch, make_error, says, not_says):
    """Each class of error load_dataset raises gets its own one line: a set that is not there, one without
    data files, a hub out of reach, a split it lacks, a file that does not parse."""
    online_hub_raising(monkeypatch, make_error())
    with pytest.raises(HarnessError) as err:
        load_prompts(composed("dataset=gsm8k").dataset)
    message = str(err.value)
    assert message.startswith("dataset") and says in message and not_says not in message and "\n" not in message


def test_only_a_bare_value_error_is_read_as_an_unknown_split(monkeypatch):
    """The split and config names are told by the text of a bare ValueError alone: a subclass (pyarrow's,
    huggingface_hub's) with the same words is another failure, and is shown as the library says it."""

    class OtherValueError(ValueError):
        pass

    online_hub_raising(monkeypatch, OtherValueError("Unknown split \"tset\". Should be one of ['test']."))
    with pytest.raises(HarnessError) as err:
        load_prompts(composed("dataset=gsm8k").dataset)
    assert str(err.value) == (
        "dataset openai/gsm8k (gsm8k), dataset.hf_config=main dataset.split=test: "
        "Unknown split \"tset\". Should be one of ['test']."
    )


# --------------------------------------------------------- overlong prompts


INSTRUCTION, QUESTION = "Answer from the text. ", " Who won?"
LONG = INSTRUCTION + "The match went on. " * 20 + QUESTION


def parts(tok, text: str, template: str) -> tuple[list[int], list[int]]:
    """The ids before and after the text's in the encoded prompt: BOS, role header / generation prompt."""
    full, body = encode(tok, text, template), tok(text, add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(full)) if full[i : i + len(body)] == body)
    return full[:start], full[start + len(body) :]


@pytest.mark.parametrize("template", ["chat", "raw"])
def test_overlong_prompts_lose_the_middle_of_their_text(template):
    tok = make_tokenizer()
    prefix, suffix = parts(tok, LONG, template)
    assert template == "raw" or (prefix[0] == tok.bos_token_id and suffix)  # the chat template has both
    instruction, question = (tok(t, add_special_tokens=False)["input_ids"] for t in (INSTRUCTION, QUESTION))
    for budget in (70, 71, 101):  # room for both ends: the text keeps as much of its start as of its end
        ids = encode_within(tok, LONG, template, budget, "truncate")
        assert budget - 1 <= len(ids) <= budget
        assert ids[: len(prefix)] == prefix and ids[len(ids) - len(suffix) :] == suffix
        body = ids[len(prefix) : len(ids) - len(suffix)]
        assert body[: len(instruction)] == instruction and body[-len(question) :] == question
    full = encode(tok, LONG, template)
    assert encode_within(tok, LONG, template, len(full), "truncate") == full
    assert encode_within(tok, LONG, template, len(full) - 1, "skip") is None
    assert encode_within(tok, LONG, template, len(full), "skip") == full


def test_a_template_longer_than_the_budget_is_one_line():
    with pytest.raises(HarnessError, match="the prompt template alone takes 18 tokens, more than the 10-token context budget"):
        encode_within(make_tokenizer(), LONG, "chat", 10, "truncate")


# ------------------------------------------------------------------ results


@pytest.mark.cli
def test_categories_flow_into_results(tiny_pair, tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", SPEC_BENCH)
    args = [
        "+pair=llama_7b_68m",
        f"pair.target.id={tiny_pair['target']}",
        f"pair.draft.id={tiny_pair['draft']}",
        "dataset=local",
        f"dataset.path={path}",
        "dataset.num_prompts=4",
        "max_new_tokens=8",
        f"out_dir={tmp_path / 'out'}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    out = subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    cell = Path(json.loads(out.stdout.strip().splitlines()[-1])["cell_dir"])
    summary = json.loads((cell / "summary.json").read_text())
    assert sorted(summary["categories"]) == ["math", "writing"]
    assert all(summary["categories"][c]["num_prompts"] == 2 for c in ("math", "writing"))
    assert summary["prompt_ids"] == ["81", "111", "82", "112"]  # round-robin over categories
    records = [json.loads(line) for line in (cell / "prompts.jsonl").read_text().splitlines()]
    assert {r["id"]: r["category"] for r in records} == {"81": "writing", "82": "writing", "111": "math", "112": "math"}
    assert "writing" in out.stdout and "math" in out.stdout  # the per-category table


def test_csv_cells_are_read_as_the_file_has_them(tmp_path):
    """pandas would read id 001 as 1, and NA, None or N/A as missing: a category lost, a prompt dropped."""
    table = tmp_path / "c.csv"
    table.write_text("uid,task,text\n001,NA,hello there\n002,EU,N/A\n003,None,plain\n,x,no id\n")
    prompts = table_prompts(table)
    assert [(p["id"], p["category"], p["prompt"]) for p in prompts] == [
        ("001", "NA", "hello there"),
        ("002", "EU", "N/A"),
        ("003", "None", "plain"),
        ("local-3", "x", "no id"),
    ]


def test_a_file_rewritten_with_its_time_kept_is_read_anew(tmp_path):
    """datasets caches a local file by path and modification time: cp -p or touch -r keep the time, and the
    old prompts would run under the cell key of the new content."""
    rows = tmp_path / "q.jsonl"
    for text in ("old text", "new and longer text"):
        write_jsonl(rows, [{"question_id": 1, "category": "a", "turns": [text]}])
        os.utime(rows, (1_700_000_000, 1_700_000_000))
        [p] = load_prompts(composed("dataset=local", f"dataset.path={rows}").dataset)
        assert p["prompt"] == text


def test_a_template_that_renders_empty_skips_the_row(tmp_path):
    rows = write_jsonl(tmp_path / "e.jsonl", [{"a": "x", "b": None}, {"a": "y", "b": "kept"}])
    prompts = load_prompts(
        composed(
            "dataset=local",
            f"dataset.path={rows}",
            "dataset.text_field=a",
            "dataset.template='{b}'",
            "dataset.id_field=null",
            "dataset.category_field=null",
        ).dataset
    )
    assert [p["prompt"] for p in prompts] == ["kept"]


def test_csv_numbers_take_number_formats_and_blank_first_lines_are_skipped(tmp_path):
    table = tmp_path / "n.csv"
    table.write_text("\n  \nid,text,score,n\n1,hi,3.14159,7\n")
    [p] = load_prompts(
        composed(
            "dataset=local",
            f"dataset.path={table}",
            "dataset.text_field=text",
            "dataset.template='{text} {score:.2f} {n:03d} {text:>4}'",
            "dataset.id_field=id",
            "dataset.category_field=null",
        ).dataset
    )
    assert (p["id"], p["prompt"]) == ("1", "hi 3.14 007   hi")


def test_rows_a_template_renders_empty_are_named_by_the_template(tmp_path, capsys):
    rows = write_jsonl(tmp_path / "t.jsonl", [{"text": ""}, {"text": "kept"}])
    prompts = load_prompts(
        composed(
            "dataset=local",
            f"dataset.path={rows}",
            "dataset.text_field=null",
            "dataset.template='{text}'",
            "dataset.id_field=null",
            "dataset.category_field=null",
        ).dataset
    )
    assert [p["prompt"] for p in prompts] == ["kept"]
    assert "1 of 2 rows have an empty dataset.template (as rendered) and were left out" in capsys.readouterr().err


def test_a_hub_sets_revision_reaches_load_dataset_and_the_cell_key(monkeypatch):
    """Pinning a revision reads those rows and is another cell; unpinned is the same cell as a config without the setting."""
    from omegaconf import OmegaConf, open_dict

    from harness.runner.store import cell_key

    seen = {}

    def fake_load(hf_id, config=None, split=None, streaming=False, revision=None):
        seen["revision"] = revision
        return datasets.Dataset.from_list([{"question": "What is 2 + 2?"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    [p] = load_prompts(composed("dataset=gsm8k", "dataset.revision=abc123", "dataset.num_prompts=1").dataset)
    assert seen["revision"] == "abc123" and p["prompt"] == "What is 2 + 2?"
    unpinned = with_default_pair(composed("dataset=gsm8k"))
    without = OmegaConf.create(OmegaConf.to_container(unpinned))  # untyped: the setting can be left out
    with open_dict(without):
        del without.dataset["revision"]  # a config without the setting
    assert (
        cell_key(unpinned)
        == cell_key(without)
        != cell_key(with_default_pair(composed("dataset=gsm8k", "dataset.revision=abc123")))
    )


# ------------------------------------------------- file layouts and config types


@pytest.mark.parametrize("layout", ["lists", "pandas-default"])
def test_a_column_oriented_json_file_is_one_line(tmp_path, layout, capsys):
    """json.dump(df.to_dict("list")) or df.to_json() is one object of columns: datasets reads it as one
    row, whose first list items (or an index-keyed dict) would silently be the only prompt."""
    frame = pd.DataFrame(
        {"id": ["q1", "q2", "q3"], "prompt": ["What is 2+2?", "Name a color.", "Say hi."], "task": ["math", "chat", "chat"]}
    )
    path = tmp_path / "cols.json"
    if layout == "lists":
        path.write_text(json.dumps(frame.to_dict("list")))
    else:
        frame.to_json(path)
    with pytest.raises(HarnessError) as err:
        load_prompts(
            composed(
                "dataset=local",
                f"dataset.path={path}",
                "dataset.text_field=prompt",
                "dataset.category_field=task",
                "dataset.id_field=id",
            ).dataset
        )
    message = str(err.value)
    assert "column-oriented" in message and "orient" in message and "jsonl" in message and "\n" not in message
    assert "dataset.template" not in message
    # One row of its own, whose turns hold two items, is a row.
    one = tmp_path / "one.json"
    one.write_text(json.dumps(SPEC_BENCH[:1]))
    [p] = load_prompts(composed("dataset=local", f"dataset.path={one}").dataset)
    assert p["prompt"] == SPEC_BENCH[0]["turns"][0]
    # So is one whose fields are all lists of two but that has no id or category per row: a warning, not a refusal.
    lists = write_jsonl(
        tmp_path / "lists.jsonl", [{"turns": ["Write a poem about cats.", "Now make it rhyme."], "tags": ["a", "b"]}]
    )
    [p] = load_prompts(
        composed("dataset=local", f"dataset.path={lists}", "dataset.id_field=null", "dataset.category_field=null").dataset
    )
    assert p["prompt"] == "Write a poem about cats." and "looks column-oriented" in capsys.readouterr().err


def test_a_dict_text_field_keyed_by_numbers_gets_no_template_that_cannot_read_it(tmp_path):
    """str.format reads {text[0]} as the int key 0: a hint naming it would fail when followed."""
    rows = write_jsonl(tmp_path / "d.jsonl", [{"text": {"0": "a", "1": "b"}}, {"text": {"0": "c", "1": "d"}}])
    base = ("dataset=local", f"dataset.path={rows}", "dataset.id_field=null", "dataset.category_field=null")
    with pytest.raises(HarnessError) as err:
        load_prompts(composed(*base, "dataset.text_field=text").dataset)
    assert "holds dict values (keys: 0, 1), not text" in str(err.value) and "dataset.template" not in str(err.value)


@pytest.mark.parametrize("streaming", [False, True])
def test_class_label_categories_and_ids_are_their_names(tmp_path, streaming):
    """A parquet saved from a datasets.Dataset (or a hub set) stores a ClassLabel as its integer."""
    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "task": datasets.ClassLabel(names=["pets", "finance", "sport"]),
            "uid": datasets.ClassLabel(names=["b", "a", "c", "d"]),
        }
    )
    path = tmp_path / "cl.parquet"
    datasets.Dataset.from_dict(
        {"text": ["a cat", "a stock", "a goal", "unlabelled"], "task": [0, 1, 2, -1], "uid": [1, 0, 2, 3]}, features=features
    ).to_parquet(str(path))
    prompts = load_prompts(
        composed(
            "dataset=local",
            f"dataset.path={path}",
            "dataset.text_field=text",
            "dataset.category_field=task",
            "dataset.id_field=uid",
            f"dataset.streaming={streaming}",
        ).dataset
    )
    assert [(p["id"], p["category"]) for p in prompts] == [("a", "pets"), ("b", "finance"), ("c", "sport"), ("d", "local")]


def test_a_numeric_fixed_category_is_text(tmp_path):
    """metrics sorts the categories: an int among them would crash the cell after every prompt had run."""
    rows = write_jsonl(tmp_path / "p.jsonl", [{"text": "hi", "task": 7}, {"text": "yo", "task": None}])
    base = ("dataset=local", f"dataset.path={rows}", "dataset.text_field=text", "dataset.id_field=null")
    prompts = load_prompts(composed(*base, "dataset.category_field=null", "dataset.category=5").dataset)
    assert [p["category"] for p in prompts] == ["5", "5"]
    prompts = load_prompts(composed(*base, "dataset.category_field=task", "dataset.category=0").dataset)
    assert [p["category"] for p in prompts] == ["7", "0"]


def test_numeric_field_names_read_columns_so_named(tmp_path):
    table = tmp_path / "n.csv"
    table.write_text("1,2,3\nhello,a,x1\nworld,b,x2\n")
    prompts = load_prompts(
        composed(
            "dataset=local", f"dataset.path={table}", "dataset.text_field=1", "dataset.category_field=2", "dataset.id_field=3"
        ).dataset
    )
    assert prompts == [{"id": "x1", "category": "a", "prompt": "hello"}, {"id": "x2", "category": "b", "prompt": "world"}]
    prompts = load_prompts(
        composed(
            "dataset=local",
            f"dataset.path={table}",
            "dataset.text_field=[1,2]",
            "dataset.category_field=null",
            "dataset.id_field=null",
        ).dataset
    )
    assert prompts[0]["prompt"] == "hello\n\na"
    with pytest.raises(HarnessError, match="has no field '5'"):
        load_prompts(composed("dataset=local", f"dataset.path={table}", "dataset.text_field=5").dataset)


@pytest.mark.parametrize("override", ["dataset.template=true", "dataset.template=5", "dataset.template=[a]"])
def test_a_template_that_is_not_text_is_one_line(tmp_path, override):
    rows = write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH)
    with pytest.raises(HarnessError) as err:
        load_prompts(composed("dataset=local", f"dataset.path={rows}", override).dataset)
    assert str(err.value).startswith(override.replace("[a]", "['a']") + " is not a format string") and "\n" not in str(err.value)


def test_a_hub_source_without_an_hf_id_is_one_line():
    with pytest.raises(HarnessError) as err:
        load_prompts(composed("dataset=local", "dataset.source=hub").dataset)
    assert "dataset.source=hub needs dataset.hf_id" in str(err.value) and "\n" not in str(err.value)


def test_a_translation_pair_with_an_empty_side_is_left_out(tmp_path, capsys):
    """The text field `translation` is a dict, never empty: the template's own field, translation[de], is the text."""
    pairs = write_jsonl(
        tmp_path / "wmt.jsonl",
        [
            {"translation": {"de": "Hallo.", "en": "Hello."}},
            {"translation": {"de": "", "en": "x"}},
            {"translation": {"de": None, "en": "y"}},
            {"translation": {"de": "  ", "en": "z"}},
        ],
    )
    prompts = load_prompts(composed("dataset=wmt14_de_en", f"dataset.path={pairs}", "dataset.num_prompts=1").dataset)
    assert [p["prompt"] for p in prompts] == ["Translate the following German text into English.\n\nHallo."]
    assert "wmt14_de_en: 3 of 4 rows have an empty translation[de]" in capsys.readouterr().err
    with pytest.raises(HarnessError, match="all 3 rows read have an empty translation"):
        load_prompts(
            composed(
                "dataset=wmt14_de_en",
                f"dataset.path={write_jsonl(tmp_path / 'e.jsonl', [{'translation': {'de': '', 'en': 'x'}}] * 3)}",
            ).dataset
        )


def test_the_offline_line_for_a_null_split_leaves_split_out():
    with pytest.raises(HarnessError) as err:
        load_prompts(composed("dataset=gsm8k", "dataset.split=null").dataset)
    assert "load_dataset('openai/gsm8k', 'main')" in str(err.value) and "split=" not in str(err.value)


def test_a_jsonl_whose_fields_change_late_names_the_cause(tmp_path, monkeypatch):
    """datasets fixes a jsonl's fields from its first chunk (10 MB; here 64 bytes): a later field
    failed as "cannot be read as json: Couldn't cast", without the cause."""
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: real(*a, chunksize=64, **kw))
    rows = write_jsonl(
        tmp_path / "late.jsonl",
        [{"question_id": i, "turns": [f"prompt {i}"]} for i in range(20)]
        + [{"question_id": 99, "category": "late", "turns": ["late one"]}],
    )
    with pytest.raises(HarnessError) as err:
        load_prompts(composed("dataset=local", f"dataset.path={rows}").dataset)
    message = str(err.value)
    assert "cannot be read as json" in message and "'category'" in message and "same fields" in message and "\n" not in message


# ------------------------------------------------- a prompt file with only its path


def found_line(text: str, category: str, pid: str, file: str = "p.jsonl") -> str:
    """The line a run prints for a set whose fields were found (dataset=local's auto)."""
    return (
        f"[harness] dataset local: prompts from {text} of {file} (category: {category}, id: {pid}); "
        f"dataset.text_field, dataset.category_field and dataset.id_field choose others"
    )


@pytest.mark.parametrize("field", ["prompt", "text", "question", "instruction"])
def test_a_file_of_prompts_needs_only_its_path(tmp_path, capsys, field):
    rows = write_jsonl(tmp_path / "p.jsonl", [{field: "What is 2 + 2?"}, {field: "Name a color."}])
    prompts = load_prompts(composed("dataset=local", f"dataset.path={rows}").dataset)
    assert prompts == [
        {"id": "local-0", "category": "local", "prompt": "What is 2 + 2?"},
        {"id": "local-1", "category": "local", "prompt": "Name a color."},
    ]
    assert capsys.readouterr().err.splitlines() == [found_line(f"field '{field}'", "'local' for all", "row number")]


def test_the_first_usual_field_is_the_prompt_and_ids_and_categories_are_found(tmp_path, capsys):
    rows = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "category": "math", "instruction": "Answer briefly.", "question": "What is 2 + 2?"},
            {"id": "b", "category": "chat", "instruction": "Be kind.", "question": "How are you?"},
        ],
    )
    prompts = load_prompts(composed("dataset=local", f"dataset.path={rows}").dataset)
    assert prompts == [
        {"id": "a", "category": "math", "prompt": "What is 2 + 2?"},
        {"id": "b", "category": "chat", "prompt": "How are you?"},
    ]
    assert capsys.readouterr().err.splitlines() == [found_line("field 'question'", "field 'category'", "field 'id'")]


def test_turns_give_the_first_turn(tmp_path, capsys):
    """MT-Bench / Spec-Bench turns without their ids and categories: the first turn, rows numbered."""
    rows = write_jsonl(tmp_path / "t.jsonl", [{"turns": ["Write a haiku.", "Now another."]}, {"turns": ["Say hi."]}])
    prompts = load_prompts(composed("dataset=local", f"dataset.path={rows}").dataset)
    assert [(p["id"], p["category"], p["prompt"]) for p in prompts] == [
        ("local-0", "local", "Write a haiku."),
        ("local-1", "local", "Say hi."),
    ]
    assert capsys.readouterr().err.splitlines() == [
        found_line("field 'turns' (its first turn)", "'local' for all", "row number", "t.jsonl")
    ]
    spec_bench = write_jsonl(tmp_path / "question.jsonl", SPEC_BENCH)  # read as with its fields named
    named = ("dataset.text_field=turns", "dataset.id_field=question_id", "dataset.category_field=category")
    assert load_prompts(composed("dataset=local", f"dataset.path={spec_bench}").dataset) == load_prompts(
        composed("dataset=local", f"dataset.path={spec_bench}", *named).dataset
    )
    assert capsys.readouterr().err.splitlines() == [
        found_line("field 'turns' (its first turn)", "field 'category'", "field 'question_id'", "question.jsonl")
    ]  # the run with every field named says nothing


def test_fields_named_win_over_those_found(tmp_path, capsys):
    rows = write_jsonl(tmp_path / "p.jsonl", [{"id": 7, "category": "a", "prompt": "From prompt.", "text": "From text."}])
    named = ("dataset.text_field=text", "dataset.id_field=null", "dataset.category_field=null", "dataset.category=mine")
    assert load_prompts(composed("dataset=local", f"dataset.path={rows}", *named).dataset) == [
        {"id": "local-0", "category": "mine", "prompt": "From text."}
    ]
    assert capsys.readouterr().err == ""
    [p] = load_prompts(composed("dataset=local", f"dataset.path={rows}", "dataset.template='{text} / {prompt}'").dataset)
    assert p == {"id": "7", "category": "a", "prompt": "From text. / From prompt."}  # a template makes the text


@pytest.mark.parametrize("streaming", [False, True])
def test_a_file_without_a_usual_prompt_field_is_one_line(tmp_path, streaming):
    rows = write_jsonl(tmp_path / "p.jsonl", [{"body": "Hello.", "label": "x"}])
    with pytest.raises(HarnessError) as err:
        load_prompts(composed("dataset=local", f"dataset.path={rows}", f"dataset.streaming={streaming}").dataset)
    assert str(err.value) == (
        f"dataset.path={rows} has none of the fields a prompt is read from by default (turns, prompt, text, question, "
        "instruction; its fields: body, label): set dataset.text_field to the one that holds the prompt, "
        "or build it with dataset.template='...{field}...'"
    )
    [p] = load_prompts(composed("dataset=local", f"dataset.path={rows}", "dataset.text_field=body").dataset)
    assert p == {"id": "local-0", "category": "local", "prompt": "Hello."}


def test_a_column_oriented_file_of_found_fields_is_one_line(tmp_path):
    path = tmp_path / "cols.json"
    path.write_text(json.dumps({"id": ["q1", "q2"], "prompt": ["What is 2+2?", "Say hi."]}))
    with pytest.raises(HarnessError, match="looks column-oriented"):
        load_prompts(composed("dataset=local", f"dataset.path={path}").dataset)


def test_a_file_of_found_fields_is_keyed_by_its_content(tmp_path):
    from harness.runner.store import cell_key, dataset_sha256

    rows = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2 + 2?"}])
    cfg = with_default_pair(composed("dataset=local", f"dataset.path={rows}"))
    key, sha = cell_key(cfg), dataset_sha256(cfg)
    assert sha == hashlib.sha256(rows.read_bytes()).hexdigest()
    assert cell_key(with_default_pair(composed("dataset=local", f"dataset.path={rows}"))) == key
    write_jsonl(rows, [{"prompt": "What is 3 + 3?"}])
    assert dataset_sha256(cfg) != sha and cell_key(cfg) != key


@pytest.mark.cli
def test_a_file_of_prompts_runs_with_only_its_path(tiny_pair, tmp_path):
    path = write_jsonl(tmp_path / "my.jsonl", [{"prompt": "The quick brown fox"}, {"prompt": "1 2 3 4"}])
    args = [
        "+pair=llama_7b_68m",
        f"pair.target.id={tiny_pair['target']}",
        f"pair.draft.id={tiny_pair['draft']}",
        "dataset=local",
        f"dataset.path={path}",
        "max_new_tokens=4",
        f"out_dir={tmp_path / 'out'}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    out = subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert found_line("field 'prompt'", "'local' for all", "row number", "my.jsonl") in out.stderr.splitlines()
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["dataset_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    summary = json.loads((Path(last["cell_dir"]) / "summary.json").read_text())
    assert sorted(summary["prompt_ids"]) == ["local-0", "local-1"] and list(summary["categories"]) == ["local"]
