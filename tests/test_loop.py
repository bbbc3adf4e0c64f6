"""The speculative loop on tiny real transformers, loaded the way users load models."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokenizer, proposal_of, tiny_model

from harness.core import sampling as sampling_module
from harness.core.drafters import ModelDrafter, NgramDrafter
from harness.core.lengths import make_policy
from harness.core.loop import autoregressive_decode, speculative_decode
from harness.core.metrics import cycle_counts
from harness.core.sampling import Sampling, shape_probs
from harness.errors import HarnessError
from harness.models.cached import CachedLM, cache_kwarg
from harness.models.loading import ModelSpec, load_model

PROMPTS = ["hello world", "The quick brown fox", "def f(x): return", "2 + 2 =", "Once upon a time, there"]
GREEDY = Sampling(0.0)


@pytest.fixture(scope="module")
def models(tiny_pair):
    cpu = torch.device("cpu")
    target = load_model(ModelSpec(str(tiny_pair["target"])), cpu)
    draft = load_model(ModelSpec(str(tiny_pair["draft"])), cpu, "draft")
    return target, draft


def ids_of(text: str) -> torch.Tensor:
    return torch.tensor(make_tokenizer()(text)["input_ids"])


def spec_tokens(target, drafter, prompt, k, sampling, max_new, eos, seed=0, cache="dynamic"):
    gen = torch.Generator().manual_seed(seed)
    cycles = list(speculative_decode(CachedLM(target, 98, cache, 256), drafter, prompt, k, sampling, max_new, eos, gen))
    return [t for c in cycles for t in c.tokens], cycles


def base_tokens(target, prompt, max_new, eos, sampling=GREEDY, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return list(autoregressive_decode(CachedLM(target, 98), prompt, sampling, max_new, eos, gen))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_target_greedy(models, k):
    target, draft = models
    rejected_somewhere = False
    for text in PROMPTS:
        prompt = ids_of(text)
        expected = base_tokens(target, prompt, 37, set())
        got, cycles = spec_tokens(target, ModelDrafter(CachedLM(draft, 98)), prompt, k, GREEDY, 37, set())
        assert got == expected
        assert len(got) == 37  # max_new_tokens = 37 is not a multiple of k + 1: the stop falls inside a cycle
        rejected_somewhere |= any(c.num_accepted < c.num_drafted for c in cycles)
    assert rejected_somewhere  # the pair really disagrees: the test exercises rejections


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_stops_at_eos_inside_a_cycle(models, k):
    target, draft = models
    for text in PROMPTS:
        prompt = ids_of(text)
        free = base_tokens(target, prompt, 40, set())
        eos = {free[13]}  # pretend a token it emits mid-way is EOS
        expected = base_tokens(target, prompt, 40, eos)
        got, _ = spec_tokens(target, ModelDrafter(CachedLM(draft, 98)), prompt, k, GREEDY, 40, eos)
        assert got == expected
        assert got[-1] in eos and all(t not in eos for t in got[:-1])


@pytest.mark.parametrize("k", [1, 4])
def test_static_cache_gives_the_same_tokens(models, k):
    """The static cache (rollback by moving the write position) agrees with the dynamic one,
    at T=0 token for token and at T=1 for the same seed."""
    target, draft = models
    for sampling in (GREEDY, Sampling(1.0)):
        for text in PROMPTS[:3]:
            prompt = ids_of(text)
            dynamic = spec_tokens(target, ModelDrafter(CachedLM(draft, 98)), prompt, k, sampling, 30, set())[0]
            static_drafter = ModelDrafter(CachedLM(draft, 98, "static", 256))
            for _ in range(2):  # reused across sequences, as in a run
                assert spec_tokens(target, static_drafter, prompt, k, sampling, 30, set(), cache="static")[0] == dynamic


def sliding_window_pair(window: int):
    """A Mistral-style target and perturbed draft whose attention sees only the last `window` tokens."""
    from transformers import MistralForCausalLM

    def mistral(seed):
        return tiny_model(
            MistralForCausalLM, 98, seed, max_position_embeddings=256, sliding_window=window, tie_word_embeddings=False
        )

    target, draft = mistral(1), mistral(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    return target, draft


@pytest.mark.parametrize("k", [1, 4])
def test_sliding_window_models_roll_back_past_the_window(k):
    """Sequences run far past an 8-token window, so rollbacks reach behind it: greedy speculative
    decoding must still equal target greedy, prompt after prompt through the same caches."""
    target, draft = sliding_window_pair(window=8)
    drafter = ModelDrafter(CachedLM(draft, 98))
    lm = CachedLM(target, 98)
    rejected = False
    for text in PROMPTS[:3]:
        prompt = ids_of(text)
        expected = base_tokens(target, prompt, 30, set())
        cycles = list(speculative_decode(lm, drafter, prompt, k, GREEDY, 30, set(), torch.Generator().manual_seed(0)))
        assert [t for c in cycles for t in c.tokens] == expected
        rejected |= any(c.num_accepted < c.num_drafted for c in cycles)
    assert rejected


@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_a_one_token_prompt_with_a_sliding_window_draft(max_new_tokens):
    """The draft prefills nothing (all but the last prompt token), and with one token to make drafts
    nothing either: its rollback then finds an empty cache, with no sliding layer to trim."""
    target, draft = sliding_window_pair(window=8)
    prompt = torch.tensor([5])
    cycles = list(
        speculative_decode(
            CachedLM(target, 98),
            ModelDrafter(CachedLM(draft, 98)),
            prompt,
            4,
            GREEDY,
            max_new_tokens,
            set(),
            torch.Generator().manual_seed(0),
        )
    )
    assert [t for c in cycles for t in c.tokens] == base_tokens(target, prompt, max_new_tokens, set())


def test_a_sliding_window_cache_refuses_a_rollback_past_its_last_cycle():
    """After a cycle's rollback, sliding-window layers keep only the window: dropping more than
    the last forward fed is refused in one line (HF's crop would cut the wrong positions), while
    any rollback within the window, or within what was just fed, restores a fresh cache's logits."""
    window = 8
    target, _ = sliding_window_pair(window=window)
    lm = CachedLM(target, 98)
    ids = ids_of("A prompt that runs well past the sliding window of eight tokens")
    lm.reset()
    lm.forward(ids[:5], num_logits=1)
    lm.forward(ids[5:7], num_logits=2)
    lm.rollback(3)  # within the window: nothing has left it
    assert lm.can_roll_back(2)
    position = 3
    for _ in range(6):  # cycles past the window: feed 3, keep 2
        lm.forward(ids[position : position + 3], num_logits=3)
        assert lm.can_roll_back(position + 1)
        lm.rollback(position + 2)
        position += 2
    assert position > window and not lm.can_roll_back(position - 2)
    with pytest.raises(HarnessError, match="sliding-window layers no longer hold"):
        lm.rollback(position - 2)
    fresh = CachedLM(target, 98)
    fresh.reset()
    fresh.forward(ids[:position], num_logits=1)
    torch.testing.assert_close(
        lm.forward(ids[position : position + 2], num_logits=2), fresh.forward(ids[position : position + 2], num_logits=2)
    )


def test_static_cache_of_a_sliding_window_model():
    """A static cache is sized within the window when the run fits in it, and then rolls back
    and resets like any other; a run longer than the window is refused in one line."""
    target, draft = sliding_window_pair(window=64)  # context 256: longer than the window
    prompt = ids_of("Sliding windows")
    expected = base_tokens(target, prompt, 24, set())
    lm, draft_lm = CachedLM(target, 98, "static"), CachedLM(draft, 98, "static")
    for model_lm in (lm, draft_lm):
        model_lm.reserve(prompt.shape[0] + 24)  # as run_cell does: fits in the window
        assert model_lm.capacity == 64
    drafter = ModelDrafter(draft_lm)
    for seed in range(3):  # reused across sequences
        cycles = list(speculative_decode(lm, drafter, prompt, 4, GREEDY, 24, set(), torch.Generator().manual_seed(seed)))
        assert [t for c in cycles for t in c.tokens] == expected
    with pytest.raises(HarnessError, match="sliding-window attention .*use cache=dynamic"):
        lm.reserve(65)


def test_an_unreserved_static_cache_of_a_sliding_window_model_says_why_every_time():
    """Used as a library, without reserve(): the first forward names the sliding window (not linear
    attention), and a second try, with or without a reset, is refused the same way rather than let through."""
    target, _ = sliding_window_pair(window=16)
    lm = CachedLM(target, 98, "static")
    for reset in (True, False, True):
        if reset:
            lm.reset()
        with pytest.raises(HarnessError, match=r"sliding-window attention \(window 16\) .*use cache=dynamic"):
            lm.forward(torch.tensor([5, 6, 7]))


def test_the_baseline_keeps_a_sliding_window_cache_windowed():
    """Only a cache that may be rolled back records what leaves the window, and the speculative
    loop crops it back every cycle: neither side's cache grows with the sequence."""
    window = 8
    target, draft = sliding_window_pair(window=window)
    prompt = ids_of("A long enough prompt")
    lm = CachedLM(target, 98)
    list(autoregressive_decode(lm, prompt, GREEDY, 40, set(), None))
    assert max(layer.keys.shape[-2] for layer in lm.cache.layers) < window
    drafter = ModelDrafter(CachedLM(draft, 98))
    list(speculative_decode(lm, drafter, prompt, 4, GREEDY, 40, set(), torch.Generator().manual_seed(0)))
    assert max(layer.keys.shape[-2] for layer in lm.cache.layers) < window
    assert max(layer.keys.shape[-2] for layer in drafter.lm.cache.layers) < window + 4


class OlderSignature(torch.nn.Module):
    """A model whose forward takes its KV cache as `past_key_values`, as transformers
    before the `cache` rename (5.17) and classes not yet renamed do."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, past_key_values=None, **kwargs):
        kwargs.pop("cache", None)  # as there: a `cache` keyword falls into **kwargs, unused
        return self.inner(input_ids=input_ids, **{cache_kwarg(self.inner): past_key_values}, **kwargs)


class DropsTheCache(OlderSignature):
    def forward(self, input_ids, **kwargs):  # a cache it does not name lands in kwargs and is lost
        kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
        return self.inner(input_ids=input_ids, **kwargs)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_cache_reaches_models_that_call_it_past_key_values(models, cache):
    target, draft = models
    prompt = ids_of(PROMPTS[1])
    expected = base_tokens(target, prompt, 20, set())
    older = CachedLM(OlderSignature(target), 98, cache, 256)
    gen = torch.Generator().manual_seed(0)
    assert list(autoregressive_decode(older, prompt, GREEDY, 20, set(), gen)) == expected
    assert older.cache_kwarg == "past_key_values" and CachedLM(target, 98).cache_kwarg == cache_kwarg(target)


def test_a_model_that_drops_the_cache_is_an_error_not_wrong_tokens(models):
    target, _ = models
    lm = CachedLM(DropsTheCache(target), 98)
    with pytest.raises(HarnessError, match="did not fill the KV cache"):
        lm.prefill(ids_of(PROMPTS[0]))


def test_static_cache_is_sized_by_reserve(models):
    """A static cache holds what the run reserves (rounded up to 256 slots, at most the
    model's context), and a sequence that outgrows it stops with a clear error."""
    target, _ = models
    lm = CachedLM(target, 98, "static")
    assert lm.capacity == target.config.max_position_embeddings
    lm.reserve(300)
    assert lm.capacity == 512 and lm.cache.layers[0].max_cache_len == 512
    lm.reserve(10**6)
    assert lm.capacity == target.config.max_position_embeddings
    lm.reserve(1)
    lm.forward(torch.arange(250) % 90 + 5)
    with pytest.raises(HarnessError, match="static KV cache holds 256 tokens"):
        lm.forward(torch.arange(5, 15))  # 250 + 10 > 256
    dynamic = CachedLM(target, 98)
    dynamic.reserve(1)
    dynamic.forward(torch.arange(295) % 90 + 5)  # the dynamic cache grows: reserve does nothing
    assert dynamic.length == 295


def test_compiled_forwards_give_the_same_tokens(models):
    """compile=true (static cache; prompts eager, decode and verify steps compiled) commits
    the tokens the eager dynamic cache commits, greedy and at T=1 for the same seed."""
    target, draft = models
    compiled_target = CachedLM(target, 98, "static", 256, compile=True)
    compiled_drafter = ModelDrafter(CachedLM(draft, 98, "static", 256, compile=True))
    steps = []  # forwards through torch.compile (a count of new graphs missed graphs dynamo already held
    for lm in (compiled_target, compiled_drafter.lm):  # from earlier tests: it failed after tests/test_host_syncs.py)
        lm.compiled = lambda *args, step=lm.compiled, **kwargs: steps.append(1) or step(*args, **kwargs)
    for sampling in (GREEDY, Sampling(1.0)):
        for text in PROMPTS[:2]:
            prompt = ids_of(text)
            eager = spec_tokens(target, ModelDrafter(CachedLM(draft, 98)), prompt, 2, sampling, 20, set())[0]
            gen = torch.Generator().manual_seed(0)
            cycles = speculative_decode(compiled_target, compiled_drafter, prompt, 2, sampling, 20, set(), gen)
            assert [t for c in cycles for t in c.tokens] == eager
    assert len(steps) > 20  # the compiled path really ran: every decode and verify step


def test_warm_up_compiles_every_step_a_run_takes(tiny_pair):
    """After Pair.warm_up(k), decoding compiles nothing more: no compilation lands inside
    a timed prompt (it did before warm_up existed, and cost the compiled run 15% of its speed)."""
    from harness.runner.pair import Pair

    cpu = torch.device("cpu")
    target = load_model(ModelSpec(str(tiny_pair["target"])), cpu)  # fresh modules: nothing compiled for them yet
    draft = load_model(ModelSpec(str(tiny_pair["draft"])), cpu, "draft")
    pair = Pair(
        "tiny",
        CachedLM(target, 98, "static", 256, compile=True),
        ModelDrafter(CachedLM(draft, 98, "static", 256, compile=True)),
        None,
        set(),
        cpu,
    )
    pair.warm_up(3)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for text in PROMPTS:
        for max_new in (7, 8, 9, 20):  # budget cuts make the last cycles draft fewer than k
            list(speculative_decode(pair.target, pair.drafter, ids_of(text), 3, GREEDY, max_new, set(), None))
        list(autoregressive_decode(pair.target, ids_of(text), GREEDY, 5, set(), None))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_with_cuda_graphs_warm_up_calls_every_step_twice(tiny_pair):
    """torch's CUDA graph trees run a function's first call as a warm-up and record its graph at the
    second: one call per step left the recording inside the first timed prompt."""
    cpu = torch.device("cpu")
    lm = CachedLM(load_model(ModelSpec(str(tiny_pair["target"])), cpu), 98, "static", 256, compile=True)
    assert not lm.graphs  # on a CPU: no CUDA graphs, one call each
    calls = []
    compiled = lm.compiled
    lm.compiled = lambda input_ids, **kwargs: calls.append(input_ids.shape[-1]) or compiled(input_ids=input_ids, **kwargs)
    lm.warm_up([(1, 1), (2, 2)])
    assert sorted(calls) == [1, 2]
    calls.clear()
    lm.graphs = True  # as on CUDA, where steps compile with mode="reduce-overhead"
    lm.warm_up([(1, 1), (2, 2)])
    assert sorted(calls) == [1, 1, 2, 2]


# v(n), n = 1..5 positions scored over one, of the shape a 2-core CPU gives (docs/metrics.md):
# the cost jumps between 3 and 4 positions.
CPU_VERIFY_COST = [1.0, 1.12, 1.19, 1.58, 1.65]


def cost_aware_lookup(verify_cost=CPU_VERIFY_COST) -> NgramDrafter:
    """Prompt lookup under draft_length=cost (c taken as 0: it runs on the host)."""
    drafter = NgramDrafter(98)
    drafter.draft_length = make_policy("cost")
    drafter.draft_length.use_costs({"cost_ratio": 0.0, "verify_cost": verify_cost})
    drafter.draft_length.start(1)
    return drafter


@pytest.mark.parametrize("policy", ["constant", "cost"])
def test_prompt_lookup_greedy_equals_target_greedy(models, policy):
    target, _ = models
    proposed = []
    drafter = cost_aware_lookup() if policy == "cost" else NgramDrafter(98)
    for text in PROMPTS:
        prompt = ids_of(text * 2)  # repeated text: lookup finds matches
        tokens, cycles = spec_tokens(target, drafter, prompt, 4, GREEDY, 30, set())
        assert tokens == base_tokens(target, prompt, 30, set())
        proposed += [c.num_drafted for c in cycles]
    assert max(proposed) == 4 or policy == "cost"
    if policy == "cost":  # the jump at 4 positions keeps most proposals under 4
        assert 0 < sum(n == 4 for n in proposed) < sum(0 < n < 4 for n in proposed)


def test_cost_aware_lookup_proposes_what_pays_for_its_verification():
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 5, 6])  # "5 6" recurs: the match offers 7 8 9 10
    assert proposal_of(NgramDrafter(98), ids, 4) == [7, 8, 9, 10]

    def cycle(drafter, accepted: int) -> list[int]:  # as the loop runs one: budget, proposal, outcome
        tokens = proposal_of(drafter, ids, drafter.draft_length.budgets([4])[0])
        drafter.draft_length.outcome([len(tokens)], [min(accepted, len(tokens))])
        drafter.rollback([ids.shape[0] + min(accepted, len(tokens))])
        return tokens

    drafter = cost_aware_lookup()
    drafter.start([ids])
    # Prior acceptance 1/2, calibrated 0.55: a third or fourth token does not pay for the jump to v(4)
    assert cycle(drafter, 4) == [7, 8]
    for _ in range(5):  # every proposal accepted: acceptance rises and the whole match pays
        cycle(drafter, 4)
    assert cycle(drafter, 4) == [7, 8, 9, 10]
    drafter = cost_aware_lookup()  # a new run starts from the prior again
    drafter.start([ids])
    assert cycle(drafter, 0) == [7, 8]
    for _ in range(10):  # every proposal rejected at its first token: acceptance falls below v(2) - 1
        cycle(drafter, 0)
    assert cycle(drafter, 0) == []  # a plain target step pays more
    unset = NgramDrafter(98)
    unset.draft_length = make_policy("cost")  # before measure_costs has given it c and v: the whole match
    unset.draft_length.start(1)
    assert proposal_of(unset, ids, 4) == [7, 8, 9, 10]


