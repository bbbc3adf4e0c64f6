"""Fixtures: tiny Llama-style models and a character tokenizer, built and saved
here, then loaded through the same path users take (HF directory -> load_model).

The draft is the target with perturbed weights, so acceptance is partial
but far from zero. Weights are scaled up from the usual init so that the
next-token distributions are peaked and depend on the context.

Also what several test files share: the tiny shape in any architecture
(tiny_config, tiny_model), saved model folders with broken variants
(saved_models), and the exactness check's settings on the tiny pair.
"""

from __future__ import annotations

import os
import shutil
import string
import tempfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaForCausalLM, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from harness.core.sampling import Sampling

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# CPU linear plans (harness.models.cpu_linear) stored per test process, never in the user's cache.
os.environ.setdefault("SPECBENCH_PLANS", tempfile.mkdtemp(prefix="specbench-plans-"))
os.environ.setdefault("SPECBENCH_BANDWIDTH", tempfile.mkdtemp(prefix="specbench-bandwidth-"))  # likewise harness.base.bandwidth

SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def make_tokenizer(chars: str = string.printable[:95]) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(dict.fromkeys(chars)))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


TINY_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def tiny_config(config_class: type[PreTrainedConfig], vocab_size: int, layers: int = 2, **settings) -> PreTrainedConfig:
    """A config of any HF architecture in the tiny shape every test model shares; `settings` add to it or replace it."""
    return config_class(**{"vocab_size": vocab_size, "num_hidden_layers": layers, **TINY_SHAPE, **settings})


def tiny_model(model_class: type[PreTrainedModel], vocab_size: int, seed: int, layers: int = 2, scale: float = 20.0, **settings):
    """A tiny model of `model_class`'s architecture, initialised from `seed`, its LM head scaled by `scale`
    (1.0: HF's own init); `settings` go to its config."""
    torch.manual_seed(seed)
    model = model_class(tiny_config(model_class.config_class, vocab_size, layers, **settings))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # peaked, context-dependent next-token rows
    return model.eval()


