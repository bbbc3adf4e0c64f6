"""Performance benchmark: our loop against HF transformers, and against its own limit.

    python -m harness.bench [--reps 5] [--prompts 8] [--ks 1 2 4] [--max-new-tokens 64] [-- HYDRA OVERRIDES]

Greedy decoding on one pair (default: the embedded SmolLM2 pair), each
measurement interleaved prompt by prompt within a repetition, medians over
repetitions:
  * target-only: our baseline loop vs HF `generate()` (the baseline must not be slow);
  * speculative, model draft: our loop vs HF `generate(assistant_model=...)` with
    `num_assistant_tokens=k`, a constant schedule and the confidence threshold off;
  * speculative, prompt lookup: our n-gram drafter vs HF `prompt_lookup_num_tokens=k`;
  * efficiency: our decode speedup / the speedup predicted from measured alpha,
    cost ratio c and verify cost v(k+1);
  * overhead: the share of speculative wall time spent outside model forwards.
Every pair of compared outputs must be token-identical (greedy), or the
benchmark stops. Figures and conditions go to JSON (`--out`), and the last
stdout line is that JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers.utils import logging as hf_logging

from harness import metrics
from harness.drafters import ModelDrafter, NgramDrafter
from harness.loop import autoregressive_decode, speculative_decode
from harness.models import CachedLM, resolve_device
from harness.datasets import load_prompts
from harness.prompts import as_tensor, encode, select
from harness.run import CONF_DIR, _sync, conditions, load_pair, measure_costs, with_default_pair
from harness.sampling import Sampling

GREEDY = Sampling(0.0)


class TimedLM(CachedLM):
    """A CachedLM that accumulates the wall time of its forwards (device-synchronised)."""

    def __init__(self, lm: CachedLM):
        self.__dict__.update(lm.__dict__)
        self.forward_s = 0.0

    def forward(self, input_ids, num_logits=1):
        _sync(self.device)
        start = time.perf_counter()
        out = super().forward(input_ids, num_logits)
        _sync(self.device)
        self.forward_s += time.perf_counter() - start
        return out


def _timed(fn, device) -> tuple[list[int], float]:
    _sync(device)
    start = time.perf_counter()
    tokens = fn()
    _sync(device)
    return tokens, time.perf_counter() - start


def _hf_generate(model, ids: torch.Tensor, max_new: int, eos: list[int], **kwargs) -> list[int]:
    out = model.generate(
        ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=max_new, do_sample=False,
        eos_token_id=eos, pad_token_id=eos[0], **kwargs,
    )
    return out[0, ids.shape[0]:].tolist()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/bench/bench.json"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +pair=smollm2 device=cuda")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = with_default_pair(compose(config_name="config", overrides=args.overrides))
    device = resolve_device(cfg.device)
    pair = load_pair(cfg.pair, device, cfg.cache, cfg.compile)
    target, eos = pair.target, sorted(pair.eos_ids)
    draft_model = pair.drafter.lm.model if isinstance(pair.drafter, ModelDrafter) else None
    ngram = NgramDrafter(target.vocab_size, max_ngram=3, min_ngram=1)
    prompts = select(load_prompts(cfg.dataset), args.prompts, cfg.seed, shuffle=False)
    encoded = [as_tensor(encode(pair.tokenizer, p["prompt"], cfg.prompts.template), device) for p in prompts]
    n = args.max_new_tokens

    def ours_base(ids):
        return list(autoregressive_decode(target, ids, GREEDY, n, pair.eos_ids, None))

    def ours_spec(drafter, k, lm=target):
        def run(ids):
            return [t for c in speculative_decode(lm, drafter, ids, k, GREEDY, n, pair.eos_ids, None) for t in c.tokens]
        return run

    contenders = {"ours_base": ours_base, "hf_base": lambda ids: _hf_generate(target.model, ids, n, eos)}
    for k in args.ks:
        if draft_model is not None:
            contenders[f"ours_spec_k{k}"] = ours_spec(pair.drafter, k)
            contenders[f"hf_assisted_k{k}"] = lambda ids, k=k: _hf_generate(
                target.model, ids, n, eos, assistant_model=draft_model, num_assistant_tokens=k,
                num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
        contenders[f"ours_ngram_k{k}"] = ours_spec(ngram, k)
        contenders[f"hf_lookup_k{k}"] = lambda ids, k=k: _hf_generate(
            target.model, ids, n, eos, prompt_lookup_num_tokens=k, max_matching_ngram_size=3)

    for ids in encoded[:2]:  # warm-up, excluded
        for fn in contenders.values():
            fn(ids[:16])

    throughput: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(args.reps):
        totals = {name: [0, 0.0] for name in contenders}
        for i, ids in enumerate(encoded):
            names = list(contenders) if (rep + i) % 2 == 0 else list(reversed(contenders))
            outputs = {}
            for name in names:
                tokens, seconds = _timed(lambda: contenders[name](ids), device)
                outputs[name] = tokens
                totals[name][0] += len(tokens)
                totals[name][1] += seconds
            reference = outputs["ours_base"]
            for name, tokens in outputs.items():
                if tokens != reference:
                    sys.exit(f"error: {name} output differs from the target's greedy output on prompt {i}: not comparable")
        for name, (tokens, seconds) in totals.items():
            throughput[name].append(tokens / seconds)
        print(f"[bench] rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in throughput.items()), file=sys.stderr)
    tps = {name: statistics.median(v) for name, v in throughput.items()}

    # Efficiency and overhead: one more pass per k with timed forwards and cycle counts.
    limits = {}
    for k in args.ks:
        if draft_model is None:
            break
        costs = measure_costs(pair, encoded[0], k, GREEDY)
        timed_target, timed_draft = TimedLM(target), TimedLM(pair.drafter.lm)
        drafter = ModelDrafter(timed_draft)
        cycles, spec_s, base_s = [], 0.0, 0.0
        for ids in encoded:
            _, seconds = _timed(lambda: cycles.extend(speculative_decode(timed_target, drafter, ids, k, GREEDY, n, pair.eos_ids, None)), device)
            spec_s += seconds
            base_s += _timed(lambda: ours_base(ids), device)[1]
        counts = metrics.cycle_counts(cycles, k)
        alpha = counts["accepted"] / counts["tested"]
        predicted = metrics.predicted_speedup(alpha, k, costs["cost_ratio"], costs["verify_cost"][k])
        forward_s = timed_target.forward_s + timed_draft.forward_s
        limits[k] = {
            "alpha": alpha, "cost_ratio": costs["cost_ratio"], "verify_cost": costs["verify_cost"][k],
            "measured_speedup": base_s / spec_s, "predicted_speedup": predicted,
            "efficiency": (base_s / spec_s) / predicted,
            "overhead_fraction": 1 - forward_s / spec_s,
        }

    result = {
        "tokens_per_s": tps,
        "ratios": {
            "ours_base / hf_base": tps["ours_base"] / tps["hf_base"],
            **{f"ours_spec_k{k} / hf_assisted_k{k}": tps[f"ours_spec_k{k}"] / tps[f"hf_assisted_k{k}"]
               for k in args.ks if draft_model is not None},
            **{f"ours_ngram_k{k} / hf_lookup_k{k}": tps[f"ours_ngram_k{k}"] / tps[f"hf_lookup_k{k}"] for k in args.ks},
        },
        "limits": limits,
        "setup": {"pair": cfg.pair.name, "prompts": len(encoded), "max_new_tokens": n, "reps": args.reps, "statistic": "median over reps of tokens/s"},
        "conditions": conditions(cfg, device, str(next(target.model.parameters()).dtype).removeprefix("torch.")),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if device.type == "cuda":
        result["max_memory_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, value in result["ratios"].items():
        print(f"{name:<36}{value:8.3f}")
    for k, lim in limits.items():
        print(f"k={k}: alpha {lim['alpha']:.3f}  speedup {lim['measured_speedup']:.3f}  predicted {lim['predicted_speedup']:.3f}  "
              f"efficiency {lim['efficiency']:.3f}  overhead {100 * lim['overhead_fraction']:.1f}%")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
