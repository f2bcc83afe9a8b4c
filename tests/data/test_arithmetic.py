from periodic_rl.data.arithmetic import (
    arithmetic_problems,
    correctness_reward,
    format_reward,
)


def test_splits_are_disjoint_and_seeded():
    train = arithmetic_problems("train", 2000, seed=0)
    test = arithmetic_problems("test", 64, seed=0)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in test})
    assert arithmetic_problems("train", 50, seed=3) == arithmetic_problems("train", 50, seed=3)
    assert arithmetic_problems("train", 50, seed=3) != arithmetic_problems("train", 50, seed=4)
    assert len({r["prompt"] for r in test}) == len(test)


def test_answers_are_right():
    for row in arithmetic_problems("train", 100, seed=1, ops=("+", "-")):
        expression = row["prompt"].removeprefix("What is ").split("?")[0]
        assert str(eval(expression)) == row["answer"]  # noqa: S307 - our own generated text


def test_rewards_credit_format_and_correctness_separately():
    completions = ["12", "The answer is 12.", "12 is not it, it is 13", "I think\n12", "banana", ""]
    answers = ["12"] * len(completions)
    assert format_reward([None] * 6, completions, answer=answers) == [1, 1, 1, 0, 0, 0]
    assert correctness_reward([None] * 6, completions, answer=answers) == [1, 1, 0, 1, 0, 0]
