"""Feature heads (harness.models.eagle, harness.core.drafters.FeatureDrafter) in the one loop.

The checkpoints are written here by hand in the layouts their authors publish (key names, config
fields, fp16 weights, pytorch_model.bin), not by our module, and loaded through the pair loader.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from conftest import make_model, make_tokenizer, tiny_cached_pair
from omegaconf import OmegaConf

from harness.core.drafters import FeatureDrafter
from harness.core.loop import autoregressive_decode, speculative_decode
from harness.core.sampling import Sampling
from harness.errors import HarnessError
from harness.exactness.acceptance import teacher_forced_agreement
from harness.models.eagle import eagle3_layers
from harness.runner.pair import draft_size, load_pair, loaded_pairs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors on one thread

H, HEADS, KV, FFN = 32, 4, 2, 64  # the tiny target's (tests/conftest.py make_model)


def _layer(prefix: str, attn_in: int, gen: torch.Generator, norms: tuple[str, ...]) -> dict[str, torch.Tensor]:
    def w(rows, cols, scale=0.3):
        return (scale * torch.randn(rows, cols, generator=gen)).half()

    D = H // HEADS
    state = {
        f"{prefix}self_attn.q_proj.weight": w(HEADS * D, attn_in),
        f"{prefix}self_attn.k_proj.weight": w(KV * D, attn_in),
        f"{prefix}self_attn.v_proj.weight": w(KV * D, attn_in),
        f"{prefix}self_attn.o_proj.weight": w(H, HEADS * D),
        f"{prefix}mlp.gate_proj.weight": w(FFN, H),
        f"{prefix}mlp.up_proj.weight": w(FFN, H),
        f"{prefix}mlp.down_proj.weight": w(H, FFN),
    }
    state.update({f"{prefix}{norm}.weight": torch.ones(H).half() for norm in norms})
    return state


def _config(vocab: int, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": FFN,
        "max_position_embeddings": 512,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": vocab,
        **extra,
    }


def write_eagle(folder: Path, vocab: int, seed: int = 0) -> Path:
    """An EAGLE-1 head as published: fc over [embedding; feature] with bias, layer 0 without input norm."""
    gen = torch.Generator().manual_seed(seed)
    state = {"fc.weight": (0.3 * torch.randn(H, 2 * H, generator=gen)).half(), "fc.bias": torch.zeros(H).half()}
    state |= _layer("layers.0.", H, gen, ("post_attention_layernorm",))
    state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(H // HEADS // 2)  # as older transformers saved it
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(_config(vocab)))
    return folder


def write_eagle3(folder: Path, vocab: int, draft_vocab: int, seed: int = 0) -> Path:
    """An EAGLE-3 head as published: fc over three features, midlayer, norm, lm_head on a draft vocabulary, d2t/t2d."""
    gen = torch.Generator().manual_seed(seed)
    used = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values  # the target tokens it drafts
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    state = {
        "fc.weight": (0.3 * torch.randn(H, 3 * H, generator=gen)).half(),
        "norm.weight": torch.ones(H).half(),
        "lm_head.weight": (3.0 * torch.randn(draft_vocab, H, generator=gen)).half(),
        "d2t": used - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    state |= _layer("midlayer.", 2 * H, gen, ("input_layernorm", "hidden_norm", "post_attention_layernorm"))
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "pytorch_model.bin")
    config = _config(vocab, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


LAYERS = 8  # the target's: EAGLE-3 reads the inputs of its layers 2, 4 and 5


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    tok = make_tokenizer()
    make_model(len(tok), seed=1, layers=LAYERS).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    vocab = len(tok)
    return {
        "target": root / "target",
        "eagle": write_eagle(root / "eagle", vocab),
        "eagle3": write_eagle3(root / "eagle3", vocab, vocab - 20),
    }


def head_pair(heads, kind: str, forward: str = "hf", folder: Path | None = None):
    loaded_pairs.clear()
    cfg = OmegaConf.create(
        {
            "name": f"tiny_{kind}",
            "target": {"id": str(heads["target"]), "dtype": "float32"},
            "draft": {"kind": kind, "id": str(folder or heads[kind]), "dtype": "float32"},
        }
    )
    return load_pair(cfg, torch.device("cpu"), forward=forward, linear="torch")


def prompts(pair, n: int = 4) -> list[torch.Tensor]:
    texts = ["The quick brown fox", "1 2 3 4 5 6", "Speculative decoding is", "abcabcabc"]
    return [pair.tokenizer(t, return_tensors="pt").input_ids[0] for t in texts[:n]]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_published_layout_loads_as_a_feature_drafter(heads, kind):
    pair = head_pair(heads, kind)
    assert isinstance(pair.drafter, FeatureDrafter)
    layers = pair.target.model.config.num_hidden_layers
    assert pair.drafter.reads_target == (eagle3_layers(layers) if kind == "eagle3" else (layers,))
    size = draft_size(pair)
    own = sum(
        v.numel() for k, v in torch.load(heads[kind] / "pytorch_model.bin").items() if k.endswith("weight") or k.endswith("bias")
    )
    assert size["draft_params"] == own  # the head's weights, not the target's embedding or LM head


@pytest.mark.parametrize("forward", ["hf", "lean"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_is_the_targets(heads, kind, k, forward):
    pair = head_pair(heads, kind, forward)
    for ids in prompts(pair):
        gen = torch.Generator().manual_seed(0)
        alone = list(autoregressive_decode(pair.target, ids, Sampling(0.0), 40, set(), gen))
        cycles = list(speculative_decode(pair.target, pair.drafter, ids, k, Sampling(0.0), 40, set(), gen))
        assert [t for c in cycles for t in c.tokens] == alone
        assert cycles[0].num_drafted == 0  # the target has not read the prompt before the first verify
        assert all(c.num_drafted == min(k, 40 - sum(len(x.tokens) for x in cycles[:i]) - 1) for i, c in enumerate(cycles) if i)


@pytest.mark.parametrize("forward", ["hf", "lean"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree", [(2, 1), (3, 2, 1), "dynamic"], ids=str)
def test_greedy_output_with_token_trees_is_the_targets(heads, kind, tree, forward):
    """EAGLE-1 and EAGLE-3 heads drafting trees (every node reads its parent's output), verified with the tree
    mask on HF's forward and the lean one: the target's greedy output (the tiny random heads rarely agree with
    the target: the tree mask's own test is tests/test_tree_attention.py), one host read per cycle."""
    from harness.base.host_reads import HostReads
    from harness.core.tree_shapes import TreeSpec, static_parents

    pair = head_pair(heads, kind, forward)
    pair.drafter.tree = TreeSpec(nodes=8, topk=3) if tree == "dynamic" else TreeSpec(tree)
    k = 3 if tree == "dynamic" else len(tree)
    for ids in prompts(pair):
        alone = list(autoregressive_decode(pair.target, ids, Sampling(0.0), 40, set(), None))
        with HostReads() as reads:
            cycles = list(speculative_decode(pair.target, pair.drafter, ids, k, Sampling(0.0), 40, set(), None))
        assert [t for c in cycles for t in c.tokens] == alone
        assert reads.total == len(cycles), reads.sites
        assert max(c.nodes for c in cycles) == (8 if tree == "dynamic" else len(static_parents(tree)))
    pair.drafter.tree = None


def test_lean_and_hf_hand_the_same_features(heads):
    pair = head_pair(heads, "eagle3", "hf")
    ids = prompts(pair)[0]
    layers = (*eagle3_layers(LAYERS), LAYERS)  # three layers' inputs and the final normed state
    pair.target.reset()
    hf_logits, hf_features = pair.target.forward_features(ids, 2, layers)
    lean = head_pair(heads, "eagle3", "lean")
    lean.target.reset()
    lean_logits, lean_features = lean.target.forward_features(ids, 2, layers)
    assert hf_features.shape == (ids.shape[0], 4 * H)
    torch.testing.assert_close(lean_features, hf_features, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lean_logits, hf_logits, rtol=1e-4, atol=1e-4)
    plain = lean.target.copy()
    plain.reset()
    torch.testing.assert_close(plain.forward(ids, 2), lean_logits)  # capturing changes nothing


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_reported_acceptance_is_the_heads_own(heads, kind):
    pair = head_pair(heads, kind)
    tested = 0
    for ids in prompts(pair):
        gen = torch.Generator().manual_seed(0)
        cycles = list(speculative_decode(pair.target, pair.drafter, ids, 4, Sampling(0.0), 40, set(), gen))
        agreement = teacher_forced_agreement(pair.drafter, ids, cycles, 4, 40, target=pair.target)
        assert agreement.ok, agreement.describe()
        tested += agreement.reported[1]
    assert tested > 20


class KeepsDrafts(FeatureDrafter):
    """Broken: its cache keeps the drafted pairs (built on its own outputs) in place of the target's."""

    def rollback(self, lengths) -> None:
        self.pairs = list(self.store.lengths)
        self.store.lengths = [min(n, length - 1) for n, length in zip(self.store.lengths, lengths)]


def test_no_capture_for_other_drafters(tiny_pair):
    """Model drafts and prompt lookup never ask the target for features."""
    from harness.core.drafters import NgramDrafter

    loaded_pairs.clear()
    cfg = OmegaConf.create(
        {
            "name": "t",
            "target": {"id": str(tiny_pair["target"]), "dtype": "float32"},
            "draft": {"kind": "model", "id": str(tiny_pair["draft"])},
        }
    )
    pair = load_pair(cfg, torch.device("cpu"), linear="torch")
    calls = []
    pair.target.backend.forward_features = lambda *a: calls.append(a)
    for drafter in (pair.drafter, NgramDrafter(pair.target.vocab_size)):
        list(
            speculative_decode(
                pair.target, drafter, prompts(pair)[0], 4, Sampling(1.0), 20, set(), torch.Generator().manual_seed(0)
            )
        )
    assert calls == []


def _corrupt(src: Path, dst: Path, edit) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    state = torch.load(src / "pytorch_model.bin")
    config = json.loads((src / "config.json").read_text())
    edit(state, config)
    torch.save(state, dst / "pytorch_model.bin")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "kind, edit, says",
    [
        ("eagle", lambda s, c: s.pop("fc.weight"), "missing fc.weight"),
        ("eagle", lambda s, c: c.update(vocab_size=c["vocab_size"] + 5), "vocabulary of"),
        ("eagle3", lambda s, c: s.update({"fc.weight": s["fc.weight"][:, :64]}), "its fc reads 64 features"),
        ("eagle", lambda s, c: None, "looks like an eagle head"),  # loaded as eagle3
        ("eagle3", lambda s, c: s.update(d2t=s["d2t"] + 1000), "d2t"),
        ("eagle", lambda s, c: c.update(num_hidden_layers=2), "2 decoder layers"),
    ],
)
def test_a_head_that_does_not_fit_is_one_line(heads, tmp_path, kind, edit, says):
    folder = _corrupt(heads[kind], tmp_path / "bad", edit)
    as_kind = "eagle3" if says.startswith("looks like") else kind
    with pytest.raises(HarnessError, match=says) as err:
        head_pair(heads, as_kind, folder=folder)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def trained(heads):
    """An EAGLE-3 head trained on the tiny target's own text by harness.distill.head (a few seconds)."""
    from types import SimpleNamespace

    from harness.distill.head import features, held_out, new_head, reads, train_head
    from harness.models.loading import ModelSpec, load_model

    torch.manual_seed(0)
    target = load_model(ModelSpec(str(heads["target"])), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(48):
        prompt = torch.randint(3, len(make_tokenizer()), (6,), generator=gen)
        with torch.no_grad():
            out = target.generate(prompt[None], do_sample=False, max_new_tokens=40, min_new_tokens=40, pad_token_id=0)
        seqs.append(out[0].tolist())
    with torch.no_grad():
        probs, ids, weights = [], [], []
        for seq in seqs:
            top = target(torch.tensor([seq])).logits[0, 1:-1].softmax(-1).topk(8, dim=-1)  # rows: positions 1..len-2
            probs.append(top.values.half())
            ids.append(top.indices.int())
            weights.append(torch.ones(len(seq) - 2))
    data = {"seqs": seqs, "starts": [1] * len(seqs), "probs": probs, "ids": ids, "weights": weights}
    layers = reads(target)
    feats = features(target, seqs, layers)
    head = new_head(target, torch.arange(target.config.vocab_size - 10))
    held = [torch.randint(3, len(make_tokenizer()), (6,), generator=gen).tolist() for _ in range(8)]
    evaluation = {"prompt_ids": held, "greedy": [], "categories": ["tiny"] * 8}
    for s in held:  # the target's greedy continuations of prompts it was not trained on
        with torch.no_grad():
            evaluation["greedy"].append(
                target.generate(torch.tensor([s[:6]]), do_sample=False, max_new_tokens=30, min_new_tokens=30, pad_token_id=0)[
                    0, 6:
                ].tolist()
            )
    before = held_out(head.eval(), target, evaluation, layers, 2)
    args = SimpleNamespace(
        lr=3e-3,
        weight_decay=0.0,
        batch_size=4,
        epochs=10,
        max_steps=0,
        warmup=5,
        min_lr_ratio=0.1,
        seed=0,
        clip=1.0,
        ttt_steps=2,
        log_every=1000,
    )
    head.train()
    training = train_head(head, data, feats, args)
    after = held_out(head.eval(), target, evaluation, layers, 2)
    folder = heads["target"].parent / "trained"
    from harness.distill.head import save_head

    save_head(head.requires_grad_(False), folder, {"test": True})
    return {"folder": folder, "before": before, "after": after, "training": training}


def test_unrolled_training_steps_of_a_padded_batch_equal_each_sequence_alone(heads):
    """Training batches right-padded sequences: each row's outputs at every drafting step are those of its sequence
    run alone (padding never reaches a real pair)."""
    from harness.distill.head import new_head, reads, unrolled
    from harness.models.loading import ModelSpec, load_model

    target = load_model(ModelSpec(str(heads["target"])), torch.device("cpu"))
    torch.manual_seed(0)
    head = new_head(target, torch.arange(target.config.vocab_size - 10)).float()
    with torch.no_grad():
        for p in head.parameters():  # away from the initialisation's zeros and identities
            p.add_(0.05 * torch.randn_like(p))
    width = len(reads(target)) * target.config.hidden_size
    lengths = (11, 7, 15)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    feats = torch.zeros(len(lengths), max(lengths), width)
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.randint(3, target.config.vocab_size, (n,), generator=gen)
        feats[row, :n] = torch.randn(n, width, generator=gen)
    with torch.no_grad():
        together = unrolled(head, tokens, feats, 3)
        for row, n in enumerate(lengths):
            alone = unrolled(head, tokens[row, :n], feats[row, :n], 3)
            for s, (a, b) in enumerate(zip(alone, together)):
                torch.testing.assert_close(b[row, :n][s:], a[s:], atol=1e-5, rtol=1e-5)


def test_training_raises_held_out_agreement(trained):
    assert trained["training"]["steps"] == 10 * 12  # every epoch over all 48 sequences, 4 a step
    before, after = trained["before"]["t0_agreement_by_step"], trained["after"]["t0_agreement_by_step"]
    assert after[0] > before[0] + 0.2 and after[1] > before[1] + 0.05, (before, after)


def test_a_trained_head_saved_in_the_eagle3_layout_loads_and_stays_exact(heads, trained):
    pair = head_pair(heads, "eagle3", folder=trained["folder"])
    accepted = tested = 0
    for ids in prompts(pair):
        gen = torch.Generator().manual_seed(0)
        alone = list(autoregressive_decode(pair.target, ids, Sampling(0.0), 40, set(), gen))
        cycles = list(speculative_decode(pair.target, pair.drafter, ids, 4, Sampling(0.0), 40, set(), gen))
        assert [t for c in cycles for t in c.tokens] == alone
        agreement = teacher_forced_agreement(pair.drafter, ids, cycles, 4, 40, target=pair.target)
        assert agreement.ok, agreement.describe()
        accepted, tested = accepted + agreement.reported[0], tested + agreement.reported[1]
    assert accepted / tested > 0.2, (accepted, tested)  # a head that drafts what the target says


def test_teacher_forced_check_catches_a_trained_head_that_keeps_its_drafts(heads, trained):
    pair = head_pair(heads, "eagle3", folder=trained["folder"])
    broken = KeepsDrafts(pair.drafter.head)
    bad = []
    for ids in prompts(pair):
        gen = torch.Generator().manual_seed(0)
        alone = list(autoregressive_decode(pair.target, ids, Sampling(0.0), 40, set(), gen))
        cycles = list(speculative_decode(pair.target, broken, ids, 4, Sampling(0.0), 40, set(), gen))
        assert [t for c in cycles for t in c.tokens] == alone  # the output cannot see it
        bad.append(not teacher_forced_agreement(broken, ids, cycles, 4, 40, target=pair.target).ok)
    assert any(bad)


@pytest.mark.parametrize(
    "variant",
    [
        None,
        "resample_from_p",
        pytest.param("no_rollback", marks=pytest.mark.slow),
        pytest.param("accept_all", marks=pytest.mark.slow),
    ],
)
def test_exactness_check_with_a_head_passes_the_loop_and_rejects_broken_variants(heads, trained, variant):
    """The output-law check at T=1 with the trained head as the draft: the real loop passes, broken ones fail."""
    from broken import BROKEN, plugged
    from conftest import FAMILY_ALPHA, tiny_check

    pair = head_pair(heads, "eagle3", folder=trained["folder"])
    prompt = prompts(pair)[0]
    broken = next((v for v in BROKEN if v.name == variant), None)
    plug = plugged(broken, pair.target, pair.drafter) if broken else contextlib.nullcontext((pair.target, pair.drafter, None))
    with plug as (t, d, rule):
        report = tiny_check(t, d, prompt, law_target=pair.target, rule=rule)
    assert report["testable"]
    assert (report["family_p"] >= FAMILY_ALPHA) == (variant is None), report["family_p"]


def test_the_bench_limit_times_a_heads_steps(heads):
    """The bench's limit part prices a head as a draft model: one timed head step per drafted token
    (the catch-up pairs ride on the first), verify passes timed with their feature capture, and the
    same tokens as the target alone."""
    from harness.bench.parts import limit

    pair = head_pair(heads, "eagle3", forward="lean")
    lim = limit(pair, prompts(pair, 2), k=2, n=8, device=torch.device("cpu"), reps=1)
    assert lim["decode_cycles"] > 0 and lim["in_loop"]["draft_forwards_per_drafted_token"] == 1.0
    assert 0 < lim["in_loop"]["cost_ratio"] < 10 and 0 <= lim["overhead_fraction"] < 1
    assert lim["in_loop"]["verify_cost_by_positions"]  # the loop's own verify passes, by positions fed
    assert lim["spec_decode_tokens"] == lim["base_decode_tokens"]


@pytest.mark.parametrize("forward", ["hf", "lean"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batch_of_rows_drafts_as_each_row_alone(heads, kind, forward, temperature):
    """batch_size=4: every row's tokens and acceptance are its own run's at batch size 1 (each row a
    head of its own, handed its row's features of the batched verify pass)."""
    from harness.core.loop import speculative_decode_rows

    pair = head_pair(heads, kind, forward)
    rows = prompts(pair)
    sampling = Sampling(temperature)
    alone = []
    for i, ids in enumerate(rows):
        cycles = list(
            speculative_decode(pair.target, pair.drafter, ids, 3, sampling, 30, set(), torch.Generator().manual_seed(i))
        )
        alone.append(([t for c in cycles for t in c.tokens], [c.num_accepted for c in cycles]))
    together = [([], []) for _ in rows]
    generators = [torch.Generator().manual_seed(i) for i in range(len(rows))]
    for step in speculative_decode_rows(pair.target, pair.drafter, rows, 3, sampling, 30, set(), generators):
        for row, c in step:
            together[row][0].extend(c.tokens)
            together[row][1].append(c.num_accepted)
    assert together == alone


# A head whose files cannot be read (what an interrupted download leaves) is one line naming the file and the fix.
DAMAGED_HEAD = {
    "model.safetensors": r"is not a readable safetensors file \(incomplete metadata",
    "pytorch_model.bin": r"is not a readable PyTorch checkpoint \(a zip archive cut short",
    "config.json": r"is not valid JSON",
}


def _damaged_head(heads, folder: Path, file: str) -> tuple[Path, str]:
    """A copy of a tiny head with `file` cut to its first half, and its layout: the EAGLE-1 head for
    pytorch_model.bin, else the EAGLE-3 head with its weights in model.safetensors."""
    import shutil

    from safetensors.torch import save_file

    kind = "eagle" if file == "pytorch_model.bin" else "eagle3"
    shutil.copytree(heads[kind], folder)
    if kind == "eagle3":
        state = torch.load(folder / "pytorch_model.bin")
        (folder / "pytorch_model.bin").unlink()
        save_file({key: value.contiguous() for key, value in state.items()}, folder / "model.safetensors")
    data = (folder / file).read_bytes()
    (folder / file).write_bytes(data[: len(data) // 2])
    return folder, kind


@pytest.mark.parametrize("file", DAMAGED_HEAD)
def test_a_head_that_cannot_be_read_is_one_line_naming_the_file_and_the_fix(heads, tmp_path, file):
    from harness.models.eagle import load_head
    from harness.models.loading import ModelSpec, load_model

    target = load_model(ModelSpec(str(heads["target"])), torch.device("cpu"))
    folder, kind = _damaged_head(heads, tmp_path / "head", file)
    fix = f"download or save the head into {folder} again .*, or point pair.draft.id at a complete head folder$"
    says = f"^feature head '{folder}' cannot be read: {folder}/{file} {DAMAGED_HEAD[file]}.*: {fix}"
    with pytest.raises(HarnessError, match=says) as err:
        load_head(str(folder), kind, target, torch.float32)
    assert "\n" not in str(err.value)


def test_a_damaged_head_in_the_hf_cache_says_to_download_it_again(heads, tmp_path, monkeypatch):
    """A hub id whose head the HF cache holds (snapshots/<commit>/) with its weights cut short."""
    from huggingface_hub import constants

    from harness.models.eagle import load_head
    from harness.models.loading import ModelSpec, load_model

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-head"
    _damaged_head(heads, repo / "snapshots" / commit, "model.safetensors")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    target = load_model(ModelSpec(str(heads["target"])), torch.device("cpu"))
    with pytest.raises(
        HarnessError,
        match=f"^feature head 'tiny-org/tiny-head' cannot be read: {repo}/snapshots/{commit}/model.safetensors .*: "
        r"delete that cache entry \(hf cache rm model/tiny-org/tiny-head\) and download it again \(hf download tiny-org/tiny-head\)",
    ):
        load_head("tiny-org/tiny-head", "eagle3", target, torch.float32)


@pytest.mark.cli
def test_the_cli_says_which_file_of_the_head_cannot_be_read(heads, tmp_path):
    from test_cli import harness

    folder, _ = _damaged_head(heads, tmp_path / "head", "model.safetensors")
    out = harness(
        "+pair=smollm2_eagle", f"pair.target.id={heads['target']}", f"pair.draft.id={folder}", f"out_dir={tmp_path / 'out'}"
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    said = [line for line in out.stderr.splitlines() if not line.startswith("[harness] ")]  # less the progress lines
    assert said == [
        f"error: feature head '{folder}' cannot be read: {folder}/model.safetensors is not a readable safetensors file "
        f"(incomplete metadata, file not fully covered): download or save the head into {folder} again "
        f"(an interrupted download leaves files cut short or missing), or point pair.draft.id at a complete head folder"
    ], out.stderr[-2000:]


@pytest.mark.parametrize("kind", ["model", "lookup", "eagle3"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_host_read_per_cycle_for_every_drafter_at_any_batch_size(heads, tiny_pair, kind, rows, temperature):
    """Every drafter kind, one row or eight: the host reads one tensor per cycle for the whole batch
    (the accepted counts and committed tokens); prompt lookup, which searches the committed tokens on
    the host, also reads the prompts once, all rows in one transfer."""
    from harness.base.host_reads import HostReads
    from harness.core.drafters import ModelDrafter, NgramDrafter
    from harness.core.loop import speculative_decode_rows

    if kind == "model":
        target, drafter, prompt = tiny_cached_pair(tiny_pair, "lean")
        batch = [prompt[: 3 + i % 4] for i in range(rows)]
        assert isinstance(drafter, ModelDrafter)
    else:
        pair = head_pair(heads, kind if kind != "lookup" else "eagle3", "lean")
        target, drafter = pair.target, pair.drafter
        if kind == "lookup":
            drafter = NgramDrafter(target.vocab_size)
        batch = [prompts(pair)[i % 4] for i in range(rows)]
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    with HostReads() as reads:
        steps = list(speculative_decode_rows(target, drafter, batch, 3, Sampling(temperature), 24, set(), generators))
    drafted = sum(c.num_drafted for step in steps for _, c in step)
    assert drafted > len(steps)  # a read per drafted token would show
    start = 1 if kind == "lookup" else 0
    assert reads.total == len(steps) + start, reads.sites
