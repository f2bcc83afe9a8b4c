"""Exact or refused: a numerical probe per model, on top of the structural checks.

The checks in :mod:`periodic_rl.attention.integration` refuse what can be read off a model before
it runs (no attention interface, no ``position_ids``, layers that are not attention, masks built
outside the mask interface, layers that never see the layout, ...). What they cannot see is a
model that accepts everything and still computes something else: an absolute position table read
with an offset, a decoder that drops ``position_ids`` on the way down, a layer that mixes tokens
without being called one, a forward that mishandles padding. So the first time a model meets a
(path, backend, dtype, device), :func:`ensure_exact` runs that path on a probe and compares it
with the definition: a plain forward ``model(input_ids=[prompt + completion])`` of each
completion on its own. A model that differs is refused with
:class:`~periodic_rl.attention.integration.SharedPromptUnsupportedError` (both paths: the padded
one too, where padding or batching changes the numbers); the verdict is kept for that model
object.

The probe is built from the call's own tokens (so they are valid ids of this vocabulary), always
with the same shapes (so every rank of a sharded model runs the same forwards): two groups, the
first with two responses (positions must restart for the second), the second after it (prompt
boundaries). It runs under ``torch.no_grad()`` with the model in eval mode (modes restored
after), a few dozen tokens in all. In half precision the first response is longer (16 tokens:
a path that continues the positions is off by 16 there, not 3), so that a structural mistake
stands out of the rounding.

Tolerance: log-probs in fp32/fp64 must agree within 1e-3 at every probe token (a structural
mistake moves them by 1e-2 to 1 on the tiny test models and far more on real ones; rounding of a
30-layer fp32 model stays near 1e-5). In bf16/fp16 (and fp32 with TF32 matmuls) rounding alone
moves single tokens by 1e-2 and more, and a structural mistake on a small model may move the
mean by little more: there the largest difference must stay under :data:`HALF_LIMIT`, or under
:data:`NOISE_FACTOR` times the rounding noise of the definition itself when that is larger (the
same plain forwards, one token longer: the same numbers in exact arithmetic, computed with other
shapes). On the tiny test models in bf16 an exact path stays under 0.03 and one that drops
``position_ids`` exceeds 0.25 (``benchmarks/gpu_check.py``'s probe check measures both).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from periodic_rl.attention.integration import SharedPromptUnsupportedError, unwrap_model
from periodic_rl.attention.packing import Group

LogprobsFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # completion_logprobs' signature

# model -> {(backend or None for padded, dtype, device type): None (exact) or the refusal}
_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, str | None]] = (
    weakref.WeakKeyDictionary()
)
_PROBING: ContextVar[bool] = ContextVar("periodic_rl_probing", default=False)


def probe_groups(groups: list[Group], half: bool = False) -> list[Group]:
    """Fixed-shape probe groups made of the tokens of ``groups`` (cycled); [] if there are none.
    ``half``: the longer shapes of the half-precision probe (module docstring)."""
    pool = [
        t for prompt, completions in groups for t in (*prompt, *(x for c in completions for x in c))
    ]
    if not pool:
        return []

    def take(start: int, n: int) -> list[int]:
        return [int(pool[(start + i) % len(pool)]) for i in range(n)]

    if half:
        return [(take(0, 4), [take(4, 16), take(20, 4)]), (take(24, 3), [take(27, 8), take(35, 4)])]
    return [(take(0, 4), [take(4, 3), take(7, 2)]), (take(9, 3), [take(12, 2)])]


#: The half-precision limit on the largest probe difference (module docstring).
HALF_LIMIT = 0.1
#: How many times the definition's own rounding noise a half-precision path may differ by.
NOISE_FACTOR = 4.0


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _plain_logprobs(
    model: torch.nn.Module, groups: list[Group], device: torch.device, extra: int = 0
) -> list:
    """The definition: one forward per ``prompt + completion``, nothing else passed; with
    ``extra``, that many more tokens after it (causal: the same log-probs, other shapes)."""
    out = []
    for prompt, completions in groups:
        for c in completions:
            ids = torch.tensor([prompt + c + prompt[:extra]], dtype=torch.long, device=device)
            end = len(prompt) + len(c) - 1
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : end].float()
            target = torch.tensor(c, dtype=torch.long, device=device)[:, None]
            out.append(logits.log_softmax(-1).gather(-1, target)[:, 0])
    return out


def exact_precision(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the probe holds the path to fp32 agreement (else half precision's rule)."""
    tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return dtype in (torch.float32, torch.float64) and not tf32


