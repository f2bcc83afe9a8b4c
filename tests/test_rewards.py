"""RewardModel: scores prompt+completion with a frozen classifier, on the device it is given
(its own, or the training device)."""

import math

import pytest
import torch

from periodic_rl.module_setup import place_reward_models
from periodic_rl.rewards import RewardModel, check_rewards

PROMPTS = ["What is 2+2?", [{"role": "user", "content": "Say hi."}], "Name a colour."]
COMPLETIONS = ["4", "Hello there, how are you today?", "blue"]


@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory, tiny_llama_path):
    """A randomly initialised tiny LlamaForSequenceClassification (one label): the tiny test
    model's config and tokenizer with a one-logit head."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(tiny_llama_path, num_labels=1)
    path = tmp_path_factory.mktemp("tiny-reward")
    LlamaForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(path)
    return str(path)


def test_scores_one_float_per_completion_whatever_the_batching(reward_model_path):
    model = RewardModel(reward_model_path, batch_size=2)  # batches of 2 and 1, padded
    scores = model(PROMPTS, COMPLETIONS, answer=["4", "", ""])
    assert len(scores) == len(COMPLETIONS)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert check_rewards("reward_model", scores, len(COMPLETIONS)) == scores
    one_by_one = [model([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert scores == pytest.approx(one_by_one, abs=1e-4)
    assert len(set(scores)) == len(scores)  # the completion matters


def test_frozen_in_eval_mode_on_the_device_given(reward_model_path):
    model = RewardModel(reward_model_path, device=torch.device("cpu"))
    params = list(model.model.parameters())
    assert all(p.device == torch.device("cpu") for p in params)
    assert model.device == torch.device("cpu")
    assert not model.model.training
    assert not any(p.requires_grad for p in params)


def test_to_moves_the_model_and_keeps_it_frozen(reward_model_path):
    model = RewardModel(reward_model_path)
    assert model.to("meta") is model
    params = list(model.model.parameters())
    assert params and all(p.device.type == "meta" for p in params)
    assert model.device.type == "meta"
    assert not model.model.training and not any(p.requires_grad for p in params)
    built_there = RewardModel(reward_model_path, device="meta")
    assert all(p.device.type == "meta" for p in built_there.model.parameters())


def test_its_own_device_is_kept_and_no_device_means_the_training_device(reward_model_path):
    """``place_reward_models`` (set-up): a RewardModel built with a device stays there (the
    policy may train elsewhere); one built without follows the training device (meta here, a
    stand-in for cuda:0 that the CPU has)."""
    own = RewardModel(reward_model_path, device="cpu")
    follows = RewardModel(reward_model_path)
    assert own.requested_device == torch.device("cpu") and follows.requested_device is None
    place_reward_models([own, follows, check_rewards], torch.device("meta"))
    assert own.device == torch.device("cpu")
    assert follows.device.type == "meta"
    assert own(PROMPTS, COMPLETIONS) == pytest.approx(
        RewardModel(reward_model_path)(PROMPTS, COMPLETIONS), abs=1e-5
    )


class _Seen(Exception):
    pass


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_inputs_follow_the_model(reward_model_path, device):
    """Token batches go to wherever the model was moved (on meta: stop before reading values)."""
    model = RewardModel(reward_model_path, device=device)
    seen = []

    def record(module, args, kwargs):
        seen.append(kwargs["input_ids"].device.type)
        if device == "meta":
            raise _Seen

    model.model.register_forward_pre_hook(record, with_kwargs=True)
    if device == "meta":
        with pytest.raises(_Seen):
            model(PROMPTS, COMPLETIONS)
    else:
        model(PROMPTS, COMPLETIONS)
    assert seen and set(seen) == {device}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scores_on_cuda_match_cpu(reward_model_path):
    cpu = RewardModel(reward_model_path)(PROMPTS, COMPLETIONS)
    model = RewardModel(reward_model_path, device="cuda")
    assert model.device.type == "cuda"
    assert model(PROMPTS, COMPLETIONS) == pytest.approx(cpu, abs=1e-3)
