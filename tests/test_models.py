"""Loading models: one clear line for what cannot be loaded, and caches that survive concurrent first runs."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import make_model, make_tokenizer, tiny_config

import harness.models.embedded as embedded
import harness.models.loading as models
from harness.errors import HarnessError
from harness.models.cached import CachedLM
from harness.models.loading import PLAIN, ModelSpec, load_model, load_tokenizer
from harness.models.shared_draft import build_shared_draft

CPU = torch.device("cpu")


def test_a_shared_draft_loads_in_its_target_dtype_only(saved_models):
    target = load_model(ModelSpec(str(saved_models / "target")), CPU)
    draft = load_model(ModelSpec(str(saved_models / "shared_draft")), CPU, "draft", target=target)
    assert draft.get_input_embeddings() is target.get_input_embeddings()
    with pytest.raises(HarnessError, match="runs in the target's dtype \\(float32\\): drop pair.draft.dtype"):
        load_model(ModelSpec(str(saved_models / "shared_draft"), dtype="bfloat16"), CPU, "draft", target=target)
    assert target.get_input_embeddings().weight.dtype == torch.float32  # the target is untouched


def test_a_shared_draft_refuses_a_target_it_was_not_made_for(saved_models):
    other = load_model(ModelSpec(str(saved_models / "other_target")), CPU)
    with pytest.raises(HarnessError, match="this target differs \\(vocab_size 98 vs 13"):
        load_model(ModelSpec(str(saved_models / "shared_draft")), CPU, "draft", target=other)


def test_a_shared_draft_refuses_a_target_of_the_same_shapes_with_other_weights_or_settings(saved_models):
    """Same shapes, other weights (a base model for its instruct one), or another norm epsilon or rope:
    the draft's layers would run on arithmetic they were not trained for. The same target in bfloat16 loads."""
    target = load_model(ModelSpec(str(saved_models / "target")), CPU)
    twin = make_model(98, seed=7)
    with pytest.raises(HarnessError, match="this target differs \\(the embedding table's values"):
        load_model(ModelSpec(str(saved_models / "shared_draft")), CPU, "draft", target=twin)
    twin.load_state_dict(target.state_dict())
    twin.config.rms_norm_eps = 0.1
    with pytest.raises(HarnessError, match="this target differs \\(rms_norm_eps 1e-06 vs 0.1"):
        load_model(ModelSpec(str(saved_models / "shared_draft")), CPU, "draft", target=twin)
    twin.config.rms_norm_eps = 9.999999974752427e-07  # 1e-6 as a GGUF file's float32 holds it: the same arithmetic
    assert load_model(ModelSpec(str(saved_models / "shared_draft")), CPU, "draft", target=twin) is not None
    with torch.no_grad():
        twin.lm_head.weight.mul_(2)  # an untied target whose head is another one's
    with pytest.raises(HarnessError, match="this target's LM head differs"):
        load_model(ModelSpec(str(saved_models / "shared_draft")), CPU, "draft", target=twin)
    bf16 = load_model(ModelSpec(str(saved_models / "target"), dtype="bfloat16"), CPU)
    assert load_model(ModelSpec(str(saved_models / "shared_draft"), dtype="bfloat16"), CPU, "draft", target=bf16) is not None


def test_a_shared_draft_of_a_target_with_layer_types_keeps_its_layers_types():
    """Qwen2-style configs list one attention type per layer: the draft takes those of the layers it copies."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = tiny_config(Qwen2Config, 98, layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    target = Qwen2ForCausalLM(config).eval()
    draft = build_shared_draft(target, 2, torch.arange(98), init_layers=[0, 3])
    assert draft.config.layer_types == [target.config.layer_types[0], target.config.layer_types[3]]


def test_what_cannot_be_loaded_says_why(saved_models):
    with pytest.raises(HarnessError, match="could not be loaded: Error no file named model.safetensors") as err:
        load_model(ModelSpec(str(saved_models / "no_weights")), CPU)
    assert "HF cache" not in str(err.value)  # it is a local folder: not an offline hub miss
    with pytest.raises(HarnessError, match="draft model .* has no tokenizer .*tokenizer.save_pretrained"):
        load_tokenizer(ModelSpec(str(saved_models / "no_tokenizer")), "draft")


def test_a_hub_id_neither_cached_nor_reachable_is_one_line_from_the_cache_alone(monkeypatch, tmp_path):
    """Online as far as huggingface_hub knows, but the hub does not answer: the load asks the cache alone
    (no request, no retries) and says how to get the model."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "hub_reachable", lambda: False)
    for load in (lambda spec: load_model(spec, CPU, "draft"), lambda spec: load_tokenizer(spec, "draft")):
        with pytest.raises(
            HarnessError,
            match=r"^draft model 'tiny-org/absent' is neither in the HF cache .* nor reachable on the hub: "
            r"download it where the hub is reachable \(hf download tiny-org/absent\)",
        ):
            load(ModelSpec("tiny-org/absent"))


