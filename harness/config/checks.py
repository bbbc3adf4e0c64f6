"""The checks of a command line and of a composed config, which run before torch loads.

A mistyped setting or a value out of range is the most common way a run ends, and it should end
in a second with one `error:` line, not after the ten seconds torch and transformers take to import.

`check_command_line(argv)` composes what a command line asks for with Hydra's compose API, as Hydra
will, against the schema of harness.config.settings (a multirun: each value of each swept setting
once): Hydra and OmegaConf decide what is unknown, unreadable or of the wrong type, and `explain`
says their exception in one line with a fix. `validate(cfg)` checks what types cannot say (k >= 1,
compile=true needs cache=static) over a composed config (harness.runner.cell.run_cell calls it again,
for callers that skip the entry points).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
import re
import sys
import typing
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from harness.config import settings
from harness.errors import HarnessError, one_line

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
for _path, _schema in settings.SCHEMAS.items():  # what conf/'s defaults lists name as /schema/<path>@_here_
    ConfigStore.instance().store(group=f"schema/{_path}".rpartition("/")[0], name=_path.rpartition("/")[2], node=_schema)

COMPOSING = (HydraException, OmegaConfBaseException, ValueError)  # what Hydra's composition raises for a command line
CHOICES = {
    "cache": settings.CACHES,
    "cpu_linear": settings.CPU_LINEAR_MODES,
    "forward": settings.FORWARDS,
    "wandb.mode": settings.WANDB_MODES,
    "prompts.template": settings.TEMPLATES,
    "prompts.overlong": settings.OVERLONG,
}
# What a setting must be: the message for a value out of range (validate) or of the wrong type (explain).
MUST = {
    "seed": f"must be an integer from 0 to {settings.MAX_SEED} (a prompt's seed is seed x {settings.PROMPT_SEED_STRIDE:_} + its index)",
    "k": "must be a positive integer (e.g. k=4)",
    "batch_size": "must be a positive integer (1: one prompt at a time)",
    "max_new_tokens": "must be a positive integer",
    "temperature": f"must be a number from 0 (greedy) to {settings.FLOAT32_MAX:.3g} (float32's largest)",
    "top_p": "must be in (0, 1] (1 turns it off)",
    "top_k": "must be an integer >= 0 (0 turns it off)",
    "device": "must be auto, cpu, cuda or cuda:N (a GPU by index: device=cuda:0)",
    "dataset.num_prompts": "must be a positive integer or null (all)",
    "dataset.max_rows": "must be a positive integer or null (every row)",
    "pair.draft.length": "must be match (prompt lookup proposes its match; how much of it: draft_length=cost, heuristic, ...)",
    "pair.target.id": "must be an HF id or a local directory",
    "pair.draft.id": "must be an HF id or a local directory",
    "cache": "must be dynamic or static",
    "cpu_linear": f"must be one of {', '.join(settings.CPU_LINEAR_MODES)}",
    "forward": "must be auto, hf or lean (auto: lean where it runs, else hf; hf: the models' own modules; lean: harness/models/lean.py, Llama models)",
    "wandb.mode": f"must be one of {', '.join(settings.WANDB_MODES)}",
    "prompts.template": "must be auto, chat or raw",
    "prompts.overlong": "must be truncate or skip",
}
MUST_TYPE = {bool: "must be true or false", int: "must be an integer", float: "must be a number"}
LOOKUP_ONLY = [f"pair.draft.{f.name}" for f in dataclasses.fields(settings.LookupDraft) if f.name != "kind"]


@contextlib.contextmanager
def hydra_on_conf():
    """Hydra's compose API over conf/: the running app's Hydra if there is one, else one for the block."""
    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def with_default_pair(cfg: DictConfig) -> DictConfig:
    """Fill `pair` with conf/pair/<default_pair>.yaml when no +pair= was given."""
    if cfg.get("pair") is None:
        cfg.pair = default_pair(cfg.default_pair)  # assigned as a copy
    return cfg


@functools.cache
def default_pair(name: str) -> DictConfig:
    """conf/pair/<name>.yaml as Hydra composes it (its schema first)."""
    try:
        with hydra_on_conf():
            return compose(config_name=f"pair/{name}").pair  # a group's config keeps the group's package
    except MissingConfigException:
        raise HarnessError(f"default_pair={name} has no conf/pair/{name}.yaml") from None


def check_choices(argv: list[str], config_name: str = "config", sweeps: bool = True) -> None:
    """`check_command_line` for an entry point: a command line refused ends the process in one line, exit 2."""
    try:
        check_command_line(argv, config_name, sweeps)
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def check_command_line(argv: list[str], config_name: str = "config", sweeps: bool = True) -> None:
    """Compose a command line's config as Hydra will, before torch loads; HarnessError (one line) if it
    cannot. `config_name`: the entry point's primary config; `sweeps`: whether it runs Hydra multiruns
    (the bench does not: one value each)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # how Hydra expands a sweep into jobs
    from hydra._internal.utils import get_args_parser  # the flags as hydra.main reads them (-m, --cfg job, --cf job)

    args = get_args_parser().parse_args(argv)
    if args.multirun and (args.cfg or args.info):  # Hydra: a ValueError traceback
        raise HarnessError(
            f"-m runs the cells and {'--cfg' if args.cfg else '--info'} only prints: give one of them "
            f"(--cfg job without -m shows one cell's config)"
        )
    if args.config_path or args.shell_completion or args.experimental_rerun:
        return  # another primary config, or nothing composed: Hydra's own
    overrides = [*args.overrides, *([f"hydra.searchpath=[file://{Path(args.config_dir).resolve()}]"] if args.config_dir else [])]
    config_name, prints = args.config_name or config_name, bool(args.cfg or args.info or args.help or args.hydra_help)
    with hydra_on_conf():
        hydra = GlobalHydra.instance().hydra
        parsed = parse(overrides, OverridesParser.create(config_loader=hydra.config_loader))  # the loader: glob(*) lists options
        swept = [o for o in parsed if o.is_sweep_override()]
        multirun = args.multirun or bool(swept) and hydra.get_mode(config_name, overrides) == RunMode.MULTIRUN
        if swept and not (sweeps and multirun):
            raise HarnessError(
                f"{swept[0].input_line} lists several values: add -m to run one cell each"
                if sweeps
                else f"{swept[0].input_line} lists several values, and this command runs one of each (k: use --ks)"
            )
        jobs, sweep_error = [overrides], None
        if multirun:
            try:  # the sweep's own config, which Hydra composes before its jobs, and without the swept pairs
                hydra.compose_config(config_name, overrides, run_mode=RunMode.MULTIRUN)
            except COMPOSING as err:
                sweep_error = err
                override, pairs = (
                    failing_override(err, parsed),
                    next((o.input_line for o in swept if o.key_or_group == "pair"), None),
                )
                if override and override.key_or_group.startswith("pair.") and pairs:
                    line = override.input_line
                    fix = (
                        "sweep one pair per command"
                        if override.is_delete() or override.key_or_group in LOOKUP_ONLY  # a model draft refuses those
                        else f"write it ++{line.lstrip('+')} to set it in every swept pair, or sweep one pair per command"
                    )
                    raise HarnessError(f"{line} cannot go with a sweep over pairs ({pairs}): {fix}") from None
            jobs, seen = [], set()
            for job in BasicSweeper.split_arguments(parsed, None)[0]:  # each value of each swept setting once
                if not seen.issuperset(job):
                    jobs.append(job)
                    seen.update(job)
        for number, job in enumerate(jobs):
            try:
                check_composed(compose(config_name, job, return_hydra_config=True), multirun, output=number == 0 and not prints)
            except COMPOSING as err:
                raise HarnessError(explain(err, config_name, job, parse(job, OverridesParser.create()))) from None
        if sweep_error is not None:
            raise HarnessError(explain(sweep_error, config_name, overrides, parsed))