def make_model(vocab_size: int, seed: int, layers: int = 2, scale: float = 20.0) -> LlamaForCausalLM:
    """The tiny Llama model of the fixtures: make_tokenizer's special-token ids, an untied head, 512 positions."""
    return tiny_model(
        LlamaForCausalLM,
        vocab_size,
        seed,
        layers,
        scale,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def perturbed(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    draft = make_model(model.config.vocab_size, seed=0, layers=model.config.num_hidden_layers)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return draft


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: a second intra-op thread only adds contention (10x slower on a busy machine, and
    pytest-xdist runs a worker per core). Modules of tiny-model tests use it (pytestmark usefixtures)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict[str, Path]:
    """Saved tiny target and draft directories sharing one tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer()
    target = make_model(len(tok), seed=1)
    draft = perturbed(target, noise=0.3, seed=2)
    paths = {"target": root / "target", "draft": root / "draft"}
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    return paths


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory) -> Path:
    """A tiny target, a shared-weights draft made for it, and broken variants: no_tokenizer, no_weights
    (a config alone), and other_target (another vocabulary). Read only: a test that damages one copies it first."""
    from harness.models.shared_draft import build_shared_draft, save_shared_draft

    root = tmp_path_factory.mktemp("models")
    tok = make_tokenizer()
    target = make_model(len(tok), seed=1)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    draft = build_shared_draft(target, 1, torch.arange(len(tok)))
    save_shared_draft(draft, root / "shared_draft", {"made_by": "test"})
    target.save_pretrained(root / "no_tokenizer")
    (root / "no_weights").mkdir()
    shutil.copy(root / "target" / "config.json", root / "no_weights")
    other_tok = make_tokenizer("abcdefghij")
    make_model(len(other_tok), seed=3).save_pretrained(root / "other_target")  # another vocabulary
    other_tok.save_pretrained(root / "other_target")
    return root


# ---------------------------------------------------------------- the exactness check on the tiny pair

FAMILY_ALPHA = 1e-4  # the family-wise level every seeded exactness check here is held to
# The tiny pair at k=2, T=1, top-k 5, L=6: 500 continuations (15-60 ms each, with the machine's load).
TINY_SAMPLES, TINY_SAMPLING, TINY_K, TINY_LENGTH = 500, Sampling(1.0, top_k=5), 2, 6
TINY_CHECK = (  # those settings as the overrides of `python -m harness.exactness`, on one prompt
    f"k={TINY_K}",
    "temperature=1.0",
    "top_k=5",
    f"exactness.length={TINY_LENGTH}",
    f"exactness.samples={TINY_SAMPLES}",
    "exactness.num_prompts=1",
    f"exactness.alpha={FAMILY_ALPHA}",
)


def compose_check(tiny_pair: dict[str, Path], out: Path, *overrides: str):
    """The composed config `python -m harness.exactness` sees, on the tiny pair."""
    from hydra import compose, initialize_config_dir

    from harness.config.checks import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            config_name="exactness_check",
            overrides=[
                "+pair=llama_7b_68m",
                f"pair.target.id={tiny_pair['target']}",
                f"pair.draft.id={tiny_pair['draft']}",
                f"out_dir={out}",
                "device=cpu",
                *overrides,
            ],
        )


def exactness_args(tiny_pair: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """The command line of `python -m harness.exactness` on the tiny pair, on the CPU, writing under `out`."""
    return [
        "+pair=llama_7b_68m",
        f"pair.target.id={tiny_pair['target']}",
        f"pair.draft.id={tiny_pair['draft']}",
        f"out_dir={out}",
        f"hydra.run.dir={out}/hydra",
        "device=cpu",
        *extra,
    ]


def tiny_cached_pair(tiny_pair: dict[str, Path], forward: str = "hf"):
    """(target CachedLM, ModelDrafter, prompt [6]) on the tiny pair, freshly loaded, both with `forward`."""
    from harness.core.drafters import ModelDrafter
    from harness.models.cached import CachedLM
    from harness.models.loading import ModelSpec, load_model

    device = torch.device("cpu")
    target_model = load_model(ModelSpec(str(tiny_pair["target"])), device)
    draft_model = load_model(ModelSpec(str(tiny_pair["draft"])), device, "draft")
    vocab = target_model.config.vocab_size
    target = CachedLM(target_model, vocab, forward=forward)
    return target, ModelDrafter(CachedLM(draft_model, vocab, forward=forward)), torch.tensor([1, 40, 60, 70, 80, 90])


def missing_rollback_report(tiny_pair: dict[str, Path], forward: str = "hf") -> dict:
    """The exactness check's report at the tiny settings on tiny_cached_pair's prompt, with a target
    cache that is never rolled back (stale keys, shifted positions)."""
    from broken import BROKEN, plugged

    target, drafter, prompt = tiny_cached_pair(tiny_pair, forward)
    variant = next(v for v in BROKEN if v.name == "no_rollback")
    with plugged(variant, target, drafter) as (t, d, _):
        return tiny_check(t, d, prompt, law_target=target)


def tiny_check(target, drafter, prompt, law_target, rule=None) -> dict:
    """The exactness check's report at the tiny settings on one prompt; `law_target` gives the exact law."""
    from harness.core.rule import verify_rows
    from harness.exactness.check import check

    return check(
        target,
        drafter,
        [("prompt", prompt)],
        k=TINY_K,
        sampling=TINY_SAMPLING,
        length=TINY_LENGTH,
        samples=TINY_SAMPLES,
        alpha=FAMILY_ALPHA,
        rule=rule or verify_rows,
        law_target=law_target,
    )


def proposal_of(drafter, ids: torch.Tensor, k: int, sampling=None, generator=None) -> list[int]:
    """What a drafter proposes for one sequence's committed ids [L] with a budget of k (greedy by default)."""
    from harness.core.loop import Rows
    from harness.core.sampling import Sampling

    drafted = drafter.propose(Rows([ids], [generator]), [k], sampling or Sampling(0.0))
    return drafted.tokens[0, : drafted.counts[0]].tolist()
