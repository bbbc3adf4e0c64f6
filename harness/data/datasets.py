"""Prompt sets, chosen by the `dataset` config group (conf/dataset/).

`load_prompts(dataset_cfg)` returns a list of {"id", "category", "prompt"}
dicts; the category travels into every result, so acceptance and speedup
can be read per task type (as Spec-Bench reads its six task groups).

Every set goes through one path, `datasets.load_dataset`:
  builtin   our offline set, harness/data/builtin_prompts.jsonl (json loader);
  hub       an HF dataset id, config and split (mt_bench, gsm8k, humaneval, ...);
  local     a jsonl, json, csv or parquet file (`dataset.path`); any hub set
            can also be pointed at a local export of itself with dataset.path.

A row becomes a prompt like this:
  - a list value (MT-Bench / Spec-Bench `turns`) stands for its first item
    ({turns}); a template can index it for another ({turns[1]});
  - `template` is a str.format string over the row's fields ("{article}",
    "{translation[de]}"); with no template the text field(s) are the prompt;
  - the id is the row's `id_field` when it has one, else "<name>-<row index>";
  - the category is the row's `category_field`, else the fixed `category`,
    always as text; an id or category the set declares a ClassLabel is its name.
Templates are only ever formatted with the row (format_map), never evaluated.

Choosing which prompts run (seeded, balanced over categories) is
harness.data.prompts.select's job; this module only reads rows, and never
tokenizes, so a large split costs no more than the rows it reads.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import hashlib
import re
import string
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Iterable, Iterator

from harness.errors import HarnessError

BUILTIN = Path(__file__).parent / "builtin_prompts.jsonl"
LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # extension -> datasets builder
# A template field: a row field, optionally indexed ({translation[de]}); no attribute access.
FIELD = re.compile(r"^([A-Za-z_]\w*)((?:\[[^\[\]]+\])*)$")
# How the datasets library says a hub set has no such split or config (read,
# streamed, or offline with the set cached under other ones): the dataset.<key>
# at fault, and a pattern whose `there` lists the splits or configs there are.
UNKNOWN_NAME = [
    ("split", re.compile(r'Unknown split ".*"\. Should be one of (?P<there>\[.*\])')),
    ("split", re.compile(r"Bad split: .*\. Available splits: (?P<there>\[.*\])")),
    ("hf_config", re.compile(r"BuilderConfig '.*' not found\. Available: (?P<there>\[.*\])")),
    ("hf_config", re.compile(r"for config '.*'\nAvailable configs in the cache: (?P<there>\[.*\])")),
    ("hf_config", re.compile(r"Config name is missing\.\nPlease pick one among the available configs: (?P<there>\[.*\])")),
]


def load_prompts(dataset_cfg) -> list[dict]:
    """Read the configured set and turn each usable row into a prompt dict."""
    cfg = dataset_cfg
    with _quiet_datasets():
        try:
            if cfg.source == "builtin":
                rows, columns, features = _load_local(cfg, BUILTIN)
            elif cfg.get("path"):
                rows, columns, features = _load_local(cfg, Path(str(cfg.path)).expanduser())
            elif cfg.source == "local":
                raise HarnessError(f"dataset={cfg.name} reads a file: give it with dataset.path=/path/to/prompts.jsonl (jsonl, json, csv or parquet)")
            elif cfg.source == "hub":
                rows, columns, features = _load_hub(cfg)
            else:
                raise HarnessError(f"dataset.source={cfg.source} is not a source: use builtin, hub or local")
            prompts = _to_prompts(cfg, rows, columns, features)
        except UnicodeDecodeError as err:  # pyarrow reads a jsonl's bytes unchecked; its strings decode per row, there
            raise HarnessError(f"{cfg.name}: a row holds text that is not UTF-8 ({err.reason} at byte {err.start}): "
                               f"save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None

    wanted = cfg.get("num_prompts")
    if wanted is not None and wanted > len(prompts):
        print(f"[harness] warning: dataset.num_prompts={wanted} but {cfg.name} has {len(prompts)} prompts: using all {len(prompts)}", file=sys.stderr)
    return prompts


# ---------------------------------------------------------------- reading rows


def _rows_to_read(cfg) -> int | None:
    """How many rows to read from the source: `max_rows` (a window the seeded
    choice picks from), never fewer than num_prompts; None reads all, streamed
    or not (reading only num_prompts rows of a streamed set stored by category
    would leave categories out, and make prompts.shuffle a reordering)."""
    max_rows, wanted = cfg.get("max_rows"), cfg.get("num_prompts")
    if max_rows is None:
        return None
    return max(max_rows, wanted or 0)


def _first_rows(ds, n: int | None) -> Iterable[dict]:
    """The first n rows (all for None). A Dataset is sliced, not copied; a
    streamed IterableDataset is read here, stopping after n rows, so that
    any read error surfaces inside the caller's error handling."""
    import datasets as hf_datasets

    if isinstance(ds, hf_datasets.IterableDataset):
        return list(ds if n is None else ds.take(n))
    return ds if n is None else ds.select(range(min(n, len(ds))))


