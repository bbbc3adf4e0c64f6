"""The contenders the bench times: our loop and HF generate() doing the same work, and how
their outputs are compared (token for token, up to a numerical tie) and counted (target passes)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import CompileConfig
from transformers import __version__ as transformers_version

from harness.core.drafters import NgramDrafter
from harness.core.lengths import make_policy
from harness.core.loop import autoregressive_decode, speculative_decode
from harness.core.sampling import Sampling
from harness.errors import HarnessError, one_line
from harness.models.cached import CachedLM

GREEDY = Sampling(0.0)
Contender = Callable[[torch.Tensor], list[int]]  # prompt ids [T] -> the greedy tokens it decodes after them


def hf_generate(model, ids: torch.Tensor, max_new: int, eos: list[int], **kwargs) -> list[int]:
    try:
        # Under the grad mode our CachedLM runs in: generate()'s own no_grad costs more per step than
        # inference_mode, which would be credited to our loop.
        with torch.inference_mode():
            out = model.generate(
                ids[None],
                attention_mask=torch.ones_like(ids[None]),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else 0,  # no EOS (a shapes: model): every token is decoded, none padded
                **kwargs,
            )
    except ValueError as err:
        if "static cache" in str(err).lower() and kwargs.get("cache_implementation") == "static":
            raise HarnessError(
                f"HF generate() in transformers {transformers_version} refuses the static cache that compile=true "
                f"gives it ({one_line(err)}): upgrade transformers (5.24 does it), or bench without compile=true"
            ) from None
        raise
    return out[0, ids.shape[0] :].tolist()


def lookup_room(new_tokens: int, k: int) -> int:
    """Positions after a prompt that the bench's caches hold: HF's prompt lookup caps its
    candidates at the input's length only, so its last cycles verify up to k - 1 positions past
    the token budget, in a static cache of our capacity (hf_compiled). Our loop never does."""
    return new_tokens + k


def hf_compiled(lm: CachedLM) -> dict:
    """generate()'s own compiled path, so that compile=true compares like with like:
    a static cache of our capacity (one compiled shape across prompts) and
    torch.compile of the target's steps. HF leaves the assistant eager."""
    config = CompileConfig(dynamic=False, mode="reduce-overhead" if lm.device.type == "cuda" else "default")
    config._compile_all_devices = True  # HF compiles on accelerators only, unless told
    return {"cache_implementation": "static", "max_cache_len": lm.capacity, "compile_config": config}


def hf_assisted(target_model, draft_model, k: int, max_new: int, eos: list[int], **hf) -> Contender:
    """HF's assisted generation with `draft_model` proposing k tokens per cycle, every cycle."""

    def run(ids):
        # HF's candidate generator reads these from the assistant's own generation config.
        draft_model.generation_config.num_assistant_tokens = k
        draft_model.generation_config.num_assistant_tokens_schedule = "constant"
        draft_model.generation_config.assistant_confidence_threshold = 0.0  # 0: no early stop
        return hf_generate(target_model, ids, max_new, eos, assistant_model=draft_model, **hf)

    return run