def parse(overrides: list[str], parser: OverridesParser) -> list[Override]:
    """Hydra's reading of each override; HarnessError for one its grammar cannot read."""
    parsed = []
    for line in overrides:
        try:
            parsed += parser.parse_overrides([line])
        except OverrideParseException as err:
            if "=" not in line and not line.startswith("~"):
                raise HarnessError(
                    f"cannot read {line!r}: an override is KEY=VALUE, e.g. k=4 (python -m harness --help lists the flags)"
                ) from None
            name, _, value = line.partition("=")
            # Brackets (a template) or a non-ASCII letter (a path, a name), which Hydra's grammar reads only quoted.
            unquoted = (any(c in value for c in "{}[]()") or not value.isascii()) and not value.startswith(("'", '"'))
            fix = (
                f"quote the value inside the shell's quotes, e.g. '{name}=\"{value}\"'"
                if unquoted
                else "see Hydra's override grammar, https://hydra.cc/docs/advanced/override_grammar/basic/"
            )
            raise HarnessError(f"cannot read {line!r} ({one_line(err)}): {fix}") from None
    return parsed


def failing_override(err: Exception, parsed: list[Override]) -> Override | None:
    """The override a composition error of Hydra's names, if it names one."""
    match = re.match(
        r"(Error merging override |Could not override '|Could not append to config\. An item is already at '|"
        r"Could not delete from config\. ')([^']+)",
        one_line(err),
    )
    return next((o for o in reversed(parsed) if match[2] in (o.input_line, o.key_or_group)), None) if match else None


