"""The acceptance a run reports is the draft's own: harness.exactness.acceptance on tiny real models.

Correct drafters pass at every k. Two broken model drafters, whose context
differs from the committed tokens, give the same greedy output as the
target alone (so no exactness test sees them) and are flagged here.
"""

from __future__ import annotations

import pytest
import torch

from harness.core.drafters import ModelDrafter, NgramDrafter
from harness.core.loop import Rows, autoregressive_decode, speculative_decode
from harness.core.sampling import Sampling
from harness.exactness.acceptance import teacher_forced_agreement
from harness.models.cached import CachedLM
from harness.models.loading import ModelSpec, load_model
from harness.models.shared_draft import build_shared_draft

PROMPTS = ["hello world", "The quick brown fox", "def f(x): return", "Once upon a time, there"]
GREEDY = Sampling(0.0)
MAX_NEW = 30
VOCAB = 98


@pytest.fixture(scope="module")
def models(tiny_pair):
    cpu = torch.device("cpu")
    return load_model(ModelSpec(str(tiny_pair["target"])), cpu), load_model(ModelSpec(str(tiny_pair["draft"])), cpu, "draft")


def ids_of(text: str) -> torch.Tensor:
    from conftest import make_tokenizer

    return torch.tensor(make_tokenizer()(text)["input_ids"])


def run(target, drafter, prompt, k, eos=frozenset()):
    cycles = list(
        speculative_decode(
            CachedLM(target, VOCAB), drafter, prompt, k, GREEDY, MAX_NEW, set(eos), torch.Generator().manual_seed(0)
        )
    )
    return [t for c in cycles for t in c.tokens], cycles


def target_alone(target, prompt, eos=frozenset()):
    return list(autoregressive_decode(CachedLM(target, VOCAB), prompt, GREEDY, MAX_NEW, set(eos), torch.Generator()))


class StaleDrafter(ModelDrafter):
    """Broken: after a rejection its context holds the rejected draft where the recovered token
    was committed (as a rollback that kept the rejected entry would), for the rest of the sequence."""

    def start(self, prompts):
        super().start(prompts)
        self.stale: tuple[int, torch.Tensor] | None = None  # (position, rejected draft) to feed there
        self.last: tuple[int, torch.Tensor] = (prompts[0].shape[0], prompts[0][:0])

    def propose(self, rows, budgets, sampling):
        ids = rows.ids[0]
        if self.stale is not None:
            position, token = self.stale
            ids = torch.cat([ids[:position], token[None], ids[position + 1 :]])  # the bug
            self.stale = None
        proposal = super().propose(Rows([ids], rows.generators), budgets, sampling)
        self.last = (ids.shape[0], proposal.tokens[0, : proposal.counts[0]])
        return proposal

    def rollback(self, lengths):
        committed, tokens = self.last
        accepted = lengths[0] - committed
        if accepted < tokens.shape[0]:  # a rejection: its draft stands where the recovered token goes
            self.stale = (lengths[0], tokens[accepted])
        super().rollback(lengths)


class ShiftedDrafter(ModelDrafter):
    """Broken: its cache starts with the first prompt token twice (a doubled BOS), so every
    committed token sits one position later in the draft's context than in the target's."""

    def start(self, prompts):
        super().start([torch.cat([prompts[0][:1], prompts[0]])])

    def propose(self, rows, budgets, sampling):
        return super().propose(Rows([torch.cat([rows.ids[0][:1], rows.ids[0]])], rows.generators), budgets, sampling)

    def rollback(self, lengths):
        super().rollback([lengths[0] + 1])


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_model_drafter_reports_its_own_acceptance(models, k):
    target, draft = models
    rejected = 0
    for text in PROMPTS:
        prompt = ids_of(text)
        _, cycles = run(target, ModelDrafter(CachedLM(draft, VOCAB)), prompt, k)
        result = teacher_forced_agreement(ModelDrafter(CachedLM(draft, VOCAB)), prompt, cycles, k, MAX_NEW)
        assert result.ok, result.describe()
        assert result.kind == "model: one teacher-forced draft pass"
        assert result.reported == result.teacher_forced and not result.ties  # float32: no tie on these prompts
        assert len(result.positions) == result.reported[1] > 0
        rejected += sum(not p.reported for p in result.positions)
    assert rejected  # the pair disagrees: rejected positions were checked too


def test_a_run_ending_at_eos_inside_a_cycle(models):
    """An EOS among accepted drafts ends the cycle: the drafts after it are not tested."""
    target, draft = models
    for text in PROMPTS[:2]:
        prompt = ids_of(text)
        eos = {target_alone(target, prompt)[11]}
        tokens, cycles = run(target, ModelDrafter(CachedLM(draft, VOCAB)), prompt, 4, eos)
        assert tokens[-1] in eos and len(tokens) < MAX_NEW
        result = teacher_forced_agreement(ModelDrafter(CachedLM(draft, VOCAB)), prompt, cycles, 4, MAX_NEW)
        assert result.ok, result.describe()


