"""compile=true on the lean forward and the feature heads: captured steps give the eager tokens at every
batch size, compile nothing after warm-up, and refuse a shape they were not warmed up for."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokenizer
from omegaconf import OmegaConf
from test_eagle import write_eagle3

from harness.core.loop import autoregressive_decode_rows, speculative_decode_rows
from harness.core.sampling import Sampling
from harness.errors import HarnessError
from harness.models.captured import compiles
from harness.models.lean import LeanLlama
from harness.runner.pair import load_pair, loaded_pairs

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = Sampling(0.0)
TEXTS = ["The quick brown fox", "1 2 3 4 5 6 1 2 3", "Speculative decoding is", "abcabcabc abc"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("captured")
    tok = make_tokenizer()
    for name, seed in (("target", 1), ("draft", 2)):
        make_model(len(tok), seed=seed, layers=4, scale=3.0).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return {"target": root / "target", "draft": root / "draft", "eagle3": write_eagle3(root / "eagle3", len(tok), len(tok) - 20)}


def pair_of(folders, kind: str, compile: bool, forward: str = "lean", cache: str = "dynamic"):
    loaded_pairs.clear()
    folder = {"model": folders["draft"], "eagle3": folders["eagle3"]}.get(kind)
    draft = {"kind": kind, "dtype": "float32"} | ({"id": str(folder)} if folder else {})
    cfg = OmegaConf.create({"name": f"tiny_{kind}", "target": {"id": str(folders["target"]), "dtype": "float32"}, "draft": draft})
    return load_pair(cfg, torch.device("cpu"), cache=cache, compile=compile, forward=forward, linear="torch")


def decode(pair, prompts, k, rows, max_new=12):
    """(speculative tokens per prompt, baseline tokens per prompt) with the pair sized and warmed for `rows`."""
    pair.reserve(max(p.shape[0] for p in prompts), max_new, k, rows)
    pair.warm_up(k, rows)
    before = compiles()
    spec, base = [[] for _ in prompts], [[] for _ in prompts]
    for at in range(0, len(prompts), rows):
        batch = prompts[at : at + rows]
        for cycle in speculative_decode_rows(pair.target, pair.drafter, batch, k, GREEDY, max_new, set(), [None] * len(batch)):
            for row, c in cycle:
                spec[at + row] += c.tokens
        for step in autoregressive_decode_rows(pair.target, batch, GREEDY, max_new, set(), [None] * len(batch)):
            for row, token in step:
                base[at + row].append(token)
    return spec, base, compiles() - before


@pytest.mark.parametrize("kind", ["model", "eagle3", "ngram"])
@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_steps_give_the_eager_tokens_and_compile_nothing_after_warm_up(folders, kind, rows):
    """Greedy tokens of the compiled pair equal the eager pair's, at one row and at three rows of
    storage fed four prompts (a last batch of one runs padded among three), and nothing compiles after warm-up."""
    eager = pair_of(folders, kind, compile=False)
    prompts = [eager.tokenizer(t, return_tensors="pt").input_ids[0] for t in TEXTS]
    want_spec, want_base, _ = decode(eager, prompts, 2, rows)
    compiled = pair_of(folders, kind, compile=True)
    assert compiled.target.lean.captured is not None
    spec, base, recompiles = decode(compiled, prompts, 2, rows)
    assert base == want_base
    assert spec == want_spec
    assert spec == base  # and greedy speculation is the target alone
    assert recompiles == 0


def test_a_shape_not_warmed_up_is_an_error_that_names_it():
    model = make_model(98, seed=0, layers=2)
    lean = LeanLlama(model)
    lean.reserve(64)
    lean.compile()
    lean.warm_up([1])
    lean.forward(torch.arange(5)[None], [0], [1])  # a prompt: eager
    lean.forward(torch.tensor([[7]]), [5], [1])  # a warmed shape
    with pytest.raises(HarnessError, match=r"met a step of shape \(1, 2, 256, \(\)\) after warm-up"):
        lean.forward(torch.tensor([[7, 8]]), [6], [2])


def test_captured_steps_read_only_their_rows_positions():
    """A captured step attends over the whole capacity: stale keys past a row's length (a rolled-back
    draft) and other rows' keys must not change its logits."""
    model = make_model(98, seed=0, layers=2).double()
    eager, compiled = LeanLlama(model, rows=2), LeanLlama(model, rows=2)
    compiled.compile()
    for lean in (eager, compiled):
        lean.reserve(64)
    compiled.warm_up([2])
    prompts = torch.randint(0, 98, (2, 9), generator=torch.Generator().manual_seed(0))
    for lean in (eager, compiled):
        lean.forward(prompts, [0, 0], [1, 1])
        lean.forward(prompts[:, :2], [9, 9], [2, 2])  # drafts, then rolled back to 9 and 7 by the next starts
    want = eager.forward(prompts[:, 3:5], [9, 7], [2, 2])
    got = compiled.forward(prompts[:, 3:5], [9, 7], [2, 2])
    torch.testing.assert_close(got, want)