def explain(err: Exception, config_name: str, overrides: list[str], parsed: list[Override]) -> str:
    """One line for an exception of Hydra's composition of `overrides`, with the fix."""
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    first = one_line(err) if str(err).strip() else one_line(cause)
    if isinstance(err, MissingConfigException) and "/" in (err.missing_cfg_file or ""):  # +pair=nope, dataset=nope
        group, _, name = err.missing_cfg_file.rpartition("/")
        prefix = next(("+" if o.is_add() else "" for o in parsed if o.key_or_group == group), "")
        close = difflib.get_close_matches(name, err.options or [], n=1)
        hint = f"did you mean {prefix}{group}={close[0]}? " if close else ""
        return f"unknown {group} '{name}': {hint}available: {', '.join(sorted(err.options or []))} (conf/{group}/)"
    override = failing_override(err, parsed)
    if override is None:
        return first
    line, key = override.input_line, override.key_or_group
    if key == "pair" and "No match in the defaults list" in str(err):
        return f"{line}: the pair is chosen with a '+': +{line}"
    if "An item is already at" in first:
        return f"{line}: {key} is already a setting, so drop the '+': {line.lstrip('+')}"
    try:  # the config without this override: what the fix can name
        base = compose(config_name, [o for o in overrides if o != line], return_hydra_config=True)
    except COMPOSING:
        return first
    if key.startswith("pair.") and base.get("pair") is None:
        return f"{line} sets the pair, so choose the pair first: add +pair=NAME (the default is +pair={base.default_pair})"
    if override.is_delete():  # a key of a schema
        return needed(key)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):  # not in struct
        return unknown_setting(key, base)
    if isinstance(cause, ValidationError):
        if isinstance(section := OmegaConf.select(base, key), DictConfig):  # wandb=disabled
            keys = sorted(section)
            example = next(
                (f"{key}.{k}={v}" for k, v in (("mode", "disabled"), ("id", "<HF id or folder>")) if k in keys),
                f"{key}.{keys[0]}=...",
            )
            return f"{line}: {key} is a section, not a setting: set one of its keys ({', '.join(keys)}), e.g. {example}"
        return f"{key}={cause.value} {MUST.get(key) or MUST_TYPE.get(field_type(base, key)) or f'({one_line(cause)})'}"
    return first


def field_type(cfg: DictConfig, key: str) -> type | None:
    """The type a schema gives a setting (int for `int | None`), if one types it."""
    section, _, leaf = key.rpartition(".")
    schema = OmegaConf.get_type(OmegaConf.select(cfg, section) if section else cfg)
    hint = typing.get_type_hints(schema).get(leaf) if dataclasses.is_dataclass(schema) else None
    return next((t for t in typing.get_args(hint) or (hint,) if t is not type(None)), None)


