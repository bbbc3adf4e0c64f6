"""The settings a run takes: the values some may take, and the schema Hydra composes against.

Each dataclass gives the keys of a config and their types; the values live in conf/ (every field
is MISSING, so a schema merged after a config overrides nothing). conf/config.yaml, each option of
conf/dataset/ and conf/pair/, and harness.exactness's config extend one through their defaults list
(`/schema/<name>@_here_`, registered by harness.config.checks), so that Hydra and OmegaConf refuse
an unknown key or a value of the wrong type (k=abc, force=maybe) as they compose. The ranges types
cannot say (k >= 1, 0 < top_p <= 1) are harness.config.checks.validate's.

Torch-free and Hydra-free: harness.models.cpu_linear, harness.models.cached, harness.tracking.tracker
and harness.core.drafters read the values they accept from here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

CPU_LINEAR_MODES = ("auto", "probe", "transposed", "torch")  # harness.models.cpu_linear (probe: time the plan anew)
FORWARDS = ("auto", "hf", "lean")  # harness.models.lean: the models' own modules, or ours; auto: ours where it runs (CachedLM)
LEAN_OWN_STORAGE = "forward=lean keeps KV storage of its own: use cache=dynamic with it (compile=true needs no static cache there), or forward=hf"
HF_COMPILE_STATIC = "compile=true on HF's forward needs fixed shapes: add cache=static, or run the lean forward (forward=auto or lean, Llama models)"
DRAFT_KINDS = ("model", "ngram", "eagle", "eagle3")  # harness.runner.pair: a separate model, prompt lookup, feature heads
BATCH_ONE_ONLY = (
    "batch_size > 1 runs with cache=dynamic, and on HF's forward with compile=false: use those, forward=auto or lean "
    "(Llama models), or batch_size=1"
)
WANDB_MODES = ("auto", "online", "offline", "disabled")  # harness.tracking.tracker
DRAFT_LENGTHS = ("constant", "heuristic", "confidence", "cost", "by_batch")  # draft_length policies (harness.core.lengths)
TREE_CANDIDATES = ("top", "sampled")  # a tree's candidates: the draft's top tokens, or drawn from it (harness.core.tree_shapes)
LOOKUP_LENGTHS = ("match",)  # prompt lookup proposes its match; how much of it: draft_length (harness.core.lengths)
COMPILED_MAX_TOKENS = (
    16  # harness.models.cached.CachedLM compiles steps of up to this many positions: k + 1 for any k a sweep uses
)
CACHES = ("dynamic", "static")
TEMPLATES = ("auto", "chat", "raw")  # prompts.template
OVERLONG = ("truncate", "skip")  # prompts.overlong
FLOAT32_MAX = struct.unpack("<f", bytes.fromhex("ffff7f7f"))[0]  # float32's largest: a larger temperature is inf in the sampler
PROMPT_SEED_STRIDE = 1_000_003  # a prompt's seed is seed x PROMPT_SEED_STRIDE + its index
MAX_SEED = (2**64 - 1) // PROMPT_SEED_STRIDE - 1_000  # torch takes seeds below 2**64; leaves room for 10^9 prompt indices


@dataclass
class Prompts:
    shuffle: bool = MISSING
    template: str = MISSING  # TEMPLATES
    overlong: str = MISSING  # OVERLONG


@dataclass
class Wandb:
    mode: str = MISSING  # WANDB_MODES
    project: str = MISSING
    entity: str | None = MISSING
    group: str | None = MISSING
    job_type: str = MISSING
    tags: list[str] = MISSING
    name: str | None = MISSING
    dir: str | None = MISSING


@dataclass
class Settings:  # conf/config.yaml
    default_pair: str = MISSING
    k: int = MISSING
    batch_size: int = MISSING
    temperature: float = MISSING
    top_k: int = MISSING
    top_p: float = MISSING
    max_new_tokens: int = MISSING
    seed: int = MISSING
    device: str = MISSING
    dtype: str = MISSING
    cache: str = MISSING  # CACHES
    compile: bool = MISSING
    forward: str = MISSING  # FORWARDS
    cpu_linear: str = MISSING  # CPU_LINEAR_MODES
    prompts: Prompts = MISSING
    wandb: Wandb = MISSING
    out_dir: str = MISSING
    force: bool = MISSING
    dataset: Any = MISSING  # a PromptSet (below): conf/dataset/
    draft_length: Any = MISSING  # conf/draft_length/: policy, and threshold or table (harness.core.lengths)
    tree: Any = MISSING  # null, or children per depth (harness.core.tree_shapes)
    tree_candidates: str = MISSING  # TREE_CANDIDATES
    tree_nodes: int = MISSING  # tree=dynamic
    tree_topk: int = MISSING  # tree=dynamic
    pair: Any = None  # a pair (below), chosen with +pair=NAME; None: conf/pair/<default_pair>.yaml


@dataclass
class Exactness:  # the `exactness` section of harness.exactness (its DEFAULTS)
    samples: int | None = MISSING
    detect_tv: float = MISSING
    length: int | None = MISSING
    num_prompts: int = MISSING
    alpha: float = MISSING
    max_cells: int = MISSING
    rows: int = MISSING


@dataclass
class ExactnessCheck(Settings):  # harness.exactness's config: conf/config.yaml and its section
    exactness: Exactness = MISSING
    acceptance: bool = MISSING  # true: the teacher-forced acceptance check (greedy) instead of the law check


@dataclass
class PromptSet:  # conf/dataset/builtin.yaml, the prompts written by the project
    name: str = MISSING
    source: str = MISSING  # builtin, hub or local
    num_prompts: int | None = MISSING
    text_field: Any = MISSING  # a field, or a list of them
    template: Any = MISSING  # a format string or null, checked where it is read (harness.data): Hydra would make 5 the text "5"
    id_field: str | None = MISSING
    category_field: str | None = MISSING
    category: str | None = MISSING
    streaming: bool = MISSING
    max_rows: int | None = MISSING


@dataclass
class LocalPromptSet(PromptSet):  # conf/dataset/local.yaml: a file
    path: str | None = MISSING
    format: str = MISSING


@dataclass
class HubPromptSet(LocalPromptSet):  # a set on the HF hub, or a local copy of it (`path`)
    hf_id: str = MISSING
    hf_config: str | None = MISSING
    split: str | None = MISSING
    revision: str | None = MISSING


# The pairs of conf/pair/, by the keys they have: each pair's keys are its own to add to (+pair.target.device_map=auto).
@dataclass
class Model:  # a model shipped with the harness (embedded:NAME)
    id: str = MISSING
    dtype: str | None = MISSING


@dataclass
class HubTarget(Model):  # a model by HF id or local folder
    revision: str | None = MISSING
    device_map: Any = MISSING  # "auto": shard a target too large for one GPU


@dataclass
class ModelDraft:
    kind: str = MISSING  # DRAFT_KINDS but ngram: model, eagle, eagle3
    id: str = MISSING
    dtype: str | None = MISSING


@dataclass
class HubDraft(ModelDraft):
    revision: str | None = MISSING


@dataclass
class LookupDraft:  # prompt lookup: no model, n-grams of the context (harness.core.drafters.NgramDrafter)
    kind: str = MISSING
    max_ngram: int = MISSING
    min_ngram: int = MISSING
    length: str = MISSING  # LOOKUP_LENGTHS


@dataclass
class EmbeddedPair:
    name: str = MISSING
    target: Model = MISSING
    draft: ModelDraft = MISSING


@dataclass
class LookupPair:
    name: str = MISSING
    target: Model = MISSING
    draft: LookupDraft = MISSING


@dataclass
class HubPair:
    name: str = MISSING
    target: HubTarget = MISSING
    draft: HubDraft = MISSING


@dataclass
class ChatHubPair(HubPair):
    chat_template: str | None = MISSING  # replaces the tokenizer's


@dataclass
class ShapesModel(Model):  # an architecture with random weights (shapes:NAME: harness.models.shapes)
    seed: int = MISSING  # the weights' seed
    config: Any = MISSING  # fields over the architecture's config (null: none)


@dataclass
class ShapesDraft(ModelDraft):
    seed: int = MISSING
    config: Any = MISSING


@dataclass
class ShapesPair(EmbeddedPair):
    target: ShapesModel = MISSING
    draft: ShapesDraft = MISSING


# Registered as /schema/<name> in Hydra's ConfigStore (harness.config.checks).
SCHEMAS = {
    "settings": Settings,
    "exactness_check": ExactnessCheck,
    "dataset/builtin": PromptSet,
    "dataset/local": LocalPromptSet,
    "dataset/hub": HubPromptSet,
    "pair/embedded": EmbeddedPair,
    "pair/lookup": LookupPair,
    "pair/hub": HubPair,
    "pair/hub_chat": ChatHubPair,
    "pair/shapes": ShapesPair,
}