def _columns(ds) -> list[str] | None:
    return list(ds.column_names) if getattr(ds, "column_names", None) is not None else None


def _column_length(value: Any) -> int | None:
    """How many rows a value of a column-oriented json object holds: a list's items, or the entries
    of a dict keyed by row number (pandas' default df.to_json()); None for any other value."""
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, dict) and value and all(isinstance(k, str) and k.isdigit() for k in value):
        return len(value)
    return None


def _refuse_column_oriented(cfg, shown: str, ds, rows: Iterable[dict]) -> None:
    """Stop on a json file that is one object of columns ({"id": [...], "prompt": [...]}, as
    json.dump(df.to_dict("list")) or df.to_json() write): datasets reads it as one row, and its
    first items would silently be the only prompt. A row of its own may hold lists too (turns, tags),
    so it is refused only when its id or category field, one value per row, holds as many values as
    the rest; otherwise a warning says what it looks like."""
    import datasets as hf_datasets

    first = list(itertools.islice(iter(rows), 2))
    if len(first) != 1 or len(first[0]) < 2:
        return
    lengths = {_column_length(value) for value in first[0].values()}
    if len(lengths) != 1 or None in lengths or (n := lengths.pop()) < 2:
        return
    total = len(list(ds.take(2))) if isinstance(ds, hf_datasets.IterableDataset) else len(ds)
    if total != 1:
        return
    what = (f"{shown} looks column-oriented: one object whose fields hold {n} values each (as json.dump(df.to_dict('list')) "
            f"or df.to_json() write), which reads as one row")
    fix = "write one object per row, as a jsonl (df.to_json(path, orient='records', lines=True)) or a list of objects (orient='records')"
    labels = [_field_name(cfg.get(key)) for key in ("id_field", "category_field")]
    if any(label in first[0] for label in labels if label):  # an id or a category per row, as a list: columns
        raise HarnessError(f"{what}: {fix}")
    print(f"warning: {what}, so it gives one prompt; if its fields are columns, {fix}", file=sys.stderr)