def unknown_setting(key: str, cfg: DictConfig) -> str:
    """The message for a key the composed config `cfg` has no place for: the closest key, or the
    option of a config group that has it (a prompt-lookup key with a model pair)."""
    parts, parent, depth = key.split("."), cfg, 0
    while depth < len(parts) - 1 and isinstance(parent.get(parts[depth]), DictConfig):  # down to the first part it lacks
        parent, depth = parent[parts[depth]], depth + 1
    siblings = sorted(k for k in parent if k not in ("hydra", parts[depth]))
    close = difflib.get_close_matches(parts[depth], siblings, n=1, cutoff=0.7)
    hint = f"did you mean {'.'.join([*parts[:depth], close[0], *parts[depth + 1 :]])}? " if close else ""
    if depth and parts[0] in ("pair", "dataset"):
        group, chosen = parts[0], OmegaConf.select(cfg, f"hydra.runtime.choices.{parts[0]}")
        options = {p.stem: OmegaConf.load(p) for p in sorted((CONF_DIR / group).glob("*.yaml"))}
        having = sorted(
            (
                o
                for o, option in options.items()  # ...: a key with a null value, or one only a run resolves
                if OmegaConf.select(option, ".".join(parts[1:]), default=..., throw_on_resolution_failure=False) is not ...
            ),
            key=lambda o: (o != "local", o),
        )  # local: any file
        choose = "dataset=" if group == "dataset" else "+pair="
        if having and chosen in options:
            keys = f", whose keys are {', '.join(sorted(set(options[chosen]) - {'defaults'}))}" if group == "dataset" else ""
            also = f" (also {', '.join(having[1:])})" if len(having) > 1 else ""
            return f"unknown setting '{key}' for {choose}{chosen}{keys}: use one that takes it, e.g. {choose}{having[0]} {key}=...{also}"
        if group == "dataset":
            return f"unknown setting '{key}': {hint}(no prompt set reads it; --cfg job prints the settings)"
        return f"unknown setting '{key}': {hint or 'no config has it '}(--cfg job prints them all; +{key}=... adds a new key)"
    if depth:  # a section's key mistyped, e.g. wandb.mdoe
        return f"unknown setting '{key}': {hint}{'.'.join(parts[:depth])} has {', '.join(siblings)}"
    return f"unknown setting '{key}': {hint or 'no config has it '}(--cfg job prints them all)"


def needed(key: str) -> str:
    """The message for a setting removed (~key)."""
    instead = (
        "choose a prompt set (dataset=NAME) or set the key instead"
        if key.startswith("dataset")
        else f"set it instead, e.g. {key}=..."
    )
    return f"~{key}: every run needs {key}; {instead}"


def check_composed(cfg: DictConfig, multirun: bool, output: bool) -> None:
    """What Hydra lets through but no run can use. A key added where nothing reads it: '+' adds a key
    even to a schema's section (+temprature=0.7), which would only give the run another cell key. A
    setting removed (~k). Results that move with each job. `output`: an output folder Hydra could not make."""
    sections = [
        ("", cfg),
        *(
            (f"{name}.", node)
            for name, node in cfg.items_ex(resolve=False)
            if name not in ("hydra", "pair") and isinstance(node, DictConfig)
        ),
    ]  # a pair's keys are its own
    for path, section in sections:
        schema = OmegaConf.get_type(section)
        fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else set(section)
        for key in sorted(
            set(section) - fields - {"hydra"}
        ):  # at the top, a config group of the user's (--config-dir) may add keys
            if path or difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.7):
                raise HarnessError(unknown_setting(path + key, cfg))
        for key in sorted(fields - {"pair"}):
            if key not in section or OmegaConf.is_missing(section, key):  # ~k; ~dataset leaves the schema's ???
                raise HarnessError(needed(path + key))
    if cfg.hydra.job.chdir and not Path(str(cfg.out_dir)).expanduser().is_absolute():
        raise HarnessError(
            f"hydra.job.chdir=true runs each job in its own folder, where out_dir={cfg.out_dir} names another place "
            f"every time, so cells never resume: leave hydra.job.chdir false, or give an absolute out_dir"
        )
    key = "sweep" if multirun or cfg.hydra.mode == RunMode.MULTIRUN else "run"
    try:
        folder = Path(str(cfg.hydra[key].dir)).expanduser()
    except OmegaConfBaseException:  # an interpolation only a running job resolves (${hydra:...})
        return
    if output and (problem := unmakeable(folder)):
        given = OmegaConf.to_container(cfg.hydra[key])["dir"]
        raise HarnessError(f"hydra.{key}.dir={given}: {problem}: give hydra.{key}.dir=<a folder that can be made>")


def unmakeable(folder: Path) -> str | None:
    """Why `folder` could not be made or written to (its nearest existing ancestor is a file, or not
    writable), or None."""
    existing = next((p for p in [folder, *folder.parents] if p.exists()), Path("."))
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK):
        return f"{existing.resolve()} is not writable"
    return None


