"""`RolloutRecord`: every trained completion, as it was trained, in Parquet files.

A run's metrics say how it went; the record says exactly what each update was computed from, so
that an update can be recomputed and checked after the fact. After every iteration each rank
writes the completions it trained to ``<dir>/iteration_<i>_rank<r>.parquet`` (``i``: the
iteration, 0-based, six digits), one row per completion, written to a temporary name and moved
into place: a run stopped mid-iteration leaves the iterations before it whole and nothing of
that one. Read the record with ``datasets.load_dataset("parquet", data_files=
"<dir>/*.parquet", split="train")`` or ``pyarrow.parquet.read_table``.

The folder is ``<log_dir>/rollouts`` (the run's log folder, else ``default_root_dir``) unless
given. It is saved in the checkpoint: a run resumed from it continues the same record, and an
iteration the first run had already recorded past the checkpoint is written again, whole.

Columns (``list<...>`` columns hold one value per completion token):

========================  ===================================================================
``iteration``             the iteration (0-based; the policy version it trained)
``rank``                  the training rank that trained the row
``micro_batch``           the micro-batch of the iteration (on that rank, 0-based)
``group``, ``sample``     the prompt group's index in the iteration, the completion's in it
``version``               the policy version that generated the group
``fingerprint``           the fingerprint of the weights that generated it
``worker``, ``seed``      the rollout worker and the group's sampling seed
``prompt_ids``            ``list<int32>``: the prompt's token ids
``completion_ids``        ``list<int32>``: the completion's token ids
``loss_mask``             ``list<int8>``: 1 where the token counts in the loss (0 on the
                          environment's tokens of a multi-turn completion, and on every
                          token of a truncated one under ``mask_truncated_completions``)
``behaviour_logprobs``    ``list<float32>``: the engine's log-prob of each sampled token (null
                          when the engine returned none)
``trainer_logprobs``      ``list<float32>``: the trainer's log-prob of each token, at the
                          iteration's first update (the policy the group was sampled from)
``truncated``             the completion hit ``max_new_tokens`` without an end token (multi-turn:
                          a length limit ended it, ``stop`` ``length`` or ``token_budget``)
``reward``                the total (weighted) reward
``rewards/<name>``        each reward function's value
``advantage``             the completion's advantage
``prompt``                the prompt as the rewards saw it (chat messages as JSON)
``completion``            the completion's text
``turns``                 multi-turn: ``list<struct>``, one per model turn: ``start``,
                          ``model_tokens``, ``env_tokens``, ``tool_calls``, ``tool_errors``,
                          ``tool_timeouts``, ``tool_seconds``, ``env_truncated``
                          (:class:`~periodic_rl.rollout.types.Turn`); null when single-turn
``messages``              multi-turn: the conversation after the prompt (JSON); else null
``env_reward``            multi-turn: the environment's summed reward (null: none)
``stop``                  multi-turn: why the trajectory ended (``Trajectory.stop``: ``done``,
                          ``max_turns``, ``token_budget``, ``length``, ...); else null
``columns``               the data row's other columns (JSON), which the rewards read too
``temperature``, ...      the sampling settings: ``temperature``, ``top_p``, ``top_k``,
                          ``min_p``, ``repetition_penalty``, ``max_new_tokens``
========================  ===================================================================

Each file also carries, in its Parquet metadata (:func:`read_gradient_digest`), a digest of the
gradient every optimizer step of the iteration applied (after normalisation and clipping): per
trainable parameter, the sum and the sum of squares of its gradient on that rank (two passes
over the gradients a step). Two runs that computed the same update give the same digest up to
float summation order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from lightning.pytorch.callbacks import Callback

from periodic_rl.callbacks._common import atomic_file, finished_iteration, last_iteration, run_dir
from periodic_rl.iteration import IterationStats
from periodic_rl.rollout.types import Trajectory, Turn
from periodic_rl.truncation import completion_keep

#: The sampling settings recorded with every row (the module's hyperparameters of that name).
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")

_FIXED = [
    ("iteration", pa.int64()),
    ("rank", pa.int32()),
    ("micro_batch", pa.int32()),
    ("group", pa.int64()),
    ("sample", pa.int32()),
    ("version", pa.int64()),
    ("fingerprint", pa.string()),
    ("worker", pa.int32()),
    ("seed", pa.int64()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("completion_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("behaviour_logprobs", pa.list_(pa.float32())),
    ("trainer_logprobs", pa.list_(pa.float32())),
    ("truncated", pa.bool_()),
    ("reward", pa.float64()),
]
_TEXT = [("advantage", pa.float64()), ("prompt", pa.string()), ("completion", pa.string())]
_TURN = pa.struct(
    [
        ("start", pa.int32()),
        ("model_tokens", pa.int32()),
        ("env_tokens", pa.int32()),
        ("tool_calls", pa.int32()),
        ("tool_errors", pa.int32()),
        ("tool_timeouts", pa.int32()),
        ("tool_seconds", pa.float64()),
        ("env_truncated", pa.bool_()),
    ]
)
_TRAJECTORY = [
    ("turns", pa.list_(_TURN)),
    ("messages", pa.string()),
    ("env_reward", pa.float64()),
    ("stop", pa.string()),
]
_SETTINGS = [
    ("columns", pa.string()),
    ("temperature", pa.float64()),
    ("top_p", pa.float64()),
    ("top_k", pa.int64()),
    ("min_p", pa.float64()),
    ("repetition_penalty", pa.float64()),
    ("max_new_tokens", pa.int64()),
]


def record_schema(reward_names: list[str]) -> pa.Schema:
    """The record's schema for a run whose reward functions are ``reward_names``."""
    rewards = [(f"rewards/{name}", pa.float64()) for name in reward_names]
    return pa.schema([*_FIXED, *rewards, *_TEXT, *_TRAJECTORY, *_SETTINGS])


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)


