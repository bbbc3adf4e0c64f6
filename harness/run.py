"""One benchmark cell: a pair, a k, a sampling setting, a prompt set.

`run_cell(cfg)` is a plain function over a composed config; the Hydra entry
point (harness.__main__) is a thin wrapper around it and tests call it
directly. For every prompt it runs the target-only baseline and the
speculative loop back to back (alternating which goes first, so drift hits
both alike), times each from outside, and appends one JSON line; the
summary is derived from those lines.

Results live in `<out_dir>/<cell key>/`, the key derived from the resolved
config, so a re-run of the same cell resumes where it stopped and a
finished cell is not run again unless `force=true`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from harness import cpu_linear, lean, metrics, tracking
from harness.datasets import file_sha256, load_prompts
from harness.drafters import Drafter, ModelDrafter, NgramDrafter, check_lookup_length
from harness.errors import HarnessError
from harness.loop import autoregressive_decode, speculative_decode
from harness.models import CachedLM, ModelSpec, check_same_vocabulary, load_model, load_tokenizer, resolve_device, resolve_dtype
from harness.prompts import as_tensor, encode, encode_within, select, set_pair_template
from harness.sampling import Sampling

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# Keys that do not change a cell's results: they stay out of its key.
NOT_IN_KEY = ("out_dir", "force", "wandb", "default_pair")


@dataclass
class Pair:
    name: str
    target: CachedLM
    drafter: Drafter
    tokenizer: Any
    eos_ids: set[int]
    device: torch.device
    linear: dict = field(default_factory=dict)  # harness.cpu_linear.choose: the product the linear layers use, and why
    linear_at_load: dict = field(default_factory=dict)  # what choose() gave at load, before any resumed cell followed another

    @property
    def context(self) -> int:
        """The longest sequence both models take: the target's context, or a draft model's if shorter."""
        if isinstance(self.drafter, ModelDrafter):
            return min(self.target.context, self.drafter.lm.context)
        return self.target.context

    def prompt_budget(self, new_tokens: int) -> int:
        """The longest prompt that leaves room in the pair's context for new_tokens, the same at
        every k (so every k of a sweep runs the same prompts): the loop and the baseline never
        hold more than prompt + new_tokens - 1 positions, since a cycle drafts at most the
        tokens it can still keep (harness.loop)."""
        return self.context - new_tokens + 1

    def reserve(self, longest_prompt: int, new_tokens: int, k: int) -> None:
        """Size both KV caches (static: their slots; dynamic: the in-place storage allocated ahead) for that
        prompt and new_tokens (prompt + new_tokens - 1 positions),
        or for measure_costs' verify of k + 1 positions after it, whichever is longer."""
        positions = longest_prompt + max(new_tokens - 1, k)
        self.target.reserve(positions)
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.lm.reserve(positions)

    def warm_up(self, k: int) -> None:
        """With compile=true, compile every step shape of a k-draft run before anything is
        timed: verifies of 1..k+1 tokens (k' < k near the token budget) and the draft's
        one-token steps and two-token catch-up (last draft + bonus)."""
        self.target.warm_up([(n, n) for n in range(1, k + 2)])
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.lm.warm_up([(1, 1), (2, 1)])

    def models(self) -> list:
        """The pair's models: the target, and the draft when it is a model."""
        return [self.target.model] + ([self.drafter.lm.model] if isinstance(self.drafter, ModelDrafter) else [])

    def follow_linear(self, records: list[dict]) -> None:
        """Set the CPU linear products for a cell whose earlier prompts are `records`: the plan they
        ran with (cpu_linear=auto times the products anew in each process, and where times are close
        may choose another), else the one chosen at load, which a previous cell in this process
        may have changed."""
        linear = self.linear_at_load
        earlier = {_linear_plan(r) for r in records}
        at_load = tuple(linear["rows_to"]) if linear.get("rows_to") else None
        if linear.get("mode") == "auto" and len(earlier) == 1 and earlier != {at_load}:
            rows_to = earlier.pop()
            linear = {key: value for key, value in linear.items() if key != "rows_to"} | {
                "product": "transposed" if rows_to else "torch", "why": "resumed: the cell's earlier prompts ran with this plan",
                **({"rows_to": list(rows_to)} if rows_to else {})}
        elif len(earlier) > 1:
            print(f"[harness] warning: this cell's earlier prompts ran with different CPU linear products "
                  f"({'; '.join(sorted(cpu_linear.describe(plan) for plan in earlier))}); force=true runs it anew with one", file=sys.stderr)
        if linear.get("rows_to") != self.linear.get("rows_to"):
            cpu_linear.apply(self.models(), linear.get("rows_to"))
        self.linear = linear

    def use_costs(self, costs: dict) -> None:
        """Hand measure_costs' v(n) to a drafter that weighs its proposals by it
        (prompt lookup with length=cost_aware proposes whole matches until then)."""
        if isinstance(self.drafter, NgramDrafter):
            self.drafter.verify_cost = costs["verify_cost"]


_loaded: dict[str, Pair] = {}  # one pair per process, reused by every cell of a multirun


def with_default_pair(cfg: DictConfig) -> DictConfig:
    """Fill `pair` from conf/pair/<default_pair>.yaml when no +pair= was given."""
    if cfg.get("pair") is None:
        path = CONF_DIR / "pair" / f"{cfg.default_pair}.yaml"
        if not path.exists():
            raise HarnessError(f"default_pair={cfg.default_pair} has no conf/pair/{cfg.default_pair}.yaml")
        OmegaConf.set_struct(cfg, False)
        cfg.pair = OmegaConf.load(path)
    return cfg


SWEEP_SYNTAX = re.compile(r"[()\[\]{}'\"]")  # Hydra's sweep functions (choice, range, glob), lists and quoting


def unknown_choice(override: str) -> str | None:
    """A message if a command-line override picks a pair or dataset config that does not exist."""
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    name, _, value = override[len(prefix):].partition("=")
    if name not in ("pair", "dataset") or not value or SWEEP_SYNTAX.search(value):  # choice(a,b), glob(*): Hydra's
        return None
    known = sorted(p.stem for p in (CONF_DIR / name).glob("*.yaml"))
    for choice in value.split(","):  # multirun: pair=a,b
        if choice and choice not in known:
            close = difflib.get_close_matches(choice, known, n=1)
            hint = f"did you mean {prefix}{name}={close[0]}? " if close else ""
            return f"unknown {name} '{choice}': {hint}available: {', '.join(known)} (conf/{name}/)"
    return None