def _mismatch(
    dtype: torch.dtype, device: torch.device, diffs: torch.Tensor, noise: float = 0.0
) -> str | None:
    """Why ``diffs`` (|probe - definition| per token) is too large, or None; ``noise``: the
    definition's own largest rounding difference (half precision only)."""
    worst = diffs.max().item()
    if exact_precision(dtype, device):
        return None if worst <= 1e-3 else f"largest difference {worst:.2e} > 1e-3"
    limit = max(HALF_LIMIT, NOISE_FACTOR * noise)
    if worst <= limit:
        return None
    return f"largest difference {worst:.2e} > {limit:.2e} ({dtype}; rounding noise {noise:.2e})"


def _probe(
    model: torch.nn.Module,
    groups: list[Group],
    backend: str | None,
    pad_token_id: int,
    device: torch.device,
    dtype: torch.dtype,
    completion_logprobs: LogprobsFn,
) -> str | None:
    token = _PROBING.set(True)
    try:
        with torch.no_grad(), _eval_mode(model):
            got, _ = completion_logprobs(
                model,
                groups,
                shared_prompt=backend is not None,
                backend=backend or "auto",
                pad_token_id=pad_token_id,
            )
            want = _plain_logprobs(model, groups, device)
            noise = 0.0
            if not exact_precision(dtype, device):
                longer = _plain_logprobs(model, groups, device, extra=1)
                noise = max((a - b).abs().max().item() for a, b in zip(want, longer, strict=True))
    finally:
        _PROBING.reset(token)
    diffs = torch.cat([(got[i, : len(w)] - w).abs() for i, w in enumerate(want)])
    why = _mismatch(dtype, device, diffs, noise)
    if why is None:
        return None
    name = type(unwrap_model(model)).__name__
    if backend is not None:
        what = f"the packed forward (backend {backend!r})"
        hint = (
            "its positions or token mixing differ from what the checks read off the model; "
            "use shared_prompt=False"
        )
    else:
        what = "the padded forward (shared_prompt=False)"
        hint = (
            "padding or batching changes its output (it mishandles the attention mask, or "
            "rows influence each other); compute one completion per forward instead"
        )
    return (
        f"{name}: {what} differs from a plain forward of each prompt + completion on a probe "
        f"({why}): {hint}"
    )


def ensure_exact(
    model: torch.nn.Module,
    groups: list[Group],
    backend: str | None,
    pad_token_id: int,
    where: tuple[torch.device, torch.dtype],
    completion_logprobs: LogprobsFn,
) -> None:
    """Raise the cached or freshly probed refusal for this model and path; no-op once verified.

    ``backend`` is the packed path's backend name, None for the padded path; ``where`` the
    model's device and (autocast) dtype; ``completion_logprobs`` the path under test
    (:func:`periodic_rl.attention.logprobs.completion_logprobs`, which calls this). Structural
    refusals raised while probing (by the checks, on the probe) propagate as they are and are not
    cached: they may depend on the call (a sliding window against its lengths).
    """
    if _PROBING.get():
        return
    device, dtype = where
    verdicts = _VERDICTS.setdefault(model, {})
    key = (backend, dtype, device.type)
    if key not in verdicts:
        probe = probe_groups(groups, half=not exact_precision(dtype, device))
        if not probe:
            return
        verdicts[key] = _probe(
            model, probe, backend, pad_token_id, device, dtype, completion_logprobs
        )
    reason = verdicts[key]
    if reason is not None:
        raise SharedPromptUnsupportedError(reason)


def forget_verdicts(model: torch.nn.Module) -> None:
    """Probe ``model`` again on its next call (after changing its config or attention code)."""
    _VERDICTS.pop(model, None)