def compiled_k_message(k: int) -> str:
    return (
        f"k={k} with compile=true: compiled steps take at most {settings.COMPILED_MAX_TOKENS} positions and a verify "
        f"takes k + 1 = {k + 1}, which would run eagerly: use k <= {settings.COMPILED_MAX_TOKENS - 1}, or compile=false"
    )


def validate(cfg: DictConfig) -> None:
    """The ranges of a composed config's settings (Hydra has checked their types), then the pair's."""
    data, k, new, forward = cfg.dataset, cfg.k, cfg.max_new_tokens, cfg.get("forward", "hf")
    within = {
        "seed": 0 <= cfg.seed <= settings.MAX_SEED,
        "k": k >= 1,
        "batch_size": cfg.get("batch_size", 1) >= 1,
        "device": re.fullmatch(r"auto|(cpu|cuda)(:\d+)?", cfg.device),
        "temperature": 0 <= cfg.temperature <= settings.FLOAT32_MAX,
        "top_p": 0 < cfg.top_p <= 1,
        "top_k": cfg.top_k >= 0,
        "max_new_tokens": new >= 1,
        "dataset.num_prompts": data.get("num_prompts") is None or data.num_prompts >= 1,
        "dataset.max_rows": data.get("max_rows") is None or data.max_rows >= 1,
        **{
            key: OmegaConf.select(cfg, key, default="hf") in values for key, values in CHOICES.items()
        },  # a config without forward: hf
    }
    checks = [
        *((ok, f"{key}={OmegaConf.select(cfg, key)} {MUST[key]}") for key, ok in within.items()),
        (
            cfg.temperature == 0 or cfg.temperature >= 1e-6,
            f"temperature={cfg.temperature} is greedy in all but name and under float32's range: use temperature=0",
        ),
        # k = max_new_tokens stays allowed (a sweep's k=8 on a quick 8-token run); far beyond, measuring the
        # verify costs of k + 1 positions takes minutes for drafts no cycle can make.
        (
            k <= new,
            f"k={k} is more than max_new_tokens={new}, and a cycle drafts at most {new - 1}: lower k or raise max_new_tokens",
        ),
        (not cfg.compile or cfg.cache == "static" or forward != "hf", settings.HF_COMPILE_STATIC),
        # Longer steps run eagerly (CachedLM.forward): a run labelled compiled would time its full verifies eager.
        (not cfg.compile or k + 1 <= settings.COMPILED_MAX_TOKENS, compiled_k_message(k)),
        (forward != "lean" or cfg.cache == "dynamic", settings.LEAN_OWN_STORAGE),
        (
            cfg.get("batch_size", 1) == 1 or (cfg.cache == "dynamic" and not (cfg.compile and forward == "hf")),
            settings.BATCH_ONE_ONLY,
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise HarnessError(message)
    check_pair(cfg.pair)
    check_draft_length(cfg.get("draft_length"), cfg.pair.draft.kind)
    check_tree(cfg)


def check_tree(cfg: DictConfig) -> None:
    """tree: children per depth (integers >= 1), drafted by a model draft or a feature head, one row, eager steps."""
    tree, candidates = cfg.get("tree"), cfg.get("tree_candidates", "top")
    if candidates not in settings.TREE_CANDIDATES:
        raise HarnessError(f"tree_candidates={candidates} must be top (the draft's top tokens) or sampled (drawn from it)")
    if tree is None:
        return
    widths = list(tree) if isinstance(tree, ListConfig | list) else tree
    if widths != "dynamic" and not (widths and all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths)):
        raise HarnessError(
            f"tree={tree} must be a list of children per depth, integers >= 1 (tree=[3,2,1]), dynamic, or null (a chain)"
        )
    nodes, topk = cfg.get("tree_nodes", 8), cfg.get("tree_topk", 4)
    reasons = [
        (
            widths == "dynamic" and candidates == "sampled",
            "a dynamic tree keeps the draft's best candidates: tree_candidates=top",
        ),
        (widths == "dynamic" and not (nodes >= 1 and topk >= 1), f"tree_nodes={nodes} and tree_topk={topk} must be >= 1"),
        (cfg.pair.draft.kind == "ngram", "prompt lookup proposes one match, not a tree: use a model draft or a feature head"),
        (cfg.get("batch_size", 1) > 1, "token trees run at batch_size=1 (a tree per row would pad every row to the widest tree)"),
        (
            cfg.get("compile", False),
            "token trees run eager steps (their attention mask is not a captured shape): use compile=false",
        ),
        (cfg.get("cache") == "static", "token trees run on cache=dynamic"),
        (
            (cfg.get("draft_length") or {}).get("policy", "constant") != "constant",
            "a tree's depth is k: draft_length policies shorten chains, use draft_length=constant",
        ),
    ]
    for refused, why in reasons:
        if refused:
            raise HarnessError(f"tree={widths}: {why}")


def check_draft_length(setting: DictConfig | None, draft_kind: str) -> None:
    """draft_length (conf/draft_length/): a known policy with settings it can use, for a draft it applies to."""
    if setting is None:
        return
    policy, threshold, table = setting.get("policy"), setting.get("threshold", 0.4), setting.get("table") or {}
    if policy not in settings.DRAFT_LENGTHS:
        raise HarnessError(f"draft_length={policy} must be one of {', '.join(settings.DRAFT_LENGTHS)} (e.g. draft_length=cost)")
    if policy == "confidence" and not (threshold == "auto" or (isinstance(threshold, (int, float)) and 0 < threshold < 1)):
        raise HarnessError(f"draft_length.threshold={threshold} must be a number in (0, 1) or auto (fitted online)")
    if policy == "confidence" and draft_kind == "ngram":
        raise HarnessError(
            "draft_length=confidence needs the draft's probabilities, and prompt lookup has none (its q is a point mass): "
            "use draft_length=cost, heuristic, by_batch or constant"
        )
    if policy == "by_batch" and not (
        table
        and all(isinstance(b, int) and b >= 1 for b in table.keys())
        and all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in table.values())
    ):
        raise HarnessError(
            f"draft_length.table={table} must map batch sizes (integers >= 1) to k (integers >= 0), e.g. '{{1: 4, 8: 2, 32: 0}}'"
        )


