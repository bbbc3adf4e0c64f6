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
import hashlib
import json
import os
import platform
import resource
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from harness import metrics, tracking
from harness.datasets import load_prompts
from harness.drafters import Drafter, ModelDrafter, NgramDrafter, check_lookup_length
from harness.errors import HarnessError
from harness.loop import autoregressive_decode, speculative_decode
from harness.models import CachedLM, ModelSpec, check_same_vocabulary, load_model, load_tokenizer, resolve_device
from harness.prompts import as_tensor, encode, fit_context, select
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

    def prompt_budget(self, new_tokens: int, k: int) -> int:
        """The longest prompt that leaves room in the target's context for new_tokens
        and the k drafts (+ 1) of a last cycle."""
        return self.target.context - new_tokens - k - 1

    def reserve(self, longest_prompt: int, new_tokens: int, k: int) -> None:
        """Size static KV caches for that prompt, new_tokens and a last cycle's k drafts (+ 1)."""
        self.target.reserve(longest_prompt + new_tokens + k + 1)
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.lm.reserve(longest_prompt + new_tokens + k + 1)

    def warm_up(self, k: int) -> None:
        """With compile=true, compile every step shape of a k-draft run before anything is
        timed: verifies of 1..k+1 tokens (k' < k near the token budget) and the draft's
        one-token steps and two-token catch-up (last draft + bonus)."""
        self.target.warm_up([(n, n) for n in range(1, k + 2)])
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.lm.warm_up([(1, 1), (2, 1)])

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


def unknown_choice(override: str) -> str | None:
    """A message if a command-line override picks a pair or dataset config that does not exist."""
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    name, _, value = override[len(prefix):].partition("=")
    if name not in ("pair", "dataset") or not value:
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
        for path in (CONF_DIR / group).glob("*.yaml"):
            known |= walk(OmegaConf.to_container(OmegaConf.load(path), resolve=False), f"{group}.")
    return known


def unknown_setting(override: str, known: set[str]) -> str | None:
    """A message if a command-line override sets a key no config has (Hydra's own
    message spans several lines). Additions (+key=), deletions (~key), Hydra's
    own settings and flags are left to Hydra."""
    name, equals, _ = override.partition("=")
    if not equals or name.startswith(("+", "~", "-", "hydra")) or "/" in name or name in known:
        return None
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.7)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown setting '{name}': {hint}(--cfg job prints them all; +{name}=... adds a new key)"


def check_choices(argv: list[str], extra: dict | None = None) -> None:
    """Before Hydra composes, for an entry point's command line: unknown `+pair=`/`dataset=`
    names and unknown settings end the process with one `error:` line ("did you mean")
    and exit 2. `extra`: a section the entry point adds to conf/config.yaml."""
    known = known_settings(extra)
    for arg in argv:
        message = unknown_choice(arg) or unknown_setting(arg, known)
        if message:
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)


def validate(cfg: DictConfig) -> None:
    checks = [
        (isinstance(cfg.k, int) and not isinstance(cfg.k, bool) and cfg.k >= 1, f"k={cfg.k} must be a positive integer (e.g. k=4)"),
        (isinstance(cfg.temperature, (int, float)) and cfg.temperature >= 0, f"temperature={cfg.temperature} must be >= 0 (0 is greedy)"),
        (isinstance(cfg.top_p, (int, float)) and 0 < cfg.top_p <= 1, f"top_p={cfg.top_p} must be in (0, 1] (1 turns it off)"),
        (isinstance(cfg.top_k, int) and cfg.top_k >= 0, f"top_k={cfg.top_k} must be an integer >= 0 (0 turns it off)"),
        (isinstance(cfg.max_new_tokens, int) and cfg.max_new_tokens >= 1, f"max_new_tokens={cfg.max_new_tokens} must be a positive integer"),
        (cfg.dataset.num_prompts is None or (isinstance(cfg.dataset.num_prompts, int) and cfg.dataset.num_prompts >= 1),
         f"dataset.num_prompts={cfg.dataset.num_prompts} must be a positive integer or null (all)"),
        (cfg.cache in ("dynamic", "static"), f"cache={cfg.cache} must be dynamic or static"),
        (not cfg.compile or cfg.cache == "static", "compile=true needs fixed shapes: add cache=static"),
        (cfg.wandb.mode in tracking.MODES, f"wandb.mode={cfg.wandb.mode} must be one of {', '.join(tracking.MODES)}"),
        (cfg.prompts.template in ("auto", "chat", "raw"), f"prompts.template={cfg.prompts.template} must be auto, chat or raw"),
        (cfg.prompts.overlong in ("truncate", "skip"), f"prompts.overlong={cfg.prompts.overlong} must be truncate or skip"),
    ]
    for ok, message in checks:
        if not ok:
            raise HarnessError(message)
    check_lookup_length(cfg.pair.draft.get("length", "match"))