def known_settings(extra: dict | None = None) -> set[str]:
    """Every dotted key a command line may set without '+': conf/config.yaml's, those of each
    option in conf/pair/ and conf/dataset/ under the group's name, and `extra` (the section
    another entry point adds, e.g. harness.exactness's `exactness`)."""
    def walk(node: dict, prefix: str) -> set[str]:
        keys = set()
        for key, value in node.items():
            keys.add(prefix + str(key))
            if isinstance(value, dict):
                keys |= walk(value, f"{prefix}{key}.")
        return keys

    base = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"), resolve=False)
    base.pop("defaults", None)
    base.pop("hydra", None)
    known = walk(base, "") | walk(extra or {}, "")
    for group in ("pair", "dataset"):
        known.add(group)
        for option in group_options(group).values():
            known |= walk(option, f"{group}.")
    return known


def group_options(group: str) -> dict[str, dict]:
    """Each option of a config group (conf/<group>/<name>.yaml) by name, unresolved."""
    return {p.stem: OmegaConf.to_container(OmegaConf.load(p), resolve=False) for p in sorted((CONF_DIR / group).glob("*.yaml"))}


def chosen_options(group: str, argv: list[str]) -> list[str]:
    """The options of a config group a command line runs: `dataset=a` or `+pair=a` (a multirun's
    a,b), else conf/config.yaml's default; none when Hydra's sweep syntax chooses them."""
    chosen = None
    for arg in argv:
        name, _, value = arg.lstrip("+").partition("=")
        if name == group and value:
            chosen = [] if SWEEP_SYNTAX.search(value) else value.split(",")
    if chosen is None:
        config = OmegaConf.load(CONF_DIR / "config.yaml")
        if group == "pair":
            return [config.default_pair]
        defaults = OmegaConf.to_container(config.defaults)
        chosen = [d[group] for d in defaults if isinstance(d, dict) and group in d]
    return chosen


def group_setting(group: str, override: str, chosen: list[str], options: dict[str, dict]) -> str | None:
    """A message if an override sets a key under `group.` that a chosen option lacks but another
    has (Hydra's struct error spans several lines; added with '+', the key would be ignored), e.g.
    pair.draft.length (a prompt-lookup setting) with a model draft. Keys no option has are left
    to unknown_setting."""
    name, equals, _ = override.lstrip("+").partition("=")
    if not equals or not name.startswith(f"{group}.") or (group == "pair" and override.startswith("+")):
        return None  # a key added to a pair (+pair.target.device_map=auto) is the pair's to read: check_pair judges it
    path = name.split(".")[1:]

    def has(keys: dict) -> bool:
        for part in path:
            if not isinstance(keys, dict) or part not in keys:
                return False
            keys = keys[part]
        return True

    lacking = [c for c in chosen if c in options and not has(options[c])]
    having = sorted((o for o, keys in options.items() if has(keys)), key=lambda o: (o != "local", o))  # local: any file
    if not lacking or not having:
        return None
    also = f" (also {', '.join(having[1:])})" if len(having) > 1 else ""
    choose = "dataset=" if group == "dataset" else "+pair="
    keys = f", whose keys are {', '.join(sorted(options[lacking[0]]))}" if group == "dataset" else ""
    return f"unknown setting '{name}' for {choose}{lacking[0]}{keys}: use one that takes it, e.g. {choose}{having[0]} {name}=...{also}"


def misplaced(override: str, multirun: bool, sweeps: bool = True) -> str | None:
    """A message for two common slips Hydra answers in several lines: a pair chosen without its
    '+', and several values without -m (an escaped comma, `\\,`, is one value)."""
    name, equals, value = override.partition("=")
    if name == "pair" and equals:
        return f"{override}: the pair is chosen with a '+': +pair={value}"
    several = re.search(r"(?<!\\),", value) and not SWEEP_SYNTAX.search(value)
    if equals and not multirun and not name.startswith(("hydra", "~")) and several:
        return (f"{override} lists several values: add -m to run one cell each" if sweeps else
                f"{override} lists several values, and this command runs one of each (k: use --ks)")
    return None


def moving_results(argv: list[str]) -> str | None:
    """A message for hydra.job.chdir=true with a relative out_dir: each job runs in its own folder, so the
    results land in another place every time and cells never resume (Hydra says nothing)."""
    def value(key: str) -> str | None:
        return next((a.partition("=")[2] for a in argv if a.lstrip("+").partition("=")[0] == key), None)

    chdir = value("hydra.job.chdir")
    out_dir = value("out_dir") or str(OmegaConf.load(CONF_DIR / "config.yaml").out_dir)
    if chdir is None or chdir.strip().lower() not in ("true", "yes", "on", "1") or Path(out_dir).expanduser().is_absolute():
        return None
    return (f"hydra.job.chdir={chdir} runs each job in its own folder, where out_dir={out_dir} names another place every "
            f"time, so cells never resume: leave hydra.job.chdir false, or give an absolute out_dir")


def _is_multirun_flag(arg: str) -> bool:
    """-m or --multirun (or a prefix of it from --m, as Hydra's argparse takes)."""
    return arg == "-m" or (len(arg) >= 3 and "--multirun".startswith(arg))


def is_multirun(argv: list[str]) -> bool:
    """-m, --multirun (or a prefix of it from --m, as Hydra's argparse takes), or hydra.mode=MULTIRUN."""
    return any(_is_multirun_flag(arg) or re.fullmatch(r"\+*hydra\.mode=\s*(['\"]?)(RunMode\.)?(MULTIRUN|2)\1\s*", arg)
               for arg in argv)


def unparsable(override: str) -> str | None:
    """A message if Hydra's override grammar cannot read an override (Hydra answers in three lines),
    most often a value with braces or brackets left unquoted, e.g. a dataset template."""
    if "=" not in override or override.startswith("-"):
        return None
    try:
        OverridesParser.create().parse_overrides([override])
    except OverrideParseException as err:
        name, _, value = override.partition("=")
        # Brackets (a template) or a non-ASCII letter (a path, a name), which Hydra's grammar reads only quoted.
        unquoted = any(c in value for c in "{}[]()") or not value.isascii()
        unquoted = unquoted and not value.startswith(("'", '"'))
        fix = (f"quote the value inside the shell's quotes, e.g. '{name}=\"{value}\"'" if unquoted
               else "see Hydra's override grammar, https://hydra.cc/docs/advanced/override_grammar/basic/")
        return f"cannot read {override!r} ({str(err).splitlines()[0]}): {fix}"
    return None


