"""Bad models and prompts that do not fit the engine fail in ``RLModule.setup``, before any
engine starts, naming the row or the model and the fix (docs/troubleshooting.md, "Bad input")."""

import json
import logging

import lightning as L
import pytest

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.attention.integration import SharedPromptUnsupportedError
from periodic_rl.models import load_tokenizer


def _zero(prompts, completions, **columns):
    return [0.0] * len(completions)


def fit_until_setup(model_path, rows, engine="hf", engine_kwargs=None, tmp_path=None, **module):
    """``trainer.fit`` on ``rows`` up to the first error; returns the strategy (its backend
    must still be None: nothing was started)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = RLModule(
        model=model_path,
        num_generations=2,
        max_new_tokens=32,  # the lengths below are checked against this budget
        reward_funcs=[_zero],
        eval_at_start=False,
        **module,
    )
    strategy = PeriodicAsyncStrategy(
        engine=engine, engine_kwargs=engine_kwargs, use_ray=False, overlap=False
    )
    trainer = L.Trainer(strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False)
    data = PromptDataModule(source=str(path), batch_size=1, val_fraction=0)
    trainer.fit(module, datamodule=data)
    return strategy


ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
LONG = {"prompt": "count: " + " ".join(str(i) for i in range(300)), "answer": "0"}


def test_prompt_longer_than_vllm_max_model_len_fails_before_vllm_starts(vllm_tiny_path, tmp_path):
    strategy = None
    expected = (
        r"training row 3 \(prompt 'count: 0 1 2.*\): its prompt "
        r"has \d+ tokens; with max_new_tokens=32 .* engine_kwargs.max_model_len "
        r"\(256\)"
    )
    with pytest.raises(ValueError, match=expected) as err:
        strategy = fit_until_setup(
            vllm_tiny_path, [*ROWS[:3], LONG], "vllm", {"max_model_len": 256}, tmp_path
        )
    assert strategy is None
    assert "set max_prompt_length" in str(err.value)


def test_long_prompt_cut_by_max_prompt_length_fits(vllm_tiny_path, tmp_path):
    """With ``max_prompt_length`` (left truncation) the cut prompt is what must fit."""
    module = RLModule(
        model=vllm_tiny_path, num_generations=2, max_new_tokens=32, max_prompt_length=64
    )
    module.configure_model()
    from periodic_rl.data.sources import PromptSource
    from periodic_rl.setup_checks import check_data_and_model

    strategy = PeriodicAsyncStrategy(engine="vllm", engine_kwargs={"max_model_len": 128})
    check_data_and_model(module, PromptSource(train=[LONG], val=[]), strategy)


def test_held_out_prompt_too_long_is_named(vllm_tiny_path, tmp_path):
    module = RLModule(model=vllm_tiny_path, num_generations=2, max_new_tokens=32)
    module.configure_model()
    from periodic_rl.data.sources import PromptSource
    from periodic_rl.setup_checks import check_data_and_model

    strategy = PeriodicAsyncStrategy(engine="vllm", engine_kwargs={"max_model_len": 256})
    with pytest.raises(ValueError, match=r"held-out row 0 \(prompt 'count"):
        check_data_and_model(module, PromptSource(train=ROWS, val=[LONG]), strategy)


def test_kv_cache_too_small_fails_before_vllm_starts(vllm_tiny_path, tmp_path):
    # the tiny Llama vLLM's CPU attention takes: 2 layers x 1 KV head x 32 dims x fp32 = 512
    # bytes a token.
    with pytest.raises(ValueError, match=r"engine_kwargs.kv_cache_gb=0.0001 GiB holds 209 tokens"):
        fit_until_setup(
            vllm_tiny_path, ROWS, "vllm", {"max_model_len": 256, "kv_cache_gb": 0.0001}, tmp_path
        )


@pytest.fixture(scope="module")
def no_template_path(tmp_path_factory, tiny_llama_path):
    """The tiny model with a tokenizer that has no chat template and no pad token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("no-template")
    AutoModelForCausalLM.from_pretrained(tiny_llama_path).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    tokenizer.chat_template = None
    tokenizer.pad_token = None
    tokenizer.save_pretrained(path)
    for name in ("chat_template.jinja", "chat_template.json"):
        (path / name).unlink(missing_ok=True)
    return str(path)


def test_chat_prompts_without_a_chat_template_name_the_model(no_template_path, tmp_path):
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": "0"} for r in ROWS]
    expected = (
        r"training row 0 \(prompt 'What is 0 \+ 0\?'\) is a list "
        r"of chat messages, but the tokenizer of .*no-template.* has no chat "
        r"template; give string prompts"
    )
    with pytest.raises(ValueError, match=expected) as err:
        fit_until_setup(no_template_path, chat, tmp_path=tmp_path)
    assert "chat_template" in str(err.value)


def test_system_prompt_without_a_chat_template_is_refused(no_template_path, tmp_path):
    expected = (
        r"system_prompt is set, but the tokenizer of .* has no "
        r"chat template.*unset system_prompt"
    )
    with pytest.raises(ValueError, match=expected):
        fit_until_setup(no_template_path, ROWS, tmp_path=tmp_path, system_prompt="Be brief.")


def test_no_pad_token_is_handled_with_eos_and_logged(no_template_path, caplog):
    caplog.set_level(logging.INFO)
    tokenizer = load_tokenizer(no_template_path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    assert any("no pad token; using its EOS token" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", ["/no/such/model", "./models/nope", "~/nope/model", "a/b/c"])
def test_model_path_that_does_not_exist_fails_at_construction(name):
    expected = (
        r"is not a local directory and not a hub id that "
        r"could be downloaded \(no such directory\); give a model directory"
    )
    with pytest.raises(FileNotFoundError, match=expected):
        RLModule(model=name)


def test_directory_that_is_not_a_model_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        RLModule(model=str(tmp_path))


def test_hub_id_that_cannot_be_downloaded_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    module = RLModule(model="no-such-owner/no-such-model")  # a hub id: cannot be told here
    expected = (
        r"(?s)'no-such-owner/no-such-model' is not a local directory "
        r"and not a hub id that could be downloaded .*HF_HUB_OFFLINE"
    )
    with pytest.raises(OSError, match=expected):
        module.configure_model()


def test_model_the_packed_path_refuses_fails_in_setup(tmp_path, tiny_llama_path):
    """A hybrid model (convolution layers) with shared_prompt=True: refused before engines."""
    import transformers as tf

    config = tf.Lfm2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1],
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    path = tmp_path / "lfm2"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(path)
    expected = (
        r"shared_prompt=True \(the packed "
        r"forward\) refuses this model: .*\['conv'\].*use shared_prompt=False"
    )
    with pytest.raises(SharedPromptUnsupportedError, match=expected):
        fit_until_setup(str(path), ROWS, tmp_path=tmp_path)


def test_attention_backend_that_cannot_train_here_fails_in_setup(tiny_llama_path, tmp_path):
    with pytest.raises(NotImplementedError, match="attention backend 'flex' has no CPU backward"):
        fit_until_setup(tiny_llama_path, ROWS, tmp_path=tmp_path, attention_backend="flex")