def cell_key(cfg: DictConfig) -> str:
    resolved = OmegaConf.to_container(cfg, resolve=True)
    keyed = {k: v for k, v in resolved.items() if k not in NOT_IN_KEY}
    for name in ("temperature", "top_p"):  # temperature=0 and temperature=0.0 are one cell
        if isinstance(keyed.get(name), (int, float)):
            keyed[name] = float(keyed[name])
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:10]
    return f"{cfg.pair.name}-k{cfg.k}-t{float(cfg.temperature)}-{digest}"


def load_pair(pair_cfg: DictConfig, device: torch.device, cache: str = "dynamic", compile: bool = False) -> Pair:
    """Load (or reuse) a pair. `cache` is dynamic or static; `compile` wraps both forwards."""
    key = json.dumps(OmegaConf.to_container(pair_cfg, resolve=True), sort_keys=True) + f"{device}{cache}{compile}"
    if key in _loaded:
        return _loaded[key]
    _loaded.clear()  # free the previous pair before loading the next
    print(f"[harness] loading pair {pair_cfg.name}: target {pair_cfg.target.id}, draft {pair_cfg.draft.get('id', pair_cfg.draft.kind)}", file=sys.stderr)
    target_spec = ModelSpec.from_config(pair_cfg.target)
    tokenizer = load_tokenizer(target_spec, "target")
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
            vocab_size = min(vocab_size, shared, draft_model.get_output_embeddings().weight.shape[0])
        drafter = ModelDrafter(CachedLM(draft_model, vocab_size, cache, compile=compile))
    else:
        raise HarnessError(f"pair.draft.kind={pair_cfg.draft.kind} is not a drafter: use model or ngram")
    eos = target_model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pair = Pair(pair_cfg.name, CachedLM(target_model, vocab_size, cache, compile=compile), drafter, tokenizer, eos_ids, device)
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

    def score(n: int):
        target.forward(extra[:n], num_logits=n)
        target.rollback(ids.shape[0] - 1)

    verify_s, draft_s = [], []  # [rounds, k + 1] scoring 1..k+1 positions; [rounds] per drafted token
    for _ in range(rounds):
        verify_s.append([seconds(lambda: score(n)) for n in range(1, k + 2)])
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


def conditions(cfg: DictConfig, device: torch.device, dtype: str) -> dict:
    import transformers

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                     if l.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {
        "device": str(device), "device_name": name, "dtype": dtype, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "seed": cfg.seed, "hostname": platform.node(),
    }


def run_prompt(pair: Pair, prompt: dict, ids: torch.Tensor, index: int, cfg: DictConfig, sampling: Sampling) -> dict:
    """Baseline and speculative decoding of one prompt, back to back."""
    seed = cfg.seed * 1_000_003 + index

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


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Treat SIGTERM (a scheduler or `kill`) like Ctrl-C, so both end a run the same way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by an interruption: everything after it is redone
    return records


def run_cell(cfg: DictConfig, out_dir: str | Path | None = None, quiet: bool = False) -> dict:
    """Run (or resume) one cell; returns its summary, also written to summary.json."""
    cfg = with_default_pair(cfg)
    validate(cfg)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    cell_dir = Path(out_dir if out_dir is not None else cfg.out_dir) / cell_key(cfg)
    try:
        cell_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise HarnessError(f"cannot write results to {cell_dir}: {err.strerror}; set out_dir=<a writable directory>") from None
    # SIGTERM ends a run as Ctrl-C does at any point, loading included: the claim is released, the exit is 130.
    with _sigterm_as_interrupt(), tracking.claim(cell_dir, quiet=quiet):  # agents or SLURM tasks sharing out_dir may pick the same cell
        return _run_claimed(cfg, cell_dir, device, quiet)


