"""What RLModule sets up: the defaults it resolves from the training device (dtype, the
engine/trainer correction), dropout switched off, and INFO records that show.

The CUDA cases run on this CPU machine with Lightning's CUDA accelerator mocked: the module is
attached to a Trainer whose strategy trains on ``cuda:0``; no model is loaded, nothing runs on a
GPU.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import CUDAAccelerator

from periodic_rl import PeriodicAsyncStrategy, RLModule
from periodic_rl.module_setup import disable_dropout, log_choices, show_info_logs


@pytest.fixture
def fake_gpu(monkeypatch):
    """Lightning sees one CUDA device on this CPU machine (nothing is run on it)."""
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def choices(model_path, accelerator, module_kwargs=None, precision="32-true", **strategy):
    """The run choices of a module attached to a Trainer on ``accelerator`` (not fitted)."""
    module = RLModule(model=model_path, **(module_kwargs or {}))
    trainer = L.Trainer(
        logger=False,
        enable_checkpointing=False,
        accelerator=accelerator,
        devices=1,
        precision=precision,
        strategy=PeriodicAsyncStrategy(**strategy),
    )
    module.trainer = trainer
    return module.run_choices


def test_cuda_module_resolves_bf16_and_the_correction_on(fake_gpu, tiny_llama_path):
    run = choices(tiny_llama_path, "gpu", engine="vllm")
    assert run.device == "cuda:0"
    assert run.dtype == "bfloat16" and run.engine_dtype == "bfloat16"
    assert run.tis_cap == 2.0
    # the HF engine in the trainer's dtype: the same numerics, no correction
    assert choices(tiny_llama_path, "gpu", engine="hf").tis_cap is None


def test_cpu_module_resolves_fp32_and_the_correction_by_engine(tiny_llama_path):
    hf = choices(tiny_llama_path, "cpu", engine="hf")
    assert (hf.device, hf.dtype, hf.engine_dtype, hf.tis_cap) == ("cpu", "float32", "float32", None)
    # vLLM's kernels differ from the trainer's even in the same dtype
    assert choices(tiny_llama_path, "cpu", engine="vllm").tis_cap == 2.0
    # another dtype on the engine's side
    mixed = choices(tiny_llama_path, "cpu", engine="hf", engine_dtype="bfloat16")
    assert mixed.tis_cap == 2.0


def test_what_the_user_sets_wins(fake_gpu, tiny_llama_path):
    run = choices(tiny_llama_path, "gpu", {"dtype": "float32", "tis_cap": None}, engine="vllm")
    assert run.dtype == "float32" and run.tis_cap is None
    assert choices(tiny_llama_path, "cpu", {"tis_cap": 3.0}, engine="hf").tis_cap == 3.0


def test_the_run_start_summary_names_the_choices(tiny_llama_path):
    text = choices(tiny_llama_path, "cpu", engine="vllm").describe()
    assert "cpu" in text and "float32 weights" in text and "vllm engine in float32" in text
    assert "correction (tis_cap) on, cap 2" in text


def said_at_start(run, caplog) -> list[logging.LogRecord]:
    """The records the module logs about ``run`` at the start of a fit."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="periodic_rl_test"):
        log_choices(run, logging.getLogger("periodic_rl_test"))
    return caplog.records


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_a_bf16_engine_against_an_fp32_trainer_is_corrected_and_said(
    fake_gpu, tiny_llama_path, caplog, engine
):
    """On a GPU both engines sample in bf16 by default: an fp32 trainer then has the
    correction on, and the start of the run says the distributions differ, naming both."""
    run = choices(tiny_llama_path, "gpu", {"dtype": "float32"}, engine=engine)
    assert (run.dtype, run.engine_dtype, run.tis_cap) == ("float32", "bfloat16", 2.0)
    summary, mismatch = said_at_start(run, caplog)
    assert "run: " in summary.getMessage()
    assert mismatch.levelno == logging.INFO
    text = mismatch.getMessage()
    assert f"{engine} engine samples in bfloat16 while the trainer computes in float32" in text
    assert "on-policy by version" in text and "(tis_cap) is on, cap 2" in text