def test_drafts_after_an_accepted_eos_do_not_count_against_acceptance(models):
    """A draft equal to the target has every draft accepted: its acceptance rate is 1 also when an EOS
    is accepted mid-cycle and the drafts after it are cut (they count as neither accepted nor rejected)."""
    from harness.core.metrics import acceptance_rate

    target, _ = models
    cut = 0
    for seed, text in enumerate(PROMPTS):
        prompt = ids_of(text)
        eos = {int(t) for t in base_tokens(target, prompt, 6, set(), Sampling(1.0), seed)[2:4]}  # tokens it does produce
        _, cycles = spec_tokens(target, ModelDrafter(CachedLM(target, 98)), prompt, 4, Sampling(1.0), 40, eos, seed)
        counts = cycle_counts(cycles, 4)
        assert acceptance_rate(counts) == 1.0 and counts["accepted"] == counts["tested"]
        cut += counts["drafted_after_eos"]
    assert cut > 0  # some EOS was accepted before the last drafted position


def test_prompt_lookup_continues_a_repeat_that_runs_into_the_end():
    """The latest match of "7 7 7" ends one token before the end: what followed it is one 7, and a
    greedy loop repeating itself gets k tokens proposed, not one period of the repeat."""
    lookup = NgramDrafter(98)
    assert proposal_of(lookup, torch.tensor([7] * 6), 4) == [7, 7, 7, 7]
    assert proposal_of(lookup, torch.tensor([5, 6, 5, 6, 5, 6, 5]), 4) == [6, 5, 6, 5]
    assert proposal_of(lookup, torch.tensor([1, 2, 3, 4, 1, 2, 3]), 6) == [4, 1, 2, 3, 4, 1]
    assert proposal_of(lookup, torch.tensor([1, 2, 3, 4, 1, 2, 3]), 1) == [4]


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(1.0), Sampling(0.7, top_p=0.9)])
def test_draft_equal_to_target_accepts_everything(models, sampling):
    target, _ = models
    for text in PROMPTS[:3]:
        _, cycles = spec_tokens(target, ModelDrafter(CachedLM(target, 98)), ids_of(text), 4, sampling, 40, set())
        assert all(c.num_accepted == c.num_drafted for c in cycles)


