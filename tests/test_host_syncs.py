"""The loop waits for the device only where acceptance needs it: checked on a
CPU by counting the host reads of tensor values (what would synchronise on
CUDA), by call site, over whole decodes."""

from __future__ import annotations

import pytest
import torch

from harness.base.host_reads import HostReads
from harness.core.drafters import ModelDrafter
from harness.core.loop import autoregressive_decode, speculative_decode
from harness.core.sampling import Sampling
from harness.models.cached import CachedLM
from harness.models.loading import ModelSpec, load_model

CPU = torch.device("cpu")
PROMPT = torch.tensor([5, 17, 33, 8, 60, 12])


@pytest.fixture(scope="module")
def models(tiny_pair):
    return (load_model(ModelSpec(str(tiny_pair["target"])), CPU), load_model(ModelSpec(str(tiny_pair["draft"])), CPU, "draft"))


def reads_per_site(target_lm: CachedLM, drafter, k: int, sampling: Sampling):
    generator = torch.Generator().manual_seed(0)
    with HostReads() as reads:
        cycles = list(speculative_decode(target_lm, drafter, PROMPT, k, sampling, 40, set(), generator))
    return cycles, reads.sites


def by_file(sites) -> dict[str, list[int]]:
    """{file: the read count of each of its lines}: one line reading n times is [n], two are [n, n]."""
    files: dict[str, list[int]] = {}
    for site, count in sorted(sites.items()):
        files.setdefault(site.rsplit(":", 1)[0], []).append(count)
    return files


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("k", [1, 4])
def test_one_host_read_per_cycle_whatever_k(models, k, temperature):
    """Per cycle the host reads the accepted count and the committed ids together, once (loop.py);
    drafting k tokens, shaping, sampling, verifying and rolling back both caches read nothing."""
    target, draft = models
    cycles, sites = reads_per_site(CachedLM(target, 98), ModelDrafter(CachedLM(draft, 98)), k, Sampling(temperature))
    if k > 1:
        assert sum(c.num_drafted for c in cycles) > 2 * len(cycles)  # a read per drafted token would show
    assert by_file(sites) == {"harness/core/loop.py": [len(cycles)]}, sites


