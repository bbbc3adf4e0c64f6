"""harness.distill.one_pass: sampling, the teacher's top-k and the features in one pass, against the two-pass data
(HF generate, then teacher-forced forwards) on a tiny Llama, with rows of different lengths finishing at
different steps."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from harness.distill.data import teacher_topk
from harness.distill.head import features
from harness.distill.one_pass import sample_all

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, LAYERS, TOPK, MAX_NEW = 96, 4, 8, 12
READS = (1, 2, 3)


@pytest.fixture(scope="module")
def model():
    return make_model(VOCAB, seed=3, layers=LAYERS, scale=4.0).eval()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 7, 12, 6)]


def greedy(model, prompt, eos):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    return out[0].tolist()


def test_greedy_one_pass_data_equal_the_two_pass_data(model, prompts):
    # An EOS that one row reaches early: rows then leave the batch at different steps.
    eos = greedy(model, prompts[0], eos=None)[len(prompts[0]) + 3]
    rows = sample_all(model, prompts, 1, 0.0, MAX_NEW, batch_size=4, seed=0, topk=TOPK, layers=READS, eos=eos, log_every=0)
    seqs = [r["seq"] for r in rows]
    assert seqs == [greedy(model, p, eos) for p in prompts]
    lengths = {len(s) - len(p) for s, p in zip(seqs, prompts)}
    assert len(lengths) > 1, lengths  # the test covers rows finishing at different steps
    probs, ids = teacher_topk(model, seqs, [1] * len(seqs), TOPK, 8, 0)
    feats = features(model, seqs, READS)
    for row, p, i, f, seq in zip(rows, probs, ids, feats, seqs):
        assert row["probs"].shape == p.shape == (len(seq) - 2, TOPK)
        assert torch.equal(row["ids"][:, 0], i[:, 0])
        torch.testing.assert_close(row["probs"].float(), p.float(), atol=2e-3, rtol=0)
        assert row["feats"].shape == f.shape == (len(seq) - 1, len(READS) * model.config.hidden_size)
        torch.testing.assert_close(row["feats"].float(), f.float(), atol=1e-2, rtol=1e-2)


def test_sampled_data_depend_on_the_seed_only(model, prompts):
    def run(seed, batch_size):
        rows = sample_all(model, prompts, 1, 1.0, MAX_NEW, batch_size, seed, TOPK, READS, eos=2, log_every=0)
        return [r["seq"] for r in rows]

    first = run(0, 2)
    assert run(0, 2) == first
    assert run(1, 2) != first
    assert all(s[: len(p)] == p for s, p in zip(first, prompts))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cuda"], "add --one-pass"),
        (["--prompt-seeds", "0", "1"], "add --one-pass"),
        (["--one-pass"], "use it with --kind eagle3"),
    ],
)
def test_one_pass_options_are_refused_where_they_do_not_apply(tmp_path, argv, message):
    from harness.distill.main import main

    with pytest.raises(SystemExit, match=message):
        main(["--out", str(tmp_path / "out"), *argv])


def test_training_prompts_sharing_ten_words_with_an_evaluation_prompt_are_left_out(capsys):
    from harness.distill.data import drop_overlapping

    evaluation = [{"prompt": "Summarize the following product review in two sentences: I bought this kettle"}]
    train = [
        ("summarization", "Summarize the following product review in two sentences: I bought these headphones"),
        ("summarization", "Summarize the following product review in one paragraph: I bought these headphones"),
    ]
    assert drop_overlapping(train, evaluation) == train[1:]
    assert "1 training prompts share 10 words" in capsys.readouterr().out