def _load_local(cfg, path: Path) -> tuple[Iterable[dict], list[str] | None, Any]:
    import datasets as hf_datasets
    from datasets.exceptions import DatasetGenerationError
    from datasets.table import CastError

    shown = f"dataset.path={path}" if cfg.source != "builtin" else f"the builtin set ({path})"
    if not path.exists():
        raise HarnessError(f"{shown} does not exist: give an existing jsonl, json, csv or parquet file")
    if path.is_dir():
        raise HarnessError(f"{shown} is a directory: give one jsonl, json, csv or parquet file")
    fmt = cfg.get("format") or "auto"
    if fmt == "auto":
        fmt = LOADERS.get(path.suffix.lower())
        if fmt is None:
            raise HarnessError(f"{shown}: cannot tell the format from '{path.suffix}': use a .jsonl, .json, .csv or .parquet file, or set dataset.format=json|csv|parquet")
    elif fmt not in ("json", "csv", "parquet"):
        raise HarnessError(f"dataset.format={fmt} is not a format: use auto, json, csv or parquet")
    if path.stat().st_size == 0:
        raise HarnessError(f"{shown} is empty: it needs one prompt per row")
    try:
        # Escaped: data_files is a glob pattern, and a name like p[1].jsonl would match p1.jsonl instead.
        streaming = bool(cfg.get("streaming"))
        ds = hf_datasets.load_dataset(
            fmt, data_files=glob.escape(str(path)), split="train", streaming=streaming, **_csv_as_written(path, fmt),
            # datasets keys its cache by path and modification time: a file rewritten with the time kept (cp -p,
            # touch -r) would be read as it was, under the cell key of its new content. Here the content keys it.
            **({} if streaming else {"cache_dir": _content_cache(path)}))
        rows = _first_rows(ds, _rows_to_read(cfg))
        if fmt == "json":
            _refuse_column_oriented(cfg, shown, ds, rows)
    except UnicodeDecodeError:  # a row's text, decoded as it is read: load_prompts says so
        raise
    except (DatasetGenerationError, ValueError, StopIteration, OSError) as err:
        if isinstance(err, StopIteration) or "corresponds to no data" in str(err):
            raise HarnessError(f"{shown} holds no rows: it needs one prompt per row") from None
        cause = err.__cause__ or err
        if isinstance(cause, CastError):  # its first line, "Couldn't cast", leaves out why
            raise HarnessError(f"{shown} cannot be read as {fmt}: its rows do not all have the same fields (datasets takes them "
                               f"from the first 10 MB of rows, and after those {cause.details().rstrip('.')}): give every row "
                               f"the same fields, null where a row has no value") from None
        raise HarnessError(f"{shown} cannot be read as {fmt}: {_one_line(cause)}") from None
    return rows, _columns(ds), getattr(ds, "features", None)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a prompt file: its cell key's part (harness.runner.cell.dataset_sha256) and its cache's name."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _content_cache(path: Path) -> str:
    """A datasets cache folder for this file's content, so an edit is never read from an old copy."""
    from datasets import config

    return str(Path(config.HF_DATASETS_CACHE) / "specbench-local" / file_sha256(path)[:16])


def _csv_as_written(path: Path, fmt: str) -> dict:
    """load_dataset arguments that keep a CSV's cells as the file has them: pandas would otherwise read
    id 001 as 1 and NA, None or N/A as missing (a category lost, a prompt dropped as empty)."""
    if fmt != "csv":
        return {}
    import csv

    from datasets import Features, Value

    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            header = next(row for row in csv.reader(f) if any(cell.strip() for cell in row))  # pandas skips blank lines
    except (OSError, UnicodeDecodeError, StopIteration, csv.Error):
        return {"keep_default_na": False}  # load_dataset says what is wrong with the file
    if len(set(header)) != len(header) or not all(header):
        return {"keep_default_na": False}
    return {"keep_default_na": False, "features": Features({name: Value("string") for name in header})}


def _load_hub(cfg) -> tuple[Iterable[dict], list[str] | None, Any]:
    import datasets as hf_datasets
    from datasets.exceptions import DatasetNotFoundError, DatasetsError

    if not cfg.get("hf_id"):  # dataset=local dataset.source=hub: a config without the hub keys
        fix = ("set dataset.hf_id=owner/name (e.g. openai/gsm8k)" if "hf_id" in cfg else
               f"dataset={cfg.name} has no hub keys, so start from a hub set's config (e.g. dataset=gsm8k dataset.hf_id=owner/name "
               f"dataset.hf_config=... dataset.split=...)")
        raise HarnessError(f"dataset.source=hub needs dataset.hf_id, the hub set's id: {fix}, or read a file with "
                           f"dataset.source=local dataset.path=...")
    hf_id, split, streaming = str(cfg.hf_id), cfg.get("split"), bool(cfg.get("streaming"))
    offline_reason = _offline_reason()
    try:
        with _offline(offline_reason is not None):
            ds = hf_datasets.load_dataset(hf_id, cfg.get("hf_config"), split=split, streaming=streaming,
                                          revision=cfg.get("revision"))
            if isinstance(ds, (hf_datasets.DatasetDict, hf_datasets.IterableDatasetDict)):  # split=null: every split
                raise HarnessError(f"dataset.split=null reads every split of {hf_id} ({cfg.name}): set dataset.split to one of "
                                   f"{', '.join(ds)}")
            rows = _first_rows(ds, _rows_to_read(cfg))
    except DatasetNotFoundError as err:
        if offline_reason is None:
            raise HarnessError(f"dataset {hf_id} ({cfg.name}) is not on the hub or is gated ({_one_line(err)}): check dataset.hf_id, or log in with `hf auth login`") from None
        raise HarnessError(_unavailable(cfg, offline_reason)) from None
    except OSError as err:  # ConnectionError, FileNotFoundError (not cached), network failures
        raise HarnessError(_unavailable(cfg, offline_reason or f"failing ({_one_line(err)})")) from None
    except ValueError as err:  # a config or split the set does not have (or, offline, the cache does not hold)
        unknown = _unknown_name(cfg, err, cached=offline_reason is not None)
        if unknown is not None:
            raise HarnessError(unknown) from None
        if offline_reason is not None:
            raise HarnessError(_unavailable(cfg, offline_reason)) from None
        raise HarnessError(f"dataset {hf_id} ({cfg.name}), dataset.hf_config={cfg.get('hf_config')} dataset.split={split}: {_one_line(err)}") from None
    except DatasetsError as err:  # e.g. a file of the set that cannot be parsed
        raise HarnessError(f"dataset {hf_id} ({cfg.name}) could not be read: {_one_line(err.__cause__ or err)}") from None
    return rows, _columns(ds), getattr(ds, "features", None)