def test_drafts_after_an_accepted_eos_are_neither_accepted_nor_tested(models):
    """The draft is the target, so every draft is accepted; an EOS among a cycle's drafts
    ends the output there, and the drafts after it count for nothing."""
    target, _ = models
    prompt = ids_of(PROMPTS[0])
    free = base_tokens(target, prompt, 40, set())
    for j in range(10, 30):  # an EOS that falls before a cycle's last draft
        eos = {free[j]}
        got, cycles = spec_tokens(target, ModelDrafter(CachedLM(target, 98)), prompt, 4, GREEDY, 40, eos)
        last = cycles[-1]
        if len(last.tokens) < last.num_drafted:
            break
    else:
        pytest.fail("no EOS position fell before a cycle's last draft")
    assert got == base_tokens(target, prompt, 40, eos)
    assert last.num_accepted == len(last.tokens) == last.expected_acceptance.shape[0]
    counts = cycle_counts(cycles, 4)
    assert counts["accepted"] == counts["tested"] == sum(c.num_accepted for c in cycles)  # alpha = 1, as it should


def test_acceptance_matches_expected_sum_min_p_q(models):
    """alpha = accepted / tested positions estimates mean sum_v min(p, q) over the
    same positions. Over ~2,000 tested positions the standard error of alpha is
    about sqrt(0.25 / 1800) = 0.012: the tolerance 0.05 is over 4 standard errors."""
    target, draft = models
    accepted = tested = 0
    expected = 0.0
    for seed in range(20):
        for text in PROMPTS:
            _, cycles = spec_tokens(target, ModelDrafter(CachedLM(draft, 98)), ids_of(text), 3, Sampling(1.0), 24, set(), seed)
            for c in cycles:
                accepted += c.num_accepted
                tested += len(c.expected_acceptance)
                expected += float(c.expected_acceptance.sum())
    assert tested > 1800
    alpha, beta = accepted / tested, expected / tested
    assert 0.2 < beta < 0.95  # partial acceptance: the comparison means something
    assert abs(alpha - beta) < 0.05


