"""A model that cannot be read (what an interrupted download leaves, a file of another format under a
weight file's name, a missing shard, a corrupt GGUF file) is one line naming the file and the fix, for
the target, the draft, a shared-weights draft, the embedded cache and the HF cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_model, make_tokenizer

import harness.models.embedded as embedded
from harness.errors import HarnessError
from harness.models.loading import ModelSpec, load_model, load_tokenizer

CPU = torch.device("cpu")


def _truncate(path: Path) -> None:
    """What an interrupted download leaves: the file's first half."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _tiny_gguf(path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _damage(kind: str, saved_models: Path, folder: Path) -> ModelSpec:
    """A copy of the tiny target in `folder`, damaged as `kind` says; the spec that names it."""
    if kind == "missing shard":
        make_model(98, seed=1).save_pretrained(folder, max_shard_size="20KB")
        make_tokenizer().save_pretrained(folder)
        shards = sorted(folder.glob("model-*.safetensors"))
        assert len(shards) > 2
        shards[1].unlink()
        return ModelSpec(str(folder))
    if kind.endswith("gguf"):
        folder.mkdir()
        _tiny_gguf(folder / "model.gguf")
        if kind == "truncated gguf":
            _truncate(folder / "model.gguf")
        else:
            (folder / "model.gguf").write_bytes(b"GGUX" + (folder / "model.gguf").read_bytes()[4:])  # a bad magic
        return ModelSpec(str(folder), gguf_file="model.gguf")
    shutil.copytree(saved_models / "target", folder)
    if kind == "truncated":
        _truncate(folder / "model.safetensors")
    else:  # an error page saved under the weights' name
        (folder / "model.safetensors").write_text("<html><body>502 Bad Gateway</body></html>\n")
    return ModelSpec(str(folder))


DAMAGE = {
    "truncated": "model.safetensors is not a readable safetensors file \\(incomplete metadata",
    "corrupt header": "model.safetensors is not a readable safetensors file \\(header too large",
    "missing shard": "model-00002-of-\\d+.safetensors is missing \\(model.safetensors.index.json lists it\\)",
    "truncated gguf": "model.gguf is not a readable GGUF file \\(ValueError",
    "corrupt gguf": "model.gguf is not a readable GGUF file \\(ValueError: GGUF magic invalid",
}


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_model_that_cannot_be_read_is_one_line_naming_the_file_and_the_fix(saved_models, tmp_path, kind, role):
    spec = _damage(kind, saved_models, tmp_path / "model")
    fix = f"download or save the model into {tmp_path / 'model'} again .*, or delete that folder$"
    with pytest.raises(
        HarnessError, match=f"^{role} model '{spec.id}' cannot be read: {tmp_path / 'model'}/{DAMAGE[kind]}.*: {fix}"
    ):
        load_model(spec, CPU, role)


@pytest.mark.parametrize("file", ["weights.safetensors", "harness_draft.json", "config.json"])
def test_a_shared_draft_that_cannot_be_read_is_one_line(saved_models, tmp_path, file):
    target = load_model(ModelSpec(str(saved_models / "target")), CPU)
    folder = tmp_path / "draft"
    shutil.copytree(saved_models / "shared_draft", folder)
    _truncate(folder / file)
    with pytest.raises(
        HarnessError, match=f"^draft model '{folder}' cannot be read: {folder / file} is not .*: download or save"
    ):
        load_model(ModelSpec(str(folder)), CPU, "draft", target=target)
    shutil.copy(saved_models / "shared_draft" / file, folder / file)
    (folder / "weights.safetensors").unlink()
    with pytest.raises(HarnessError, match=f"cannot be read: {folder}/weights.safetensors is missing: download or save"):
        load_model(ModelSpec(str(folder)), CPU, "draft", target=target)


def test_a_damaged_embedded_cache_says_to_delete_its_folder(saved_models, tmp_path, monkeypatch):
    """The dequantised cache under SPECBENCH_CACHE, as embedded_model_dir leaves it once built, with its
    weights cut short (or its tokenizer's file): delete that folder, and the next run rebuilds it."""
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "find_gguf", lambda: pytest.fail("the cache is built: nothing is dequantised"))
    out = tmp_path / embedded.EMBEDDED["smollm2"]
    shutil.copytree(saved_models / "target", out)
    _truncate(out / "model.safetensors")
    fix = f"delete the folder {out} so that the next run rebuilds it$"
    with pytest.raises(HarnessError, match=f"^target model 'embedded:smollm2' cannot be read: {out}/model.safetensors .*: {fix}"):
        load_model(ModelSpec("embedded:smollm2"), CPU)
    (out / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.raises(HarnessError, match=f"cannot be read: {out}/tokenizer.json is not valid JSON .*: {fix}"):
        load_tokenizer(ModelSpec("embedded:smollm2"))


def test_a_damaged_gguf_for_the_embedded_cache_says_to_fetch_it_again(tmp_path, monkeypatch):
    """The GGUF file fetched into the harness's cache, cut short: nothing is dequantised, and the line says
    to delete it so that the next run fetches it anew."""
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    gguf = tmp_path / "gguf" / embedded.GGUF_NAME
    gguf.parent.mkdir()
    _tiny_gguf(gguf)
    _truncate(gguf)
    monkeypatch.setattr(embedded, "find_gguf", lambda: gguf)
    with pytest.raises(
        HarnessError,
        match=f"^the embedded model's GGUF file {gguf} is not a readable GGUF file .*: "
        "delete it so that the next run fetches it again$",
    ):
        embedded.embedded_model_dir("smollm2")
    assert not (tmp_path / embedded.EMBEDDED["smollm2"]).exists()


def test_a_damaged_hf_cache_entry_says_to_delete_it(saved_models, tmp_path, monkeypatch):
    """A hub id whose files the HF cache holds (snapshots/<commit>/, as huggingface_hub lays them out) with
    its weights cut short: remove that cache entry and download it again."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-model"
    shutil.copytree(saved_models / "target", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert load_model(ModelSpec("tiny-org/tiny-model"), CPU) is not None  # the entry as it should be: loads
    _truncate(repo / "snapshots" / commit / "model.safetensors")
    with pytest.raises(
        HarnessError,
        match=f"^target model 'tiny-org/tiny-model' cannot be read: {repo}/snapshots/{commit}/model.safetensors "
        r".*: delete that cache entry \(hf cache rm model/tiny-org/tiny-model\) and download it again",
    ):
        load_model(ModelSpec("tiny-org/tiny-model"), CPU)


@pytest.mark.cli
def test_the_cli_says_which_file_of_the_draft_cannot_be_read(tiny_pair, tmp_path):
    import subprocess
    import sys

    draft = tmp_path / "draft"
    shutil.copytree(tiny_pair["draft"], draft)
    _truncate(draft / "model.safetensors")
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "+pair=llama_7b_68m",
            f"pair.target.id={tiny_pair['target']}",
            f"pair.draft.id={draft}",
            f"out_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        env=env,
        timeout=300,
    )
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert errors == [
        f"error: draft model '{draft}' cannot be read: {draft}/model.safetensors is not a readable safetensors file "
        f"(incomplete metadata, file not fully covered): download or save the model into {draft} again "
        f"(an interrupted download leaves files cut short or missing), or delete that folder"
    ]
