"""Greedy identity: every row of a batched speculative run (and of the batched baseline) commits the
tokens its prompt gets decoded alone by the target, on every builtin prompt; at batch size 1, the
one-sequence loop (harness.core.loop.speculative_decode) likewise.

    python scripts/batch_greedy_check.py --pairs smollm2_eagle smollm2 smollm2_ngram --batch-sizes 2 4 8 \
        --ks 2 --max-new-tokens 32 --out results/batch_greedy.json
    python scripts/batch_greedy_check.py --pairs smollm2_eagle smollm2 --batch-sizes 1 --ks 4 \
        --draft-lengths heuristic confidence cost by_batch   # each draft-length policy
    python scripts/batch_greedy_check.py --pairs smollm2_eagle smollm2 --batch-sizes 1 --trees 2,1 3,2,1 --dynamic 8 4
        # token trees, each at k = its depth; a dynamic tree of 8 nodes, depth 4

The reference is the target alone at batch size 1 (harness.core.loop.autoregressive_decode). A row
that parts from it is explained only by a numerical tie (harness.core.ties.same_greedy_output:
the target's two best logits within the dtype's tie gap at the first difference, and every later token
the target's greedy choice on the row's own context); anything else stops the check with exit code 1.
Prints one line per pair and batch size, writes the counts (and every tie) as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from hydra import compose

from harness.config.checks import hydra_on_conf, validate, with_default_pair
from harness.core.loop import autoregressive_decode, autoregressive_decode_rows, speculative_decode, speculative_decode_rows
from harness.core.sampling import Sampling
from harness.core.ties import same_greedy_output
from harness.data.datasets import load_prompts
from harness.data.prompts import as_tensor, encode, select
from harness.errors import HarnessError
from harness.models.loading import resolve_device
from harness.runner.costs import measure_costs
from harness.runner.pair import load_pair
from harness.runner.provenance import harness_commit, machine


def check(
    pair_name: str,
    batch_sizes: list[int],
    ks: list[int],
    max_new_tokens: int,
    num_prompts: int | None,
    policy: str = "constant",
    tree: list[int] | str | None = None,
    nodes: int = 8,
) -> dict:
    with hydra_on_conf():
        cfg = with_default_pair(compose(config_name="config", overrides=[f"+pair={pair_name}", f"draft_length={policy}"]))
    validate(cfg)
    device = resolve_device(cfg.device)
    prompts = select(load_prompts(cfg.dataset), num_prompts, cfg.seed, cfg.prompts.shuffle)
    pair = load_pair(cfg.pair, device, cfg.cache, cfg.compile, cfg.cpu_linear, cfg.forward)
    greedy, none = Sampling(0.0), torch.Generator(device)
    encoded = [(p, as_tensor(encode(pair.tokenizer, p["prompt"], cfg.prompts.template), device)) for p in prompts]
    longest = max(ids.shape[0] for _, ids in encoded)
    for B in batch_sizes:
        pair.reserve(longest, max_new_tokens, max(ks), B)
    alone = [list(autoregressive_decode(pair.target, ids, greedy, max_new_tokens, pair.eos_ids, none)) for _, ids in encoded]
    target, drafter = pair.target, pair.drafter
    out = {"pair": pair_name, "draft_length": policy, "tree": tree, "prompts": len(encoded), "by_k_and_batch_size": {}}
    for k, B in ((k, B) for k in ks for B in batch_sizes):
        pair.follow_draft_length(cfg.draft_length)  # a fresh policy, with this machine's costs (cost weighs by them)
        pair.follow_tree({"k": k, "tree": tree, "tree_nodes": nodes})
        pair.use_costs(measure_costs(pair, [ids for _, ids in encoded[:B]], k, greedy))
        started, outputs = time.perf_counter(), []  # (prompt index, what decoded it, its tokens)
        for i, (_, ids) in enumerate(encoded if B == 1 else []):  # the one-sequence loop
            cycles = speculative_decode(pair.target, pair.drafter, ids, k, greedy, max_new_tokens, pair.eos_ids, none)
            outputs.append((i, f"speculative, k={k}", [t for c in cycles for t in c.tokens]))
        for start in range(0, len(encoded) if B > 1 else 0, B):
            batch = list(range(start, min(start + B, len(encoded))))
            ids = [encoded[i][1] for i in batch]
            gens = [torch.Generator(device) for _ in batch]
            spec, base = [[] for _ in batch], [[] for _ in batch]
            for cycle in speculative_decode_rows(target, drafter, ids, k, greedy, max_new_tokens, pair.eos_ids, gens):
                for row, c in cycle:
                    spec[row].extend(c.tokens)
            for step in autoregressive_decode_rows(target, ids, greedy, max_new_tokens, pair.eos_ids, gens):
                for row, token in step:
                    base[row].append(token)
            for row, i in enumerate(batch):
                outputs += [(i, f"speculative row at B={B}", spec[row]), (i, f"baseline row at B={B}", base[row])]
        ties = []
        for i, name, tokens in outputs:
            tie = same_greedy_output(pair.target, encoded[i][1], alone[i], tokens, name, i)
            if tie is not None:
                ties.append({**tie, "id": encoded[i][0]["id"]})
        rows, differ = len(outputs), len(ties)
        out["by_k_and_batch_size"][f"k{k}-b{B}"] = {
            "rows_checked": rows,
            "differ": differ,
            "ties": ties,
            "seconds": round(time.perf_counter() - started, 1),
        }
        drafted = drafter.draft_length.describe()
        out["by_k_and_batch_size"][f"k{k}-b{B}"]["draft_length"] = drafted
        shape = "" if tree is None else f" tree={tree}"
        print(f"{pair_name} draft_length={policy}{shape} k={k} B={B}: {rows} rows, {differ} differ (all by a tie)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=["smollm2_eagle", "smollm2", "smollm2_ngram"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[2])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft-lengths", nargs="*", default=["constant"], help="draft-length policies (conf/draft_length/)")
    parser.add_argument("--trees", nargs="+", default=[], help="token trees, e.g. 2,1 3,2,1: each at k = its depth, B=1")
    parser.add_argument("--dynamic", type=int, nargs=2, metavar=("NODES", "DEPTH"), help="a dynamic tree too (tree_topk=4)")
    parser.add_argument("--num-prompts", type=int, default=None, help="builtin prompts (default: all 60)")
    parser.add_argument("--out", type=Path, default=Path("results/batch_greedy.json"))
    args = parser.parse_args(argv)
    result = {
        "command": "python scripts/batch_greedy_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "harness_commit": harness_commit(Path(__file__).parents[1]),
        "torch": torch.__version__,
        "ks": args.ks,
        "max_new_tokens": args.max_new_tokens,
        "pairs": [],
    }
    try:
        for name in args.pairs:
            for policy in args.draft_lengths:
                result["pairs"].append(check(name, args.batch_sizes, args.ks, args.max_new_tokens, args.num_prompts, policy))
            for tree in ([int(w) for w in shape.split(",")] for shape in args.trees):
                result["pairs"].append(check(name, [1], [len(tree)], args.max_new_tokens, args.num_prompts, tree=tree))
            if args.dynamic:
                nodes, depth = args.dynamic
                result["pairs"].append(
                    check(name, [1], [depth], args.max_new_tokens, args.num_prompts, tree="dynamic", nodes=nodes)
                )
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