def unknown_setting(override: str, known: set[str]) -> str | None:
    """A message if a command-line override sets a key no config has (Hydra's own
    message spans several lines). Deletions (~key), Hydra's own settings and flags, and keys
    added under pair are left to Hydra; a key added anywhere else is judged like a setting,
    since no code would read it (a prompt set reads only the keys conf/dataset/ configs have)."""
    name, equals, _ = override.partition("=")
    bare = name.lstrip("+")
    # A key added (+key=, ++key=) is read only under pair (a model's loading settings, a chat template) and by
    # Hydra: elsewhere nothing reads it, and it would only give the run another cell key (+temprature=0.7). A
    # top-level name may also be a config group of the user's (+experiment=short with --config-dir): judged only
    # when it is close to a setting, as a slip.
    if name.startswith("+") and not bare.startswith(("pair", "hydra")) and bare != "dataset" and \
            ("." in bare or difflib.get_close_matches(bare, sorted(known), n=1, cutoff=0.7)):
        name = bare
    if not equals or name.startswith(("+", "~", "-", "hydra")) or "/" in name or name in known:
        return None
    close = difflib.get_close_matches(name, sorted(k for k in known if not name.startswith(k + ".")), n=1, cutoff=0.7)
    hint = f"did you mean {close[0]}? " if close else ""  # not the section the key is in (exactness for exactness.bogus)
    if name.startswith("dataset."):
        return f"unknown setting '{name}': {hint}(no prompt set reads it; --cfg job prints the settings)"
    section = name.rpartition(".")[0]
    siblings = sorted(k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == section) if section else []
    if siblings and not section.startswith("pair"):  # a section's key mistyped, e.g. exactness.sample
        return f"unknown setting '{name}': {hint}{section} has {', '.join(siblings)}"
    added = f"; +{name}=... adds a new key" if name.startswith("pair.") else ""  # only a pair's keys are read when added
    return f"unknown setting '{name}': {hint}(--cfg job prints them all{added})"


def replaces_section(override: str, known: set[str]) -> str | None:
    """A message for `wandb=disabled`: a value given to a section of settings, which Hydra takes and
    the run then trips over. `pair` and `dataset` are config groups, whose value is an option's name."""
    name, equals, value = override.partition("=")
    name = name.lstrip("+")
    keys = sorted(k[len(name) + 1:] for k in known if k.startswith(name + ".") and "." not in k[len(name) + 1:])
    if not equals or name in ("pair", "dataset") or not keys or value.lstrip().startswith("{"):  # {a: 1}: a whole section
        return None
    example = next((f"{name}.{k}={v}" for k, v in (("mode", "disabled"), ("id", "<HF id or folder>")) if k in keys), f"{name}.{keys[0]}=...")
    return f"{override}: {name} is a section, not a setting: set one of its keys ({', '.join(keys)}), e.g. {example}"


# The dataset keys every run reads (as attributes: removing one crashed); the others are read with a default.
DATASET_KEYS_READ = ("name", "source", "num_prompts")


def added_or_removed(override: str, known: set[str]) -> str | None:
    """A message for `+key=` on a key that exists (Hydra: "Could not append") and for `~key` on one
    of the harness's own settings (a crash later), which Hydra answers in several lines."""
    name, equals, value = override.partition("=")
    bare = name.lstrip("+~")
    if name.startswith("~") and (bare == "dataset" or bare.removeprefix("dataset.") in DATASET_KEYS_READ):  # validate crashed
        return f"{override}: every run needs {bare}; choose a prompt set (dataset=NAME) or set the key instead"
    if name.startswith("++") or bare.startswith(("pair", "dataset", "hydra")) or bare not in known:  # ++: Hydra's add-or-set
        return None  # a pair's or dataset's keys are theirs to add and remove; unknown ones: unknown_setting
    if name.startswith("+") and equals:
        return f"{override}: {bare} is already a setting, so drop the '+': {bare}={value}"
    if name.startswith("~"):
        return f"{override}: every run needs {bare}; set it instead, e.g. {bare}=..."
    return None


# Hydra's flags that take the next word as their value (`--cfg job`, `-cn config`).
VALUED_FLAGS = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun"}


def _takes_value(flag: str | None) -> bool:
    """A Hydra flag that takes the next word, also shortened as argparse allows (`--cf job`)."""
    return flag is not None and (flag in VALUED_FLAGS or (flag.startswith("--") and len(flag) > 2
                                                          and any(f.startswith(flag) for f in VALUED_FLAGS if f.startswith("--"))))


def bare_words(argv: list[str]) -> str | None:
    """A message for a word that is neither a flag, a flag's value nor an override (`k 4` for `k=4`)."""
    for before, arg in zip([None, *argv], argv):
        if "=" not in arg and not arg.startswith(("-", "~")) and not _takes_value(before):
            return f"cannot read {arg!r}: an override is KEY=VALUE, e.g. k=4 (python -m harness --help lists the flags)"
    return None


def check_choices(argv: list[str], extra: dict | None = None, sweeps: bool = True) -> None:
    """Before Hydra composes, for an entry point's command line: unknown `+pair=`/`dataset=`
    names, unknown settings and `dataset.` keys the chosen dataset lacks end the process with
    one `error:` line ("did you mean") and exit 2. `extra`: a section the entry point adds to
    conf/config.yaml; `sweeps`: whether the entry point runs Hydra multiruns (the bench does not)."""
    known, multirun = known_settings(extra), sweeps and is_multirun(argv)
    options = {group: group_options(group) for group in ("pair", "dataset")}
    chosen = {group: chosen_options(group, argv) for group in ("pair", "dataset")}
    if not any(arg.startswith("+pair=") for arg in argv):  # pair.* needs the group chosen first, or Hydra's struct error
        setting = next((arg for arg in argv if arg.lstrip("+~").startswith("pair.")), None)
        if setting:
            default = OmegaConf.load(CONF_DIR / "config.yaml").default_pair
            print(f"error: {setting} sets the pair, so choose the pair first: add +pair=NAME (the default is +pair={default})", file=sys.stderr)
            sys.exit(2)
    shown = next((arg for arg in argv if arg in ("--cfg", "-c", "--info", "-i") or arg.startswith(("--cfg=", "--info="))), None)
    if shown and any(_is_multirun_flag(arg) for arg in argv):  # Hydra: a ValueError traceback (hydra.mode=MULTIRUN it allows)
        print(f"error: -m runs the cells and {shown} only prints: give one of them (--cfg job without -m shows "
              f"one cell's config)", file=sys.stderr)
        sys.exit(2)
    swept_pairs = next((arg for arg in argv if arg.startswith("+pair=") and (re.search(r"(?<!\\),", arg)
                        or re.match(r"\s*(choice|range|glob)\(", arg.partition("=")[2]))), None)
    setting = next((arg for arg in argv if arg.lstrip("+~").startswith("pair.") and not arg.startswith("++")), None)
    if multirun and swept_pairs and setting:  # Hydra applies it before any pair is chosen: "not in struct"
        key = setting.lstrip("+~").partition("=")[0]
        # A prompt-lookup key set in every pair would be refused in a model-draft pair (check_pair).
        lookup_only = key in ("pair.draft.length", "pair.draft.max_ngram", "pair.draft.min_ngram")
        fix = "sweep one pair per command" if setting.startswith("~") or lookup_only else \
            f"write it ++{setting.lstrip('+')} to set it in every swept pair, or sweep one pair per command"
        print(f"error: {setting} cannot go with a sweep over pairs ({swept_pairs}): {fix}", file=sys.stderr)
        sys.exit(2)
    if sweeps and (problem := unwritable_output(argv, multirun)):  # an entry point run by Hydra, which makes the folder
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    if problem := moving_results(argv):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    words = bare_words(argv)
    if words:
        print(f"error: {words}", file=sys.stderr)
        sys.exit(2)
    for arg in argv:
        message = (unparsable(arg) or misplaced(arg, multirun, sweeps) or unknown_choice(arg) or replaces_section(arg, known)
                   or added_or_removed(arg, known)
                   or next(filter(None, (group_setting(g, arg, chosen[g], options[g]) for g in options)), None)
                   or unknown_setting(arg, known))
        if message:
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)