@pytest.fixture
def hub(monkeypatch):
    """huggingface_hub online, its endpoint a local server that answers any HEAD with 404 (and counts
    the requests), a metadata timeout of 1 s, no proxies; its HTTP client made anew for the test."""
    import http.server
    import threading

    from huggingface_hub import close_session, constants

    requests = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            requests.append(self.path)
            self.send_response(404)  # an answer of any status: the hub is there
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    close_session()  # its client reads the proxy variables when made
    models.hub_reachable.cache_clear()
    yield SimpleNamespace(requests=requests, endpoint=constants.ENDPOINT)
    server.shutdown()
    server.server_close()
    close_session()
    models.hub_reachable.cache_clear()


def test_the_hub_probe_asks_huggingface_hub_once(hub, monkeypatch):
    """One request to huggingface_hub's endpoint per process; none in its offline mode (HF_HUB_OFFLINE
    or TRANSFORMERS_OFFLINE as it reads them at import, here set on its constants)."""
    from huggingface_hub import constants

    assert models.hub_reachable() and models.hub_reachable() and hub.requests == ["/"]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    models.hub_reachable.cache_clear()
    assert not models.hub_reachable() and hub.requests == ["/"]


@pytest.mark.parametrize(
    "offline, reachable", [({}, True), ({"HF_HUB_OFFLINE": "ON"}, False), ({"TRANSFORMERS_OFFLINE": "1"}, False)]
)
def test_the_hub_probe_follows_huggingface_hubs_environment(hub, offline, reachable):
    """HF_ENDPOINT, HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE as a new process's huggingface_hub reads them."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub.endpoint, **offline)
    out = subprocess.run(
        [sys.executable, "-c", "from harness.models.loading import hub_reachable; print(hub_reachable())"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        env=env,
        timeout=120,
    )
    assert out.stdout.strip() == str(reachable), out.stderr[-2000:]
    assert hub.requests == (["/"] if reachable else [])


def test_an_unreachable_hub_is_told_within_huggingface_hubs_timeout(hub, monkeypatch):
    """Nothing listening, a server that never answers (within HF_HUB_ETAG_TIMEOUT, here 1 s), a proxy that
    is down: unreachable after one attempt each, not after huggingface_hub's retries."""
    import time

    from huggingface_hub import close_session, constants

    mute = socket.create_server(("127.0.0.1", 0))  # accepts connections (its backlog), never answers
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    try:
        for endpoint in (f"http://127.0.0.1:{closed_port}", f"http://127.0.0.1:{mute.getsockname()[1]}"):
            monkeypatch.setattr(constants, "ENDPOINT", endpoint)
            models.hub_reachable.cache_clear()
            start = time.monotonic()
            assert not models.hub_reachable(), endpoint
            assert time.monotonic() - start < 5, endpoint
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)  # the hub is up, behind a proxy that is down
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port}")
        close_session()
        models.hub_reachable.cache_clear()
        assert not models.hub_reachable() and hub.requests == []
    finally:
        mute.close()


def test_models_load_as_their_own_modules_whatever_transformers_defaults_to(saved_models, monkeypatch, tmp_path):
    """transformers 5.25 swaps layers for hub kernels unless told not to (it needs the `kernels` package
    and the hub): the pair's models and the embedded model's dequantisation both say use_kernels=False."""
    real, calls = models.AutoModelForCausalLM.from_pretrained, []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", spy)
    load_model(ModelSpec(str(saved_models / "target")), CPU)
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: make_tokenizer())
    monkeypatch.setattr(
        "transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: calls.append(k) or make_model(98, seed=1)
    )
    embedded.embedded_model_dir("smollm2")
    assert PLAIN == {"use_kernels": False}
    assert [call.get("use_kernels") for call in calls] == [False, False]


