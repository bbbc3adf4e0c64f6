"""How a row of a prompt set becomes a prompt: its text, id and category.

  - a list value (MT-Bench / Spec-Bench `turns`) stands for its first item
    ({turns}); a template can index it for another ({turns[1]});
  - `template` is a str.format string over the row's fields ("{article}",
    "{translation[de]}"); with no template the text field(s) are the prompt;
  - the id is the row's `id_field` when it has one, else "<name>-<row index>";
  - the category is the row's `category_field`, else the fixed `category`,
    always as text; an id or category the set declares a ClassLabel is its name;
  - a field set to `auto` (conf/dataset/local.yaml's defaults) is the first of
    its usual names the set has (TEXT_NAMES, ID_NAMES, CATEGORY_NAMES): the text's
    must be there, an id or category may not be (rows numbered, fixed category).
Templates are only ever formatted with the row (format_map), never evaluated.
Reading the rows is harness.data.datasets' job.
"""

from __future__ import annotations

import itertools
import re
import string
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from harness.errors import HarnessError

# A template field: a row field, optionally indexed ({translation[de]}); no attribute access.
FIELD = re.compile(r"^([A-Za-z_]\w*)((?:\[[^\[\]]+\])*)$")
# text_field, id_field or category_field set to AUTO: the first of these names the set has. MT-Bench /
# Spec-Bench's fields come first, so that a question.jsonl reads as it does with them named.
AUTO = "auto"
TEXT_NAMES = ("turns", "prompt", "text", "question", "instruction")
ID_NAMES = ("question_id", "id")
CATEGORY_NAMES = ("category",)