def test_the_uncorrected_mismatch_is_a_warning_and_equal_dtypes_say_nothing(
    fake_gpu, tiny_llama_path, caplog
):
    run = choices(tiny_llama_path, "gpu", {"dtype": "float32", "tis_cap": None}, engine="vllm")
    (mismatch,) = said_at_start(run, caplog)[1:]
    assert mismatch.levelno == logging.WARNING and "correction is off" in mismatch.getMessage()
    same = choices(tiny_llama_path, "gpu", engine="vllm")  # bf16 on both sides
    assert len(said_at_start(same, caplog)) == 1  # the summary only


def test_a_mixed_precision_trainer_computes_in_bf16_against_an_fp32_engine(tiny_llama_path, caplog):
    """``bf16-mixed`` on fp32 weights: the HF engine in float32 no longer shares the trainer's
    numerics, so ``auto`` turns the correction on."""
    run = choices(tiny_llama_path, "cpu", precision="bf16-mixed", engine="hf")
    assert (run.dtype, run.engine_dtype, run.tis_cap) == ("float32", "float32", 2.0)
    assert "trainer computes in bfloat16" in said_at_start(run, caplog)[1].getMessage()


# ---- dropout ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dropout_gpt2(tmp_path_factory, smollm2_path) -> str:
    """A GPT-2-shaped tiny model whose config has dropout 0.5 in every field, saved to disk."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=49152,
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.5,
        embd_pdrop=0.5,
        attn_pdrop=0.5,
        summary_first_dropout=0.5,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2-dropout")
    GPT2LMHeadModel(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(path)
    return str(path)


def train_and_eval_logps(module: RLModule) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's log-probs of one sequence in training mode and in eval mode."""
    module.configure_model()  # loads as a fit would (no Trainer: the CPU defaults)
    policy = module.policy
    ids = torch.arange(3, 40).unsqueeze(0)
    assert policy.training  # RL trains in train() mode
    torch.manual_seed(1)
    with torch.no_grad():
        training = policy(ids).logits.log_softmax(-1)
        policy.eval()
        evaluated = policy(ids).logits.log_softmax(-1)
    return training, evaluated


def test_dropout_is_off_in_the_policy_and_the_reference(dropout_gpt2):
    module = RLModule(model=dropout_gpt2, beta=0.1)  # beta > 0: a reference copy too
    training, evaluated = train_and_eval_logps(module)
    assert torch.equal(training, evaluated)
    for model in (module.policy, module.reference):
        assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
        assert model.config.resid_pdrop == model.config.attn_pdrop == 0.0


def test_disable_dropout_false_keeps_it(dropout_gpt2):
    module = RLModule(model=dropout_gpt2, disable_dropout=False)
    training, evaluated = train_and_eval_logps(module)
    assert not torch.equal(training, evaluated)


def test_functional_dropout_rates_are_zeroed_too():
    """Attention that applies dropout from a float attribute (Llama's ``attention_dropout``)."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_dropout = 0.1
            self.scale = 0.5  # not a dropout rate: kept

    model = torch.nn.Sequential(Attention(), torch.nn.Dropout(0.3))
    disable_dropout(model)
    assert model[0].attention_dropout == 0.0 and model[0].scale == 0.5
    assert model[1].p == 0.0


# ---- INFO records -----------------------------------------------------------------------------
def test_info_records_get_a_handler_only_when_nobody_configured_logging(monkeypatch):
    logger = logging.getLogger("periodic_rl")
    root = logging.getLogger()
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(root, "handlers", [])
    show_info_logs()
    show_info_logs()  # once
    assert logger.level == logging.INFO and len(logger.handlers) == 1 and not logger.propagate
    # a user who configured logging keeps their configuration
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    show_info_logs()
    assert logger.handlers == [] and logger.propagate
