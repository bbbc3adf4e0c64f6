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
import functools
import hashlib
import json
import os
import platform
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
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from harness.models import cpu_linear
from harness.core import metrics
import harness.tracking.tracker as tracking
from harness.config.checks import PROMPT_SEED_STRIDE, validate, with_default_pair
from harness.data.datasets import file_sha256, load_prompts
from harness.core.drafters import Drafter, ModelDrafter, NgramDrafter
from harness.errors import HarnessError
from harness.core.loop import autoregressive_decode, speculative_decode
from harness.models.loading import ModelSpec, check_same_vocabulary, load_model, load_tokenizer, resolve_device, resolve_dtype
from harness.models.cached import CachedLM
from harness.data.prompts import as_tensor, encode, encode_within, select, set_pair_template
from harness.core.sampling import Sampling

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
    linear: dict = field(default_factory=dict)  # harness.models.cpu_linear.choose: the product the linear layers use, and why
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
        tokens it can still keep (harness.core.loop)."""
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
    if keyed.get("forward", "hf") == "hf" or (keyed["forward"] == "auto" and device.type != "cpu"):
        keyed.pop("forward", None)  # HF's forward (auto's off the CPU), as before the setting existed: the same cells
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
    `linear` is the cpu_linear mode (harness.models.cpu_linear); `forward` hf or lean (harness.models.lean)."""
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
        "forward": "lean" if pair.target.lean is not None else "hf",  # as forward=auto resolved, for the target
        **({"draft_forward": "lean" if pair.drafter.lm.lean is not None else "hf"} if hasattr(pair.drafter, "lm") else {}),
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
def harness_commit(root: Path = Path(__file__).resolve().parents[2]) -> str | None:
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