class RecordingDrafter(ModelDrafter):
    """A model drafter that compares its cache with a fresh forward before each proposal."""

    checked = 0

    def propose(self, rows, budgets, sampling):
        ids = rows.ids[0]
        cached_len = self.lm.length  # the drafter caches a prefix of the committed ids
        if cached_len > 0:
            logits = self.lm.forward(ids[cached_len : cached_len + 1], 1)
            self.lm.rollback(cached_len)
            fresh = CachedLM(self.lm.model, self.lm.vocab_size).forward(ids[: cached_len + 1], 1)
            torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
            RecordingDrafter.checked += 1
        return super().propose(rows, budgets, sampling)


def test_cache_rollback_matches_fresh_forward(models):
    """After any pattern of rejections, both models' next logits over the committed
    sequence equal those of a fresh forward pass over it."""
    target_model, draft_model = models
    for sampling in (GREEDY, Sampling(1.0)):
        for text in PROMPTS:
            prompt = ids_of(text)
            target = CachedLM(target_model, 98)
            drafter = RecordingDrafter(CachedLM(draft_model, 98))
            gen = torch.Generator().manual_seed(3)
            committed = prompt
            patterns = set()
            for cycle in speculative_decode(target, drafter, prompt, 4, sampling, 40, set(), gen):
                patterns.add(cycle.num_accepted)
                committed = torch.cat([committed, torch.tensor(cycle.tokens)])
                assert target.length == len(committed) - 1
                cached = target.forward(committed[-1:], 1)
                target.rollback(target.length - 1)
                fresh = CachedLM(target_model, 98).forward(committed, 1)
                torch.testing.assert_close(cached, fresh, rtol=1e-4, atol=1e-4)
            assert len(patterns) >= 2  # several different rejection points were exercised
    assert RecordingDrafter.checked > 50


