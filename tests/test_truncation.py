"""Length limits without a model: the soft overlong penalty on hand-picked lengths, the
truncation flags and the penalty in scoring (before the advantages), the loss mask, the
iteration counts, prompt truncation, and the refused settings."""

from __future__ import annotations

import pytest
import torch

from periodic_rl import RLModule
from periodic_rl.algorithms.advantages import group_advantages
from periodic_rl.iteration import IterationStats
from periodic_rl.rollout.types import GeneratedGroup
from periodic_rl.scoring import Scorer
from periodic_rl.truncation import (
    eos_token_ids,
    fit_prompts,
    is_truncated,
    mask_truncated,
    overlong_penalty,
)

EOS = 2


def dapo_eq13(length: int, l_max: int, l_cache: int) -> float:
    """DAPO Eq. 13 as TRL's ``get_soft_overlong_punishment`` writes it (penalty factor 1)."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (1, 0.0), (12, 0.0), (15, 0.0), (16, -0.2), (17, -0.4), (19, -0.8), (20, -1.0)],
)
def test_overlong_penalty_on_hand_picked_lengths(length, expected):
    """L_max = 20, buffer 5: 0 up to 15 tokens, then -1/5 per token down to -1 at 20."""
    assert overlong_penalty(length, 20, 5, 1.0) == pytest.approx(expected, abs=1e-12)
    assert overlong_penalty(length, 20, 5, 1.0) == pytest.approx(dapo_eq13(length, 20, 5))
    # verl's penalty_factor scales the ramp: -0.5 at the cap with a factor 0.5
    assert overlong_penalty(length, 20, 5, 0.5) == pytest.approx(expected * 0.5, abs=1e-12)


def test_truncated_means_at_the_cap_without_eos():
    eos = {EOS, 7}
    assert is_truncated([5, 5, 5, 5], 4, eos)  # the cap, no EOS
    assert not is_truncated([5, 5, 5, EOS], 4, eos)  # its EOS is the last allowed token
    assert not is_truncated([5, 5, 5, 7], 4, eos)  # any of the EOS ids
    assert not is_truncated([5, EOS], 4, eos)
    assert not is_truncated([5, 5], 4, eos)  # stopped early for another reason: not truncated


def test_eos_ids_are_the_tokenizer_s_and_the_generation_config_s():
    tokenizer = type("T", (), {"eos_token_id": 2})()
    config = type("C", (), {"eos_token_id": [2, 9, 11]})()
    model = type("M", (), {"generation_config": config})()
    assert eos_token_ids(tokenizer, model) == (2, 9, 11)
    assert eos_token_ids(tokenizer) == (2,)


class StubTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, c)) for c in ids]


def constant(prompts, completions, **columns):
    return [1.0] * len(completions)


def scored(scale_rewards="group", **scorer):
    # lengths 20 (no EOS: truncated), 20 ending on EOS, 17 ending on EOS, 2
    completions = [[5] * 20, [5] * 19 + [EOS], [5] * 16 + [EOS], [5, EOS]]
    generated = GeneratedGroup(0, completions, version=0, fingerprint="f", worker=0, seed=0)
    scorer = Scorer(
        StubTokenizer(),
        [constant],
        [1.0],
        scale_rewards=scale_rewards,
        max_new_tokens=20,
        eos_token_ids=(EOS,),
        **scorer,
    )
    return scorer, generated


def test_overlong_penalty_is_part_of_the_reward_before_the_advantages():
    """A constant task reward gives zero advantages; the penalty alone must create them."""
    scorer, generated = scored(overlong_buffer=5, overlong_penalty=2.0)
    group = scorer.score(generated, {"prompt": "p"}, [1, 2])
    penalties = [-2.0, -2.0, -0.8, 0.0]  # 20, 20, 17, 2 tokens (the EOS counts)
    assert group.reward_components["overlong"] == pytest.approx(penalties)
    assert group.reward_components["constant"] == [1.0] * 4
    assert group.rewards == pytest.approx([1.0 + p for p in penalties])
    expected = group_advantages(torch.tensor(group.rewards, dtype=torch.float64), 4)
    assert group.advantages == pytest.approx(expected.tolist())
    assert group.advantages[0] < 0 < group.advantages[3]
    assert group.truncated == [True, False, False, False]


def test_batch_scaled_advantages_see_the_penalty_too():
    scorer, generated = scored(scale_rewards="batch", overlong_buffer=5)
    group = scorer.score(generated, {"prompt": "p"}, [1, 2])
    assert group.advantages == []  # filled once the iteration is in
    scorer.scale_batch([group])
    expected = group_advantages(torch.tensor(group.rewards, dtype=torch.float64), 4, "batch")
    assert group.advantages == pytest.approx(expected.tolist())
    assert max(group.advantages) > min(group.advantages)


def test_without_a_buffer_no_penalty_and_held_out_groups_are_left_alone():
    scorer, generated = scored()
    group = scorer.score(generated, {"prompt": "p"}, [1, 2])
    assert "overlong" not in group.reward_components
    assert group.rewards == [1.0] * 4
    assert group.truncated == [True, False, False, False]  # flagged whether masked or not
    scorer, generated = scored(overlong_buffer=5)
    held_out = scorer.score(generated, {"prompt": "p"}, [1, 2], held_out=True)
    assert "overlong" not in held_out.reward_components and held_out.rewards == [1.0] * 4
    assert held_out.truncated == []


def test_scorer_refuses_a_clashing_overlong_reward_name():
    def overlong(prompts, completions, **columns):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="named 'overlong'"):
        Scorer(StubTokenizer(), [overlong], [1.0], max_new_tokens=8, overlong_buffer=2)


def test_mask_zeroes_the_rows_of_truncated_completions():
    scorer, generated = scored()
    group = scorer.score(generated, {"prompt": "p"}, [1, 2])
    mask = torch.ones(4, 20)
    masked = mask_truncated(mask, [group])
    assert masked.sum(dim=1).tolist() == [0.0, 20.0, 20.0, 20.0]
    group.truncated = []  # scored without flags: refused, not silently kept
    with pytest.raises(ValueError, match="truncation flags"):
        mask_truncated(mask, [group])


def test_iteration_counts_truncated_completions_and_masked_tokens():
    scorer, generated = scored()
    stats = IterationStats(finished=1.0)
    stats.add_groups([scorer.score(generated, {"prompt": "p"}, [1, 2])])
    assert stats.num_tokens == 20 + 20 + 17 + 2
    assert stats.loss_tokens(mask_truncated_completions=False) == 59
    assert stats.loss_tokens(mask_truncated_completions=True) == 39
    metrics = stats.metrics()
    assert metrics["frac_truncated"] == 0.25
    assert "prompts_truncated" not in metrics  # no max_prompt_length: not logged
    stats.prompts_truncated = 3
    assert stats.metrics()["prompts_truncated"] == 3.0


def test_left_truncation_keeps_the_last_tokens_and_counts_them():
    prompts = [list(range(10)), [1, 2, 3], list(range(100, 106))]
    kept, cut = fit_prompts(prompts, 5, "left")
    assert kept == [[5, 6, 7, 8, 9], [1, 2, 3], [101, 102, 103, 104, 105]]
    assert cut == 2
    assert fit_prompts(prompts, None, "error") == (prompts, 0)  # no limit: unchanged
    assert fit_prompts(prompts, 10, "error") == (prompts, 0)  # within the limit


def test_error_mode_names_the_prompt_its_length_and_the_fix():
    prompts = [[1, 2], list(range(9))]
    with pytest.raises(ValueError) as raised:
        fit_prompts(prompts, 5, "error", "iteration 3: prompt")
    message = str(raised.value)
    assert "iteration 3: prompt 1 has 9 tokens" in message
    assert "max_prompt_length=5" in message
    assert "prompt_truncation='left'" in message and "filter" in message


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"overlong_buffer": 0}, r"overlong_buffer must be an integer in \(0, max_new_tokens=8\)"),
        ({"overlong_buffer": 8}, "overlong_buffer"),
        ({"overlong_buffer": -1}, "overlong_buffer"),
        ({"overlong_buffer": 2.5}, "overlong_buffer"),
        ({"overlong_buffer": 2, "overlong_penalty": 0.0}, "overlong_penalty must be"),
        ({"overlong_penalty": float("inf")}, "overlong_penalty"),
        ({"max_prompt_length": 0}, "max_prompt_length must be >= 1"),
        ({"max_prompt_length": 1.5}, "max_prompt_length"),
        ({"prompt_truncation": "right"}, "prompt_truncation must be one of 'left', 'error'"),
        ({"mask_truncated_completions": "yes"}, "mask_truncated_completions"),
    ],
)
def test_bad_length_settings_are_refused(tiny_llama_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RLModule(model=tiny_llama_path, max_new_tokens=8, **kwargs)


def test_good_length_settings_are_accepted(tiny_llama_path):
    RLModule(
        model=tiny_llama_path,
        max_new_tokens=8,
        mask_truncated_completions=True,
        overlong_buffer=7,
        overlong_penalty=0.5,
        max_prompt_length=1,
        prompt_truncation="error",
    )
