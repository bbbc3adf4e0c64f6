"""The checks of a command line and of a composed config, which run before torch loads.

A mistyped setting or a value out of range is the most common way a run ends, and it
should end in a second with one `error:` line, not after the ten seconds torch and
transformers take to import. So this module needs only Hydra and OmegaConf: the values
a setting may take live here, and the modules that use them (harness.models.cpu_linear,
harness.tracking.tracker, harness.core.drafters, harness.models.loading) read them from here.

`check_choices(argv)` reads the command line before Hydra composes; `validate(cfg)`
reads the composed config (harness.runner.cell.run_cell calls it again, for callers that skip
the entry point).
"""

from __future__ import annotations

import difflib
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf

from harness.errors import HarnessError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# The values a setting may take (each module named reads its own from here).
CPU_LINEAR_MODES = ("auto", "transposed", "torch")  # harness.models.cpu_linear
FORWARDS = ("auto", "hf", "lean")  # harness.models.lean: the models' own modules, or ours; auto: ours where it runs (CachedLM)
LEAN_EAGER_ONLY = "forward=lean keeps KV storage of its own and runs eagerly: use cache=dynamic compile=false with it, or forward=hf"
WANDB_MODES = ("auto", "online", "offline", "disabled")  # harness.tracking.tracker
LOOKUP_LENGTHS = ("match", "cost_aware")  # how much of a prompt-lookup match to propose (harness.core.drafters.NgramDrafter)
COMPILED_MAX_TOKENS = 16  # harness.models.cached.CachedLM compiles steps of up to this many positions: k + 1 for any k a sweep uses


def check_lookup_length(length: str) -> None:
    if length not in LOOKUP_LENGTHS:
        raise HarnessError(f"pair.draft.length={length} must be {' or '.join(LOOKUP_LENGTHS)} (prompt lookup's proposal length)")


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
    return f"unknown setting '{name}': {hint or 'no config has it '}(--cfg job prints them all{added})"


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


FLOAT32_MAX = struct.unpack("<f", bytes.fromhex("ffff7f7f"))[0]  # float32's largest: a larger temperature is inf in the sampler
PROMPT_SEED_STRIDE = 1_000_003
MAX_SEED = (2**64 - 1) // PROMPT_SEED_STRIDE - 1_000  # torch takes seeds below 2**64; leaves room for 10^9 prompt indices


def compiled_k_message(k: int) -> str:
    return (f"k={k} with compile=true: compiled steps take at most {COMPILED_MAX_TOKENS} positions and a verify "
            f"takes k + 1 = {k + 1}, which would run eagerly: use k <= {COMPILED_MAX_TOKENS - 1}, or compile=false")


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
        (not cfg.compile or not _positive_int(cfg.k) or cfg.k + 1 <= COMPILED_MAX_TOKENS,
         compiled_k_message(cfg.k) if _positive_int(cfg.k) else ""),  # messages are made before any check: k=abc
        (cfg.cpu_linear in CPU_LINEAR_MODES, f"cpu_linear={cfg.cpu_linear} must be one of {', '.join(CPU_LINEAR_MODES)}"),
        (cfg.get("forward", "hf") in FORWARDS, f"forward={cfg.get('forward')} must be {', '.join(FORWARDS[:-1])} or {FORWARDS[-1]} (auto: lean where it runs, else hf; hf: the models' own modules; lean: harness/lean.py, Llama models)"),
        (cfg.get("forward", "hf") != "lean" or (cfg.cache == "dynamic" and not cfg.compile), LEAN_EAGER_ONLY),
        (cfg.wandb.mode in WANDB_MODES, f"wandb.mode={cfg.wandb.mode} must be one of {', '.join(WANDB_MODES)}"),
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
