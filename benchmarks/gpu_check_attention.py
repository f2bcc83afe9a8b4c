"""The attention parts of the GPU check: packing exact, the probe's tolerance, the benchmark.

- :func:`check_packing`: for each family, dtype and backend (``sdpa``, ``split``, ``flex``), the
  packed ``completion_logprobs`` against the padded one, forward (log-probs) and backward
  (gradients of a weighted sum). fp32: within 1e-4 (log-probs) and 1e-3 (gradients, relative
  to the largest). bf16: both are compared with the padded forward in fp32 on the same
  bf16-rounded weights, and the packed path may be off by at most twice what the padded one is
  (plus a small floor): packing adds no error beyond bf16's own rounding.
- :func:`check_probe`: the numerical probe (``periodic_rl.attention.support``) accepts the exact
  packed path and refuses a broken one (a decoder that drops ``position_ids``) in each dtype, so
  its bf16 tolerance sits between rounding and a structural mistake; both distances recorded (a
  broken path the probe accepted: its mean and largest distance from the definition).
- :func:`benchmark`: packed against padded forward-backward of one group on a 0.5B Qwen2 shape
  in bf16: completion tokens per second and peak memory, at G = 8, 16 and prompts of 512, 2048.
"""

from __future__ import annotations

import copy
import re
import time
from typing import Any

import torch
from gpu_check_common import Budget, CheckFailed, NotRun, Setting, dtype_name, summarise
from gpu_check_models import (
    FAMILIES,
    UNEQUAL,
    family_config,
    family_model,
    qwen2_half_billion,
    random_groups,
)

from periodic_rl.attention import SharedPromptUnsupportedError, completion_logprobs
from periodic_rl.attention.support import (
    HALF_LIMIT,
    NOISE_FACTOR,
    forget_verdicts,
    probe_groups,
)

FP32_LOGP, FP32_GRAD = 1e-4, 1e-3
BF16_FACTOR, BF16_FLOOR = 2.0, 5e-3
BACKENDS = ("sdpa", "split", "flex")