def test_concurrent_first_runs_share_the_embedded_cache(monkeypatch, tmp_path):
    """Two runs dequantising the embedded model at once: the one finishing second finds the
    first one's folder in place, keeps it, and leaves no temporary folder behind."""
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    tok, model = make_tokenizer(), make_model(98, seed=1)
    out = tmp_path / embedded.EMBEDDED["smollm2"]
    save = model.save_pretrained

    def save_while_another_run_finishes(path, **kwargs):
        save(path, **kwargs)
        if not out.exists():  # the other run renames its copy in first
            save(out, **kwargs)
            tok.save_pretrained(out)

    model.save_pretrained = save_while_another_run_finishes
    monkeypatch.setattr(embedded, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: tok)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: model)
    assert embedded.embedded_model_dir("smollm2") == out
    assert (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_the_embedded_cache_is_readable_by_other_users(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    tok, model = make_tokenizer(), make_model(98, seed=1)
    monkeypatch.setattr(embedded, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: tok)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: model)
    old = os.umask(0o022)
    try:
        out = embedded.embedded_model_dir("smollm2")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755  # not tempfile's private 0o700
    files = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert files["model.safetensors"] == 0o644 and set(files.values()) == {0o644}, files  # transformers writes weights 0600


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+pair=smollm2", "~pair.draft"], "every run needs pair.draft"),
        (["+pair=smollm2", "pair.draft.kind=foo"], "pair.draft.kind=foo must be model"),
        (["+pair=smollm2", "pair.draft.id=null"], "pair.draft.id=None must be an HF id or a local directory"),
        (["+pair=smollm2", "pair.target.id=null"], "pair.target.id=None must be an HF id or a local directory"),
        (["+pair=smollm2_ngram", "pair.draft.min_ngram=0"], "1 <= min_ngram <= max_ngram"),
        (["+pair=smollm2_ngram", "pair.draft.max_ngram=0"], "1 <= min_ngram <= max_ngram"),
        (["+pair=smollm2_ngram", "pair.draft.min_ngram=3", "pair.draft.max_ngram=2"], "1 <= min_ngram <= max_ngram"),
        (["+pair=smollm2_ngram", "pair.draft.length=longest"], "pair.draft.length=longest must be match"),
    ],
)
def test_a_pair_that_cannot_run_is_one_line_before_loading(overrides, message):
    from hydra import compose, initialize_config_dir

    from harness.config.checks import CONF_DIR, check_command_line, validate, with_default_pair

    with pytest.raises(HarnessError, match=message):  # refused while composing, or by the checks after it
        check_command_line(overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            validate(with_default_pair(compose(config_name="config", overrides=overrides)))


def test_pair_settings_without_a_chosen_pair_are_one_line(capsys):
    from harness.config.checks import check_choices

    with pytest.raises(SystemExit) as exit:
        check_choices(["pair.target.id=/models/llama-2-7b", "k=2"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: pair.target.id=/models/llama-2-7b sets the pair, so choose the pair first: "
        "add +pair=NAME (the default is +pair=smollm2_eagle)"
    )
    check_choices(["+pair=smollm2", "pair.target.id=/models/llama-2-7b"])  # with the pair chosen: fine


def test_a_pair_can_give_its_target_the_chat_template_its_tokenizer_lacks(tiny_pair):
    """Vicuna v1.3's tokenizer has no chat template; the pair config gives the v1.1 format it was
    tuned on (and Spec-Bench prompts it with), so prompts.template=auto does not fall back to raw text."""
    from hydra import compose, initialize_config_dir

    from harness.config.checks import CONF_DIR
    from harness.data.prompts import encode
    from harness.runner.pair import load_pair, loaded_pairs

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["+pair=vicuna_7b_68m", f"pair.target.id={tiny_pair['target']}", f"pair.draft.id={tiny_pair['draft']}"],
        )
    pair = load_pair(cfg.pair, torch.device("cpu"), linear="torch")
    from tokenizers.processors import TemplateProcessing

    bos = pair.tokenizer.bos_token_id  # a tokenizer that adds BOS to raw text, as Llama's does
    pair.tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    ids = encode(pair.tokenizer, "Name a prime.", "auto")
    assert ids[0] == bos and ids.count(bos) == 1
    prompt = (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: Name a prime. ASSISTANT:"
    )
    assert ids == pair.tokenizer(prompt)["input_ids"]  # FastChat's text, tokenized as FastChat does (the tokenizer's BOS)
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "How?"},
    ]
    assert (
        pair.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        == "Be brief. USER: Hi ASSISTANT: Hello</s>USER: How? ASSISTANT:"
    )
    from harness.data.prompts import set_pair_template

    set_pair_template(pair.tokenizer, "{{ bos_token }}" + cfg.pair.chat_template)  # a template that writes its own BOS
    assert encode(pair.tokenizer, "Name a prime.", "auto").count(bos) == 1  # not twice
    loaded_pairs.clear()  # the cached pair's tokenizer was changed here


