"""Fixtures: tiny Llama-style models and a character tokenizer, built and saved
here, then loaded through the same path users take (HF directory -> load_model).

The draft is the target with perturbed weights, so acceptance is partial
but far from zero. Weights are scaled up from the usual init so that the
next-token distributions are peaked and depend on the context.
"""

from __future__ import annotations

import os
import string
import tempfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# CPU linear plans (harness.models.cpu_linear) stored per test process, never in the user's cache.
os.environ.setdefault("SPECBENCH_PLANS", tempfile.mkdtemp(prefix="specbench-plans-"))

SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def make_tokenizer(chars: str = string.printable[:95]) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(dict.fromkeys(chars)))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(vocab_size: int, seed: int, layers: int = 2, scale: float = 20.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # peaked, context-dependent next-token rows
    return model.eval()


def perturbed(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    draft = make_model(model.config.vocab_size, seed=0, layers=model.config.num_hidden_layers)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return draft


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