def _weighted(logps: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(0.1, 1.0, logps.numel(), device=logps.device).view_as(logps)
    return (logps * weights).sum()


def _run(model: torch.nn.Module, groups: list, backward: bool, **kwargs: Any) -> tuple:
    """Log-probs (fp32, masked) and, with ``backward``, the fp32 gradients of a weighted sum."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        logps, mask = completion_logprobs(model, groups, **kwargs)
        if backward:
            _weighted(logps * mask).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return (logps * mask).detach().float(), grads


def _grad_error(grads: dict, reference: dict) -> float:
    """Largest gradient difference relative to the largest reference gradient."""
    if not reference:
        return 0.0
    scale = max(g.abs().max().item() for g in reference.values()) or 1.0
    return max((grads[k] - reference[k]).abs().max().item() for k in reference) / scale


def _packing_case(
    family: str, dtype: torch.dtype, backend: str, backward: bool, setting: Setting
) -> dict[str, Any]:
    groups = random_groups(4, UNEQUAL[:3] if setting.quick else UNEQUAL)
    model32 = family_model(family).to(setting.device)
    if dtype == torch.float32:
        ref, ref_grads = _run(model32, groups, backward, shared_prompt=False)
        got, grads = _run(model32, groups, backward, backend=backend)
        logp, grad = (got - ref).abs().max().item(), _grad_error(grads, ref_grads)
        ok = logp <= FP32_LOGP and grad <= FP32_GRAD
        return dict(logp_diff=logp, grad_rel_diff=grad, passed=ok)
    model16 = copy.deepcopy(model32).to(dtype)
    model32 = copy.deepcopy(model16).float()  # the same rounded weights, computed in fp32
    ref, ref_grads = _run(model32, groups, backward, shared_prompt=False)
    padded, padded_grads = _run(model16, groups, backward, shared_prompt=False)
    packed, packed_grads = _run(model16, groups, backward, backend=backend)
    numbers = dict(
        logp_diff=(packed - ref).abs().max().item(),
        padded_logp_diff=(padded - ref).abs().max().item(),
        grad_rel_diff=_grad_error(packed_grads, ref_grads),
        padded_grad_rel_diff=_grad_error(padded_grads, ref_grads),
    )
    numbers["passed"] = (
        numbers["logp_diff"] <= (BF16_FACTOR * numbers["padded_logp_diff"] + BF16_FLOOR)
        and numbers["grad_rel_diff"] <= BF16_FACTOR * numbers["padded_grad_rel_diff"] + BF16_FLOOR
    )
    return numbers


def check_packing(setting: Setting, budget: Budget) -> dict[str, Any]:
    """Shared-prompt packing exact against the padded forward (module docstring)."""
    families = ["llama"] if setting.quick else list(FAMILIES)
    rows: list[dict[str, Any]] = []
    for family in families:
        for dtype in setting.dtypes:
            for backend in BACKENDS:
                row: dict[str, Any] = dict(family=family, dtype=dtype_name(dtype), backend=backend)
                rows.append(row)
                for direction in ("forward", "backward"):
                    key = f"{direction}_status"
                    if direction == "backward" and backend == "flex" and not setting.cuda:
                        row[key] = "not-run"
                        row["reason"] = "FlexAttention has no CPU backward"
                        continue
                    if not budget.allows():
                        row[key], row["reason"] = "not-run", "time budget spent"
                        continue
                    try:
                        numbers = _packing_case(
                            family, dtype, backend, direction == "backward", setting
                        )
                    except Exception as error:  # recorded per case, the others still run
                        row[key], row["error"] = "failed", f"{type(error).__name__}: {error}"
                        continue
                    passed = numbers.pop("passed")
                    row.update({f"{direction}_{k}": v for k, v in numbers.items()})
                    row[key] = "passed" if passed else "failed"
                statuses = {row.get("forward_status"), row.get("backward_status")}
                row["status"] = (
                    "failed" if "failed" in statuses else "passed" if "passed" in statuses else
                    "not-run"
                )  # fmt: skip
    numbers = {"cases": rows, "counts": summarise(rows)}
    if numbers["counts"]["failed"]:
        raise CheckFailed(f"{numbers['counts']['failed']} packing case(s) failed", numbers)
    return numbers


def _plain_mean_diff(model: torch.nn.Module, groups: list, backend: str) -> dict[str, float]:
    """The probe's own measure on its groups: packed against one plain forward per completion."""
    probe = probe_groups(groups, half=next(model.parameters()).dtype != torch.float32)
    got, _ = completion_logprobs(model, probe, backend=backend)
    diffs = []
    for i, (prompt, completion) in enumerate((p, c) for p, cs in probe for c in cs):
        ids = torch.tensor([prompt + completion], device=got.device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        want = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        diffs.append((got[i, : len(completion)] - want).abs())
    diffs_all = torch.cat(diffs)
    return dict(mean=diffs_all.mean().item(), max=diffs_all.max().item())


def _refused_distance(message: str) -> float | None:
    match = re.search(r"(?:mean|largest) difference ([0-9.e+-]+)", message)
    return float(match.group(1)) if match else None


def check_probe(setting: Setting, budget: Budget) -> dict[str, Any]:
    """The probe accepts the exact packed path and refuses a broken one, in each dtype."""
    backend = "auto"
    families = ["llama"] if setting.quick else list(FAMILIES)
    rows: list[dict[str, Any]] = []
    for family in families:
        for dtype in setting.dtypes:
            row: dict[str, Any] = dict(family=family, dtype=dtype_name(dtype))
            rows.append(row)
            if not budget.allows():
                row["status"], row["reason"] = "not-run", "time budget spent"
                continue
            model = family_model(family).to(setting.device, dtype)
            groups = random_groups(5, UNEQUAL)
            with torch.no_grad():
                try:
                    completion_logprobs(model, groups, backend=backend)  # probes, must accept
                    exact = _plain_mean_diff(model, groups, backend)
                    row.update(exact_mean=exact["mean"], exact_max=exact["max"], accepted=True)
                except SharedPromptUnsupportedError as error:
                    row.update(accepted=False, error=str(error))
                inner = model.model.forward
                model.model.forward = lambda *a, position_ids=None, _f=inner, **k: _f(*a, **k)
                forget_verdicts(model)
                try:
                    completion_logprobs(model, groups, backend=backend)
                    broken = _plain_mean_diff(model, groups, backend)  # accepted: how far off
                    row.update(refused_broken=False, broken_mean=broken["mean"])
                    row["broken_max"] = broken["max"]
                except SharedPromptUnsupportedError as error:
                    row.update(refused_broken=True, broken_distance=_refused_distance(str(error)))
            half = f"max {HALF_LIMIT:g}, or {NOISE_FACTOR:g} x the definition's rounding noise"
            row["tolerance"] = "max 1e-3" if dtype == torch.float32 else half
            row["status"] = "passed" if row["accepted"] and row["refused_broken"] else "failed"
    numbers = {"cases": rows, "counts": summarise(rows)}
    if numbers["counts"]["failed"]:
        raise CheckFailed(f"{numbers['counts']['failed']} probe case(s) failed", numbers)
    return numbers


def _step(model: torch.nn.Module, groups: list, shared: bool, cuda: bool) -> float:
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    logps, mask = completion_logprobs(model, groups, shared_prompt=shared)
    (logps * mask).sum().backward()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def benchmark(setting: Setting, budget: Budget) -> dict[str, Any]:
    """Packed against padded forward-backward of one group (module docstring)."""
    if setting.quick:
        config = family_config("qwen2", tie_word_embeddings=True)
        prompts, sizes, reply, repeats = (32,), (2,), 8, 1
        dtype = torch.float32
    else:
        config = qwen2_half_billion()
        prompts, sizes, reply, repeats = (512, 2048), (8, 16), 256, 2
        dtype = torch.bfloat16
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(setting.device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    rows: list[dict[str, Any]] = []
    for prompt in prompts:
        for g in sizes:
            groups = random_groups(prompt + g, [(prompt, [reply] * g)], vocab=config.vocab_size)
            for layout, shared in (("padded", False), ("packed", True)):
                row: dict[str, Any] = dict(prompt=prompt, G=g, reply=reply, layout=layout)
                rows.append(row)
                if not budget.allows(20.0):
                    row["status"], row["reason"] = "not-run", "time budget spent"
                    continue
                try:
                    _step(model, groups, shared, setting.cuda)  # warm-up: probe, compile
                    if setting.cuda:
                        torch.cuda.reset_peak_memory_stats()
                    seconds = min(
                        _step(model, groups, shared, setting.cuda) for _ in range(repeats)
                    )
                except torch.OutOfMemoryError as error:
                    row["status"], row["error"] = "failed", f"out of memory: {error}"[:300]
                    continue
                row.update(
                    status="passed",
                    seconds=seconds,
                    tokens_per_s=g * reply / seconds,
                    peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30
                    if setting.cuda
                    else None,
                )
            model.zero_grad(set_to_none=True)
    numbers: dict[str, Any] = {
        "parameters": params,
        "dtype": dtype_name(dtype),
        "backend": "auto",
        "rows": rows,
        "counts": summarise(rows),
    }
    if numbers["counts"]["passed"] == 0:
        raise NotRun("no benchmark row had time to run")
    return numbers