def trajectory_columns(trajectory: Trajectory | None) -> dict[str, Any]:
    """The record's multi-turn columns of one completion (all null for a single-turn one)."""
    if trajectory is None:
        return {"turns": None, "messages": None, "env_reward": None, "stop": None}
    return {
        "turns": [asdict(turn) for turn in trajectory.turns],
        "messages": _json(trajectory.messages),
        "env_reward": trajectory.env_reward,
        "stop": trajectory.stop,
    }


def read_trajectory(row: Mapping[str, Any]) -> Trajectory | None:
    """The :class:`~periodic_rl.rollout.types.Trajectory` a record row was trained with (None
    for a single-turn row). The loss mask is the row's, except in a row masked whole as
    truncated, where it is rebuilt from the turns (1 on each turn's model tokens)."""
    if row.get("turns") is None:
        return None
    turns = tuple(Turn(**turn) for turn in row["turns"])
    mask = list(row["loss_mask"])
    if row["truncated"] and not any(mask):
        mask = [0] * len(row["completion_ids"])
        for turn in turns:
            for position in range(turn.start, min(turn.start + turn.model_tokens, len(mask))):
                mask[position] = 1
    return Trajectory(
        loss_mask=mask,
        turns=turns,
        messages=json.loads(row["messages"]) if row["messages"] else [],
        env_reward=row["env_reward"],
        stop=row["stop"],
    )


