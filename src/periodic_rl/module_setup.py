"""What :class:`~periodic_rl.RLModule` sets up before training: the policy and its reference,
the scorer (which rewards, with which weights), the check of the data and the rewards on a real
row, and the token ids of a prompt."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from periodic_rl.compat.lightning import attached_trainer
from periodic_rl.config_checks import DTYPES
from periodic_rl.models import TOKENIZER_LOCK, load_causal_lm
from periodic_rl.rewards import RewardModel, resolve_reward
from periodic_rl.scoring import Scorer
from periodic_rl.truncation import eos_token_ids


def load_policy(model_path: str, h: Any) -> tuple[Any, Any]:
    """The trainable policy (a peft model with ``lora``) and the frozen reference: a copy of
    the initial weights for full fine-tuning with ``beta > 0``, else None (with LoRA the
    reference is the policy with its adapter disabled, :func:`reference_model`)."""
    policy = load_causal_lm(model_path, dtype=DTYPES[h.dtype])
    reference = None
    if h.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    if h.lora is not None:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(**{"task_type": "CAUSAL_LM", **h.lora}))
    elif h.beta > 0:
        reference = load_causal_lm(model_path, dtype=DTYPES[h.dtype])
        reference.requires_grad_(False)
    policy.train()
    return policy, reference


def reference_model(policy: Any, reference: Any, lora: bool) -> Any:
    """A context manager that gives the reference policy of the KL term."""
    if reference is not None:
        return nullcontext(reference)
    if lora:
        return _adapter_disabled(policy)
    raise RuntimeError("beta > 0 needs a reference model")


@contextmanager
def _adapter_disabled(policy: Any) -> Iterator[Any]:
    """The LoRA policy with its adapter disabled: the reference, without a second weight copy."""
    with policy.disable_adapter():
        yield policy


def build_scorer(module: Any, source: Any) -> Scorer:
    """The module's rewards: ``reward_funcs`` (plus ``reward_model``), else the data source's
    task rewards, else the module's own :meth:`reward`."""
    h = module.hparams
    funcs = [resolve_reward(spec) for spec in module.reward_specs]
    weights = list(h.reward_weights or [])
    if h.reward_model:  # scores on the training device
        trainer = attached_trainer(module)
        device = trainer.strategy.root_device if trainer is not None else None
        funcs.append(RewardModel(h.reward_model, device=device))
    if not funcs and source is not None and source.reward_funcs:
        funcs = list(source.reward_funcs)
        weights = weights or list(source.reward_weights or [])
    if not funcs:
        funcs = [module.reward]
    return Scorer(
        tokenizer=module.tokenizer,
        reward_funcs=funcs,
        reward_weights=weights or [1.0] * len(funcs),
        scale_rewards=h.scale_rewards,
        baseline=h.advantage_baseline,
        accuracy_func=source.accuracy_func if source is not None else None,
        max_new_tokens=h.max_new_tokens,
        eos_token_ids=eos_token_ids(module.tokenizer, module.policy),
        overlong_buffer=h.overlong_buffer,
        overlong_penalty=h.overlong_penalty,
        reward_timeout_s=h.get("reward_timeout_s", 300.0),
        reward_on_error=h.get("reward_on_error", "raise"),
    )


def probe_rewards(module: Any, row: dict[str, Any]) -> None:
    """The rewards score two probe completions of ``row`` (right count, finite values) before
    any engine starts. Under ``reward_on_error: zero`` a failing probe warns (the failure is
    not counted: the probes are not samples). The rows themselves were checked when they
    loaded and encoded by :func:`periodic_rl.setup_checks.check_data_and_model`."""
    probes = ["", "42"]
    columns = {k: [v] * len(probes) for k, v in row.items() if k != "prompt"}
    module.scorer.rewards([row["prompt"]] * len(probes), probes, columns, count=False)


def encode_prompt(
    tokenizer: Any, prompt: str | list[dict[str, str]], system_prompt: str | None = None
) -> list[int]:
    """Token ids of a prompt, through the tokenizer's own chat template when it has one; a
    string becomes a user message, after ``system_prompt`` when given."""
    with TOKENIZER_LOCK:
        return _encode_prompt(tokenizer, prompt, system_prompt)


def _encode_prompt(
    tokenizer: Any, prompt: str | list[dict[str, str]], system_prompt: str | None
) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer.chat_template is None:
            return tokenizer(prompt, add_special_tokens=True)["input_ids"]
        messages = [{"role": "user", "content": prompt}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
    elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        messages = prompt
    else:
        raise ValueError(
            f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
