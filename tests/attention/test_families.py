"""Every causal-LM family of transformers' auto mapping is exact or refused, on a tiny model.

For each family (``model_type``): the padded path and the packed path (``sdpa`` and ``split``)
of ``completion_logprobs`` either equal a plain forward of every ``prompt + completion`` on its
own (log-probs within 1e-5; gradients of a weighted sum within 1e-4, relative to the largest
reference gradient when that exceeds 1, as Gemma 4's scaled embeddings make it ~40), or raise
``SharedPromptUnsupportedError`` naming the model class. Families that cannot be built are a
recorded list (``families.CANNOT_BUILD``), each checked to still fail as recorded, and at least
30 families must build. Every family's row (outcome and refusal reasons, measured numbers masked)
must match the record ``family_outcomes.json`` that ``.venv/bin/python docs/generate_families.py``
writes together with the table in docs/shared_prompt.md (checked equal): a family that turns from
exact to refused, or a refusal that moves to another check (say, from the structural
``position_ids`` check to the numerical probe), is a failing test, not a silent change.

The tiny models' weights are redrawn with O(1) attention logits (``tiny_configs``): packing with
contiguous positions instead of restarting ones moves the log-probs of every exact family here by
2e-2 to 2.6, far above the tolerance.
"""

from __future__ import annotations

import pytest
from families import (
    CANNOT_BUILD,
    DOC,
    GRAD_ATOL,
    LOGP_ATOL,
    documented_rows,
    evaluate,
    families,
    recorded_rows,
    row,
    without_numbers,
)

FAMILIES = families()
REGENERATE = "regenerate the table: .venv/bin/python docs/generate_families.py"


@pytest.fixture(scope="module")
def recorded():
    return recorded_rows()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_exact_or_refused(family, recorded):
    result = evaluate(family)
    if family in CANNOT_BUILD:
        reason, error_piece = CANNOT_BUILD[family]
        assert result.build_error is not None, f"{family} builds now: drop it from CANNOT_BUILD"
        assert error_piece in result.build_error, (reason, result.build_error)
    else:
        assert result.build_error is None, f"{family}: {result.build_error}"
    for name, path in result.paths.items():
        where = f"{family} ({result.model_class}), {name}"
        if path.kind == "refused":
            assert result.model_class in path.message, f"{where}: {path.message}"
            continue
        assert path.kind == "exact", f"{where}: {path.kind} {path}"
        assert path.logp_diff <= LOGP_ATOL and path.grad_diff <= GRAD_ATOL * path.grad_scale
    # the same outcome and refusal reasons as recorded (and documented, checked below)
    assert without_numbers(row(result)) == without_numbers(recorded.get(family, [])), REGENERATE


def test_the_families_that_cannot_be_built_are_the_recorded_ones():
    assert {f for f in FAMILIES if evaluate(f).build_error is not None} == set(CANNOT_BUILD)
    assert len(FAMILIES) - len(CANNOT_BUILD) >= 30


def test_record_and_docs_table_have_the_same_row_per_family(recorded):
    assert list(recorded) == FAMILIES, REGENERATE
    if not DOC.exists():
        pytest.skip(f"{DOC} is not in this copy of the repository")
    assert documented_rows() == recorded, REGENERATE


# ---- the mechanisms behind the table, one model each -----------------------------------------


def _call_groups():
    from families import groups

    return groups()


def test_probe_refuses_a_decoder_that_drops_position_ids():
    """Accepts position_ids at the top, loses them below: only the numerical probe can tell."""
    import torch
    from tiny_configs import build_tiny_model

    from periodic_rl.attention import SharedPromptUnsupportedError, completion_logprobs
    from periodic_rl.attention.support import forget_verdicts

    model = build_tiny_model("llama")
    inner = model.model.forward
    model.model.forward = lambda *args, position_ids=None, **kwargs: inner(*args, **kwargs)
    with torch.no_grad():
        completion_logprobs(model, _call_groups(), shared_prompt=False)  # right padding: fine
        for _ in range(2):  # the second refusal comes from the cached verdict
            with pytest.raises(SharedPromptUnsupportedError, match="LlamaForCausalLM: the packed"):
                completion_logprobs(model, _call_groups(), backend="split")
        model.model.forward = inner
        with pytest.raises(SharedPromptUnsupportedError, match="on a probe"):
            completion_logprobs(model, _call_groups(), backend="split")  # still cached
        forget_verdicts(model)
        completion_logprobs(model, _call_groups(), backend="split")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
def test_in_bf16_the_probe_accepts_the_exact_path_and_refuses_lost_position_ids(family):
    """Half precision: rounding alone moves single tokens, yet a decoder that loses
    ``position_ids`` below the top is still refused, and the exact packed path accepted."""
    import torch
    from tiny_configs import build_tiny_model

    from periodic_rl.attention import SharedPromptUnsupportedError, completion_logprobs

    model = build_tiny_model(family).to(torch.bfloat16)
    with torch.no_grad():
        completion_logprobs(model, _call_groups(), backend="split")  # probed: exact
        broken = build_tiny_model(family).to(torch.bfloat16)
        inner = broken.model.forward
        broken.model.forward = lambda *args, position_ids=None, **kwargs: inner(*args, **kwargs)
        with pytest.raises(SharedPromptUnsupportedError, match=r"largest difference .*bfloat16"):
            completion_logprobs(broken, _call_groups(), backend="split")


def test_probe_refuses_a_padded_forward_that_sees_the_padding():
    """A bidirectional model that drops the attention mask: padding changes its output."""
    import torch
    from tiny_configs import build_tiny_model

    from periodic_rl.attention import SharedPromptUnsupportedError, completion_logprobs

    model = build_tiny_model("bert", is_decoder=False)
    inner = model.bert.forward
    model.bert.forward = lambda *args, attention_mask=None, **kwargs: inner(*args, **kwargs)
    with torch.no_grad(), pytest.raises(SharedPromptUnsupportedError, match="padded forward"):
        completion_logprobs(model, _call_groups(), shared_prompt=False)


def test_layer_without_kwargs_uses_the_forward_context_except_under_checkpointing():
    """StableLM's decoder layer does not pass kwargs to its attention (layout from the context)."""
    from tiny_configs import build_tiny_model

    from periodic_rl.attention import (
        SharedPromptUnsupportedError,
        completion_logprobs,
        shared_prompt_attention,
    )

    model = build_tiny_model("stablelm")
    model.gradient_checkpointing_enable()
    model.train()
    with shared_prompt_attention(model):
        with pytest.raises(SharedPromptUnsupportedError, match="StableLmForCausalLM: .*kwargs"):
            completion_logprobs(model, _call_groups(), backend="split")