def test_compile_refuses_a_static_cache_with_sliding_window_layers():
    """transformers' StaticSlidingWindowLayer keeps its length as a Python int, which dynamo guards on:
    a new graph at every length, then (past the recompile limit) eager steps timed as compiled."""
    from tests.test_loop import sliding_window_pair

    target, _ = sliding_window_pair(window=8)
    with pytest.raises(HarnessError, match="has sliding-window layers, whose static cache .* use compile=false"):
        CachedLM(target, 98, cache="static", compile=True)
    assert not CachedLM(target, 98, cache="static").compiled  # static without compile stays allowed


def test_compiling_makes_running_out_of_graphs_an_error():
    """Target and draft share one code object (transformers' forward wrapper), and every cache capacity
    a multirun reserves adds graphs: dynamo's default limit of 8 fell back to eager steps without a word."""
    from harness.models.hf_backends import compile_steps

    config = torch._dynamo.config
    saved = {k: getattr(config, k) for k in ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")}
    suppress = config.suppress_errors
    try:
        compile_steps(make_model(98, seed=1), None)
        assert config.recompile_limit >= 64 * CachedLM.COMPILED_MAX_TOKENS and config.fail_on_recompile_limit_hit
        assert config.accumulated_recompile_limit >= config.recompile_limit
        config.fail_on_recompile_limit_hit, config.suppress_errors = False, True  # torch refuses the two together
        compile_steps(make_model(98, seed=1), None)
        assert not config.fail_on_recompile_limit_hit
    finally:
        config.suppress_errors = suppress
        for key, value in saved.items():
            setattr(config, key, value)


def test_a_composite_models_context_comes_from_its_text_config():
    """Gemma 3 (4B and up) loads as *ForConditionalGeneration, whose top config has no max_position_embeddings."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {
        "vocab_size": 98,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 4096,
        "sliding_window": 64,
    }
    vision = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    assert getattr(model.config, "max_position_embeddings", None) is None
    assert CachedLM(model, 98).context == 4096


def test_a_draft_that_scores_fewer_tokens_than_the_target_leaves_the_target_its_range(tiny_pair, tmp_path):
    """Same tokenizer, a draft head and embedding two rows short (as Gemma 3 1B beside 4B and up): the target
    keeps its whole range (its greedy output is HF's, ids 96 and 97 included), the draft gives those ids
    probability 0, and a prompt holding them runs (the draft reads them as token 0)."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.config.checks import CONF_DIR
    from harness.core.loop import speculative_decode
    from harness.core.sampling import Sampling
    from harness.runner.pair import load_pair

    vocab = len(AutoTokenizer.from_pretrained(tiny_pair["target"]))
    folder = tmp_path / "short"
    make_model(vocab - 2, seed=3).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_pair["target"]).save_pretrained(folder)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["+pair=llama_7b_68m", f"pair.target.id={tiny_pair['target']}", f"pair.draft.id={folder}"],
        )
    pair = load_pair(cfg.pair, torch.device("cpu"), linear="torch")
    assert pair.target.vocab_size == vocab and pair.drafter.lm.scored == vocab - 2
    hf = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], **PLAIN)
    hf.generation_config.eos_token_id = None
    seen = set()
    for prompt in ([5, 17, 40, 9], [10, vocab - 1, 30, vocab - 2], [2, 28]):
        ids = torch.tensor(prompt)
        expected = hf.generate(ids[None], max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, len(prompt) :].tolist()
        cycles = list(speculative_decode(pair.target, pair.drafter, ids, 3, Sampling(0.0), 24, set(), torch.Generator()))
        assert [t for c in cycles for t in c.tokens] == expected
        seen |= set(expected)
    assert seen & {vocab - 1, vocab - 2}  # the target does produce the ids the draft lacks
    from harness.core.loop import Rows

    pair.drafter.start([torch.tensor([10, vocab - 1, 30])])
    proposal = pair.drafter.propose(
        Rows([torch.tensor([10, vocab - 1, 30])], [torch.Generator().manual_seed(0)]), [3], Sampling(1.0)
    )
    tokens, q = proposal.tokens[0], proposal.q[0]
    assert q.shape == (3, vocab) and (q[:, vocab - 2 :] == 0).all() and torch.allclose(q.sum(-1), torch.ones(3))
    assert (tokens < vocab - 2).all()
