"""Reward functions: resolving them from config, calling them, and checking what they return.

A reward is a plain callable ``(prompts, completions, **columns) -> list[float]`` (TRL's
convention): extra dataset columns arrive as keyword lists aligned with ``completions``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

RewardFunc = Callable[..., Sequence[float]]


def reward_name(func: Any) -> str:
    """The name a reward component is logged under."""
    return getattr(func, "__name__", None) or type(func).__name__


def resolve_reward(spec: str | RewardFunc) -> RewardFunc:
    """A callable from itself or a dotted path: ``pkg.module:func`` or ``pkg.module.func``."""
    if callable(spec):
        return spec
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"reward_funcs: cannot import {spec!r} ({error}); give 'package.module:function'"
        ) from error
    if not callable(func):
        raise ValueError(f"reward_funcs: {spec!r} is not callable")
    return func


def check_rewards(name: str, values: Any, expected: int) -> list[float]:
    """``values`` as floats, or a ValueError that names the reward and what is wrong."""
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as error:
        raise ValueError(f"reward '{name}' must return a list of numbers: {error}") from error
    if len(values) != expected:
        raise ValueError(
            f"reward '{name}' returned {len(values)} values for {expected} completions; "
            "return one float per completion"
        )
    bad = [i for i, v in enumerate(values) if math.isnan(v) or math.isinf(v)]
    if bad:
        raise ValueError(
            f"reward '{name}' returned NaN or inf for completion(s) {bad[:5]}; "
            "return a finite float for every completion"
        )
    return values


class RewardModel:
    """A frozen sequence-classification model used as a reward: the score of prompt+completion.

    Loaded once from a local path (or hub id), frozen and in eval mode; runs without gradients on
    ``device``. The trainer passes its training device (``device=...`` or :meth:`to`); without
    one it stays on the CPU. Inputs follow the model wherever it is moved.
    """

    def __init__(
        self,
        path: str,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 8,
        device: str | torch.device | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.__name__ = "reward_model"
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval().requires_grad_(False)
        self.batch_size = batch_size
        if device is not None:
            self.to(device)

    @property
    def device(self) -> torch.device:
        """Where the model (and so each scoring batch) is."""
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> RewardModel:
        """Move the model to ``device`` (e.g. the trainer's); it stays frozen and in eval mode."""
        self.model.to(torch.device(device))
        return self

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
        texts = [_as_text(p) + c for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True
            ).to(self.device)
            logits = self.model(**batch).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores


def _as_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)
