"""`HFExport`: the trained policy as a folder transformers, peft and vLLM load directly.

A Lightning checkpoint holds the whole RL state (optimizer included) under Lightning's names;
what a user wants after a run is a model folder: ``AutoModelForCausalLM.from_pretrained(path)``
or ``vllm serve path``. Folders are written to a temporary name and renamed into place, so a
reader never sees half a model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from periodic_rl.callbacks._common import atomic_directory, run_dir
from periodic_rl.weight_sync.export import policy_state_dict

MERGED_SUBDIR = "merged"


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a peft model (the LoRA case)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


@contextmanager
def _inference_config(config: Any) -> Iterator[None]:
    """Save ``use_cache=True`` even when gradient checkpointing turned it off for training."""
    was = getattr(config, "use_cache", None)
    if was is False:
        config.use_cache = True
    try:
        yield
    finally:
        if was is False:
            config.use_cache = was


def save_merged(policy: Any, tokenizer: Any, path: Path) -> Path:
    """Write a LoRA policy's merged weights as a plain transformers model folder.

    The weights are :func:`periodic_rl.weight_sync.export.policy_state_dict`, the very tensors
    the rollout engines are given (``W + delta`` computed out of place: the training model is
    not merged and unmerged, and no second model is built).
    """
    base = policy.get_base_model()
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(policy_state_dict(policy), str(path / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(base.config)
    if getattr(config, "use_cache", None) is False:
        config.use_cache = True
    config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def save_hf_model(policy: Any, tokenizer: Any, path: Path, merged: bool = False) -> Path:
    """Write ``policy`` (and its tokenizer) to ``path`` atomically; returns ``path``.

    Full fine-tuning: ``save_pretrained`` (safetensors). LoRA: the peft adapter
    (``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
    ``PeftModel.from_pretrained(base, path)`` or ``AutoModelForCausalLM.from_pretrained(path)``
    when the base is reachable), and with ``merged`` the merged full model in ``path/merged``.
    """
    with atomic_directory(path) as tmp:
        if is_peft_model(policy):
            policy.save_pretrained(str(tmp))
            if merged:
                save_merged(policy, tokenizer, tmp / MERGED_SUBDIR)
        else:
            with _inference_config(policy.config):
                policy.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return path


class HFExport(Callback):
    """Export the policy as a transformers model folder during and at the end of training.

    Folders: ``<output_dir>/iteration-<k>`` after every ``every_n_iterations``-th iteration
    (``k`` iterations done: the weights of policy version ``k``) and ``<output_dir>/final`` at
    the end of training. Only global rank 0 writes.

    Args:
        every_n_iterations: export after iterations N, 2N, ... (None: only at the end).
        output_dir: where to write (default ``<log_dir>/hf_model``).
        at_end: export ``final`` when training ends (not after a crash or an interrupt:
            Lightning does not call ``on_train_end`` then).
        merged: for a LoRA policy, also write the merged full model to ``<folder>/merged``
            (the folder for vLLM or anything without peft). Ignored for full fine-tuning.
    """

    def __init__(
        self,
        every_n_iterations: int | None = None,
        output_dir: str | None = None,
        at_end: bool = True,
        merged: bool = False,
    ) -> None:
        if every_n_iterations is not None and every_n_iterations < 1:
            raise ValueError(f"every_n_iterations must be >= 1, got {every_n_iterations}")
        self.every_n_iterations = every_n_iterations
        self.output_dir = output_dir
        self.at_end = at_end
        self.merged = merged
        self.exports: list[Path] = []
        self.final_path: Path | None = None

    def resolve_output_dir(self, trainer: Any) -> Path:
        """The folder this run's exports go to."""
        if self.output_dir is not None:
            return Path(self.output_dir)
        return run_dir(trainer) / "hf_model"

    @property
    def last_export(self) -> Path | None:
        """The newest folder written (``final`` once training has ended)."""
        return self.exports[-1] if self.exports else None

    def model_path(self, path: Path) -> Path:
        """The folder ``AutoModelForCausalLM.from_pretrained`` / vLLM should be given: the
        export itself, or its merged model for a LoRA export with ``merged``."""
        merged = path / MERGED_SUBDIR
        return merged if self.merged and merged.is_dir() else path

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.every_n_iterations
        if n is None or trainer.global_step == 0 or trainer.global_step % n:
            return
        self.export(trainer, pl_module, f"iteration-{trainer.global_step}")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.at_end:
            self.final_path = self.export(trainer, pl_module, "final")

    def export(self, trainer: Any, pl_module: Any, name: str) -> Path | None:
        """Write the policy to ``<output_dir>/<name>`` (rank 0 only); returns the folder."""
        if not trainer.is_global_zero:
            return None
        path = self.resolve_output_dir(trainer) / name
        save_hf_model(pl_module.policy, pl_module.tokenizer, path, merged=self.merged)
        self.exports.append(path)
        return path
