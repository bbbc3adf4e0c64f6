"""Prompt sets and how a prompt becomes token ids.

The builtin set (harness/data/builtin_prompts.jsonl) is ours, offline:
60 prompts, 10 in each of six categories. Each prompt is a dict with
`id`, `category` and `prompt`; the category travels into every result.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from harness.errors import HarnessError

if TYPE_CHECKING:
    import torch

# The builtin prompt set, one JSON object a line (harness.data.datasets reads it as dataset=builtin).
BUILTIN_PROMPTS = Path(__file__).parent / "builtin_prompts.jsonl"


def load_builtin() -> list[dict]:
    """The builtin set's prompts as the file holds them, without the datasets library."""
    return [json.loads(line) for line in BUILTIN_PROMPTS.read_text().splitlines() if line.strip()]


def select(prompts: list[dict], num_prompts: int | None, seed: int, shuffle: bool) -> list[dict]:
    """A deterministic choice of prompts, balanced over categories.

    Prompts are taken round-robin over categories (in order of first
    appearance), so any prefix of the selection covers every category
    evenly; `shuffle` first permutes each category with `seed`. The chosen
    ids are recorded in the results.
    """
    rng = random.Random(seed)
    by_category: dict[str, list[dict]] = {}
    for p in prompts:
        by_category.setdefault(p["category"], []).append(p)
    queues = [rng.sample(group, len(group)) if shuffle else group for group in by_category.values()]
    ordered = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    return ordered if num_prompts is None else ordered[:num_prompts]


PAIR_TEMPLATE = "harness_pair_template"  # set on a tokenizer given a pair's chat template (set_pair_template)


def set_pair_template(tokenizer, template: str) -> None:
    """Give a target's tokenizer the chat template its pair config names (for a tokenizer without
    one, e.g. Vicuna v1.3's). Such a template is written without BOS, and its rendered text is
    tokenized as raw text is, the tokenizer adding its special tokens: as FastChat does, so the
    first word keeps the form it has at the start of a text."""
    tokenizer.chat_template = template
    setattr(tokenizer, PAIR_TEMPLATE, True)


def encode(tokenizer, text: str, template: str) -> list[int]:
    """Token ids for a user prompt: the chat template when the tokenizer has
    one (template=auto or chat), raw text otherwise. Special tokens are added
    once: by the template, or by the tokenizer for raw text (and for a pair's
    own template, set_pair_template), never both."""
    use_chat = template == "chat" or (template == "auto" and tokenizer.chat_template)
    if template == "chat" and not tokenizer.chat_template:
        raise HarnessError("prompts.template=chat but the target's tokenizer has no chat template: use template=raw or auto")
    if use_chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        # A pair's own template leaves BOS to the tokenizer, unless it writes one itself (then not twice).
        specials = getattr(tokenizer, PAIR_TEMPLATE, False) and not (
            tokenizer.bos_token and rendered.startswith(tokenizer.bos_token)
        )
        return tokenizer(rendered, add_special_tokens=specials)["input_ids"]
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def encode_within(
    tokenizer, text: str, template: str, budget: int, overlong: str, length_setting: str = "max_new_tokens"
) -> list[int] | None:
    """Token ids for a user prompt (as `encode` makes them) within `budget` tokens.

    A longer prompt is skipped (None) with overlong=skip. With
    overlong=truncate the middle of its text is left out, as long-context
    benchmarks do: the template (BOS, role headers, generation prompt) and
    both ends of the text (an instruction at the start, a question at the
    end) are kept. The cut is the smallest that fits, found by bisection on
    the number of characters kept, re-encoding each time. `length_setting`: the
    setting that leaves the budget, named in the error when the template alone overflows.
    """
    ids = encode(tokenizer, text, template)
    if len(ids) <= budget:
        return ids
    if overlong != "truncate":
        return None
    fitting = encode(tokenizer, "", template)
    if len(fitting) > budget:
        raise HarnessError(
            f"the prompt template alone takes {len(fitting)} tokens, more than the {budget}-token context budget: lower {length_setting}, or use prompts.template=raw"
        )
    kept, too_many = 0, len(text)  # keeping `kept` characters fits, keeping `too_many` does not
    while too_many - kept > 1:
        middle = (kept + too_many) // 2
        ids = encode(tokenizer, _without_middle(text, middle), template)
        if len(ids) <= budget:
            kept, fitting = middle, ids
        else:
            too_many = middle
    return fitting


def _without_middle(text: str, keep: int) -> str:
    """The first and last characters of text, `keep` in all (the odd one at the start)."""
    head = (keep + 1) // 2
    return text[:head] + text[len(text) - (keep - head) :]


def as_tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    """[len(ids)] the ids as a long tensor on `device` (torch imported here: the rest of this module needs none)."""
    import torch

    return torch.tensor(ids, dtype=torch.long, device=device)
