"""HFExport: exported folders reload with transformers/peft and give the trainer's log-probs."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from periodic_rl.callbacks._common import atomic_directory

TEXT = "Twelve plus thirty is 42, and the quick brown fox jumps over the lazy dog."


def token_logprobs(model, tokenizer) -> torch.Tensor:
    """Log-probability of each next token of TEXT under ``model``."""
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _assert_same(loaded, run, path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    expected = token_logprobs(run.module.policy, run.module.tokenizer)
    torch.testing.assert_close(token_logprobs(loaded, tokenizer), expected, atol=1e-5, rtol=0)


def _assert_trained(run, model_path):
    base = AutoModelForCausalLM.from_pretrained(model_path)
    moved = token_logprobs(run.module.policy, run.module.tokenizer) - token_logprobs(
        base, run.module.tokenizer
    )
    assert moved.abs().max() > 1e-3, "the weights did not move: the comparison would be vacuous"


def test_full_export_folders(full_run):
    export = full_run.root / "tb" / "version_0" / "hf_model"
    assert sorted(p.name for p in export.iterdir()) == ["final", "iteration-2"]  # no temp dirs
    files = {p.name for p in (export / "final").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    umask = os.umask(0o022)
    os.umask(umask)
    for file in (export / "final").iterdir():  # readable by a server running as another user
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file.name
    callback = full_run.callbacks["HFExport"]
    assert callback.final_path == export / "final"
    assert callback.exports == [export / "iteration-2", export / "final"]


def test_full_export_reloads_with_the_trainers_logprobs(full_run, tiny_llama_path):
    path = full_run.callbacks["HFExport"].final_path
    _assert_same(AutoModelForCausalLM.from_pretrained(path), full_run, path)
    _assert_trained(full_run, tiny_llama_path)
    assert AutoModelForCausalLM.from_pretrained(path.parent / "iteration-2") is not None


def test_lora_adapter_reloads_on_the_base(lora_run, tiny_llama_path):
    from peft import PeftModel

    path = lora_run.callbacks["HFExport"].final_path
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in path.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    _assert_same(PeftModel.from_pretrained(base, path), lora_run, path)
    _assert_same(AutoModelForCausalLM.from_pretrained(path), lora_run, path)  # via peft
    _assert_trained(lora_run, tiny_llama_path)


def test_lora_merged_reloads_as_a_plain_model(lora_run):
    callback = lora_run.callbacks["HFExport"]
    merged = callback.model_path(callback.final_path)
    assert merged == callback.final_path / "merged"
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in name for name, _ in model.named_parameters())
    _assert_same(model, lora_run, merged)


def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "final"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        (tmp / "a").write_text("half")
        raise RuntimeError("crash while writing")
    assert (target / "a").read_text() == "old"
    with atomic_directory(target) as tmp:
        (tmp / "b").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    assert [p.name for p in target.iterdir()] == ["b"]