def unmakeable(folder: Path) -> str | None:
    """Why `folder` could not be made or written to (its nearest existing ancestor is a file, or not
    writable), or None."""
    existing = next((p for p in [folder, *folder.parents] if p.exists()), Path("."))
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK):
        return f"{existing.resolve()} is not writable"
    return None


def unwritable_output(argv: list[str], multirun: bool) -> str | None:
    """Why Hydra could not make its output folder (a traceback from Hydra), or None: the folder
    `hydra.run.dir=` / `hydra.sweep.dir=` gives, else conf/config.yaml's under the current folder."""
    if any(arg in ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help") or arg.startswith(("--cfg=", "--info="))
           for arg in argv):
        return None  # Hydra only prints
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = next((arg.partition("=")[2] for arg in argv if arg.lstrip("+").partition("=")[0] == key), None)
    fixed = (given or "").strip("'\"").partition("${")[0]  # the part before an interpolation (${oc.env:HOME}/runs: none)
    if given and not fixed:
        return None
    problem = unmakeable(Path(fixed).expanduser() if given else Path("multirun" if multirun else "outputs"))
    where = f"{key}={given}" if given else f"the current folder, {Path.cwd()}"
    return f"{where}: {problem}: give {key}=<a folder that can be made>" if problem else None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    """An int or float, not a bool (top_k=true would be top-1, temperature=true a cell apart from 1.0)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # a larger temperature is inf in the sampler's float32
PROMPT_SEED_STRIDE = 1_000_003
MAX_SEED = (2**64 - 1) // PROMPT_SEED_STRIDE - 1_000  # torch takes seeds below 2**64; leaves room for 10^9 prompt indices


def compiled_k_message(k: int) -> str:
    return (f"k={k} with compile=true: compiled steps take at most {CachedLM.COMPILED_MAX_TOKENS} positions and a verify "
            f"takes k + 1 = {k + 1}, which would run eagerly: use k <= {CachedLM.COMPILED_MAX_TOKENS - 1}, or compile=false")


def validate(cfg: DictConfig) -> None:
    data = cfg.dataset
    checks = [
        *((isinstance(OmegaConf.select(cfg, name), bool), f"{name}={OmegaConf.select(cfg, name)} must be true or false")
          for name in ("force", "compile", "prompts.shuffle")),  # Hydra reads off / no as strings, which are truthy
        (isinstance(cfg.seed, int) and not isinstance(cfg.seed, bool) and 0 <= cfg.seed <= MAX_SEED,
         f"seed={cfg.seed} must be an integer from 0 to {MAX_SEED} (a prompt's seed is seed x {PROMPT_SEED_STRIDE:_} + its index)"),
        (_positive_int(cfg.k), f"k={cfg.k} must be a positive integer (e.g. k=4)"),
        (isinstance(cfg.device, str), f"device={cfg.device} must be auto, cpu, cuda or cuda:N (a GPU by index: device=cuda:0)"),
        (_number(cfg.temperature) and 0 <= cfg.temperature <= FLOAT32_MAX,
         f"temperature={cfg.temperature} must be a number from 0 (greedy) to {FLOAT32_MAX:.3g} (float32's largest)"),
        (not _number(cfg.temperature) or cfg.temperature == 0 or cfg.temperature >= 1e-6,
         f"temperature={cfg.temperature} is greedy in all but name and under float32's range: use temperature=0"),
        (_number(cfg.top_p) and 0 < cfg.top_p <= 1, f"top_p={cfg.top_p} must be in (0, 1] (1 turns it off)"),
        (isinstance(cfg.top_k, int) and not isinstance(cfg.top_k, bool) and cfg.top_k >= 0, f"top_k={cfg.top_k} must be an integer >= 0 (0 turns it off)"),
        (_positive_int(cfg.max_new_tokens), f"max_new_tokens={cfg.max_new_tokens} must be a positive integer"),
        # k = max_new_tokens stays allowed (a sweep's k=8 on a quick 8-token run); far beyond, measuring the
        # verify costs of k + 1 positions takes minutes for drafts no cycle can make.
        (not (_positive_int(cfg.k) and _positive_int(cfg.max_new_tokens)) or cfg.k <= cfg.max_new_tokens,
         f"k={cfg.k} is more than max_new_tokens={cfg.max_new_tokens}, and a cycle drafts at most "
         f"{cfg.max_new_tokens - 1 if _positive_int(cfg.max_new_tokens) else 0}: lower k or raise max_new_tokens"),
        (data.num_prompts is None or _positive_int(data.num_prompts), f"dataset.num_prompts={data.num_prompts} must be a positive integer or null (all)"),
        (data.get("max_rows") is None or _positive_int(data.max_rows), f"dataset.max_rows={data.get('max_rows')} must be a positive integer or null (every row)"),
        (isinstance(data.get("streaming", False), bool), f"dataset.streaming={data.get('streaming')} must be true or false"),
        (cfg.cache in ("dynamic", "static"), f"cache={cfg.cache} must be dynamic or static"),
        (not cfg.compile or cfg.cache == "static", "compile=true needs fixed shapes: add cache=static"),
        # Longer steps run eagerly (CachedLM.forward): a run labelled compiled would time its full verifies eager.
        (not cfg.compile or not _positive_int(cfg.k) or cfg.k + 1 <= CachedLM.COMPILED_MAX_TOKENS,
         compiled_k_message(cfg.k) if _positive_int(cfg.k) else ""),  # messages are made before any check: k=abc
        (cfg.cpu_linear in cpu_linear.MODES, f"cpu_linear={cfg.cpu_linear} must be one of {', '.join(cpu_linear.MODES)}"),
        (cfg.get("forward", "hf") in lean.FORWARDS, f"forward={cfg.get('forward')} must be {' or '.join(lean.FORWARDS)} (hf: the models' own modules; lean: harness/lean.py, Llama models)"),
        (cfg.get("forward", "hf") != "lean" or (cfg.cache == "dynamic" and not cfg.compile), lean.EAGER_ONLY),
        (cfg.wandb.mode in tracking.MODES, f"wandb.mode={cfg.wandb.mode} must be one of {', '.join(tracking.MODES)}"),
        (cfg.prompts.template in ("auto", "chat", "raw"), f"prompts.template={cfg.prompts.template} must be auto, chat or raw"),
        (cfg.prompts.overlong in ("truncate", "skip"), f"prompts.overlong={cfg.prompts.overlong} must be truncate or skip"),
    ]
    for ok, message in checks:
        if not ok:
            raise HarnessError(message)
    check_pair(cfg.pair)


def check_pair(pair: DictConfig) -> None:
    """A pair names a target and a draft the loop can run, before anything loads."""
    name, draft = pair.get("name"), pair.get("draft")
    if not isinstance(name, str) or not re.fullmatch(r"\w[\w.-]*", name):  # it starts the cell's folder name
        raise HarnessError(f"pair.name={name} must be a plain name (letters, digits, _ . -): it names the cell's folder")
    if not pair.get("target") or not pair.target.get("id"):
        raise HarnessError(f"pair {name} has no target: set pair.target.id (an HF id or a local directory)")
    if not isinstance(draft, DictConfig) or draft.get("kind") is None:
        raise HarnessError(f"pair {name} has no draft: set pair.draft.kind=model with pair.draft.id, or pair.draft.kind=ngram")
    if draft.kind not in ("model", "ngram"):
        raise HarnessError(f"pair.draft.kind={draft.kind} must be model (with pair.draft.id) or ngram (prompt lookup)")
    if draft.kind == "model" and not draft.get("id"):
        raise HarnessError(f"pair {name} has a model draft without an id: set pair.draft.id (an HF id or a local directory)")
    if draft.kind == "ngram":
        low, high = draft.get("min_ngram", 1), draft.get("max_ngram", 3)
        if not (_positive_int(low) and _positive_int(high) and low <= high):
            raise HarnessError(f"pair.draft.min_ngram={low} and max_ngram={high} must be integers with 1 <= min_ngram <= max_ngram")
    check_lookup_length(draft.get("length", "match"))
    lookup_only = [key for key in ("length", "max_ngram", "min_ngram") if draft.kind == "model" and key in draft]
    if lookup_only:
        raise HarnessError(f"pair.draft.{lookup_only[0]} is a prompt-lookup setting and this pair's draft is a model, which would "
                           f"ignore it: use +pair=smollm2_ngram, or pair.draft.kind=ngram")


def device_name(device: torch.device) -> str:
    """The model of a GPU (e.g. "NVIDIA H200") or of the CPU (e.g. "AMD EPYC")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), platform.processor() or device.type)