def _unknown_name(cfg, err: ValueError, cached: bool) -> str | None:
    """The one line for a split or config the set (or the cache) does not
    have, naming the ones it does; None for any other error."""
    for key, pattern in UNKNOWN_NAME:
        match = pattern.search(str(err))
        if match is not None:
            break
    else:
        return None
    noun = "split" if key == "split" else "config"
    bad = cfg.get(key)
    there = ", ".join(re.findall(r"'([^']*)'", match["there"]))
    where = " in the cache" if cached else ""
    return (f"dataset.{key}={'null' if bad is None else bad} is not a {noun} of {cfg.get('hf_id')} ({cfg.name}){where}: "
            f"its {noun}s{where} are {there}; set dataset.{key} to one of them")


# ------------------------------------------------------------ offline handling


def _offline_reason() -> str | None:
    """Why the hub cannot be used, or None when it can.

    When the hub is unreachable but no offline variable is set, the datasets
    library retries for about half a minute before giving up; one quick
    connection attempt instead lets us go straight to the cache.
    """
    import datasets as hf_datasets

    from harness.models.loading import hub_reachable

    if hf_datasets.config.HF_HUB_OFFLINE:
        return "offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)"
    if not hub_reachable():
        return "unreachable"
    return None


@contextlib.contextmanager
def _offline(enabled: bool) -> Iterator[None]:
    """Run the datasets library in offline mode (cache only) for the duration.

    Both libraries read their offline flag at import time from the
    environment, so the flag is flipped on the modules and restored after.
    """
    if not enabled:
        yield
        return
    import datasets as hf_datasets
    import huggingface_hub.constants as hub_constants

    saved = hf_datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    hf_datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hf_datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _unavailable(cfg, reason: str) -> str:
    """The one line for a hub set that cannot be loaded: what, why, and the three ways out."""
    import datasets as hf_datasets

    cache = hf_datasets.config.HF_DATASETS_CACHE
    config = f", '{cfg.hf_config}'" if cfg.get("hf_config") else ""
    split = f", split='{cfg.split}'" if cfg.get("split") is not None else ""  # null: load_dataset's own default, every split
    return (
        f"dataset {cfg.hf_id} ({cfg.name}) is not in the datasets cache ({cache}) and the hub is {reason}: "
        f"cache it where the hub is reachable (python -c \"import datasets; datasets.load_dataset('{cfg.hf_id}'{config}{split})\") "
        f"and copy the cache here, point HF_DATASETS_CACHE or HF_HOME at a cache that holds it, "
        f"or export it to a file and run with dataset.path=/path/to/file.jsonl (see docs/datasets.md)"
    )


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars or cache chatter from the datasets library: our own
    lines (and errors) are the ones a user should read."""
    import datasets as hf_datasets

    bars = hf_datasets.is_progress_bar_enabled()
    verbosity = hf_datasets.logging.get_verbosity()
    hf_datasets.disable_progress_bars()
    hf_datasets.logging.set_verbosity(hf_datasets.logging.CRITICAL)  # its read errors become our one line
    try:
        yield
    finally:
        hf_datasets.logging.set_verbosity(verbosity)
        if bars:
            hf_datasets.enable_progress_bars()


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


# ------------------------------------------------------------ rows -> prompts


def _as_list(value) -> list[str]:
    """text_field as a list of field names: one name or several, each as text (a csv column may be named 5)."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, Sequence) and not isinstance(value, str) else [str(value)]