def contenders(pair, ks: list[int], max_new: int, verify_cost: list[float]) -> tuple[dict[str, Contender], dict[str, str]]:
    """Every contender by name, and for each of ours the HF contender doing the same work.

    ours_base / hf_base decode with the target alone; ours_spec_kK / hf_assisted_kK with the
    pair's draft model (when it has one); ours_ngram_kK / hf_lookup_kK by prompt lookup; and
    ours_ngram_cost_aware_kK, a lookup proposing only what pays for its verification (draft_length=cost,
    v(n) measured), against the same HF lookup; ours_head_kK, the pair's feature head, against our
    target alone (HF's generate() has no EAGLE path). Compiled (compile=true), HF gets generate()'s own
    compiled path (hf_compiled)."""
    target, eos, n = pair.target, sorted(pair.eos_ids), max_new
    draft_model = next(iter(pair.drafter.models()), None)  # a draft model, where the pair has one
    ngram = NgramDrafter(target.vocab_size, max_ngram=3, min_ngram=1)
    ngram_cost_aware = NgramDrafter(target.vocab_size, max_ngram=3, min_ngram=1)
    ngram_cost_aware.draft_length = make_policy("cost")  # lookup runs on the host: c taken as 0, v(n) measured
    ngram_cost_aware.draft_length.use_costs({"cost_ratio": 0.0, "verify_cost": verify_cost})

    def ours_base(ids):
        return list(autoregressive_decode(target, ids, GREEDY, n, pair.eos_ids, None))

    def ours_spec(drafter, k):
        return lambda ids: [
            t for c in speculative_decode(target, drafter, ids, k, GREEDY, n, pair.eos_ids, None) for t in c.tokens
        ]

    hf = hf_compiled(target) if target.compiled is not None else {}
    named = {"ours_base": ours_base, "hf_base": lambda ids: hf_generate(target.model, ids, n, eos, **hf)}
    rivals = {"ours_base": "hf_base"}  # each of ours -> the HF contender doing the same work
    for k in ks:
        if draft_model is not None:
            named[f"ours_spec_k{k}"] = ours_spec(pair.drafter, k)
            named[f"hf_assisted_k{k}"] = hf_assisted(target.model, draft_model, k, n, eos, **hf)
            rivals[f"ours_spec_k{k}"] = f"hf_assisted_k{k}"
        if pair.drafter.reads_target:  # a feature head: HF's generate() has no feature-head (EAGLE) path: ours alone
            named[f"ours_head_k{k}"] = ours_spec(pair.drafter, k)
            rivals[f"ours_head_k{k}"] = "ours_base"
        named[f"ours_ngram_k{k}"] = ours_spec(ngram, k)
        named[f"hf_lookup_k{k}"] = lambda ids, k=k: hf_generate(
            target.model, ids, n, eos, prompt_lookup_num_tokens=k, max_matching_ngram_size=3, **hf
        )
        rivals[f"ours_ngram_k{k}"] = f"hf_lookup_k{k}"
        # Not the like-for-like comparison (HF proposes the whole match): what a cost-aware length gives at the same k.
        named[f"ours_ngram_cost_aware_k{k}"] = ours_spec(ngram_cost_aware, k)
        rivals[f"ours_ngram_cost_aware_k{k}"] = f"hf_lookup_k{k}"
    return named, rivals


def fewest_lookup_passes(prompt: list[int], output: list[int], k: int) -> int:
    """Target passes a prompt lookup needs to commit `output` after `prompt` if each cycle
    proposes the best it could: of the continuations after every earlier occurrence of the
    context's last n tokens (any n >= 1; one that runs into the end of the context repeats,
    as NgramDrafter's does), the one that agrees longest with what the target commits, up
    to k tokens (fewer when the token budget can keep no more, as in the loop).

    Known only in hindsight, so a floor on every lookup policy, ours and HF's alike. Taking the
    longest agreement each cycle is optimal: if a cycle from an earlier position could reach
    further, the same occurrence shifted by what was committed in between (its last token
    matches) offers that reach from the later position too.
    """
    seq = prompt + output
    committed, end, passes = len(prompt), len(seq), 0
    while committed < end:
        k_cycle = min(k, end - committed - 1)
        context, best = seq[:committed], 0
        for n in range(1, committed):
            suffix = context[-n:]
            starts = [i + n for i in range(committed - n) if context[i : i + n] == suffix]  # where a continuation begins
            if not starts:
                break  # no longer n-gram can match either
            for s in starts:
                agree = 0
                while agree < k_cycle and context[s + agree % (committed - s)] == seq[committed + agree]:
                    agree += 1
                best = max(best, agree)
        committed += best + 1  # the agreeing drafts, then the target's own token
        passes += 1
    return passes


class ForwardCounter:
    """Counts forward passes of a module (pre-hook), to compare cycles across implementations."""

    def __init__(self, module):
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._hook)  # .remove() stops counting

    def _hook(self, module, args):
        self.count += 1
