"""What :class:`~periodic_rl.RLModule` sets up before training: the policy and its reference,
the scorer (which rewards, with which weights), the check of the data and the rewards on a real
row, and the token ids of a prompt."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from periodic_rl.compat.lightning import attached_trainer
from periodic_rl.config_checks import DTYPES
from periodic_rl.models import TOKENIZER_LOCK, load_causal_lm
from periodic_rl.rewards import RewardModel, resolve_reward
from periodic_rl.rollout.device_defaults import compute_dtype, importance_cap, training_dtype
from periodic_rl.scoring import Scorer
from periodic_rl.truncation import eos_token_ids

#: The ``model_init_kwargs`` that ``AutoTokenizer.from_pretrained`` takes too: the tokenizer
#: comes from the same revision and place as the weights.
TOKENIZER_KWARGS = ("revision", "trust_remote_code", "cache_dir", "token", "local_files_only")


def tokenizer_kwargs(model_init_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The entries of ``model_init_kwargs`` that the tokenizer's ``from_pretrained`` takes."""
    return {k: v for k, v in (model_init_kwargs or {}).items() if k in TOKENIZER_KWARGS}


def load_policy(model_path: str, h: Any, dtype: str) -> tuple[Any, Any]:
    """The trainable policy (a peft model with ``lora``) and the frozen reference: a copy of
    the initial weights for full fine-tuning with ``beta > 0``, else None (with LoRA the
    reference is the policy with its adapter disabled, :func:`reference_model`). ``dtype``:
    the weights' dtype, resolved for the device (:func:`~periodic_rl.rollout.device_defaults.
    training_dtype`). With ``disable_dropout`` (the default) neither computes with dropout."""
    init_kwargs = h.get("model_init_kwargs") or {}  # from_pretrained's own arguments
    policy = load_causal_lm(model_path, dtype=DTYPES[dtype], **init_kwargs)
    reference = None
    if h.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    if h.lora is not None:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(**{"task_type": "CAUSAL_LM", **h.lora}))
    elif h.beta > 0:
        reference = load_causal_lm(model_path, dtype=DTYPES[dtype], **init_kwargs)
        reference.requires_grad_(False)
    if h.get("disable_dropout", True):
        for model in (policy, reference):
            if model is not None:
                disable_dropout(model)
    policy.train()
    return policy, reference


def disable_dropout(model: torch.nn.Module) -> None:
    """Switch dropout off for good, whatever mode ``model`` is in: the rollouts were sampled
    without it, so a policy trained in ``train()`` mode with it would not compute the
    distribution they came from (TRL's ``disable_dropout``). Every dropout module gets
    ``p = 0``, and so do the float ``*dropout`` / ``*_pdrop`` fields of the configs and of the
    modules that apply dropout functionally (attention's ``attention_dropout``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
            continue
        for name, value in list(vars(module).items()):
            if _is_dropout_rate(name, value):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for name, value in config.to_dict().items():
                if _is_dropout_rate(name, value):
                    setattr(config, name, 0.0)


def _is_dropout_rate(name: str, value: Any) -> bool:
    return (
        (name.endswith("dropout") or name.endswith("_pdrop"))
        and isinstance(value, float)
        and value > 0
    )


@dataclass(frozen=True)
class RunChoices:
    """What a run resolved from its settings and its training device: logged once at the start
    (:meth:`describe`); ``tis_cap`` is what the loss uses."""

    device: str
    dtype: str
    precision: str
    engine: str
    engine_dtype: str | None
    tis_cap: float | None
    tuning: str | None = None
    max_staleness: int = 0

    def describe(self) -> str:
        correction = f"on, cap {self.tis_cap:g}" if self.tis_cap is not None else "off"
        parts = [
            f"trainer on {self.device}, {self.dtype} weights, precision {self.precision}",
            f"rollouts: {self.engine} engine in {self.engine_dtype or 'its own dtype'}",
            f"engine/trainer correction (tis_cap) {correction}",
        ]
        if self.tuning:
            parts.append(f"hardware tuning {self.tuning}")
        return "; ".join(parts)

    def dtype_mismatch(self) -> tuple[int, str] | None:
        """When the engine samples in another dtype than the trainer computes in: the level and
        text of the line said once at the start (a warning when nothing corrects for it), else
        None. The run stays on-policy by version, not by distribution."""
        trainer = compute_dtype(self.dtype, self.precision)
        if self.engine_dtype is None or self.engine_dtype == trainer:
            return None
        text = (
            f"the {self.engine} engine samples in {self.engine_dtype} while the trainer computes "
            f"in {trainer}: every rollout comes from its iteration's weights (on-policy by "
            f"version; the fingerprint checks the {self.engine_dtype} weights that landed), but "
            "its sampling distribution differs from the trainer's (mismatch/* shows by how "
            "much); "
        )
        if self.tis_cap is not None:
            return (
                logging.INFO,
                text + f"the importance correction (tis_cap) is on, cap {self.tis_cap:g}",
            )
        if self.max_staleness >= 1:
            return logging.INFO, text + "the staleness correction (max_staleness >= 1) covers it"
        return logging.WARNING, text + (
            "the importance correction is off (tis_cap: null): set tis_cap: auto (cap 2) or "
            f"a number, or run the engine in {trainer}"
        )


def log_choices(choices: RunChoices, logger: logging.Logger) -> None:
    """Say once, at the start, what the run chose, and how its engine's numerics differ."""
    logger.info("run: %s", choices.describe())
    mismatch = choices.dtype_mismatch()
    if mismatch is not None:
        logger.log(*mismatch)


