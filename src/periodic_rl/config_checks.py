"""The checks of :class:`~periodic_rl.RLModule`'s settings, run at construction so that a bad
value fails before any model loads or engine starts, naming the field and the fix.

The choice arguments (``loss_type``, ``lr_scheduler``, ``dtype``, ...) are typed as ``Literal``
and checked against their types by :func:`~periodic_rl.choices.check_choices`; the checks here
are those of ranges and shapes, which a type cannot say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from periodic_rl.choices import check_choices
from periodic_rl.optim import check_schedule
from periodic_rl.reward_pool import check_reward_workers
from periodic_rl.rewards import check_reward_policy, resolve_reward
from periodic_rl.rollout.types import SamplingConfig
from periodic_rl.truncation import check_truncation_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``from_pretrained`` arguments the module sets itself, refused in ``model_init_kwargs``.
RESERVED_INIT_KWARGS = {
    "dtype": "set the module's dtype instead",
    "torch_dtype": "set the module's dtype instead",
    "device_map": "Lightning places the model (trainer.accelerator, trainer.devices)",
}


def check_module_config(args: dict[str, Any], signature: Callable[..., Any]) -> None:
    """Refuse bad settings at construction, naming the field and the fix; ``signature`` is
    the function whose ``Literal`` annotations give the allowed choices (``RLModule.__init__``)."""
    check_choices(signature, args)
    g = args["num_generations"]
    if g < 2:
        raise ValueError(f"num_generations must be >= 2 (group advantages need a group), got {g}")
    mbs = args["micro_batch_size"] if args["micro_batch_size"] is not None else g
    if mbs < 1 or mbs % g:
        raise ValueError(
            f"micro_batch_size ({mbs}) must be a positive multiple of num_generations ({g}) "
            "so that a group never spans two micro-batches"
        )
    if args["max_new_tokens"] < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {args['max_new_tokens']}")
    check_truncation_config(args)
    if args["temperature"] <= 0:
        raise ValueError(f"temperature must be > 0 for RL sampling, got {args['temperature']}")
    if not 0 < args["top_p"] <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {args['top_p']}")
    check_sampling(args)
    if not isinstance(args.get("num_iterations", 1), int) or args.get("num_iterations", 1) < 1:
        raise ValueError(
            f"num_iterations must be an integer >= 1 (optimizer steps per generated batch), "
            f"got {args.get('num_iterations')!r}"
        )
    if args.get("dynamic_sampling_max_batches", 1) < 1:
        raise ValueError(
            "dynamic_sampling_max_batches must be >= 1 (spares, in iterations' worth of "
            f"groups), got {args['dynamic_sampling_max_batches']}"
        )
    if args.get("dynamic_sampling_spares_ahead", 0) < 0:
        raise ValueError(
            "dynamic_sampling_spares_ahead must be >= 0, got "
            f"{args['dynamic_sampling_spares_ahead']}"
        )
    if args["epsilon"] <= 0 or (args["epsilon_high"] is not None and args["epsilon_high"] <= 0):
        raise ValueError("epsilon and epsilon_high must be > 0")
    if args["beta"] < 0:
        raise ValueError(f"beta must be >= 0, got {args['beta']}")
    tis_cap = args.get("tis_cap")
    if tis_cap not in (None, "auto") and (
        isinstance(tis_cap, bool)
        or not isinstance(tis_cap, int | float)
        or not 0 < tis_cap < float("inf")
    ):
        raise ValueError(
            f"tis_cap must be a finite number > 0 (the cap C of truncated importance sampling, "
            f"e.g. 2.0), auto (on where the engine's numerics differ), or null to switch it off; "
            f"got {tis_cap!r}"
        )
    if args["learning_rate"] <= 0:
        raise ValueError(f"learning_rate must be > 0, got {args['learning_rate']}")
    check_schedule(
        args["lr_scheduler"],
        args["warmup_steps"],
        args["warmup_ratio"],
        args["lr_scheduler_kwargs"],
    )
    weights = args["reward_weights"]
    funcs = args["reward_funcs"]
    if weights is not None and funcs and len(weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(weights)} entries for {len(funcs)} reward_funcs; "
            "give one weight per function"
        )
    for spec in funcs or []:
        resolve_reward(spec)
    check_reward_policy(args.get("reward_on_error", "raise"), args.get("reward_timeout_s"))
    check_reward_workers(args.get("reward_workers", 0))
    if args["lora"] is not None and not isinstance(args["lora"], dict):
        raise ValueError("lora must be a dict of peft LoraConfig arguments, or null")
    check_model_init_kwargs(args.get("model_init_kwargs"))
    check_training_knobs(args)


def check_model_init_kwargs(kwargs: Any) -> None:
    """Refuse ``model_init_kwargs`` that are not a dict, or that set what the module sets."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise ValueError(
            "model_init_kwargs must be a dict of from_pretrained arguments (e.g. "
            f"{{'attn_implementation': 'sdpa'}}), or null; got {kwargs!r}"
        )
    for key, fix in RESERVED_INIT_KWARGS.items():
        if key in kwargs:
            raise ValueError(f"model_init_kwargs must not set {key!r}: {fix}")