def test_a_static_cache_draft_checked_with_the_drafter_that_ran(models):
    """The check copies the drafter's CachedLM (a static cache of its own): the drafter that ran can be passed."""
    target, draft = models
    drafter = ModelDrafter(CachedLM(draft, VOCAB, "static", 256))
    for text in PROMPTS[:2]:
        prompt = ids_of(text)
        _, cycles = run(target, drafter, prompt, 4)
        result = teacher_forced_agreement(drafter, prompt, cycles, 4, MAX_NEW)
        assert result.ok and result.reported == result.teacher_forced, result.describe()
        again = run(target, drafter, prompt, 4)[1]  # the drafter still runs as before
        assert [(c.tokens, c.num_accepted) for c in again] == [(c.tokens, c.num_accepted) for c in cycles]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_shared_weights_draft_reports_its_own_acceptance(models, k):
    target, _ = models
    draft = build_shared_draft(target, 1, torch.arange(3, 60)).eval()
    for text in PROMPTS[:2]:
        prompt = ids_of(text)
        _, cycles = run(target, ModelDrafter(CachedLM(draft, VOCAB)), prompt, k)
        result = teacher_forced_agreement(ModelDrafter(CachedLM(draft, VOCAB)), prompt, cycles, k, MAX_NEW)
        assert result.ok, result.describe()
        assert result.kind == "model (shared weights): one teacher-forced draft pass" and result.positions


@pytest.mark.parametrize("policy", ["constant", "cost"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_prompt_lookup_reports_its_own_acceptance(models, k, policy):
    from harness.core.lengths import make_policy

    target, _ = models
    drafted = 0
    for text in PROMPTS:
        prompt = ids_of(text)
        drafter = NgramDrafter(VOCAB)
        drafter.draft_length = make_policy(policy)
        drafter.draft_length.use_costs({"cost_ratio": 0.0, "verify_cost": [1.0, 1.3, 1.6, 1.9, 2.2]})  # long proposals must pay
        _, cycles = run(target, drafter, prompt, k)
        result = teacher_forced_agreement(drafter, prompt, cycles, k, MAX_NEW)
        assert result.ok, result.describe()
        assert result.kind.startswith(f"prompt lookup (draft_length={policy})")
        assert result.reported == result.teacher_forced
        drafted += sum(c.num_drafted for c in cycles)
    assert drafted  # lookups found matches


@pytest.mark.parametrize("broken", [StaleDrafter, ShiftedDrafter])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_drafter_with_the_wrong_context_is_caught_here_and_nowhere_else(models, broken, k):
    """Its greedy output is the target's own and the correct drafter's, token for token (the
    exactness tests cannot tell), while its reported acceptance differs and the check says so."""
    target, draft = models
    flagged = changed = 0
    for text in PROMPTS:
        prompt = ids_of(text)
        tokens, cycles = run(target, broken(CachedLM(draft, VOCAB)), prompt, k)
        correct_tokens, correct_cycles = run(target, ModelDrafter(CachedLM(draft, VOCAB)), prompt, k)
        assert tokens == correct_tokens == target_alone(target, prompt)
        changed += [c.num_accepted for c in cycles] != [c.num_accepted for c in correct_cycles]
        result = teacher_forced_agreement(broken(CachedLM(draft, VOCAB)), prompt, cycles, k, MAX_NEW)
        if not result.ok:
            flagged += 1
            assert result.mismatches and result.describe().startswith("reported acceptance is not the draft's own")
    assert changed and flagged >= changed  # every run whose acceptance moved is caught


def test_disagreements_within_the_tie_gap_are_counted_apart(models):
    """The same broken run, with every logit gap declared a tie: nothing fails, and the ties are counted."""
    target, draft = models
    prompt = ids_of(PROMPTS[1])
    _, cycles = run(target, StaleDrafter(CachedLM(draft, VOCAB)), prompt, 4)
    strict = teacher_forced_agreement(ModelDrafter(CachedLM(draft, VOCAB)), prompt, cycles, 4, MAX_NEW)
    lenient = teacher_forced_agreement(ModelDrafter(CachedLM(draft, VOCAB)), prompt, cycles, 4, MAX_NEW, tie_gap=float("inf"))
    assert not strict.ok and lenient.ok
    assert len(lenient.ties) == len(strict.mismatches) > 0 and all(p.gap > 0 for p in lenient.ties)


def test_a_drafter_it_does_not_know_is_refused(models):
    with pytest.raises(TypeError, match="no teacher-forced acceptance check for a object"):
        teacher_forced_agreement(object(), ids_of("hi"), [], 4, MAX_NEW)