TREES = {"[3,2,1] top": ((3, 2, 1), False), "[3,2,1] sampled": ((3, 2, 1), True), "dynamic 8": ((), False)}


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("forward", ["hf", "lean"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_host_read_per_cycle_with_a_tree(models, temperature, forward, tree):
    """A token tree, static or dynamic (its structure chosen on the device from the draft's values): drafting
    its levels, the tree pass, the rule's walk and compacting both caches read nothing; the cycle's one read
    takes the path, where the draft cached it and its ranks with the accepted count and the next token."""
    from harness.core.tree_shapes import TreeSpec

    widths, sampled = TREES[tree]
    target, draft = models
    drafter = ModelDrafter(CachedLM(draft, 98, forward=forward))
    drafter.tree = TreeSpec(widths, sampled=sampled, nodes=8, topk=3)
    cycles, sites = reads_per_site(CachedLM(target, 98, forward=forward), drafter, 3, Sampling(temperature))
    assert sum(c.nodes for c in cycles) > 7 * len(cycles)  # trees were drafted
    assert by_file(sites) == {"harness/core/loop.py": [len(cycles)]}, sites


@pytest.mark.parametrize("ladder", [(), (16,)])
def test_top_p_reads_nothing_on_the_path_cuda_takes(models, monkeypatch, ladder):
    """Top-p on CUDA sorts each row at once: a sampled top-p decode reads once per
    cycle and never in the sampler. On a CPU a candidate ladder (here 16 of the
    tiny vocabulary's 98) first tries the most probable tokens, and its early
    exit is a host read per shaped row: the count sees it."""
    from harness.core import sampling

    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", ladder)
    target, draft = models
    cycles, sites = reads_per_site(CachedLM(target, 98), ModelDrafter(CachedLM(draft, 98)), 4, Sampling(1.0, top_p=0.9, top_k=50))
    assert sum(c.num_drafted for c in cycles) > 2 * len(cycles)
    files = by_file(sites)
    ladder_reads = sum(files.pop("harness/core/sampling.py", []))
    assert files == {"harness/core/loop.py": [len(cycles)]}, sites
    assert (ladder_reads > 0) == bool(ladder)


class CountsLongForwards(CachedLM):
    long_forwards = 0

    def forward(self, input_ids, num_logits=1):
        self.long_forwards += input_ids.shape[0] > 1
        return super().forward(input_ids, num_logits)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_cache_reads_only_in_transformers_mask_code_for_multi_token_forwards(models, temperature):
    """With the static cache (eager), transformers' attention-mask code reads the
    cache's position tensor once per forward of more than one token (a verify,
    a prompt, the draft catching up two tokens): masking_utils' `q_offset == 0`.
    The draft's one-token steps read nothing, and our cache check reads once per
    model. (Compiled, the mask code does not read: it sees a traced tensor.)"""
    target, draft = models
    target_lm, draft_lm = CountsLongForwards(target, 98, "static", 256), CountsLongForwards(draft, 98, "static", 256)
    cycles, sites = reads_per_site(target_lm, ModelDrafter(draft_lm), 4, Sampling(temperature))
    files = by_file(sites)
    assert sum(c.num_drafted for c in cycles) > 2 * len(cycles)
    mask_reads = sum(files.pop("transformers/masking_utils.py"))
    assert files == {"harness/core/loop.py": [len(cycles)], "harness/models/hf_backends.py": [2]}, sites
    long_forwards = target_lm.long_forwards + draft_lm.long_forwards
    assert long_forwards - 2 <= mask_reads <= long_forwards < 2 * len(cycles)  # a fresh cache's first pass has an int position


def test_the_baseline_reads_each_token_once(models):
    target, _ = models
    with HostReads() as reads:
        tokens = list(
            autoregressive_decode(CachedLM(target, 98), PROMPT, Sampling(1.0), 30, set(), torch.Generator().manual_seed(0))
        )
    assert by_file(reads.sites) == {"harness/core/loop.py": [len(tokens)]}


class ReadsEachDraft(ModelDrafter):
    """Broken on purpose: inspects every drafted token on the host."""

    def propose(self, rows, budgets, sampling):
        proposal = super().propose(rows, budgets, sampling)
        for token in proposal.tokens[0, : proposal.counts[0]]:
            int(token)
        return proposal


def test_a_read_per_drafted_token_is_caught(models):
    target, draft = models
    cycles, sites = reads_per_site(CachedLM(target, 98), ReadsEachDraft(CachedLM(draft, 98)), 4, Sampling(0.0))
    drafted = sum(c.num_drafted for c in cycles)
    assert sum(n for site, n in sites.items() if site.startswith("tests/test_host_syncs.py")) == drafted
    assert by_file(sites) != {"harness/core/loop.py": [len(cycles)]}


def test_reads_inside_a_model_forward_are_seen(models):
    """A model whose forward reads a value (as some attention-mask code does)
    is caught too: the count covers the model's code, not only ours."""
    target, draft = models
    handle = draft.model.layers[0].register_forward_hook(
        lambda module, args, out: None if bool(args[0].isfinite().all()) else None
    )
    try:
        cycles, sites = reads_per_site(CachedLM(target, 98), ModelDrafter(CachedLM(draft, 98)), 4, Sampling(0.0))
    finally:
        handle.remove()
    hook_reads = sum(n for site, n in sites.items() if site.startswith("tests/test_host_syncs.py"))
    assert hook_reads == sum(c.num_drafted for c in cycles) + 1  # a draft forward per drafted token, and the prompt's


def test_host_reads_sees_each_kind_of_read():
    t, mask, i = torch.arange(6), torch.arange(6) > 2, torch.tensor(2)
    reads = []
    with HostReads() as counted:
        for read in (
            lambda: t[0].item(),
            t.tolist,
            lambda: int(t[1]),
            lambda: float(t[2]),
            lambda: bool(t[3]),
            t.nonzero,
            lambda: t[mask],
            lambda: torch.equal(t, t),
            t.cpu,
            lambda: torch.where(mask),
            lambda: torch.argwhere(t),
            lambda: t[i],
            lambda: t[:i],
            lambda: t.__setitem__(mask, 0),
            lambda: torch.allclose(t, t),
            lambda: torch.is_nonzero(i),
            lambda: t.repeat_interleave(t),
            lambda: repr(t),
            lambda: f"{i}",
        ):
            before = counted.total
            read()
            reads.append(counted.total - before)
        t = torch.arange(6)
        for keep in (
            t.sum,
            t.argmax,
            lambda: t[1:3],
            lambda: t[[0, 2]],
            lambda: torch.cat([t, t]),
            lambda: torch.where(mask, t, 0),
            lambda: t.to(torch.float32),
            lambda: t.to("cpu"),
            lambda: t.repeat_interleave(2),
            t.any,
        ):
            before = counted.total
            keep()
            reads.append(counted.total - before - 1)  # -1 each: none counted
    assert reads == [1] * 19 + [-1] * 10, reads


def test_compiled_steps_run_unwatched_and_compile_nothing_new(tiny_pair):
    """Dynamo guards on the torch function modes: a compiled step called under
    HostReads would compile again (minutes per shape with CUDA graphs). Compiled
    steps run with it set aside, so the count covers what runs eagerly around
    them, and nothing compiles anew."""
    target = load_model(ModelSpec(str(tiny_pair["target"])), CPU)
    draft = load_model(ModelSpec(str(tiny_pair["draft"])), CPU, "draft")
    target_lm = CachedLM(target, 98, "static", 256, compile=True)
    drafter = ModelDrafter(CachedLM(draft, 98, "static", 256, compile=True))
    target_lm.warm_up([(n, n) for n in range(1, 6)])
    drafter.lm.warm_up([(1, 1), (2, 1)])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    cycles, sites = reads_per_site(target_lm, drafter, 4, Sampling(0.0))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs > 0
    files = by_file(sites)
    assert files.pop("transformers/masking_utils.py") == [2]  # the two prompts' passes, eager
    assert files == {"harness/core/loop.py": [len(cycles)]}


def test_unwatched_sets_aside_only_host_reads():
    """Under HostReads and another torch function mode (torch.device's, here), a
    compiled step runs with the other mode alone, as it was compiled; the stack is
    restored after, also when the step raises."""
    from torch.overrides import _get_current_function_mode_stack

    from harness.base.host_reads import unwatched

    def step():
        return [type(mode).__name__ for mode in _get_current_function_mode_stack()]

    def fails():
        raise RuntimeError("step failed")

    with HostReads() as reads, torch.device("cpu"):
        before = step()
        assert unwatched(step) == [name for name in before if name != "HostReads"] and "HostReads" in before
        with pytest.raises(RuntimeError):
            unwatched(fails)
        assert step() == before
        torch.ones(2).tolist()
    assert reads.total == 1 and step() == []


def test_value_dependent_ops_count_as_reads():
    """Ops whose result (or its size) needs the values on the host, each a sync on CUDA: a stop check written
    `token in eos_ids_tensor`, a bincount, one_hot without num_classes, Python data copied to a device.
    The same ops with sizes given, or on the host, read nothing."""
    import torch.nn.functional as F

    t = torch.tensor([1, 2, 3])
    reads = {
        "in": lambda: 3 in t,
        "bincount": lambda: t.bincount(),
        "unique_consecutive": lambda: torch.unique_consecutive(t),
        "one_hot": lambda: F.one_hot(t),
        "to a device": lambda: torch.tensor([1, 2], device="meta"),
        "new_tensor on a device": lambda: t.to("meta").new_tensor([1]),
    }
    quiet = {
        "one_hot, sized": lambda: F.one_hot(t, num_classes=5),
        "tensor on the host": lambda: torch.tensor([1, 2]),
        "new_tensor on the host": lambda: t.new_tensor([1]),
        "as_tensor of a tensor": lambda: torch.as_tensor(t.to("meta"), device="meta"),
    }
    for name, op in {**reads, **quiet}.items():
        with HostReads() as watched:
            op()
        assert watched.total == (name in reads), name