def record_rows(
    stats: IterationStats,
    iteration: int,
    rank: int,
    hparams: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """One row per trained completion of the iteration ``stats`` describes (training order)."""
    masked = bool(hparams.get("mask_truncated_completions", False))
    sampling = {name: hparams.get(name) for name in SAMPLING}
    rows = []
    for group in stats.groups:
        keep = completion_keep([group]) if masked else [True] * len(group.completion_ids)
        trainer = stats.trainer_logprobs.get(group.index)
        masks = group.loss_masks()
        for i, ids in enumerate(group.completion_ids):
            logprobs = group.logprobs[i] if group.logprobs and group.logprobs[i] else None
            mask = masks[i] if masks is not None else [1] * len(ids)
            trajectory = group.trajectories[i] if group.trajectories else None
            rows.append(
                {
                    "iteration": iteration,
                    "rank": rank,
                    "micro_batch": stats.micro_batch.get(group.index, 0),
                    "group": group.index,
                    "sample": i,
                    "version": group.version,
                    "fingerprint": group.fingerprint,
                    "worker": group.worker,
                    "seed": group.seed,
                    "prompt_ids": list(group.prompt_ids),
                    "completion_ids": list(ids),
                    "loss_mask": [int(keep[i]) * m for m in mask],
                    "behaviour_logprobs": logprobs,
                    "trainer_logprobs": trainer[i] if trainer else None,
                    "truncated": bool(group.truncated[i]) if group.truncated else False,
                    "reward": group.rewards[i],
                    **{f"rewards/{k}": v[i] for k, v in group.reward_components.items()},
                    "advantage": group.advantages[i] if group.advantages else None,
                    "prompt": _json(group.prompt),
                    "completion": group.completions[i],
                    **trajectory_columns(trajectory),
                    "columns": _json(group.columns),
                    **sampling,
                }
            )
    return rows


#: The Parquet metadata key of the gradient digest.
DIGEST_KEY = b"periodic_rl.gradient_digest"

#: Per trainable parameter: the sum, the sum of squares and the number of its gradient's values.
GradientDigest = dict[str, tuple[float, float, int]]


def gradient_digest(module: torch.nn.Module) -> GradientDigest:
    """The sum, sum of squares and size of every trainable parameter's gradient on this rank
    (its local shard under FSDP); parameters without a gradient are left out."""
    digest: GradientDigest = {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            grad = param.grad
            if not param.requires_grad or grad is None:
                continue
            local = (grad.to_local() if hasattr(grad, "to_local") else grad).detach()
            digest[name] = _sums(local.reshape(-1))
    return digest


def _sums(flat: torch.Tensor, row: int = 4096) -> tuple[float, float, int]:
    """Sum and sum of squares of ``flat``: over rows of ``row`` values in its own dtype (as
    fast as the dtype allows), the rows' results added in float64 (so the error stays that of
    a short sum)."""
    cut = flat.numel() - flat.numel() % row
    rows, rest = flat[:cut].view(-1, row), flat[cut:].double()
    total = rows.sum(dim=1).double().sum() + rest.sum()
    norms = torch.linalg.vector_norm(rows, dim=1).double()
    return float(total), float(norms.square().sum() + rest.square().sum()), flat.numel()


def read_gradient_digest(path: str | Path) -> list[GradientDigest]:
    """The gradient digest of each optimizer step recorded in one record file."""
    metadata = pq.read_schema(path).metadata or {}
    steps = json.loads(metadata.get(DIGEST_KEY, b"[]"))
    return [{name: (s, q, int(n)) for name, (s, q, n) in step.items()} for step in steps]


def write_record(
    path: Path, rows: list[dict[str, Any]], digests: Sequence[GradientDigest] = ()
) -> Path:
    """Write ``rows`` (and the iteration's gradient ``digests``) as one Parquet file at
    ``path``, atomically (whole or absent)."""
    names = [c[len("rewards/") :] for c in rows[0] if c.startswith("rewards/")] if rows else []
    schema = record_schema(names).with_metadata({DIGEST_KEY: json.dumps(list(digests))})
    table = pa.Table.from_pylist(rows, schema=schema)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)
    return path


class RolloutRecord(Callback):
    """Write every trained completion of every iteration to Parquet (module docstring).

    ``RLModule(record_rollouts=True)`` adds one; pass your own to choose the folder.

    Args:
        dirpath: the record's folder (default ``<log_dir>/rollouts``).
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.resolved: Path | None = Path(dirpath) if dirpath is not None else None
        self.written: list[Path] = []
        self._digests: list[GradientDigest] = []  # the iteration's optimizer steps so far

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.resolved is None:
            self.resolved = run_dir(trainer) / "rollouts"

    def file_of(self, iteration: int, rank: int) -> Path:
        """Where iteration ``iteration`` of rank ``rank`` is recorded."""
        assert self.resolved is not None, "used before setup"
        return self.resolved / f"iteration_{iteration:06d}_rank{rank}.parquet"

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._digests = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._digests.append(gradient_digest(pl_module))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = last_iteration(pl_module)
        if stats is None or not stats.groups:
            return
        iteration, rank = finished_iteration(trainer), trainer.global_rank
        rows = record_rows(stats, iteration, rank, pl_module.hparams)
        path = write_record(self.file_of(iteration, rank), rows, self._digests)
        self.written.append(path)

    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": None if self.resolved is None else str(self.resolved)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed run continues the record of the run it resumes (unless given a folder)."""
        if self.dirpath is None and state_dict.get("dirpath"):
            self.resolved = Path(state_dict["dirpath"])