def device_identity(device: torch.device) -> dict:
    """What of a device a cell's results depend on: its type and model (`device_name`), not its
    index; on a CPU also the torch threads, which its timings depend on as much."""
    identity = {"type": device.type, "name": device_name(device)}
    if device.type == "cpu":
        identity["threads"] = torch.get_num_threads()
    return identity


def cell_key(cfg: DictConfig, device: torch.device | None = None) -> str:
    """`<pair>-k<k>-t<temperature>-<hash>`, the hash over the resolved config less NOT_IN_KEY, with
    `device` and every dtype as they resolve on this machine (`device_identity`; auto: bfloat16
    on CUDA, float32 on CPU) rather than as written, so that a CPU and a GPU process sharing
    out_dir never share a cell. `device`: the resolved device (default: cfg.device resolved here)."""
    device = device if device is not None else resolve_device(cfg.device)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    keyed = {k: v for k, v in resolved.items() if k not in NOT_IN_KEY}
    keyed["device"] = device_identity(device)
    if device.type != "cpu":
        keyed.pop("cpu_linear", None)  # it changes nothing off the CPU
    if keyed.get("forward", "hf") == "hf":  # HF's forward, as before the setting existed: the same cells
        keyed.pop("forward", None)
    pair = keyed["pair"]
    models = [pair["target"]] + ([pair["draft"]] if pair["draft"].get("kind") == "model" else [])
    for node in (keyed, *models):  # the top-level dtype, and each model's (a pair may pin its own)
        node["dtype"] = str(resolve_dtype(node.get("dtype") or "auto", device)).removeprefix("torch.")
    for name in ("temperature", "top_p"):  # temperature=0 and temperature=0.0 are one cell
        if isinstance(keyed.get(name), (int, float)):
            keyed[name] = float(keyed[name])
    if keyed["dataset"].get("revision", "") is None:  # unpinned, as before the setting existed: the same cells
        del keyed["dataset"]["revision"]
    if (sha256 := dataset_sha256(cfg)) is not None:  # an edited file is another prompt set
        keyed["dataset"]["file_sha256"] = sha256
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:10]
    return f"{cfg.pair.name}-k{cfg.k}-t{float(cfg.temperature)}-{digest}"


def cell_path(cfg: DictConfig, out_dir: str | Path | None = None, device: torch.device | None = None) -> Path:
    """Where a cell's results go: <out_dir>/<cell key> (out_dir: cfg.out_dir unless given)."""
    return Path(out_dir if out_dir is not None else cfg.out_dir) / cell_key(cfg, device)


def dataset_sha256(cfg: DictConfig) -> str | None:
    """The SHA-256 of the file a prompt set is read from: `dataset.path` of dataset=local or of a
    hub set read from a local copy (None when prompts come from the hub or the builtin set)."""
    data_file = Path(str(cfg.dataset.get("path") or "")).expanduser()
    return file_sha256(data_file) if data_file.is_file() else None


def _linear_plan(record: dict) -> tuple[int, ...] | None:
    """The cpu_linear plan a prompt record names: its `linear_rows_to`, else (records written
    before plans) the one the transposed product then had, cpu_linear=transposed's; None: torch's."""
    if record.get("linear_rows_to"):
        return tuple(record["linear_rows_to"])
    return cpu_linear.ONE_AS_TWO if record.get("linear") == "transposed" else None