def _run_claimed(cfg: DictConfig, cell_dir: Path, device: torch.device, quiet: bool) -> dict:
    """The body of run_cell, run while this process holds the cell's claim."""
    summary_path, lines_path = cell_dir / "summary.json", cell_dir / "prompts.jsonl"
    if summary_path.exists() and not cfg.force:
        summary = json.loads(summary_path.read_text())
        if not quiet:
            print(f"[harness] cell already complete, not re-run (force=true to redo): {cell_dir}", file=sys.stderr)
        return summary
    if cfg.force:
        lines_path.unlink(missing_ok=True)
    (cell_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    # Prompts first: a dataset problem should stop the run before a model loads.
    prompts = select(load_prompts(cfg.dataset), cfg.dataset.num_prompts, cfg.seed, cfg.prompts.shuffle)
    pair = load_pair(cfg.pair, device, cfg.cache, cfg.compile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sampling = Sampling(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p))
    budget = pair.prompt_budget(cfg.max_new_tokens, cfg.k)
    if budget < 1:
        raise HarnessError(f"max_new_tokens={cfg.max_new_tokens} and k={cfg.k} leave no room for a prompt in the target's {pair.target.context}-token context: lower max_new_tokens")
    encoded, skipped, truncated = [], 0, 0
    for p in prompts:
        full = encode(pair.tokenizer, p["prompt"], cfg.prompts.template)
        ids = fit_context(full, budget, cfg.prompts.overlong)
        if ids is None:
            skipped += 1
        else:
            truncated += len(ids) < len(full)
            encoded.append((p, as_tensor(ids, device)))
    if not encoded:
        raise HarnessError(f"every prompt is longer than the context budget ({budget} tokens): lower max_new_tokens or use prompts.overlong=truncate")
    pair.reserve(max(ids.shape[0] for _, ids in encoded), cfg.max_new_tokens, cfg.k)
    pair.warm_up(cfg.k)

    # Warm-up (excluded): allocator, kernels and caches see both paths once.
    run_prompt(pair, encoded[0][0], encoded[0][1][-32:], 0, OmegaConf.merge(cfg, {"max_new_tokens": 8}), sampling)
    costs = measure_costs(pair, encoded[0][1], cfg.k, sampling)
    pair.use_costs(costs)

    records = _read_records(lines_path)
    resumed = len(records)  # records[resumed:] are run by this process
    done = {r["id"] for r in records}
    tracker = tracking.start(cfg, cell_dir)
    todo = [(i, p, ids) for i, (p, ids) in enumerate(encoded) if p["id"] not in done]
    _write_json_atomic(cell_dir / "status.json", {"status": "running", "done": len(records), "total": len(encoded)})
    try:
        with lines_path.open("a") as out:
            for i, p, ids in tqdm(todo, desc=f"{cfg.pair.name} k={cfg.k} T={cfg.temperature}", unit="prompt", file=sys.stderr, disable=quiet):
                record = run_prompt(pair, p, ids, i, cfg, sampling)
                record["rss_mb"] = _current_rss_mb()
                if device.type == "cuda":
                    record["cuda_allocated_mb"] = torch.cuda.memory_allocated(device) / 2**20
                out.write(json.dumps(record) + "\n")
                out.flush()  # append-only and flushed per prompt: an interruption loses at most the prompt in flight
                records.append(record)
                tracker.log_prompt(record)
    except BaseException as err:
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        _write_json_atomic(cell_dir / "status.json", {"status": status, "done": len(records), "total": len(encoded), "error": repr(err)})
        partial = metrics.summarize(records, cfg.k, costs, cfg.seed) if records else {}
        tracker.finish({**partial, "status": status}, records, status=status)
        raise

    summary = metrics.summarize(records, cfg.k, costs, cfg.seed)
    summary.update(
        pair=cfg.pair.name, target=cfg.pair.target.id, draft=cfg.pair.draft.get("id", cfg.pair.draft.kind),
        k=cfg.k, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
        dataset=cfg.dataset.name, prompts_skipped=skipped, prompts_truncated=truncated,
        prompt_selection={"seed": cfg.seed, "shuffle": cfg.prompts.shuffle, "num_prompts": cfg.dataset.num_prompts},
        prompt_ids=[p["id"] for p, _ in encoded],
        categories=metrics.by_category(records, cfg.k, costs, cfg.seed), costs=costs, **draft_size(pair),
        conditions=conditions(cfg, device, str(next(pair.target.model.parameters()).dtype).removeprefix("torch.")),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        max_memory_allocated_mb=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        **memory_growth(records[resumed:]),  # a resumed run's earlier process had its own memory
        cell=cell_dir.name, cell_dir=str(cell_dir),
    )
    summary["status"] = "finished"
    _write_json_atomic(summary_path, summary)
    _write_json_atomic(cell_dir / "status.json", {"status": "finished", "done": len(records), "total": len(encoded)})
    tracker.finish(summary, records)
    return summary