def check_pair(pair: DictConfig) -> None:
    """A pair names a target and a draft the loop can run, before anything loads."""
    name, draft = pair.get("name"), pair.get("draft")
    if not isinstance(name, str) or not re.fullmatch(r"\w[\w.-]*", name):  # it starts the cell's folder name
        raise HarnessError(f"pair.name={name} must be a plain name (letters, digits, _ . -): it names the cell's folder")
    if not pair.get("target") or not pair.target.get("id"):
        raise HarnessError(f"pair {name} has no target: set pair.target.id (an HF id or a local directory)")
    if not isinstance(draft, DictConfig) or draft.get("kind") is None:
        raise HarnessError(f"pair {name} has no draft: set pair.draft.kind=model with pair.draft.id, or pair.draft.kind=ngram")
    if draft.kind not in settings.DRAFT_KINDS:
        raise HarnessError(
            f"pair.draft.kind={draft.kind} must be model (with pair.draft.id), ngram (prompt lookup), "
            f"or eagle / eagle3 (a feature head, with pair.draft.id)"
        )
    if draft.kind != "ngram" and not draft.get("id"):
        raise HarnessError(
            f"pair {name} has a {draft.kind} draft without an id: set pair.draft.id (an HF id or a local directory)"
        )
    low, high = draft.get("min_ngram", 1), draft.get("max_ngram", 3)
    if draft.kind == "ngram" and not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        raise HarnessError(f"pair.draft.min_ngram={low} and max_ngram={high} must be integers with 1 <= min_ngram <= max_ngram")
    if draft.get("length") == "cost_aware":
        raise HarnessError(
            "pair.draft.length=cost_aware is draft_length=cost now, one policy for every draft: "
            "use +pair=smollm2_ngram draft_length=cost (docs/metrics.md, Draft length)"
        )
    if draft.get("length", "match") not in settings.LOOKUP_LENGTHS:
        raise HarnessError(f"pair.draft.length={draft.length} {MUST['pair.draft.length']}")
    lookup_only = [key for key in ("length", "max_ngram", "min_ngram") if draft.kind != "ngram" and key in draft]
    if lookup_only:
        raise HarnessError(
            f"pair.draft.{lookup_only[0]} is a prompt-lookup setting and this pair's draft is a {draft.kind} draft, which would "
            f"ignore it: use +pair=smollm2_ngram, or pair.draft.kind=ngram"
        )