def load_pair(pair_cfg: DictConfig, device: torch.device, cache: str = "dynamic", compile: bool = False,
              linear: str = "auto", forward: str = "hf") -> Pair:
    """Load (or reuse) a pair. `cache` is dynamic or static; `compile` wraps both forwards;
    `linear` is the cpu_linear mode (harness.cpu_linear); `forward` hf or lean (harness.lean)."""
    key = json.dumps(OmegaConf.to_container(pair_cfg, resolve=True), sort_keys=True) + f"{device}{cache}{compile}{linear}{forward}"
    if key in _loaded:
        return _loaded[key]
    _loaded.clear()  # free the previous pair before loading the next
    print(f"[harness] loading pair {pair_cfg.name}: target {pair_cfg.target.id}, draft {pair_cfg.draft.get('id', pair_cfg.draft.kind)}", file=sys.stderr)
    target_spec = ModelSpec.from_config(pair_cfg.target)
    tokenizer = load_tokenizer(target_spec, "target")
    if pair_cfg.get("chat_template"):  # the prompt format a target was tuned on, where its tokenizer carries none (Vicuna v1.3)
        set_pair_template(tokenizer, pair_cfg.chat_template)
    target_model = load_model(target_spec, device, "target")
    # The rule compares token ids over the range the tokenizer can produce and
    # both models score (padded embedding rows beyond it are dropped).
    vocab_size = min(len(tokenizer), target_model.get_output_embeddings().weight.shape[0])
    drafter: Drafter
    if pair_cfg.draft.kind == "ngram":
        drafter = NgramDrafter(vocab_size, pair_cfg.draft.get("max_ngram", 3), pair_cfg.draft.get("min_ngram", 1),
                               pair_cfg.draft.get("length", "match"))
    elif pair_cfg.draft.kind == "model":
        draft_spec = ModelSpec.from_config(pair_cfg.draft)
        draft_model = load_model(draft_spec, device, "draft", target=target_model)
        if not getattr(draft_model, "shares_target_weights", False):
            shared = check_same_vocabulary(tokenizer, load_tokenizer(draft_spec, "draft"))
            vocab_size = min(vocab_size, shared)  # a draft scoring fewer is padded (CachedLM): the target keeps its range
        drafter = ModelDrafter(CachedLM(draft_model, vocab_size, cache, compile=compile, forward=forward))
    else:
        raise HarnessError(f"pair.draft.kind={pair_cfg.draft.kind} is not a drafter: use model or ngram")
    eos = target_model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pair = Pair(pair_cfg.name, CachedLM(target_model, vocab_size, cache, compile=compile, forward=forward), drafter, tokenizer, eos_ids, device)
    pair.linear = pair.linear_at_load = cpu_linear.choose(linear, pair.models(), device)  # before the first forward compiles
    if "probe" in pair.linear:
        print(f"[harness] cpu_linear=auto: {cpu_linear.describe(pair.linear.get('rows_to'))} (a step's linear layers, "
              f"timed at 1 to {cpu_linear.FEW_ROWS} rows, in {pair.linear['probe']['seconds']:.1f} s)", file=sys.stderr)
        if warning := cpu_linear.noisy(pair.linear["probe"]):
            print(f"warning: {warning}", file=sys.stderr)
    _loaded[key] = pair
    return pair


