"""Exact or refused, per causal-LM family: what test_families.py checks and the docs table shows.

For every ``model_type`` in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
:func:`evaluate` builds a tiny model (:mod:`tiny_configs`) and runs ``completion_logprobs`` on
three paths (padded, packed with ``sdpa``, packed with ``split``). Each path must either equal
the definition, a plain forward ``model(input_ids=[prompt + completion]).logits`` of every
completion on its own (log-probs within ``LOGP_ATOL``, gradients of a weighted sum within
``GRAD_ATOL`` times the largest reference gradient when that exceeds 1), or raise
``SharedPromptUnsupportedError`` naming the model class.

``CANNOT_BUILD`` lists the families whose tiny model cannot be built on the CPU, or whose plain
forward/backward (the definition itself) fails, each with the reason and a piece of the error it
raises (the test checks that it still does).

``docs/generate_families.py`` renders :func:`evaluate` of every family as the table in
``docs/shared_prompt.md`` and records the same rows in ``family_outcomes.json`` here;
``test_families.py`` checks every row against the record (outcome and refusal reasons; measured
numbers masked), so a refusal that changes its reason, or a family that turns from exact to
refused, shows as a failing test, and checks that the docs table equals the record.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch
from sp_models import UNEQUAL, random_groups, weighted_sum
from tiny_configs import build_tiny_model

from periodic_rl.attention import SharedPromptUnsupportedError, completion_logprobs

LOGP_ATOL = 1e-5
GRAD_ATOL = 1e-4
PATHS = {
    "padded": {"shared_prompt": False},
    "sdpa": {"backend": "sdpa"},
    "split": {"backend": "split"},
}
DOC = Path(__file__).resolve().parents[2] / "docs" / "shared_prompt.md"
# the same rows as the docs table, machine-readable, next to the tests (copies of src/ and tests/
# without docs/, like the mutation runs', still have the record)
RECORD = Path(__file__).resolve().with_name("family_outcomes.json")
START, END = "<!-- families:start -->", "<!-- families:end -->"

# family -> (why it cannot be built / its definition cannot run, a piece of the error it raises)
_DRAFTER = "a drafter for a Gemma 4 model: no vocab of its own, it reads the main model's KV"
_MUSICGEN = "text encoder + audio codec + a decoder over codebook ids; needs both sub-configs"
CANNOT_BUILD: dict[str, tuple[str, str]] = {
    "blt": (
        "byte-latent model made of four sub-models; BltConfig has no num_hidden_layers",
        "num_hidden_layers",
    ),
    "cohere_compass_text": (
        "its 3-D rotary split leaves no frequencies at head_dim 16",
        "expanded size",
    ),
    "gemma3n": ("its vision tower needs the timm library (not installed)", "timm"),
    "gemma4_assistant": (_DRAFTER, "vocab_size"),
    "gemma4_unified_assistant": (_DRAFTER, "vocab_size"),
    "musicgen": (_MUSICGEN, "text_encoder"),
    "musicgen_melody": (_MUSICGEN, "text_encoder"),
    "reformer": (
        "its backward asserts training mode (reversible layers): no eval-mode gradients",
        "model.train()",
    ),
    "rwkv": (
        "its CPU backward fails: an in-place update of a tensor saved for backward",
        "inplace",
    ),
    "xlstm": ("its mLSTM kernel rejects the tiny head sizes", "matC_old"),
    "zamba": (
        "its shared-transformer weight tying does not resolve at 2 layers",
        "tie_weights_keys",
    ),
}


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@dataclass
class PathResult:
    """``kind``: exact, refused, wrong (differs, no refusal) or error (another exception)."""

    kind: str
    logp_diff: float | None = None
    grad_diff: float | None = None
    grad_scale: float | None = None
    message: str = ""


@dataclass
class FamilyResult:
    family: str
    model_class: str = ""
    build_error: str | None = None  # set when building or the definition itself fails
    paths: dict[str, PathResult] = field(default_factory=dict)


def groups() -> list[tuple[list[int], list[list[int]]]]:
    return random_groups(0, UNEQUAL)


def _definition(model: torch.nn.Module, grps: list) -> torch.Tensor:
    """``[N, T]`` log-probs from one plain forward per prompt + completion (zero padded)."""
    t = max(len(c) for _, cs in grps for c in cs)
    rows = []
    for prompt, completions in grps:
        for c in completions:
            logits = model(input_ids=torch.tensor([prompt + c])).logits[0, len(prompt) - 1 : -1]
            lp = logits.float().log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, t - len(c))))
    return torch.stack(rows)


def _grads(model: torch.nn.Module, fn) -> dict[str, torch.Tensor]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    weighted_sum(fn()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name in a.keys() | b.keys():
        x, y = a.get(name), b.get(name)
        x = torch.zeros_like(y) if x is None else x
        y = torch.zeros_like(x) if y is None else y
        worst = max(worst, (x - y).abs().max().item())
    return worst


def _run_path(model: torch.nn.Module, grps: list, ref, ref_grads, kwargs: dict) -> PathResult:
    try:
        with torch.no_grad():
            logps, _ = completion_logprobs(model, grps, **kwargs)
        grads = _grads(model, lambda: completion_logprobs(model, grps, **kwargs)[0])
    except SharedPromptUnsupportedError as err:
        return PathResult("refused", message=str(err))
    except Exception as err:  # noqa: BLE001 - recorded, the test fails on it
        return PathResult("error", message=f"{type(err).__name__}: {err}")
    scale = max(1.0, max(g.abs().max().item() for g in ref_grads.values()))
    res = PathResult(
        "exact",
        logp_diff=(logps - ref).abs().max().item(),
        grad_diff=_max_diff(grads, ref_grads),
        grad_scale=scale,
    )
    if not (res.logp_diff <= LOGP_ATOL and res.grad_diff <= GRAD_ATOL * scale):
        res.kind = "wrong"
    return res


@cache
def evaluate(family: str) -> FamilyResult:
    """Build ``family`` tiny, run the three paths against the definition (cached per process)."""
    torch.set_num_threads(1)  # tiny matrices: threads cost more than they save
    result = FamilyResult(family)
    grps = groups()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = build_tiny_model(family)
            result.model_class = type(model).__name__
            with torch.no_grad():
                ref = _definition(model, grps)
            ref_grads = _grads(model, lambda: _definition(model, grps))
        except Exception as err:  # noqa: BLE001 - compared with CANNOT_BUILD by the test
            result.build_error = f"{type(err).__name__}: {err}"
            return result
        for name, kwargs in PATHS.items():
            result.paths[name] = _run_path(model, grps, ref, ref_grads, kwargs)
    return result


# ---- the docs table ------------------------------------------------------------------------


def _reason(result: FamilyResult, path: PathResult) -> str:
    """The refusal message as one short table cell: no class prefix, first clause."""
    text = path.message
    if text.startswith(result.model_class + ":"):
        text = text[len(result.model_class) + 1 :].strip()
    text = text.replace(f"{result.model_class}.forward", "its forward")
    text = text.replace(result.model_class, "the model")
    text = re.sub(r" \(backend '\w+'\)", "", text).replace("|", "/")
    text = re.sub(r"which backend '\w+'", "which this backend", text)
    cuts = ("; ", ". ", ": use ", ", use ", ": only attention", " (built outside", ": its pos")
    for cut in cuts:
        text = text.split(cut)[0]
    text = text.rstrip(".")
    return text if len(text) <= 140 else text[:137] + "..."


def _cell(result: FamilyResult, path: PathResult) -> str:
    if path.kind == "exact":
        return f"exact ({path.logp_diff:.0e} / {path.grad_diff / path.grad_scale:.0e})"
    if path.kind == "refused":
        return f"refused: {_reason(result, path)}"
    return f"**{path.kind.upper()}**: {path.message[:120]}"


def outcome_kinds(result: FamilyResult) -> str:
    """One word per family: exact, refused (packed), refused, cannot build, or a failure."""
    if result.build_error is not None:
        return "cannot build"
    kinds = [p.kind for p in result.paths.values()]
    if all(k == "exact" for k in kinds):
        return "exact"
    if result.paths["padded"].kind == "exact" and all(k == "refused" for k in kinds[1:]):
        return "padded only"
    if all(k == "refused" for k in kinds):
        return "refused"
    return "/".join(kinds)


def row(r: FamilyResult) -> list[str]:
    """The table cells of one family: family, class, outcome, padded, packed."""
    if r.build_error is not None:
        reason = CANNOT_BUILD.get(r.family, (r.build_error[:120], ""))[0]
        return [f"`{r.family}`", "", "cannot build", reason, ""]
    padded = _cell(r, r.paths["padded"])
    sdpa, split = _cell(r, r.paths["sdpa"]), _cell(r, r.paths["split"])
    packed = sdpa if sdpa == split and r.paths["sdpa"].kind != "exact" else f"{sdpa}, {split}"
    return [f"`{r.family}`", r.model_class, outcome_kinds(r), padded, packed]


def table(results: list[FamilyResult]) -> str:
    """The markdown table (and counts) written between the markers in docs/shared_prompt.md."""
    counts: dict[str, int] = {}
    for r in results:
        counts[outcome_kinds(r)] = counts.get(outcome_kinds(r), 0) + 1
    lines = [
        f"{len(results)} families: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
        "",
        "| family | class | outcome | padded | packed (`sdpa`, `split`) |",
        "|--------|-------|---------|--------|--------------------------|",
    ]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines)


def without_numbers(cells: list[str]) -> list[str]:
    """Cells with measured numbers (1.4e-06, 8.36e-01) masked: they vary with the CPU's kernels."""
    return [re.sub(r"\d+(\.\d+)?e[-+]\d+", "#", c) for c in cells]


def recorded_rows() -> dict[str, list[str]]:
    """``family -> cells`` as recorded by docs/generate_families.py in family_outcomes.json."""
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


def documented_rows() -> dict[str, list[str]]:
    """``family -> cells`` as recorded in the generated table of docs/shared_prompt.md."""
    text = DOC.read_text()
    if START not in text or END not in text:
        return {}
    body = text[text.index(START) : text.index(END)]
    rows = {}
    for line in body.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
    return rows
