"""Greedy ties: where two correct greedy decoders of one target may part, and the check that they did only there."""

from __future__ import annotations

import torch

from harness.errors import HarnessError

# Two correct greedy decoders can part where the target's two best logits are closer than its dtype's
# rounding (a verify pass and a one-token step sum in other orders): within these gaps, a tie, not a bug.
TIE_LOGIT_GAP = {torch.float32: 1e-3, torch.float16: 0.125, torch.bfloat16: 0.5}


def same_greedy_output(target, ids: torch.Tensor, reference: list[int], tokens: list[int], name: str, prompt: int) -> dict | None:
    """None when `tokens` equal `reference`; a record of the tie where they first differ by one; otherwise a
    HarnessError. After a tie each later token must still be the target's greedy choice up to a tie, scored
    along the contender's own output in one pass."""
    if tokens == reference:
        return None
    j = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if j is None:
        raise HarnessError(
            f"{name} stopped after {len(tokens)} tokens and the target's greedy output after {len(reference)} on prompt {prompt}: not comparable"
        )
    target.reset()
    rows = target.forward(torch.cat([ids, ids.new_tensor(tokens[:-1])]), num_logits=len(tokens) - j)  # [n - j, V]: tokens j..
    target.reset()
    dtype = next(target.model.parameters()).dtype
    tolerance = TIE_LOGIT_GAP.get(dtype, 1e-3)
    chosen = rows.gather(1, ids.new_tensor(tokens[j:])[:, None])[:, 0]  # [n - j] the contender's tokens' logits
    gaps = rows.max(-1).values - chosen  # [n - j] >= 0: how far each is from the target's greedy choice
    beyond = (gaps > tolerance).nonzero()
    if beyond.numel():
        i = int(beyond[0])
        raise HarnessError(
            f"{name} output differs from the target's greedy output on prompt {prompt} at token {j + i}: the target "
            f"prefers {int(rows[i].argmax())} to {tokens[j + i]} by {float(gaps[i]):.3g} logits, more than a "
            f"{str(dtype).removeprefix('torch.')} tie ({tolerance}): not comparable"
        )
    gap = float(rows[0][reference[j]] - chosen[0])
    later = int((gaps[1:] > 0).sum())  # later tokens that were not the target's strict argmax either
    return {"contender": name, "prompt": prompt, "position": j, "logit_gap": gap, "later_ties": later}
