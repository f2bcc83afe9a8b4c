"""``reasoning_gym:<task>`` sources: seeded rows that carry what the verifier needs, the task's
own ``score_answer`` as the reward, and clear errors for an unknown task or a missing package."""

from __future__ import annotations

import pickle
import sys

import pytest

from periodic_rl.data import PromptDataModule
from periodic_rl.data.reasoning_gym import TaskVerifier

pytest.importorskip(
    "reasoning_gym", reason="needs reasoning-gym: pip install 'periodic_rl[reasoning-gym]'"
)

TASK = "leg_counting"


def source(**kwargs):
    dm = PromptDataModule(source=f"reasoning_gym:{TASK}", batch_size=2, **kwargs)
    dm.setup("fit")
    return dm.source


def test_rows_are_seeded_and_held_out_questions_are_not_training_questions():
    import reasoning_gym

    rows = source(num_train=30, num_val=8, seed=3)
    expected = list(reasoning_gym.create_dataset(TASK, size=30, seed=3))
    assert [r["prompt"][-1]["content"] for r in rows.train] == [e["question"] for e in expected]
    assert [r["answer"] for r in rows.train] == [e["answer"] for e in expected]
    assert rows.train[0]["metadata"] == expected[0]["metadata"]
    assert rows.train[0]["prompt"][0]["role"] == "system"
    assert "<answer>" in rows.train[0]["prompt"][0]["content"]  # the format the verifier reads
    assert len(rows.val) == 8
    train = {r["prompt"][-1]["content"] for r in rows.train}
    assert not train & {r["prompt"][-1]["content"] for r in rows.val}
    assert source(num_train=30, num_val=8, seed=4).train != rows.train


def test_the_reward_is_the_tasks_verifier_on_the_answer_tags():
    rows = source(num_train=4, num_val=0)
    (reward,) = rows.reward_funcs
    assert reward.__name__ == TASK  # logged as rewards/leg_counting
    row = rows.train[0]
    right = f"<think>count the legs</think> <answer>{row['answer']}</answer>"
    wrong = f"<answer>{int(row['answer']) + 1}</answer>"
    untagged = row["answer"]  # right number, but not where the verifier looks
    completions = [right, wrong, untagged]
    columns = {"answer": [row["answer"]] * 3, "metadata": [row["metadata"]] * 3}
    assert reward([row["prompt"]] * 3, completions, **columns) == [1.0, 0.0, 0.0]
    assert rows.accuracy_func([row["prompt"]] * 3, completions, **columns) == [1.0, 0.0, 0.0]
    again = pickle.loads(pickle.dumps(reward))  # a reward may run in another process
    assert again([row["prompt"]], [right], answer=[row["answer"]], metadata=[row["metadata"]])


def test_a_partial_score_passes_through_and_accuracy_needs_a_full_one():
    """Tasks may give partial credit; the reward is the score, accuracy is score == 1."""
    calls = []

    def score(answer, entry):
        calls.append((answer, entry["answer"], entry["question"]))
        return 0.5

    verifier, exact = TaskVerifier(TASK), TaskVerifier(TASK, exact=True)
    verifier._score = exact._score = score
    prompt = [{"role": "user", "content": "how many legs?"}]
    assert verifier([prompt], ["<answer> 7 </answer>"], answer=["8"], metadata=[{}]) == [0.5]
    assert exact([prompt], ["<answer>7</answer>"], answer=["8"], metadata=[{}]) == [0.0]
    assert calls[0] == ("7", "8", "how many legs?")


def test_an_unknown_task_is_refused_at_construction_with_close_names():
    with pytest.raises(ValueError, match=r"reasoning_gym:leg_count; did you mean \['leg_counting'"):
        PromptDataModule(source="reasoning_gym:leg_count")


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r'pip install "periodic_rl\[reasoning-gym\]"'):
        PromptDataModule(source=f"reasoning_gym:{TASK}")


def test_num_train_must_be_positive():
    with pytest.raises(ValueError, match=r"num_train must be >= 1 \(rows of reasoning_gym:"):
        PromptDataModule(source=f"reasoning_gym:{TASK}", num_train=0)