def draft_size(pair: Pair) -> dict:
    """Parameters and bytes of the draft's own weights (prompt lookup: 0; weights shared with the target excluded)."""
    if not isinstance(pair.drafter, ModelDrafter):
        return {"draft_params": 0, "draft_bytes": 0}
    shared = {id(p) for p in pair.target.model.parameters()}
    own = [p for p in pair.drafter.lm.model.parameters() if id(p) not in shared]
    return {"draft_params": sum(p.numel() for p in own), "draft_bytes": sum(p.numel() * p.element_size() for p in own)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(generator, device: torch.device) -> tuple[list, list[float]]:
    """Drain a decode generator, stamping each yield (device synchronised)."""
    items, stamps = [], []
    start = time.perf_counter()
    for item in generator:
        _sync(device)
        stamps.append(time.perf_counter() - start)
        items.append(item)
    return items, stamps


def measure_costs(pair: Pair, ids: torch.Tensor, k: int, sampling: Sampling, rounds: int = 9) -> dict:
    """Target step time, verify cost v(n) = T(n positions) / T(1), draft cost ratio c.

    Measured at the context length of a real prompt, in interleaved rounds: each
    round times a target pass over 1..k+1 positions and then a k-token draft, and
    each figure is the median over rounds (v and c of the ratios within a round).
    Timed in separate blocks instead, a drift in the machine's speed between blocks
    lands in the ratios: one compiled run put v(3) 4% under what the loop then paid.
    """
    target, device = pair.target, pair.device
    ids = ids[-max(pair.context - k, 1):]  # room for the k + 1 positions scored after it (k may exceed max_new_tokens)
    target.reset()
    target.prefill(ids[:-1])
    extra = ids[-1:].repeat(k + 1)  # positions to score; their values do not matter for timing
    generator = torch.Generator(device).manual_seed(0)

    def seconds(fn) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    def score(n: int) -> float:
        """Seconds of a target pass over n positions; the rollback after it is not timed (a step has none)."""
        spent = seconds(lambda: target.forward(extra[:n], num_logits=n))
        target.rollback(ids.shape[0] - 1)
        return spent

    verify_s, draft_s = [], []  # [rounds, k + 1] scoring 1..k+1 positions; [rounds] per drafted token
    for _ in range(rounds):
        verify_s.append([score(n) for n in range(1, k + 2)])
        # As in the loop, the draft runs right after a target pass: on a CPU the
        # target's weights have evicted the draft's from the caches (measured
        # back to back instead, the draft step looks ~25% cheaper than it is).
        pair.drafter.start(ids)
        score(k + 1)
        draft_s.append(seconds(lambda: pair.drafter.propose(ids, k, sampling, generator)) / k)
    median = statistics.median
    return {
        "target_step_s": median(row[0] for row in verify_s),
        "draft_step_s": median(draft_s),
        "cost_ratio": median(d / row[0] for d, row in zip(draft_s, verify_s)),
        "verify_s": [median(row[n] for row in verify_s) for n in range(k + 1)],  # [k + 1]: scoring 1..k+1 positions
        "verify_cost": [median(row[n] / row[0] for row in verify_s) for n in range(k + 1)],  # [k + 1]: v(n) = T(n) / T(1)
        "rounds": rounds,
    }


def libraries() -> str:
    """The libraries a prompt's timings depend on most, as one record field."""
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def conditions(cfg: DictConfig, pair: Pair) -> dict:
    """What a run's figures depend on beyond its config: the device, the target's dtype, threads,
    versions, and the CPU linear product the pair's layers use (Pair.linear)."""
    import transformers

    return {
        "device": str(pair.device), "device_name": device_name(pair.device),
        "dtype": str(next(pair.target.model.parameters()).dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "seed": cfg.seed, "hostname": platform.node(), "harness_commit": harness_commit(),
        "forward": "lean" if pair.target.lean is not None else "hf",
        **({"linear": pair.linear} if pair.linear else {}),
        **({"cuda": torch.version.cuda, "capability": ".".join(map(str, torch.cuda.get_device_capability(pair.device)))}
           if pair.device.type == "cuda" else {}),
    }


def run_prompt(pair: Pair, prompt: dict, ids: torch.Tensor, index: int, cfg: DictConfig, sampling: Sampling) -> dict:
    """Baseline and speculative decoding of one prompt, back to back."""
    seed = cfg.seed * PROMPT_SEED_STRIDE + index

    def spec():
        gen = torch.Generator(pair.device).manual_seed(seed)
        return timed(speculative_decode(pair.target, pair.drafter, ids, cfg.k, sampling, cfg.max_new_tokens, pair.eos_ids, gen), pair.device)

    def base():
        gen = torch.Generator(pair.device).manual_seed(seed)
        return timed(autoregressive_decode(pair.target, ids, sampling, cfg.max_new_tokens, pair.eos_ids, gen), pair.device)

    if index % 2 == 0:
        base_out, spec_out = base(), spec()
    else:
        spec_out, base_out = spec(), base()
    (cycles, spec_stamps), (base_tokens, base_stamps) = spec_out, base_out
    counts = metrics.cycle_counts(cycles, cfg.k)
    spec_tokens = [t for c in cycles for t in c.tokens]
    return {
        "index": index, "id": prompt["id"], "category": prompt["category"], "prompt_tokens": int(ids.shape[0]),
        "spec": {
            **counts, "new_tokens": len(spec_tokens), "time_s": spec_stamps[-1], "ttft_s": spec_stamps[0],
            "first_tokens": len(cycles[0].tokens),
            "draft_passes": counts["drafted"] if isinstance(pair.drafter, ModelDrafter) else 0,
            "tokens": spec_tokens,
        },
        "base": {
            "new_tokens": len(base_tokens), "time_s": base_stamps[-1], "ttft_s": base_stamps[0], "first_tokens": 1,
            "tokens": base_tokens,
        },
        "speedup": (len(spec_tokens) / spec_stamps[-1]) / (len(base_tokens) / base_stamps[-1]),
    }


def _submitit_handles_sigterm() -> bool:
    """In a submitit task (its environment variable set, and its own handler on SIGTERM): not in a
    process the task started, such as a `wandb agent`'s harness, which would then die unhandled."""
    handler = signal.getsignal(signal.SIGTERM)
    owner = getattr(getattr(handler, "__self__", None), "__class__", type(handler))
    return bool(os.environ.get("SUBMITIT_EXECUTOR")) and owner.__module__.startswith("submitit")


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Treat SIGTERM (a scheduler or `kill`) like Ctrl-C, so both end a run the same way. Not in a
    submitit task (Hydra's SLURM launcher): submitit ignores SIGTERM on purpose, since SLURM sends it
    on preemption too, and requeues the task on its own signal (the cell then resumes)."""
    if threading.current_thread() is not threading.main_thread() or _submitit_handles_sigterm():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _reset_peak_rss() -> bool:
    """Start the peak resident memory afresh for this cell (Linux: writing 5 to clear_refs resets
    VmHWM), so that a multirun's later cells do not report an earlier cell's peak. False where
    that cannot be done (not Linux, or /proc read-only)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mb(since_reset: bool) -> tuple[float, str]:
    """(peak resident memory in MB, over what): since a successful _reset_peak_rss ("cell", Linux
    VmHWM), else the whole process's ("process", getrusage)."""
    if since_reset:
        with contextlib.suppress(OSError, ValueError, StopIteration):
            line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
            return int(line.split()[1]) / 1024, "cell"
    return process_peak_rss_mb(), "process"


def process_peak_rss_mb() -> float:
    """The process's peak resident memory in MB (getrusage: kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


@functools.cache
def harness_commit(root: Path = Path(__file__).resolve().parent.parent) -> str | None:
    """The git commit of the harness's checkout (with -dirty for uncommitted changes), if it is one; else
    SPECBENCH_COMMIT, which a copy of the tree without .git may set (scripts/gpu_check.sh, from its payload)."""
    if not (root / ".git").exists():
        return os.environ.get("SPECBENCH_COMMIT") or None
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _current_rss_mb() -> float:
    """Resident memory now (Linux /proc), to show it does not grow across prompts."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def memory_growth(records: list[dict]) -> dict:
    """Resident memory after the first and last prompt, and its fitted growth
    per prompt (scipy.stats.linregress over the prompts run in this process)."""
    rss = [r["rss_mb"] for r in records if r.get("rss_mb") is not None]
    if len(rss) < 3:
        return {}
    from scipy import stats

    return {"rss_first_mb": rss[0], "rss_last_mb": rss[-1],
            "rss_growth_mb_per_prompt": float(stats.linregress(range(len(rss)), rss).slope)}


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _read_records(path: Path, trim: bool = False) -> list[dict]:
    """The prompt records up to the first line that does not parse (one cut by a kill mid-write:
    it and everything after it are redone). trim: also cut the file back to those records, each
    ending its line, so that the records a resumed run appends start on a line of their own."""
    if not path.exists():
        return []
    data = path.read_bytes()
    records, good = [], 0
    for line in data.splitlines(keepends=True):
        try:
            records.append(json.loads(line))
        except ValueError:
            break
        good += len(line)
    if trim and (good < len(data) or not data.endswith(b"\n")):
        with path.open("r+b") as f:
            f.truncate(good)
            if good and not data[:good].endswith(b"\n"):
                f.seek(good)
                f.write(b"\n")
    return records


def run_cell(cfg: DictConfig, out_dir: str | Path | None = None, quiet: bool = False) -> dict:
    """Run (or resume) one cell; returns its summary, also written to summary.json."""
    cfg = with_default_pair(cfg)
    validate(cfg)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    cell_dir = cell_path(cfg, out_dir, device)
    try:
        cell_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise HarnessError(f"cannot write results to {cell_dir}: {err.strerror}; set out_dir=<a writable directory>") from None
    try:
        # SIGTERM ends a run as Ctrl-C does at any point, loading included: the claim is released, the exit is 130.
        with _sigterm_as_interrupt(), tracking.claim(cell_dir, quiet=quiet):  # agents or SLURM tasks sharing out_dir may pick the same cell
            return _run_claimed(cfg, cell_dir, device, quiet)
    except BaseException:
        # A run that stopped before writing anything (a dataset offline, a model missing) leaves no empty
        # cell. Only an empty folder goes: another process's claim or any result keeps it (and a process
        # waiting for the claim makes the folder again).
        with contextlib.suppress(OSError):
            cell_dir.rmdir()
        raise


def _run_claimed(cfg: DictConfig, cell_dir: Path, device: torch.device, quiet: bool) -> dict:
    """The body of run_cell, run while this process holds the cell's claim."""
    summary_path, status_path, lines_path = cell_dir / "summary.json", cell_dir / "status.json", cell_dir / "prompts.jsonl"
    if summary_path.exists() and not cfg.force:
        summary = json.loads(summary_path.read_text())
        if not quiet:
            print(f"[harness] cell already complete, not re-run (force=true to redo): {cell_dir}", file=sys.stderr)
        then, now = (summary.get("conditions") or {}).get("harness_commit"), harness_commit()
        if then and now and then != now:  # the cell key holds the settings, not the code that measured them
            print(f"warning: {cell_dir.name} was measured by harness commit {then}, and this is {now}: its numbers are "
                  f"kept as they are; force=true remeasures it with this code", file=sys.stderr)
        summary = {**summary, "cell": cell_dir.name, "cell_dir": str(cell_dir)}  # where it is now (the store may have moved)
        if os.environ.get("WANDB_SWEEP_ID"):  # the sweep's run gets the stored numbers: its metric, its report's cell
            with tracking.start(cfg, cell_dir) as tracker:
                tracker.finish({**summary, "reused": True}, _read_records(lines_path))
        return summary
    peak_since_reset = _reset_peak_rss()

    # Prompts first: a dataset problem should stop the run before a model loads.
    prompts = select(load_prompts(cfg.dataset), cfg.dataset.num_prompts, cfg.seed, cfg.prompts.shuffle)
    pair = load_pair(cfg.pair, device, cfg.cache, cfg.compile, cfg.cpu_linear, cfg.get("forward", "hf"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sampling = Sampling(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p))
    budget = pair.prompt_budget(cfg.max_new_tokens)
    if budget < 1:
        raise HarnessError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the pair's {pair.context}-token context: lower max_new_tokens")
    encoded, skipped, truncated = [], 0, 0
    for p in prompts:
        full = encode(pair.tokenizer, p["prompt"], cfg.prompts.template)
        fits = len(full) <= budget
        ids = full if fits else encode_within(pair.tokenizer, p["prompt"], cfg.prompts.template, budget, cfg.prompts.overlong)
        if ids is None:
            skipped += 1
        else:
            truncated += not fits
            encoded.append((p, as_tensor(ids, device)))
    if not encoded:
        raise HarnessError(f"every prompt is longer than the context budget ({budget} tokens): lower max_new_tokens or use prompts.overlong=truncate")
    (cell_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # once the cell can start
    if cfg.force:  # once prompts and pair have loaded (a redo that cannot start keeps the finished cell), before
        for path in (summary_path, status_path, lines_path):  # any new result: a stopped redo must not look complete
            path.unlink(missing_ok=True)
    records = _read_records(lines_path, trim=True)
    pair.follow_linear(records)
    pair.reserve(max(ids.shape[0] for _, ids in encoded), cfg.max_new_tokens, cfg.k)
    pair.warm_up(cfg.k)

    # Warm-up (excluded): allocator, kernels and caches see both paths once.
    run_prompt(pair, encoded[0][0], encoded[0][1][-32:], 0, OmegaConf.merge(cfg, {"max_new_tokens": min(8, cfg.max_new_tokens)}), sampling)
    costs = measure_costs(pair, encoded[0][1], cfg.k, sampling)
    pair.use_costs(costs)

    resumed = len(records)  # records[resumed:] are run by this process
    done = {r["id"] for r in records}
    tracker = tracking.start(cfg, cell_dir)
    todo = [(i, p, ids) for i, (p, ids) in enumerate(encoded) if p["id"] not in done]
    versions_now = libraries()
    _write_json_atomic(status_path, {"status": "running", "done": len(records), "total": len(encoded)})
    try:
        with lines_path.open("a") as out:
            for i, p, ids in tqdm(todo, desc=f"{cfg.pair.name} k={cfg.k} T={cfg.temperature}", unit="prompt", file=sys.stderr, disable=quiet):
                record = run_prompt(pair, p, ids, i, cfg, sampling)
                record["rss_mb"] = _current_rss_mb()
                record["host"] = platform.node()  # a resumed cell may have run part of its prompts elsewhere
                record["harness_commit"] = harness_commit()  # ... or with other code
                record["libraries"] = versions_now  # ... or other torch and transformers
                record["linear"] = pair.linear.get("product")
                if pair.linear.get("rows_to"):
                    record["linear_rows_to"] = pair.linear["rows_to"]
                if device.type == "cuda":
                    record["cuda_allocated_mb"] = torch.cuda.memory_allocated(device) / 2**20
                out.write(json.dumps(record) + "\n")
                out.flush()  # append-only and flushed per prompt: an interruption loses at most the prompt in flight
                records.append(record)
                tracker.log_prompt(record)
        summary = metrics.summarize(records, cfg.k, costs, cfg.seed)
        peak_rss_mb, peak_rss_over = _peak_rss_mb(peak_since_reset)
        run_conditions = conditions(cfg, pair)
        hosts = sorted({r["host"] for r in records if r.get("host")} | {run_conditions["hostname"]})
        if len(hosts) > 1:  # a resumed cell: timings (and costs, measured by this process) from several machines
            run_conditions["hostnames"] = hosts
            print(f"warning: the prompts of {cell_dir.name} ran under several host names ({', '.join(hosts)}): if these are "
                  f"different machines its timings mix them; force=true reruns it in one go", file=sys.stderr)
        commits = sorted({r.get("harness_commit") or "unknown" for r in records} | {run_conditions["harness_commit"] or "unknown"})
        if len(commits) > 1:  # a resumed cell whose earlier prompts ran with other code (or code before commits were kept)
            run_conditions["harness_commits"] = commits
            print(f"warning: the prompts of {cell_dir.name} were measured by several harness versions ({', '.join(commits)}): "
                  f"force=true reruns it with one", file=sys.stderr)
        versions = sorted({r["libraries"] for r in records if r.get("libraries")} | {versions_now})  # records before: unknown
        if len(versions) > 1:  # a resumed cell whose earlier prompts ran with another torch or transformers
            run_conditions["libraries_mixed"] = versions
            print(f"warning: the prompts of {cell_dir.name} were measured with several library versions ({'; '.join(versions)}): "
                  f"their timings may not compare; force=true reruns it with one", file=sys.stderr)
        summary.update(
            pair=cfg.pair.name, target=cfg.pair.target.id, draft=cfg.pair.draft.get("id", cfg.pair.draft.kind),
            k=cfg.k, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
            dataset=cfg.dataset.name, prompts_skipped=skipped, prompts_truncated=truncated,
            prompt_selection={"seed": cfg.seed, "shuffle": cfg.prompts.shuffle, "num_prompts": cfg.dataset.num_prompts},
            dataset_sha256=dataset_sha256(cfg),  # the analysis pairs prompts of one file only
            prompt_ids=[p["id"] for p, _ in encoded],
            categories=metrics.by_category(records, cfg.k, costs, cfg.seed), costs=costs, **draft_size(pair),
            conditions=run_conditions,
            peak_rss_mb=peak_rss_mb, peak_rss_over=peak_rss_over,  # "cell": since this cell started; "process": since the process did
            max_memory_allocated_mb=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
            **memory_growth(records[resumed:]),  # a resumed run's earlier process had its own memory
            cell=cell_dir.name, cell_dir=str(cell_dir),
        )
        summary["status"] = "finished"
        _write_json_atomic(summary_path, summary)
        _write_json_atomic(status_path, {"status": "finished", "done": len(records), "total": len(encoded)})
    except BaseException as err:
        # Ctrl-C, SIGTERM, or SystemExit from a SLURM requeue (submitit): interrupted; anything else, summary
        # and writing included, failed. Either way the W&B run and status.json say so.
        status = "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "failed"
        _write_json_atomic(status_path, {"status": status, "done": len(records), "total": len(encoded), "error": repr(err)})
        try:
            partial = metrics.summarize(records, cfg.k, costs, cfg.seed) if records else {}
        except Exception:  # the summary may be what failed
            partial = {}
        tracker.finish({**partial, "status": status}, records, status=status)
        raise
    tracker.finish(summary, records)
    return summary
