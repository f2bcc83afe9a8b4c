"""``reasoning_gym:<task>`` sources: procedurally generated problems of a `reasoning-gym` task
(``reasoning_gym:leg_counting``), scored by the task's own verifier.

Each row is ``{"prompt", "answer", "metadata"}``: the prompt is two chat messages, reasoning-gym's
default system prompt (think, then give the final answer between ``<answer>`` and ``</answer>``)
and the task's question; ``answer`` and ``metadata`` are what the verifier needs. The reward,
:class:`TaskVerifier`, takes the text inside the completion's last ``<answer>...</answer>``
(reasoning-gym's ``extract_answer``) and returns the task's ``score_answer`` for it, in [0, 1]
(0 without tags). It is logged as ``rewards/<task>``; held-out accuracy is the share of
completions it scores 1.

Training rows are the task's items ``0 .. num_train - 1`` from ``seed``; held-out rows come
from seed ``seed + num_train`` (the task derives item ``i`` from ``seed + i``, so the two never
share a generator seed), and a held-out row whose question is also a training question is
left out. `reasoning-gym` is an optional dependency: ``pip install "periodic_rl[reasoning-gym]"``.
"""

from __future__ import annotations

import difflib
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

PREFIX = "reasoning_gym:"
INSTALL = 'pip install "periodic_rl[reasoning-gym]"'


def _gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(
            f"a {PREFIX}<task> source needs the reasoning-gym package, which is not installed: "
            f"{INSTALL} (or pip install reasoning-gym)"
        ) from error
    return reasoning_gym


def check_task(task: str) -> None:
    """Refuse a missing package or an unknown task, naming the close task names."""
    _gym()
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=5)
        hint = f"did you mean {close}? " if close else ""
        raise ValueError(
            f"unknown reasoning-gym task {PREFIX}{task!s}; {hint}its {len(DATASETS)} tasks are "
            'listed by `python -c "from reasoning_gym.factory import DATASETS; '
            'print(sorted(DATASETS))"`'
        )


def task_rows(task: str, size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` rows of ``task`` from ``seed`` (see the module docstring)."""
    gym = _gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    system = SYSTEM_PROMPTS["default"]
    rows = []
    for entry in gym.create_dataset(task, size=size, seed=seed):
        prompt = [
            {"role": "system", "content": system},
            {"role": "user", "content": entry["question"]},
        ]
        rows.append({"prompt": prompt, "answer": entry["answer"], "metadata": entry["metadata"]})
    return rows


def train_and_val(
    task: str, num_train: int, num_val: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training rows and the held-out rows (at most ``num_val``, none a training question)."""
    check_task(task)
    train = task_rows(task, num_train, seed)
    if num_val == 0:
        return train, []
    seen = {_question(row["prompt"]) for row in train}
    candidates = task_rows(task, 2 * num_val, seed + num_train)
    val = [row for row in candidates if _question(row["prompt"]) not in seen]
    val = list({_question(row["prompt"]): row for row in val}.values())[:num_val]
    rank_zero_info(
        f"held-out: {len(val)} rows of {PREFIX}{task} (seed {seed + num_train}, none a "
        f"training question); {len(train)} rows for training (seed {seed})"
    )
    return train, val


class TaskVerifier:
    """A reward calling the task's own ``score_answer`` on each completion's final
    ``<answer>`` text; with ``exact``, 1.0 only where the score is 1 (the accuracy)."""

    def __init__(self, task: str, exact: bool = False) -> None:
        self.task = task
        self.exact = exact
        self.__name__ = f"{task}_solved" if exact else task
        self._score: Any = None

    def __getstate__(self) -> dict[str, Any]:  # the verifier is rebuilt where it runs
        return {**self.__dict__, "_score": None}

    def __call__(
        self,
        prompts: list[Any],
        completions: list[str],
        answer: list[Any],
        metadata: list[dict[str, Any]],
        **columns: Any,
    ) -> list[float]:
        from reasoning_gym.utils import extract_answer

        if self._score is None:
            self._score = _gym().get_score_answer_fn(self.task)
        scores = []
        for prompt, completion, gold, meta in zip(
            prompts, completions, answer, metadata, strict=True
        ):
            entry = {"question": _question(prompt), "answer": gold, "metadata": meta}
            score = float(self._score(extract_answer(completion), entry))
            scores.append(float(score >= 1.0) if self.exact else score)
        return scores


def _question(prompt: Any) -> str:
    """The question of a prompt: the string, or the last user message's content."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""