def resolve_choices(h: Any, strategy: Any, precision: str = "32-true") -> RunChoices:
    """The device-dependent choices (:mod:`periodic_rl.rollout.device_defaults`) of a module
    with hyperparameters ``h`` trained by ``strategy``, a Lightning strategy that is a
    :class:`~periodic_rl.strategies.protocol.RolloutStrategy`."""
    dtype = training_dtype(h.get("dtype", "auto"), strategy.root_device.type)
    engine, engine_dtype = strategy.rollout_engine, strategy.rollout_engine_dtype()
    return RunChoices(
        device=str(strategy.root_device),
        dtype=dtype,
        precision=str(precision),
        engine=engine,
        engine_dtype=engine_dtype,
        tis_cap=importance_cap(h.get("tis_cap", "auto"), engine, engine_dtype, dtype, precision),
        tuning=_describe_tuning(getattr(strategy, "tuning", None)),
        max_staleness=int(getattr(strategy, "max_staleness", 0) or 0),
    )


def _describe_tuning(tuning: Any) -> str | None:
    """The tuner and the cores it pins each side to, or None without one."""
    if tuning is None or type(tuning).__name__ == "HardwareTuning":
        return None
    shown = ", ".join(
        f"{key} {getattr(tuning, key)}"
        for key in ("worker_cores", "trainer_cores")
        if getattr(tuning, key, None) is not None
    )
    return f"{type(tuning).__name__}({shown})"


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
    task rewards, else the module's own :meth:`reward`. A scorer the module already had (an
    earlier fit) is closed first: its reward pool's workers stop."""
    h = module.hparams
    if getattr(module, "scorer", None) is not None:
        module.scorer.close()
    funcs = [resolve_reward(spec) for spec in module.reward_specs]
    weights = list(h.reward_weights or [])
    trainer = attached_trainer(module)
    device = trainer.strategy.root_device if trainer is not None else None
    if h.reward_model:  # scores on the training device
        funcs.append(RewardModel(h.reward_model, device=device))
    place_reward_models(funcs, device)
    if not funcs and source is not None and source.reward_funcs:
        funcs = list(source.reward_funcs)
        weights = weights or list(source.reward_weights or [])
    if not funcs and not (module.agent_config is not None and not _overrides_reward(module)):
        funcs = [module.reward]  # a multi-turn run may score with its environment's only
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
        reward_workers=h.get("reward_workers", 1),
    )


def _overrides_reward(module: Any) -> bool:
    """Whether the module's class defines its own ``reward`` (RLModule's raises)."""
    owner = next(klass for klass in type(module).__mro__ if "reward" in vars(klass))
    return owner.__module__ != "periodic_rl.module"


def place_reward_models(funcs: list[Any], device: Any) -> None:
    """Move each :class:`RewardModel` built without a device of its own to ``device`` (the
    training device; None: leave it where it is)."""
    for func in funcs:
        if isinstance(func, RewardModel) and func.requested_device is None and device is not None:
            func.to(device)


def probe_rewards(module: Any, row: dict[str, Any]) -> None:
    """The rewards score two probe completions of ``row`` (right count, finite values) before
    any engine starts. Under ``reward_on_error: zero`` a failing probe warns (the failure is
    not counted: the probes are not samples). The rows themselves were checked when they
    loaded and encoded by :func:`periodic_rl.setup_checks.check_data_and_model`."""
    probes = ["", "42"]
    columns = {k: [v] * len(probes) for k, v in row.items() if k != "prompt"}
    if module.agent_config is not None:  # a trajectory's conversation, one assistant turn here
        columns["messages"] = [[{"role": "assistant", "content": p}] for p in probes]
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


def show_info_logs() -> None:
    """Make the library's INFO records (the run's choices, held-out results) visible, the way
    Lightning shows its own: the ``periodic_rl`` logger gets level INFO and, when neither it
    nor the root logger has a handler (nobody configured logging), a handler of its own.
    Whatever the user configured is left as it is; calling it again changes nothing."""
    logger = logging.getLogger("periodic_rl")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[periodic_rl] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def resumed_at_the_end(trainer: Any, checkpoint: dict[str, Any]) -> bool:
    """Whether a fit resumes from a checkpoint that already reached ``trainer.max_steps``:
    nothing is left to train, which is said here, once; the strategy then starts no engines
    and Lightning's loop ends at once (exit status 0)."""
    if trainer is None or trainer.state.fn != "fit" or not trainer.max_steps > 0:
        return False
    step = int(checkpoint.get("global_step", 0))
    if step < trainer.max_steps:
        return False
    if trainer.is_global_zero:
        logging.getLogger(__name__).info(
            "the checkpoint is at step %d and trainer.max_steps is %d: nothing left to train "
            "(raise max_steps to train further)",
            step,
            trainer.max_steps,
        )
    return True
