"""A loaded pair: the target, the drafter, the tokenizer, and what sizes and warms them.

`load_pair` loads a pair once per process: every cell of a multirun over one
pair (k, temperature, prompt sets) reuses it (`loaded_pairs`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from harness.base.device import device_identity
from harness.config.settings import DRAFT_KINDS
from harness.core.drafters import Drafter, FeatureDrafter, ModelDrafter, NgramDrafter
from harness.core.lengths import make_policy
from harness.core.tree_shapes import TreeSpec
from harness.data.prompts import set_pair_template
from harness.errors import HarnessError
from harness.models import cpu_linear
from harness.models.batched import rows_of
from harness.models.cached import CachedLM
from harness.models.eagle import LAYOUTS, load_head
from harness.models.loading import ModelSpec, check_same_vocabulary, load_model, load_tokenizer, resolve_dtype
from harness.models.shapes import COST_ONLY, architecture, is_shapes, random_head


@dataclass
class Pair:
    name: str
    target: CachedLM
    drafter: Drafter
    tokenizer: Any
    eos_ids: set[int]
    device: torch.device
    linear: dict = field(default_factory=dict)  # harness.models.cpu_linear.choose: the products the linear layers use, and why
    linear_at_load: dict = field(default_factory=dict)  # what choose() gave at load, before any resumed cell followed another
    cost_only: str | None = None  # why acceptance and speedup are not results (random weights), else None
    compiled_at_warm_up: int = 0  # harness.models.captured.compiles() after the last warm_up: later ones are recompiles

    @property
    def context(self) -> int:
        """The longest sequence both models take: the target's context, or a draft model's if shorter."""
        return min(self.target.context, self.drafter.context or self.target.context)

    def prompt_budget(self, new_tokens: int) -> int:
        """The longest prompt leaving room for new_tokens, the same at every k (a cycle drafts at most what it can keep)."""
        return self.context - new_tokens + 1

    def reserve(self, longest_prompt: int, new_tokens: int, k: int, rows: int = 1) -> None:
        """Size both models' KV storage for that prompt and new_tokens, or measure_costs' verify of k + 1, for `rows` rows."""
        positions = longest_prompt + max(new_tokens - 1, k)
        self.target.reserve(positions)
        if rows > 1:
            rows_of(self.target, rows).reserve(positions, rows)
        self.drafter.reserve(positions, rows)

    def warm_up(self, k: int, rows: int = 1) -> None:
        """compile=true: compile every step of a k-draft run of `rows` rows before timing (verifies of 1..k+1, the draft's)."""
        captures = list(dict.fromkeys([(), self.drafter.reads_target]))  # the baseline's steps, the verifies' features
        rows_of(self.target, rows).warm_up([(n, n) for n in range(1, k + 2)], captures)
        self.drafter.warm_up(k, rows)

    def models(self) -> list:
        """The pair's models: the target, and the draft when it is a model."""
        return [self.target.model, *self.drafter.models()]

    def follow_linear(self, records: list[dict]) -> None:
        """The CPU linear plans for a cell whose earlier prompts are `records`: theirs (a cell never mixes
        plans), else those chosen at load (which a previous cell in this process may have changed)."""
        linear = self.linear_at_load
        earlier = {_frozen(r.get("linear_plans") or {cpu_linear.EVERY_SHAPE: r.get("linear_rows_to")}) for r in records}
        if linear.get("mode") in ("auto", "probe") and len(earlier) == 1 and earlier != {_frozen(linear.get("plans"))}:
            plans = {shape: list(rows_to) for shape, rows_to in earlier.pop()}
            linear = linear | {
                "product": "transposed" if plans else "torch",
                "why": "resumed: the cell's earlier prompts ran with these plans",
                "plans": plans,
            }
        elif len(earlier) > 1:
            print(
                f"[harness] warning: this cell's earlier prompts ran with different CPU linear products "
                f"({'; '.join(sorted(cpu_linear.describe(dict(plans)) for plans in earlier))}); force=true runs it anew with one",
                file=sys.stderr,
            )
        if _frozen(linear.get("plans")) != _frozen(self.linear.get("plans")):
            cpu_linear.apply(self.models(), linear.get("plans"))
        self.linear = linear

    def use_costs(self, costs: dict) -> None:
        """measure_costs' figures to the drafter and its draft-length policy (`cost` weighs by c and v(n))."""
        self.drafter.use_costs(costs)
        self.drafter.draft_length.use_costs(costs)

    def follow_tree(self, cfg) -> None:
        """The cell's token tree (harness.core.tree_shapes): `tree` cut to depth k, or a chain of one child below it;
        or a dynamic tree of depth k."""
        tree, k = cfg.get("tree"), cfg.get("k")
        if tree is None:
            self.drafter.tree = None
        elif tree == "dynamic":
            self.drafter.tree = TreeSpec(nodes=cfg.get("tree_nodes", 8), topk=cfg.get("tree_topk", 4))
        else:
            widths = (list(tree) + [1] * k)[:k]
            self.drafter.tree = TreeSpec(tuple(widths), sampled=cfg.get("tree_candidates", "top") == "sampled")

    def follow_draft_length(self, setting) -> None:
        """The cell's draft-length policy (conf/draft_length/), fresh: a pair loaded once serves every cell."""
        self.drafter.draft_length = make_policy(**dict(setting or {"policy": "constant"}))


loaded_pairs: dict[str, Pair] = {}  # one pair per process, reused by every cell of a multirun


def _frozen(plans: dict | None) -> tuple:
    """Plans as a comparable value: (shape, rows_to) pairs, those of torch's product left out (as absent)."""
    return tuple(sorted((shape, tuple(rows_to)) for shape, rows_to in (plans or {}).items() if rows_to))


def load_pair(
    pair_cfg: DictConfig,
    device: torch.device,
    cache: str = "dynamic",
    compile: bool = False,
    linear: str = "auto",
    forward: str = "hf",
) -> Pair:
    """Load (or reuse) a pair. `cache` is dynamic or static; `compile` wraps both forwards;
    `linear` is the cpu_linear mode (harness.models.cpu_linear); `forward` hf or lean (harness.models.lean)."""
    key = (
        json.dumps(OmegaConf.to_container(pair_cfg, resolve=True), sort_keys=True) + f"{device}{cache}{compile}{linear}{forward}"
    )
    if key in loaded_pairs:
        return loaded_pairs[key]
    loaded_pairs.clear()  # free the previous pair before loading the next
    print(
        f"[harness] loading pair {pair_cfg.name}: target {pair_cfg.target.id}, draft {pair_cfg.draft.get('id', pair_cfg.draft.kind)}",
        file=sys.stderr,
    )
    target_spec = ModelSpec.from_config(pair_cfg.target)
    tokenizer = load_tokenizer(target_spec, "target")
    if pair_cfg.get("chat_template"):  # the prompt format a target was tuned on, where its tokenizer carries none (Vicuna v1.3)
        set_pair_template(tokenizer, pair_cfg.chat_template)
    target_model = load_model(target_spec, device, "target")
    # The rule compares token ids over the range the tokenizer can produce and
    # both models score (padded embedding rows beyond it are dropped).
    vocab_size = min(len(tokenizer), target_model.get_output_embeddings().weight.shape[0])
    drafter, vocab_size = make_drafter(pair_cfg.draft, target_model, tokenizer, vocab_size, device, cache, compile, forward)
    eos = target_model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pair = Pair(
        pair_cfg.name,
        CachedLM(target_model, vocab_size, cache, compile=compile, forward=forward),
        drafter,
        tokenizer,
        eos_ids,
        device,
    )
    if is_shapes(pair_cfg.target.id) or is_shapes(pair_cfg.draft.get("id")):
        pair.cost_only = COST_ONLY
    pair.linear = pair.linear_at_load = cpu_linear.choose(
        linear, pair.models(), device, device_identity(device)
    )  # before the first forward compiles
    if "plan" in pair.linear:
        _say_linear_plan(pair.linear, linear)
    loaded_pairs[key] = pair
    return pair


def make_drafter(
    draft_cfg: DictConfig, target_model, tokenizer, vocab_size: int, device: torch.device, cache: str, compile: bool, forward: str
) -> tuple[Drafter, int]:
    """The one factory of drafters: the drafter `draft_cfg` names for this target, and the vocabulary
    the rule compares (a draft model with a smaller one narrows it)."""
    if draft_cfg.kind == "ngram":
        lookup = NgramDrafter(vocab_size, draft_cfg.get("max_ngram", 3), draft_cfg.get("min_ngram", 1))
        return lookup, vocab_size
    if draft_cfg.kind == "model":
        draft_spec = ModelSpec.from_config(draft_cfg)
        draft_model = load_model(draft_spec, device, "draft", target=target_model)
        if not getattr(draft_model, "shares_target_weights", False):
            shared = check_same_vocabulary(tokenizer, load_tokenizer(draft_spec, "draft"))
            vocab_size = min(vocab_size, shared)  # a draft scoring fewer is padded (CachedLM): the target keeps its range
        return ModelDrafter(CachedLM(draft_model, vocab_size, cache, compile=compile, forward=forward)), vocab_size
    if draft_cfg.kind in LAYOUTS:
        draft_dtype = resolve_dtype(draft_cfg.get("dtype") or "auto", device)
        if is_shapes(draft_cfg.id):
            spec = ModelSpec.from_config(draft_cfg)
            head = random_head(spec.id, draft_cfg.kind, target_model, draft_dtype, spec.seed, spec.config)
        else:
            head = load_head(draft_cfg.id, draft_cfg.kind, target_model, draft_dtype, draft_cfg.get("revision"))
        return FeatureDrafter(head, compile=compile), vocab_size
    raise HarnessError(f"pair.draft.kind={draft_cfg.kind} is not a drafter: use {', '.join(DRAFT_KINDS)}")


def _say_linear_plan(linear: dict, mode: str) -> None:
    """One line on the CPU linear products chosen and where their plans came from (and a warning if a probe was noisy)."""
    plan = linear["plan"]
    timed = f"{len(plan['probed'])} shapes timed at 1 to {cpu_linear.FEW_ROWS} rows in {plan['seconds']:.1f} s"
    how = {
        "stored": "the plans stored for this machine; cpu_linear=probe times them anew",
        "probed": f"{timed}, stored for later runs",
    }.get(plan["source"], f"{timed}, the noisy ones not stored: the next run probes them again")
    print(f"[harness] cpu_linear={mode}: {cpu_linear.describe(linear['plans'])} ({how}: {plan['file']})", file=sys.stderr)
    for found in linear.get("probe", {}).values():
        if warning := cpu_linear.noisy(found):
            print(f"warning: {warning}", file=sys.stderr)
            break


def architectures(pair: Pair) -> dict:
    """The shapes of the target and of the draft (None for prompt lookup): a cost-only cell and a cell with
    real weights of the same shapes share them (analysis.shapes joins the two)."""
    draft = pair.drafter.models()[:1] or [getattr(pair.drafter, "head", None)]
    return {"target": architecture(pair.target.model.config), "draft": architecture(draft[0].config) if draft[0] else None}


def draft_size(pair: Pair) -> dict:
    """Parameters and bytes of the draft's own weights (prompt lookup: 0; weights shared with the target excluded)."""
    return pair.drafter.size(pair.target.model)