def _field_name(value) -> str | None:
    """id_field or category_field as a field name (text: a csv column may be named 5)."""
    return None if value is None else str(value)


def _template(cfg) -> str | None:
    """dataset.template, refused in one line when it is not text (Hydra reads true, 5 or [a] as a bool, number or list)."""
    template = cfg.get("template")
    if template is None or isinstance(template, str):
        return template
    shown = str(template).lower() if isinstance(template, bool) else str(template)
    raise HarnessError(f"dataset.template={shown} is not a format string: give text naming the row's fields in braces, quoted, "
                       f"e.g. 'dataset.template=\"Summarize: {{text}}\"' (null: the text field as is)")


def _template_fields(template: str | None) -> list[tuple[str, str]]:
    """The row fields a template names, each as (field, as written: translation[de]); refuses
    anything but {field} and {field[key]}."""
    if not template:
        return []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise HarnessError(f"dataset.template is not a valid format string ({err}): write fields as {{field}} and literal braces as {{{{ }}}}") from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        match = FIELD.match(name)
        if match is None:
            raise HarnessError(f"dataset.template field {{{name}}} is not a row field: use {{field}} or {{field[key]}}")
        fields.append((match.group(1), name))
    return fields


def _blank(value: Any) -> bool:
    value = _first_item(value)
    return value is None or str(value).strip() == ""


def _blank_reference(name: str, row: dict) -> bool:
    """Whether a template field ({translation[de]}) reads an empty value from the row; one it cannot
    read is left to the formatting, which says so."""
    try:
        value, _ = string.Formatter().get_field(name, (), row)
    except (KeyError, IndexError, TypeError, ValueError):
        return False
    return _blank(value)


def _class_label(features: Any, field: str | None):
    """The ClassLabel feature of a field (a parquet saved from a datasets.Dataset, a hub set), else None."""
    if not field or not features or field not in features:
        return None
    from datasets import ClassLabel

    feature = features[field]
    return feature if isinstance(feature, ClassLabel) else None