def test_top_p_from_candidates_equals_the_full_sort(monkeypatch):
    """On a CPU top-p first looks for the nucleus among the 256, then 2048, most
    probable tokens; rows it does not settle fall back to sorting everything.
    Every row must come out bit for bit as with the full sort alone."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.3, 1.0, 2.0, 3.0, 5.0, 8.0]).repeat(8)[:, None]  # flat to peaked rows
    logits = torch.randn(48, 6000, generator=gen) * scales  # [48, V]
    logits[:4, :300] = 7.0  # ties: 300 equally likely tokens that hold most of the mass
    for top_p in (0.3, 0.9, 0.99):
        fast = shape_probs(logits, Sampling(1.0, top_p=top_p))
        with monkeypatch.context() as m:
            m.setattr(sampling_module, "NUCLEUS_CANDIDATES", ())
            full = shape_probs(logits, Sampling(1.0, top_p=top_p))
        assert torch.equal(fast, full)
        sizes = (fast > 0).sum(-1)
        if top_p == 0.9:  # every rung was used: settled at 256, at 2048, and by the full sort
            assert (sizes <= 256).any() and ((sizes > 256) & (sizes <= 2048)).any() and (sizes > 2048).any()


def test_top_p_keeps_every_token_tied_with_the_last_one_in():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    full = logits.softmax(-1)[0]
    top_p = float(full[0] + full[1]) - 1e-3  # the nucleus ends inside the three-way tie
    p = shape_probs(logits, Sampling(1.0, top_p=top_p))
    assert (p[0, :4] > 0).all() and p[0, 4] == 0


def test_sampling_shapes_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = shape_probs(logits, Sampling(1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    p = shape_probs(logits, Sampling(1.0, top_p=0.8))
    kept = (p[0] > 0).sum().item()
    assert full[: kept - 1].sum() < 0.8 <= full[:kept].sum()  # smallest prefix reaching top_p
    p = shape_probs(logits, Sampling(0.5))
    torch.testing.assert_close(p, (logits / 0.5).softmax(-1))