def check_training_knobs(args: dict[str, Any]) -> None:
    """Refuse a bad ``weight_decay``, ``max_grad_norm``, ``attention_backend`` or
    ``eval_max_new_tokens`` (a knob absent from ``args`` is not checked)."""
    decay = args.get("weight_decay", 0.0)
    if not _is_number(decay) or not 0 <= decay < float("inf"):
        raise ValueError(f"weight_decay must be a finite number >= 0 (0: off), got {decay!r}")
    norm = args.get("max_grad_norm")
    if norm is not None and (not _is_number(norm) or not 0 < norm < float("inf")):
        raise ValueError(f"max_grad_norm must be a finite number > 0, or null (off), got {norm!r}")
    from periodic_rl.attention.backends import BACKENDS

    backend = args.get("attention_backend", "auto")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(
            f"attention_backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}"
        )
    cap = args.get("eval_max_new_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(
            f"eval_max_new_tokens must be an integer >= 1, or null (max_new_tokens), got {cap!r}"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_sampling(args: dict[str, Any]) -> None:
    """Refuse bad sampling knobs (``top_k``, ``min_p``, ``repetition_penalty``, with
    ``max_new_tokens``, ``temperature`` and ``top_p``) the way the rollouts would, through
    :class:`~periodic_rl.rollout.types.SamplingConfig`'s own checks. A knob absent from ``args``
    takes its "off" value."""
    SamplingConfig(
        max_new_tokens=args["max_new_tokens"],
        temperature=args["temperature"],
        top_p=args["top_p"],
        top_k=args.get("top_k", 0),
        min_p=args.get("min_p", 0.0),
        repetition_penalty=args.get("repetition_penalty", 1.0),
    )


#: Lightning's precisions that train in float16 behind a loss scale, refused by
#: :func:`check_precision`.
FP16_PRECISIONS = ("16-mixed", "16-true")


def check_precision(precision: str) -> None:
    """Refuse a float16 training precision. Under ``16-mixed`` with manual optimisation the
    gradients are clipped while still multiplied by the loss scale (Lightning #18089), so the
    clip cuts them far too hard; DeepSpeed's fp16 (``16-mixed`` / ``16-true``) adds a dynamic
    loss scaler that changes the scale the iteration's gradients are divided by."""
    if str(precision) in FP16_PRECISIONS:
        raise ValueError(
            f"Trainer(precision={precision!r}) is not supported: float16 training clips the "
            "gradients while they are still loss-scaled. Use precision='bf16-mixed' (or "
            "'bf16-true', or '32-true' on hardware without bfloat16)"
        )


def check_run_config(hparams: Any, trainer: Any) -> None:
    """Refuse settings that only clash with the trainer or its strategy, before any model
    loads or engine starts."""
    check_precision(trainer.precision)
    updates = hparams.get("num_iterations", 1)
    staleness = getattr(trainer.strategy, "max_staleness", 0)
    if updates > 1 and staleness > 0:
        raise ValueError(
            f"num_iterations={updates} with max_staleness={staleness}: several updates per "
            "batch are only supported on-policy; set num_iterations: 1 or max_staleness: 0"
        )
    options = getattr(getattr(trainer.strategy, "rollouts", None), "options", None)
    if hparams.get("dynamic_sampling") and getattr(options, "partial_rollout_tokens", None):
        raise ValueError(
            "dynamic_sampling with partial_rollout_tokens: the spare groups dynamic sampling adds "
            "mid-iteration are not generated in chunks; unset one of them"
        )
    if updates > 1 and trainer.max_steps > 0 and trainer.max_steps % updates:
        raise ValueError(
            f"trainer.max_steps ({trainer.max_steps}) counts optimizer steps and must be a "
            f"multiple of num_iterations ({updates}), e.g. max_steps: "
            f"{trainer.max_steps - trainer.max_steps % updates + updates}"
        )
