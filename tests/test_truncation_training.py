"""Length limits end to end (tiny model, in-process HF engine, plain SGD): masked truncated
completions contribute nothing to the update, K micro-batches still equal one batch, the
overlong penalty and the prompt limit reach the logged metrics, and ``prompt_truncation="error"``
stops a run before anything is generated.

The tiny random model almost never samples its one EOS in 8 tokens, so every completion would
be truncated. ``many_eos_path`` is the same model whose ``generation_config`` ends a completion
on any of 5000 token ids (about 10% of its near-uniform distribution): about a third of the
completions then hit ``max_new_tokens`` without EOS.
"""

from __future__ import annotations

import shutil

import lightning as L
import pytest
import torch
from rl_helpers import ORDER_TOLERANCE, max_diff, train

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule

LR = 0.5  # train()'s SGD learning rate, no gradient clipping
#: Largest parameter difference between the trainer's update and the one computed here with a
#: plain, unpadded forward per completion (another float summation order). Measured: 1.5e-7
#: at most; dropping the mask, or the masked token count, moves the weights by 2e-2 to 5e-2.
INDEPENDENT_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def many_eos_path(tiny_llama_path, tmp_path_factory) -> str:
    from transformers import GenerationConfig

    path = tmp_path_factory.mktemp("tiny-llama-many-eos") / "model"
    shutil.copytree(tiny_llama_path, path)
    eos = [2, *range(1000, 6000)]
    GenerationConfig(bos_token_id=1, eos_token_id=eos, pad_token_id=2).save_pretrained(path)
    return str(path)


