"""Multi-turn trajectories made up on the trainer's side, for training tests that do not run an
agent loop: the completions an engine sampled are declared trajectories whose tokens 3 and 4
are an environment reply (loss mask 0) between two model turns."""

from __future__ import annotations

from typing import Any

from rl_helpers import RecordingModule

from periodic_rl.rollout.types import Trajectory, Turn

#: The positions of a completion that the made-up trajectories give the environment.
ENVIRONMENT = range(3, 5)


def made_up_trajectory(ids: list[int], sample: int, ones: bool = False) -> Trajectory:
    """Two model turns around an environment reply at :data:`ENVIRONMENT` (``ones``: a loss
    mask of ones and no environment reward, what a single-turn completion trains as). Sample
    ``i`` has environment reward ``i % 2`` (None for sample 2) and one tool call of
    ``0.25 * (i + 1)`` seconds, an error on odd samples; sample 3 stopped on its length."""
    n = len(ids)
    env = [i for i in ENVIRONMENT if i < n]
    mask = [1] * n if ones else [0 if i in env else 1 for i in range(n)]
    first = min(n, ENVIRONMENT.start)
    turns = [
        Turn(
            start=0,
            model_tokens=first,
            env_tokens=len(env),
            tool_calls=1,
            tool_errors=sample % 2,
            tool_seconds=0.25 * (sample + 1),
            env_truncated=sample == 0,
        )
    ]
    if n > ENVIRONMENT.stop:
        turns.append(Turn(start=ENVIRONMENT.stop, model_tokens=n - ENVIRONMENT.stop))
    return Trajectory(
        loss_mask=mask,
        turns=tuple(turns),
        messages=[
            {"role": "assistant", "content": f"call {sample}"},
            {"role": "tool", "content": "reply"},
        ],
        env_reward=None if ones or sample == 2 else float(sample % 2),
        stop="length" if sample == 3 else "done",
    )


def attach_trajectories(module: Any, ones: bool = False) -> None:
    """Wrap ``module.scorer.score`` so that every group it scores is a multi-turn group of
    :func:`made_up_trajectory` trajectories, its environment tokens' behaviour log-probs 0.0
    (as the agent loop gives them)."""
    score = module.scorer.score

    def with_trajectories(generated, row, prompt_ids, held_out=False):
        generated.trajectories = [
            made_up_trajectory(ids, i, ones) for i, ids in enumerate(generated.completion_ids)
        ]
        if generated.logprobs:
            generated.logprobs = [
                [v if m else 0.0 for v, m in zip(values, t.loss_mask, strict=True)]
                for values, t in zip(generated.logprobs, generated.trajectories, strict=True)
            ]
        return score(generated, row, prompt_ids, held_out)

    module.scorer.score = with_trajectories


class TrajectoryModule(RecordingModule):
    """:class:`~rl_helpers.RecordingModule` whose groups are made-up trajectories."""

    ones = False

    def setup(self, stage: str) -> None:
        super().setup(stage)
        attach_trajectories(self, self.ones)


class OnesTrajectoryModule(TrajectoryModule):
    """Trajectories whose loss masks are all ones."""

    ones = True
