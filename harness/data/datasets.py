"""Prompt sets, chosen by the `dataset` config group (conf/dataset/).

`load_prompts(dataset_cfg)` returns a list of {"id", "category", "prompt"}
dicts; the category travels into every result, so acceptance and speedup
can be read per task type (as Spec-Bench reads its six task groups).

Every set goes through one path, `datasets.load_dataset`:
  builtin   our offline set, harness/data/builtin_prompts.jsonl (json loader);
  hub       an HF dataset id, config and split (mt_bench, gsm8k, humaneval, ...);
  local     a jsonl, json, csv or parquet file (`dataset.path`); any hub set
            can also be pointed at a local export of itself with dataset.path.

A row becomes a prompt (its text, id and category) in harness.data.rows.

Choosing which prompts run (seeded, balanced over categories) is
harness.data.prompts.select's job; this module only reads rows, and never
tokenizes, so a large split costs no more than the rows it reads.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from harness.base.files import file_sha256
from harness.data.prompts import BUILTIN_PROMPTS
from harness.data.rows import field_candidates, to_prompts
from harness.errors import HarnessError, one_line

LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # extension -> datasets builder
# A split or config that a hub set (or, offline, the cache) does not have: datasets raises a bare
# ValueError whose text alone says so (builder.py, arrow_reader.py, packaged_modules/cache), so these
# patterns are matched against bare ValueErrors only. Each gives the dataset.<key> at fault, and
# `there`, the splits or configs there are.
UNKNOWN_NAME = [
    ("split", re.compile(r'Unknown split ".*"\. Should be one of (?P<there>\[.*\])')),
    ("split", re.compile(r"Bad split: .*\. Available splits: (?P<there>\[.*\])")),
    ("hf_config", re.compile(r"BuilderConfig '.*' not found\. Available: (?P<there>\[.*\])")),
    ("hf_config", re.compile(r"for config '.*'\nAvailable configs in the cache: (?P<there>\[.*\])")),
    ("hf_config", re.compile(r"Config name is missing\.\nPlease pick one among the available configs: (?P<there>\[.*\])")),
]
# A split with no rows at all (a local file of blank lines, or [] only): also a bare ValueError known by its text.
NO_ROWS = "corresponds to no data"


def load_prompts(dataset_cfg) -> list[dict]:
    """Read the configured set and turn each usable row into a prompt dict."""
    cfg = dataset_cfg
    with _quiet_datasets():
        try:
            if cfg.source == "builtin":
                rows, columns, features = _load_local(cfg, BUILTIN_PROMPTS)
            elif cfg.get("path"):
                rows, columns, features = _load_local(cfg, Path(str(cfg.path)).expanduser())
            elif cfg.source == "local":
                raise HarnessError(
                    f"dataset={cfg.name} reads a file: give it with dataset.path=/path/to/prompts.jsonl (jsonl, json, csv or parquet)"
                )
            elif cfg.source == "hub":
                rows, columns, features = _load_hub(cfg)
            else:
                raise HarnessError(f"dataset.source={cfg.source} is not a source: use builtin, hub or local")
            prompts = to_prompts(cfg, rows, columns, features)
        except UnicodeDecodeError as err:  # pyarrow reads a jsonl's bytes unchecked; its strings decode per row, there
            raise HarnessError(
                f"{cfg.name}: a row holds text that is not UTF-8 ({err.reason} at byte {err.start}): "
                f"save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            ) from None

    wanted = cfg.get("num_prompts")
    if wanted is not None and wanted > len(prompts):
        print(
            f"[harness] warning: dataset.num_prompts={wanted} but {cfg.name} has {len(prompts)} prompts: using all {len(prompts)}",
            file=sys.stderr,
        )
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
    what = (
        f"{shown} looks column-oriented: one object whose fields hold {n} values each (as json.dump(df.to_dict('list')) "
        f"or df.to_json() write), which reads as one row"
    )
    fix = "write one object per row, as a jsonl (df.to_json(path, orient='records', lines=True)) or a list of objects (orient='records')"
    labels = [name for key in ("id_field", "category_field") for name in field_candidates(cfg, key)]
    if any(label in first[0] for label in labels):  # an id or a category per row, as a list: columns
        raise HarnessError(f"{what}: {fix}")
    print(f"warning: {what}, so it gives one prompt; if its fields are columns, {fix}", file=sys.stderr)


def _load_local(cfg, path: Path) -> tuple[Iterable[dict], list[str] | None, Any]:
    import datasets as hf_datasets
    from datasets.exceptions import DatasetGenerationError

    shown = f"dataset.path={path}" if cfg.source != "builtin" else f"the builtin set ({path})"
    if not path.exists():
        raise HarnessError(f"{shown} does not exist: give an existing jsonl, json, csv or parquet file")
    if path.is_dir():
        raise HarnessError(f"{shown} is a directory: give one jsonl, json, csv or parquet file")
    fmt = cfg.get("format") or "auto"
    if fmt == "auto":
        fmt = LOADERS.get(path.suffix.lower())
        if fmt is None:
            raise HarnessError(
                f"{shown}: cannot tell the format from '{path.suffix}': use a .jsonl, .json, .csv or .parquet file, or set dataset.format=json|csv|parquet"
            )
    elif fmt not in ("json", "csv", "parquet"):
        raise HarnessError(f"dataset.format={fmt} is not a format: use auto, json, csv or parquet")
    if path.stat().st_size == 0:
        raise HarnessError(f"{shown} is empty: it needs one prompt per row")
    try:
        # Escaped: data_files is a glob pattern, and a name like p[1].jsonl would match p1.jsonl instead.
        streaming = bool(cfg.get("streaming"))
        ds = hf_datasets.load_dataset(
            fmt,
            data_files=glob.escape(str(path)),
            split="train",
            streaming=streaming,
            **_csv_as_written(path, fmt),
            # datasets keys its cache by path and modification time: a file rewritten with the time kept (cp -p,
            # touch -r) would be read as it was, under the cell key of its new content. Here the content keys it.
            **({} if streaming else {"cache_dir": _content_cache(path)}),
        )
        rows = _first_rows(ds, _rows_to_read(cfg))
        if fmt == "json":
            _refuse_column_oriented(cfg, shown, ds, rows)
    except UnicodeDecodeError:  # a ValueError: a row's text, decoded as it is read, which load_prompts names
        raise
    except (DatasetGenerationError, ValueError, StopIteration, OSError) as err:
        raise HarnessError(_local_error(shown, fmt, err)) from None
    return rows, _columns(ds), getattr(ds, "features", None)


def _local_error(shown: str, fmt: str, err: Exception) -> str:
    """The one line for a local file load_dataset could not read, chosen by the exception's class:
    no rows (StopIteration, or the bare ValueError of an empty split), rows whose fields differ (a
    CastError under the DatasetGenerationError), or anything else that keeps the file from parsing
    as `fmt` (DatasetGenerationError, pyarrow's and pandas' ValueErrors, OSError)."""
    from datasets.table import CastError

    if isinstance(err, StopIteration) or (type(err) is ValueError and NO_ROWS in str(err)):
        return f"{shown} holds no rows: it needs one prompt per row"
    cause = err.__cause__ or err
    if isinstance(cause, CastError):  # its first line, "Couldn't cast", leaves out why
        return (
            f"{shown} cannot be read as {fmt}: its rows do not all have the same fields (datasets takes them "
            f"from the first 10 MB of rows, and after those {cause.details().rstrip('.')}): give every row "
            f"the same fields, null where a row has no value"
        )
    return f"{shown} cannot be read as {fmt}: {one_line(cause)}"


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
    from datasets.exceptions import DatasetsError

    if not cfg.get("hf_id"):  # dataset=local dataset.source=hub: a config without the hub keys
        fix = (
            "set dataset.hf_id=owner/name (e.g. openai/gsm8k)"
            if "hf_id" in cfg
            else f"dataset={cfg.name} has no hub keys, so start from a hub set's config (e.g. dataset=gsm8k dataset.hf_id=owner/name "
            f"dataset.hf_config=... dataset.split=...)"
        )
        raise HarnessError(
            f"dataset.source=hub needs dataset.hf_id, the hub set's id: {fix}, or read a file with "
            f"dataset.source=local dataset.path=..."
        )
    hf_id, split, streaming = str(cfg.hf_id), cfg.get("split"), bool(cfg.get("streaming"))
    offline_reason = _offline_reason()
    try:
        with _offline(offline_reason is not None):
            ds = hf_datasets.load_dataset(
                hf_id, cfg.get("hf_config"), split=split, streaming=streaming, revision=cfg.get("revision")
            )
            if isinstance(ds, (hf_datasets.DatasetDict, hf_datasets.IterableDatasetDict)):  # split=null: every split
                raise HarnessError(
                    f"dataset.split=null reads every split of {hf_id} ({cfg.name}): set dataset.split to one of {', '.join(ds)}"
                )
            rows = _first_rows(ds, _rows_to_read(cfg))
    except (DatasetsError, OSError, ValueError) as err:
        raise HarnessError(_hub_error(cfg, err, offline_reason)) from None
    return rows, _columns(ds), getattr(ds, "features", None)


def _hub_error(cfg, err: Exception, offline_reason: str | None) -> str:
    """The one line for a hub set that load_dataset could not give, chosen by the exception's class:

    DatasetNotFoundError       no such set, a gated one, or no such revision; offline: not cached
    DataFilesNotFoundError,    the set (or this config of it) has no data files datasets can read
    EmptyDatasetError
    other OSError              ConnectionError (the hub out of reach), FileNotFoundError (offline:
                               not cached), huggingface_hub's HfHubHTTPError (the hub failing)
    ValueError                 a bare one: a split or config the set (or the cache) lacks
                               (UNKNOWN_NAME); offline, any other: not cached as asked
    DatasetsError              e.g. a file of the set that cannot be parsed (its cause says why)
    """
    from datasets.data_files import EmptyDatasetError
    from datasets.exceptions import DataFilesNotFoundError, DatasetNotFoundError

    what = f"dataset {cfg.hf_id} ({cfg.name})"
    if isinstance(err, DatasetNotFoundError):
        if offline_reason is not None:
            return _unavailable(cfg, offline_reason)
        revision = " and dataset.revision" if cfg.get("revision") else ""
        return f"{what} is not on the hub or is gated ({one_line(err)}): check dataset.hf_id{revision}, or log in with `hf auth login`"
    if isinstance(err, (DataFilesNotFoundError, EmptyDatasetError)):
        return (
            f"{what} has no data files that datasets can read ({one_line(err)}): check dataset.hf_id and dataset.hf_config, "
            f"or export the set to a file and run with dataset.path=/path/to/file.jsonl (see docs/datasets.md)"
        )
    if isinstance(err, OSError):
        return _unavailable(cfg, offline_reason or f"failing ({one_line(err)})")
    if isinstance(err, ValueError):
        unknown = _unknown_name(cfg, err, cached=offline_reason is not None) if type(err) is ValueError else None
        if unknown is not None:
            return unknown
        if offline_reason is not None:
            return _unavailable(cfg, offline_reason)
        return f"{what}, dataset.hf_config={cfg.get('hf_config')} dataset.split={cfg.get('split')}: {one_line(err)}"
    return f"{what} could not be read: {one_line(err.__cause__ or err)}"


def _unknown_name(cfg, err: ValueError, cached: bool) -> str | None:
    """The one line for a split or config the set (or the cache) does not
    have, naming the ones it does; None for any other ValueError."""
    found = next(((key, match) for key, pattern in UNKNOWN_NAME if (match := pattern.search(str(err)))), None)
    if found is None:
        return None
    key, match = found
    noun = "split" if key == "split" else "config"
    bad = cfg.get(key)
    there = ", ".join(re.findall(r"'([^']*)'", match["there"]))
    where = " in the cache" if cached else ""
    return (
        f"dataset.{key}={'null' if bad is None else bad} is not a {noun} of {cfg.get('hf_id')} ({cfg.name}){where}: "
        f"its {noun}s{where} are {there}; set dataset.{key} to one of them"
    )


# ------------------------------------------------------------ offline handling


def _offline_reason() -> str | None:
    """Why the hub cannot be used, or None when it can.

    When the hub is unreachable but no offline variable is set, the datasets
    library retries for about half a minute before giving up; one quick
    connection attempt instead lets us go straight to the cache.
    """
    import datasets as hf_datasets

    from harness.base.hub import hub_reachable

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