def expected_update(path: str, groups, loss_type: str, masked: bool, tokens_normaliser=None):
    """Parameters after one SGD step on the groups' loss, computed here independently of the
    trainer: the policy from disk, one plain forward per kept completion, the loss written out.

    With ``old_logps = logps.detach()`` the clipped surrogate of a token is ``-A * ratio`` with
    ``ratio = exp(logp - logp.detach()) == 1`` (no clipping), ``beta = 0``. ``dapo``: the sum over
    kept tokens / kept tokens (``tokens_normaliser`` overrides the count); ``grpo``: the mean over
    ALL completions (TRL's ``.mean()`` over every row) of each kept one's token mean.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    terms, num_sequences, num_tokens = [], 0, 0
    for group in groups:
        rows = zip(group.completion_ids, group.advantages, group.truncated, strict=True)
        for ids, advantage, truncated in rows:
            num_sequences += 1
            if masked and truncated:
                continue
            num_tokens += len(ids)
            x = torch.tensor([group.prompt_ids + ids])
            logits = model(input_ids=x).logits[0, len(group.prompt_ids) - 1 : -1]
            logps = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(ids)), ids]
            terms.append((advantage, torch.exp(logps - logps.detach())))
    if loss_type == "dapo":
        normaliser = tokens_normaliser if tokens_normaliser is not None else num_tokens
        loss = sum(-a * ratio.sum() for a, ratio in terms) / normaliser
    else:
        loss = sum(-a * ratio.mean() for a, ratio in terms) / num_sequences
    loss.backward()
    return {n: (p - LR * p.grad).detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_masked_truncated_completions_contribute_nothing(many_eos_path, loss_type):
    """One iteration in 3 micro-batches with ``mask_truncated_completions``: the update equals
    the one computed here on the untruncated completions only (their tokens alone normalise
    ``dapo``; ``grpo`` averages over every completion, as TRL does), and differs clearly from
    the unmasked update and from a masked loss over the unmasked token count."""
    params, module, _ = train(
        many_eos_path,
        steps=1,
        micro_batch_size=4,
        mask_truncated_completions=True,
        loss_type=loss_type,
    )
    groups = module.last_iteration.groups
    flags = [t for g in groups for t in g.truncated]
    assert len(flags) == 12 and 0 < sum(flags) < 12  # a mix of truncated and finished ones
    kept = [(a, t) for g in groups for a, t in zip(g.advantages, g.truncated, strict=True)]
    assert any(a != 0 for a, t in kept if not t) and any(a != 0 for a, t in kept if t)
    assert module.last_iteration.metrics()["frac_truncated"] == sum(flags) / 12

    expected = expected_update(many_eos_path, groups, loss_type, masked=True)
    assert max_diff(params, expected) <= INDEPENDENT_TOLERANCE
    # the test can tell: the truncated completions, or their tokens, would move the weights
    unmasked = expected_update(many_eos_path, groups, loss_type, masked=False)
    assert max_diff(params, unmasked) > 100 * INDEPENDENT_TOLERANCE
    if loss_type == "dapo":
        all_tokens = module.last_iteration.num_tokens
        miscounted = expected_update(
            many_eos_path, groups, loss_type, masked=True, tokens_normaliser=all_tokens
        )
        assert max_diff(params, miscounted) > 100 * INDEPENDENT_TOLERANCE
    assert module.last_iteration.loss["tokens"] == sum(
        len(c) for g in groups for c, t in zip(g.completion_ids, g.truncated, strict=True) if not t
    )


def test_k_micro_batches_equal_one_batch_with_masking(many_eos_path):
    """The token normaliser (``dapo``) is streamed: it must count the masked tokens only."""
    kwargs = dict(steps=2, mask_truncated_completions=True, loss_type="dapo")
    one, module, _ = train(many_eos_path, micro_batch_size=12, **kwargs)
    three, _, _ = train(many_eos_path, micro_batch_size=4, **kwargs)
    assert 0 < module.last_iteration.truncated < 12
    assert max_diff(one, three) <= ORDER_TOLERANCE


def test_overlong_penalty_and_prompt_truncation_reach_the_metrics(many_eos_path):
    """``overlong_buffer=3`` of 8 new tokens; prompts cut to their last 12 tokens."""
    params, module, _ = train(
        many_eos_path, steps=1, overlong_buffer=3, overlong_penalty=0.5, max_prompt_length=12
    )
    stats = module.last_iteration
    for group in stats.groups:
        full = module.encode_prompt(group.prompt)
        assert len(full) > 12 and group.prompt_ids == full[-12:]  # the last tokens are kept
        lengths = [len(c) for c in group.completion_ids]
        penalty = [min(0.0, (5 - n) / 3 * 0.5) for n in lengths]
        assert group.reward_components["overlong"] == pytest.approx(penalty)
        task = group.reward_components["length_reward"]
        assert group.rewards == pytest.approx([r + p for r, p in zip(task, penalty, strict=True)])
    logged = module.trainer.callback_metrics
    assert float(logged["prompts_truncated"]) == 3.0  # every prompt of the iteration
    penalties = [p for g in stats.groups for p in g.reward_components["overlong"]]
    assert float(logged["rewards/overlong"]) == pytest.approx(sum(penalties) / 12, abs=1e-6)
    assert min(penalties) == -0.5
    assert float(logged["frac_truncated"]) == pytest.approx(stats.truncated / 12)


def _fit_rows(path, rows, tmp_path, calls, strategy):
    """Fit one iteration on ``rows`` (in file order, 3 per iteration, G = 2) with
    ``max_prompt_length=40, prompt_truncation="error"`` (a short prompt has 31 tokens, chat
    template included); ``calls`` records each reward call."""
    import json

    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def counting(prompts, completions, **columns):
        calls.append(len(completions))
        return [float(len(c)) for c in completions]

    module = RLModule(
        model=path,
        num_generations=2,
        micro_batch_size=2,
        max_new_tokens=4,
        reward_funcs=[counting],
        max_prompt_length=40,
        prompt_truncation="error",
    )
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(source=str(source), batch_size=3, num_val=0, shuffle=False)
    trainer.fit(module, datamodule=data)


LONG = {"prompt": "count: " + " ".join(str(i) for i in range(40))}


def test_error_mode_refuses_a_long_prompt_before_the_iteration_generates(many_eos_path, tmp_path):
    """Setup encodes every training row: the third prompt is too long, refused in setup
    (before the rewards' probe, before any engine starts), naming it."""
    calls: list[int] = []
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    rows = [{"prompt": "hi"}, {"prompt": "yo"}, LONG]
    with pytest.raises(ValueError, match=r"training data row 2 has \d+ tokens") as raised:
        _fit_rows(many_eos_path, rows, tmp_path, calls, strategy)
    assert "max_prompt_length=40" in str(raised.value)
    assert "prompt_truncation='left'" in str(raised.value)
    assert calls == []  # refused before the rewards' probe: nothing was generated
    assert strategy.rollouts.backend is None


def test_error_mode_refuses_a_long_data_row_in_setup(many_eos_path, tmp_path):
    calls: list[int] = []
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    rows = [LONG, {"prompt": "hi"}, {"prompt": "yo"}]
    with pytest.raises(ValueError, match=r"training data row 0 has \d+ tokens"):
        _fit_rows(many_eos_path, rows, tmp_path, calls, strategy)
    assert calls == []
    assert strategy.rollouts.backend is None  # nothing expensive was started