def test_a_feature_head_on_hfs_compiled_forward_reads_its_features_from_the_forward(folders):
    """HF's forward returns the hidden states a head reads (output_hidden_states, no hooks), compiled with
    a static cache as well as eager: the same greedy tokens, nothing compiled after warm-up."""
    eager = pair_of(folders, "eagle3", compile=False, forward="hf")
    prompts = [eager.tokenizer(t, return_tensors="pt").input_ids[0] for t in TEXTS[:2]]
    want_spec, want_base, _ = decode(eager, prompts, 2, 1)
    compiled = pair_of(folders, "eagle3", compile=True, forward="hf", cache="static")
    assert compiled.target.compiled is not None and compiled.target.lean is None
    spec, base, recompiles = decode(compiled, prompts, 2, 1)
    assert (spec, base, recompiles) == (want_spec, want_base, 0)


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_compiled_steps_read_the_host_once_per_cycle(folders, kind):
    """Compiled (four rows, one finishing early), the host reads one tensor per cycle for the whole batch,
    as eager: the captured steps take their positions from the host's ints, never from a device read."""
    from harness.base.host_reads import HostReads

    pair = pair_of(folders, kind, compile=True)
    prompts = [pair.tokenizer(t, return_tensors="pt").input_ids[0] for t in TEXTS]
    pair.reserve(max(p.shape[0] for p in prompts), 16, 3, 4)
    pair.warm_up(3, 4)
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    with HostReads() as reads:
        steps = list(speculative_decode_rows(pair.target, pair.drafter, prompts, 3, Sampling(1.0), 16, set(), generators))
    assert sum(c.num_drafted for step in steps for _, c in step) > len(steps)
    assert reads.total == len(steps), reads.sites


def test_compiled_storage_has_room_for_a_steps_padding():
    """A captured step cannot grow the storage (a new shape): reserved for L positions, a compiled
    forward keeps room for a step's padding past L, rounding up to the next ROOM only when L is near it."""
    model = make_model(98, seed=0, layers=2)
    for length, capacity in ((200, 256), (250, 512)):
        lean = LeanLlama(model, rows=2)
        lean.compile()
        lean.reserve(length)
        assert lean.capacity == capacity
    eager = LeanLlama(model, rows=2)
    eager.reserve(250)
    assert eager.capacity == 256


def test_a_machine_that_cannot_compile_says_so_in_one_line():
    """torch.compile needs a C++ compiler on a CPU (Triton on a GPU): without one, the first compiled
    step is a HarnessError naming the step and the way out, not inductor's traceback."""
    import torch._inductor.exc

    lean = LeanLlama(make_model(98, seed=0, layers=2))
    lean.reserve(64)
    lean.compile()

    def no_compiler(*args):
        raise torch._inductor.exc.InvalidCxxCompiler()

    lean.captured.fn = no_compiler
    with pytest.raises(HarnessError, match=r"could not compile the lean forward of LlamaForCausalLM \(No working C\+\+ compiler"):
        lean.warm_up([1])
    assert lean.captured.inputs == {}  # nothing left half-made: a later call tries again


def test_gpu_clocks_are_read_from_nvidia_smi(tmp_path, monkeypatch):
    """On CUDA a cell records the GPU's clocks from nvidia-smi at its start and end; fields the GPU does
    not report are null, a CPU or a failing nvidia-smi gives None (checked with a stand-in nvidia-smi)."""
    from harness.base.device import gpu_clocks

    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho "1755, 2619, 1980, 41, [N/A]"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert gpu_clocks(torch.device("cpu")) is None
    clocks = gpu_clocks(torch.device("cuda", 1))
    assert clocks == {
        "clocks.sm": 1755.0,
        "clocks.mem": 2619.0,
        "clocks.max.sm": 1980.0,
        "temperature.gpu": 41.0,
        "power.draw": None,
    }
    assert (tmp_path / "args").read_text().split()[-2:] == ["-i", "1"]
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert gpu_clocks(torch.device("cuda", 0)) is None
