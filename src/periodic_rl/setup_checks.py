"""What :meth:`RLModule.setup <periodic_rl.RLModule.setup>` checks on every data row and on the
model before any engine starts (the rows' own shape was checked when they were loaded,
:mod:`periodic_rl.data.checks`):

- chat prompts (and ``system_prompt``) need a tokenizer with a chat template;
- every training and held-out prompt encodes, within ``max_prompt_length`` under
  ``prompt_truncation='error'``, and with ``max_new_tokens`` fits the engine's ``max_model_len``;
  vLLM's KV cache holds one group (:func:`~periodic_rl.rollout.engines.engine_checks.
  check_prompts_fit_engine`); the CPU build of vLLM supports the model's attention head size
  (:func:`~periodic_rl.rollout.engines.engine_checks.check_engine_takes_model`);
- with ``shared_prompt`` (the packed path), the attention backend can run here and the model's
  structure takes the packed layout (:func:`~periodic_rl.attention.integration.
  check_model_supported`; the numerical probe still runs on the first training forward).
"""

from __future__ import annotations

from typing import Any

from periodic_rl.rollout.engines.engine_checks import (
    check_engine_takes_model,
    check_prompts_fit_engine,
    model_text_config,
)


def check_data_and_model(module: Any, source: Any, strategy: Any) -> None:
    """All of the module docstring's checks, for ``source``'s training and held-out rows and
    ``strategy``'s engine (when it is a periodic-async strategy)."""
    rows = [("training row", i, row) for i, row in enumerate(source.train)]
    rows += [("held-out row", i, row) for i, row in enumerate(source.val)]
    check_chat_template(module.tokenizer, rows, module.hparams.system_prompt, module.model_path)
    h = module.hparams
    train_ids, _ = module.encode_prompts(source.train, "training data row")
    val_ids, _ = module.encode_prompts(source.val, "held-out data row")
    options = getattr(getattr(strategy, "rollouts", None), "options", None)
    if options is not None:
        names = [_row_name(kind, i, row) for kind, i, row in rows]
        eval_new = h.eval_max_new_tokens or h.max_new_tokens
        config = model_text_config(module.model_path)
        check_engine_takes_model(options.engine, config, module.model_path)
        settings = getattr(strategy, "rollout_settings", None)
        kwargs = settings.engine_kwargs if settings is not None else options.engine_kwargs
        fit = (options.engine, kwargs, config)
        check_prompts_fit_engine(
            *fit, [len(x) for x in train_ids], names, h.num_generations, h.max_new_tokens
        )
        check_prompts_fit_engine(
            *fit, [len(x) for x in val_ids], names[len(train_ids) :], 1, eval_new
        )
    if h.shared_prompt:
        device = getattr(strategy, "root_device", None)
        dtype = str(module.policy.dtype).removeprefix("torch.")  # dtype: auto, resolved
        check_packed_path(module.policy, h.attention_backend, dtype, device)


def check_chat_template(
    tokenizer: Any, rows: list[tuple[str, int, Any]], system_prompt: str | None, model: str
) -> None:
    """Refuse chat prompts (or a ``system_prompt``) for a tokenizer without a chat template,
    which would fail on the first such prompt (or silently drop the system prompt)."""
    if getattr(tokenizer, "chat_template", None) is not None:
        return
    fix = (
        "give string prompts (they are encoded as plain text), or use a model whose "
        "tokenizer has a chat template (a chat_template entry in tokenizer_config.json, or a "
        "chat_template.jinja file next to it)"
    )
    if system_prompt:
        raise ValueError(
            f"system_prompt is set, but the tokenizer of {model} has no chat template to put it "
            f"in; unset system_prompt, or {fix}"
        )
    for kind, i, row in rows:
        if isinstance(row["prompt"], list):
            raise ValueError(
                f"{_row_name(kind, i, row)} is a list of chat messages, but the tokenizer of "
                f"{model} has no chat template; {fix}"
            )


def check_packed_path(policy: Any, backend: str, dtype: str, device: Any) -> None:
    """Refuse, before any engine starts, an attention backend that cannot train here and a
    model whose structure the packed (``shared_prompt``) forward refuses."""
    import torch

    from periodic_rl.attention.backends import select_backend
    from periodic_rl.attention.integration import (
        SharedPromptUnsupportedError,
        check_model_supported,
    )
    from periodic_rl.config_checks import DTYPES

    device = torch.device(device) if device is not None else torch.device("cpu")
    select_backend(backend, device, DTYPES[dtype], needs_backward=True)
    try:
        check_model_supported(policy)
    except SharedPromptUnsupportedError as err:
        raise SharedPromptUnsupportedError(
            f"shared_prompt=True (the packed forward) refuses this model: {err}"
        ) from err


def _row_name(kind: str, index: int, row: dict[str, Any]) -> str:
    prompt = row["prompt"]
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))
    return f"{kind} {index} (prompt {text[:40]!r})"