def _as_list(value) -> list[str]:
    """text_field as a list of field names: one name or several, each as text (a csv column may be named 5)."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, Sequence) and not isinstance(value, str) else [str(value)]


def field_name(value) -> str | None:
    """id_field or category_field as a field name (text: a csv column may be named 5)."""
    return None if value is None else str(value)


def is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


def field_candidates(cfg, key: str) -> list[str]:
    """The fields id_field or category_field may name: the configured one, or each of its usual names when it is auto."""
    value = cfg.get(key)
    if is_auto(value):
        return list(ID_NAMES if key == "id_field" else CATEGORY_NAMES)
    return [name] if (name := field_name(value)) else []


def _resolve_fields(cfg, columns: list[str], template: str | None) -> tuple[list[str], str | None, str | None]:
    """(text fields, id field, category field) as configured, each set to auto replaced by the first of
    its usual names among `columns`: the text's none when a template makes the text, and refused in one
    line when the set has none of them; the id's or category's None when the set has none (rows are
    numbered, prompts take the fixed category)."""
    text_fields = _as_list(cfg.get("text_field"))
    if text_fields == [AUTO]:
        found = next((name for name in TEXT_NAMES if name in columns), None)
        if found is None and not template:
            raise HarnessError(
                f"{_where(cfg)} has none of the fields a prompt is read from by default ({', '.join(TEXT_NAMES)}; "
                f"its fields: {', '.join(columns)}): set dataset.text_field to the one that holds the prompt, "
                f"or build it with dataset.template='...{{field}}...'"
            )
        text_fields = [] if template else [found]
    id_field, category_field = (
        next((name for name in field_candidates(cfg, key) if name in columns), None)
        if is_auto(cfg.get(key))
        else field_name(cfg.get(key))
        for key in ("id_field", "category_field")
    )
    return text_fields, id_field, category_field


def _where(cfg) -> str:
    return f"dataset.path={cfg.path}" if cfg.get("path") else (cfg.get("hf_id") or cfg.name)


def _say_fields(cfg, text_fields: list[str], id_field: str | None, category_field: str | None, fixed_category: str) -> None:
    """The one line that says which fields a set whose fields were found (auto) is read from."""
    if not text_fields:
        text = "dataset.template"
    else:
        text = ", ".join(f"field '{f}'" + (" (its first turn)" if f == "turns" else "") for f in text_fields)
    source = Path(str(cfg.path)).name if cfg.get("path") else (cfg.get("hf_id") or cfg.name)
    category = f"field '{category_field}'" if category_field else f"'{fixed_category}' for all"
    pid = f"field '{id_field}'" if id_field else "row number"
    print(
        f"[harness] dataset {cfg.name}: prompts from {text} of {source} (category: {category}, id: {pid}); "
        f"dataset.text_field, dataset.category_field and dataset.id_field choose others",
        file=sys.stderr,
    )


def _template(cfg) -> str | None:
    """dataset.template, refused in one line when it is not text (Hydra reads true, 5 or [a] as a bool, number or list)."""
    template = cfg.get("template")
    if template is None or isinstance(template, str):
        return template
    shown = str(template).lower() if isinstance(template, bool) else str(template)
    raise HarnessError(
        f"dataset.template={shown} is not a format string: give text naming the row's fields in braces, quoted, "
        f"e.g. 'dataset.template=\"Summarize: {{text}}\"' (null: the text field as is)"
    )


def _template_fields(template: str | None) -> list[tuple[str, str]]:
    """The row fields a template names, each as (field, as written: translation[de]); refuses
    anything but {field} and {field[key]}."""
    if not template:
        return []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise HarnessError(
            f"dataset.template is not a valid format string ({err}): write fields as {{field}} and literal braces as {{{{ }}}}"
        ) from None
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
    where = _where(cfg)
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
            keys_usable = (
                [k for k in text if isinstance(k, str) and k and not k.isdigit() and not set(k) & set("[]{}'\"")]
                if isinstance(text, dict)
                else [0]
                if text
                else []
            )
            if keys_usable:
                key = next((k for k in ("content", "text", "value") if k in keys_usable), keys_usable[0])
                hint += f", or build it with 'dataset.template=\"{{{item}[{key}]}}\"'"
            raise HarnessError(
                f"dataset.text_field={field} of {cfg.name} holds {type(text).__name__} values{keys}, not text: {hint}"
            )


def to_prompts(cfg, rows: Iterable[dict], columns: list[str] | None, features: Any = None) -> list[dict]:
    """The {"id", "category", "prompt"} dicts of a set's rows (see the module docstring). `columns`: the
    set's fields when it declares them (None: a streamed set, checked on its first row); `features`: its
    datasets Features, for ClassLabel ids and categories. Rows whose text is empty are left out, with a
    warning; a configured field the set lacks, or no prompt at all, is one line."""
    text_fields = _as_list(cfg.get("text_field"))
    template = _template(cfg)
    if not text_fields and not template:
        raise HarnessError(
            f"dataset={cfg.name} names no text: set dataset.text_field=<field> or dataset.template='...{{field}}...'"
        )
    id_field, category_field = field_name(cfg.get("id_field")), field_name(cfg.get("category_field"))
    any_auto = text_fields == [AUTO] or AUTO in (id_field, category_field)
    if any_auto and columns is None:  # a streamed set that declares no fields: found on its first row
        rows = iter(rows)
        first = next(rows, None)
        rows = itertools.chain([] if first is None else [first], rows)
        columns = None if first is None else list(first)  # no rows: said below
    if any_auto and columns is not None:
        text_fields, id_field, category_field = _resolve_fields(cfg, columns, template)
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
            raise HarnessError(
                f"dataset.template does not fit row {index} of {cfg.name} ({type(err).__name__}: {err}): check the fields it names"
            ) from None
        if not text.strip():  # a template over an empty or null field
            empty += 1
            continue
        pid = _label(row.get(id_field), id_labels) if id_field else None
        pid = f"{cfg.name}-{index}" if pid is None else pid
        if pid in seen:
            raise HarnessError(
                f"{cfg.name}: id {pid!r} appears twice in field '{id_field}': ids must be unique (dataset.id_field=null numbers the rows)"
            )
        seen.add(pid)
        row_category = _label(row.get(category_field), category_labels) if category_field else None
        prompts.append({"id": pid, "category": fixed_category if row_category is None else row_category, "prompt": text})

    if read == 0:
        raise HarnessError(f"{cfg.name} holds no rows: it needs one prompt per row")
    shown_fields = [name for f in text_fields for name in ([n for n in text_reads if FIELD.match(n).group(1) == f] or [f])]
    what_empty = (
        "/".join(dict.fromkeys(shown_fields)) + (" (or dataset.template renders empty)" if template else "")
        if text_fields
        else "dataset.template (as rendered)"
    )
    if empty:
        print(
            f"[harness] warning: {cfg.name}: {empty} of {read} rows have an empty {what_empty} and were left out", file=sys.stderr
        )
    if not prompts:
        raise HarnessError(f"{cfg.name} gave no prompts: all {read} rows read have an empty {what_empty}")
    if any_auto:
        _say_fields(cfg, text_fields, id_field, category_field, fixed_category)
    return prompts