def _first_item(value: Any) -> Any:
    """A list value (the `turns` of MT-Bench / Spec-Bench) stands for its first item."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _label(value: Any, class_label: Any = None) -> str | None:
    """An id or category as text (None, and an empty csv cell, stay None). An integral float is
    written as an integer: a json number column may hold 1.0. A ClassLabel's integer is its name
    (-1, datasets' "no label", is None)."""
    value = _first_item(value)
    if class_label is not None and isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            return None
        if value < class_label.num_classes:
            return class_label.int2str(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return None if value is None or value == "" else str(value)


class _RowFormatter(string.Formatter):
    """Formats a template over a row: a list field written bare ({turns}) is
    its first item, indexed ({turns[1]}) the item; a null field (a jsonl row
    without it reads as null) is empty; a number a csv holds as text takes a
    number's format spec ({score:.2f}, {n:03d})."""

    def format_field(self, value: Any, spec: str) -> str:
        value = _first_item(value)
        value = "" if value is None else value
        try:
            return format(value, spec)
        except ValueError:
            if not isinstance(value, str):
                raise
            for number in (int, float):
                try:
                    return format(number(value), spec)
                except ValueError:
                    continue
            raise


def _check_fields(cfg, needed: list[str], columns: list[str], id_field: str | None, category_field: str | None) -> None:
    """One line naming a configured field the set lacks, and the fields it has."""
    missing = [f for f in needed if f not in columns]
    if not missing:
        return
    where = f"dataset.path={cfg.path}" if cfg.get("path") else (cfg.get("hf_id") or cfg.name)
    own_fix = {
        category_field: "set dataset.category_field to one of them, or dataset.category_field=null dataset.category=<name>",
        id_field: "set dataset.id_field to one of them, or dataset.id_field=null to number the rows",
    }
    text_fix = "set dataset.text_field (and the fields dataset.template names) to fields it has"
    fix = "; ".join(dict.fromkeys(own_fix.get(f, text_fix) for f in missing))
    raise HarnessError(f"{where} has no field {', '.join(repr(f) for f in missing)} (its fields: {', '.join(columns)}): {fix}")


def _check_text(cfg, text_fields: list[str], texts: list, row: dict) -> None:
    """Stop when a text field holds structured values (chat messages, a translation pair): their
    Python repr, sent as the prompt, would be no prompt the user meant."""
    for field, text in zip(text_fields, texts):
        if isinstance(text, (dict, list, tuple)):
            item = f"{field}[0]" if isinstance(row[field], (list, tuple)) else field
            keys = f" (keys: {', '.join(map(str, text))})" if isinstance(text, dict) else ""
            hint = "pick a field that holds the prompt"
            # An index or key that reads text out of it, quoted as a shell then Hydra read it. str.format reads
            # a key of digits as a number, and one with brackets, braces or quotes would not survive the quoting.
            keys_usable = [k for k in text if isinstance(k, str) and k and not k.isdigit() and not set(k) & set("[]{}'\"")] \
                if isinstance(text, dict) else [0] if text else []
            if keys_usable:
                key = next((k for k in ("content", "text", "value") if k in keys_usable), keys_usable[0])
                hint += f", or build it with 'dataset.template=\"{{{item}[{key}]}}\"'"
            raise HarnessError(f"dataset.text_field={field} of {cfg.name} holds {type(text).__name__} values{keys}, not text: {hint}")


def _to_prompts(cfg, rows: Iterable[dict], columns: list[str] | None, features: Any = None) -> list[dict]:
    text_fields = _as_list(cfg.get("text_field"))
    template = _template(cfg)
    if not text_fields and not template:
        raise HarnessError(f"dataset={cfg.name} names no text: set dataset.text_field=<field> or dataset.template='...{{field}}...'")
    id_field, category_field = _field_name(cfg.get("id_field")), _field_name(cfg.get("category_field"))
    category = cfg.get("category")
    fixed_category = str(cfg.name) if category is None or category == "" else str(category)  # text: metrics sorts categories
    id_labels, category_labels = _class_label(features, id_field), _class_label(features, category_field)
    template_fields = _template_fields(template)
    # The template's own reads of a text field ({translation[de]}): a row is empty when one of them is.
    text_reads = [name for field, name in template_fields if field in text_fields and name != field]
    needed = list(dict.fromkeys(text_fields + [f for f, _ in template_fields] + [f for f in (category_field, id_field) if f]))
    if columns is not None:
        _check_fields(cfg, needed, columns, id_field, category_field)

    prompts, seen, read, empty = [], set(), 0, 0
    for index, row in enumerate(rows):
        read += 1
        if columns is None:  # a streamed set that declares no features: check its first row
            columns = list(row)
            _check_fields(cfg, needed, columns, id_field, category_field)
        texts = [_first_item(row[f]) for f in text_fields]
        if any(_blank(t) for t in texts) or any(_blank_reference(name, row) for name in text_reads):
            empty += 1
            continue
        if not template:
            _check_text(cfg, text_fields, texts, row)
        try:
            if template:
                text = _RowFormatter().vformat(template, (), row)
            else:
                text = "\n\n".join(str(t) for t in texts)
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise HarnessError(f"dataset.template does not fit row {index} of {cfg.name} ({type(err).__name__}: {err}): check the fields it names") from None
        if not text.strip():  # a template over an empty or null field
            empty += 1
            continue
        pid = _label(row.get(id_field), id_labels) if id_field else None
        pid = f"{cfg.name}-{index}" if pid is None else pid
        if pid in seen:
            raise HarnessError(f"{cfg.name}: id {pid!r} appears twice in field '{id_field}': ids must be unique (dataset.id_field=null numbers the rows)")
        seen.add(pid)
        row_category = _label(row.get(category_field), category_labels) if category_field else None
        prompts.append({"id": pid, "category": fixed_category if row_category is None else row_category, "prompt": text})

    if read == 0:
        raise HarnessError(f"{cfg.name} holds no rows: it needs one prompt per row")
    shown_fields = [name for f in text_fields for name in ([n for n in text_reads if FIELD.match(n).group(1) == f] or [f])]
    what_empty = ("/".join(dict.fromkeys(shown_fields)) + (" (or dataset.template renders empty)" if template else "") if text_fields
                  else "dataset.template (as rendered)")
    if empty:
        print(f"[harness] warning: {cfg.name}: {empty} of {read} rows have an empty {what_empty} and were left out", file=sys.stderr)
    if not prompts:
        raise HarnessError(f"{cfg.name} gave no prompts: all {read} rows read have an empty {what_empty}")
    return prompts
