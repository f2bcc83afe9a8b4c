"""Replay one recorded iteration and compare it with what the run did.

:func:`replay` resumes the run from the checkpoint taken at the start of iteration ``i`` (none
for ``i = 0``: the initial model) for exactly that iteration, with the rollout engine replaced by
:class:`RecordedEngine`, which returns the recorded completions and behaviour log-probs instead
of sampling. Everything else is the run's own code: the same data order (the checkpoint's), the
rewards recomputed by the module's reward functions, the advantages, the on-policy check (the
replayed weights must have the fingerprint the groups were stamped with), the loss, the
normalisation, the clip and the optimizer step. The replay is recorded too
(:class:`~periodic_rl.callbacks.RolloutRecord`), and :class:`ReplayReport` compares the two
records: the gradient digests (equal up to float summation order when the update is the one the
run made), the rewards and advantages, the trainer's log-probs, and each token's engine/trainer
log-prob mismatch (the tokens whose behaviour log-prob is off by more than a tolerance, by group,
sample and position).

A multi-turn iteration is replayed with its trajectories: with the run's agent loop, each model
turn is the recorded one and the environment answers it again (its replies, rewards and stop
reasons are recomputed like the rewards; :class:`RecordedEngine`); groups that come without
trajectories get the record's (:class:`RecordedTrajectories`: loss masks, turns, messages,
environment rewards, stop reasons). Either way the environment's tokens stay out of the
replayed loss as they were out of the run's, and no mismatch is reported on them (they carry
no behaviour log-prob).

The run must have been recorded (``record_rollouts: true``) with ``max_staleness: 0``, and have
a checkpoint at the start of the iteration (``ModelCheckpoint(every_n_train_steps=1,
save_top_k=-1)``, or one whose step is the iteration's first).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pyarrow.parquet as pq
from lightning.pytorch.callbacks import Callback

from periodic_rl.callbacks.record import (
    GradientDigest,
    RolloutRecord,
    read_gradient_digest,
    read_trajectory,
)
from periodic_rl.rollout.engine import sample_seed
from periodic_rl.rollout.engines.hf_engine import HFEngine
from periodic_rl.rollout.types import GeneratedGroup, GenerationRequest, SamplingConfig, Trajectory

#: Relative difference of two gradient digests that float summation order explains.
DIGEST_TOLERANCE = 1e-4
#: A token's |trainer - behaviour| log-prob above this is reported.
TOKEN_TOLERANCE = 1e-2


def record_files(record: str | Path, iteration: int) -> list[Path]:
    """The record's files of ``iteration`` (one per rank); a clear error when there are none."""
    files = sorted(Path(record).glob(f"iteration_{iteration:06d}_rank*.parquet"))
    if not files:
        raise FileNotFoundError(
            f"no record of iteration {iteration} in {record}: record the run with "
            "record_rollouts: true, and give the folder holding iteration_<i>_rank<r>.parquet"
        )
    return files


def read_rows(files: Iterable[Path]) -> list[dict[str, Any]]:
    """Every row of ``files``."""
    return [row for path in files for row in pq.read_table(path).to_pylist()]


class RecordedEngine(HFEngine):
    """An engine that returns what the record says was generated: for each request, the
    completions and behaviour log-probs of the recorded group with the same prompt and seed.
    It holds and fingerprints the pushed weights as the transformers engine does.

    In a multi-turn run the agent loop asks for one model turn at a time (``n = 1``, the
    prompt followed by the trajectory so far, the turn's own seed): it gets the recorded
    turn's tokens, and the environment answers them again, as the rewards are computed again
    (an environment that answers otherwise than in the run leads to a prefix the record does
    not have, and a :class:`LookupError`).

    Args:
        model: the run's model (loaded for the weights and their fingerprint).
        record: the record's folder.
        iteration: the iteration whose groups it returns.
        dtype, device: as :class:`~periodic_rl.rollout.engines.hf_engine.HFEngine`.
    """

    def __init__(
        self,
        model: str,
        record: str,
        iteration: int,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> None:
        super().__init__(model, dtype=dtype, device=device)
        self.groups: dict[tuple[tuple[int, ...], int], tuple[list, list]] = {}
        self.turns: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}
        for row in read_rows(record_files(record, iteration)):
            key = (tuple(row["prompt_ids"]), row["seed"])
            completions, logprobs = self.groups.setdefault(key, ([], []))
            completions.append((row["sample"], row["completion_ids"]))
            logprobs.append((row["sample"], row["behaviour_logprobs"] or []))
            self.turns.update(recorded_turns(row))

    def generate_with_logprobs(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        out = []
        for request in requests:
            key = (tuple(request.prompt_ids), request.seed)
            found = self.groups.get(key)
            turn = self.turns.get(key) if request.n == 1 else None
            if turn is not None:  # a group has at least 2 completions
                tokens, values = turn
                out.append(([tokens], [values] if values else []))
                continue
            if found is None or len(found[0]) != request.n:
                raise LookupError(
                    f"the record has no group of {request.n} completions (nor a model turn) for "
                    f"a prompt of {len(request.prompt_ids)} tokens with seed {request.seed}: "
                    "replay with the run's own configuration (data, seed, num_generations, "
                    "agent) and its checkpoint"
                )
            completions = [ids for _, ids in sorted(found[0])]
            logprobs = [values for _, values in sorted(found[1])]
            out.append((completions, logprobs if all(logprobs) else []))
        return out

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[list[int]]]:
        return [completions for completions, _ in self.generate_with_logprobs(requests, sampling)]


def recorded_turns(
    row: dict[str, Any],
) -> dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]]:
    """Each model turn of a multi-turn record row by the request the agent loop makes for it
    (the prompt and the trajectory before the turn, the turn's seed): its tokens and their
    behaviour log-probs (``[]`` when the engine gave none)."""
    if not row.get("turns"):
        return {}
    prompt, ids = list(row["prompt_ids"]), list(row["completion_ids"])
    values = row["behaviour_logprobs"] or []
    seed = sample_seed(row["seed"], row["sample"])
    out = {}
    for number, turn in enumerate(row["turns"], start=1):  # the agent loop's turn seeds
        start, end = turn["start"], turn["start"] + turn["model_tokens"]
        key = (tuple(prompt + ids[:start]), sample_seed(seed, number))
        out[key] = (ids[start:end], list(values[start:end]))
    return out


class RecordedTrajectories(Callback):
    """Gives each generated group of a replay that comes without trajectories the ones the
    record holds for it (same prompt ids and seed, as :class:`RecordedEngine` finds its
    completions): the module's scorer is wrapped at the start of the fit, so the groups it
    scores carry them. The groups of a run with an agent loop have their own (the loop replays
    them turn by turn); a group the record has as single-turn is left as it is."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        found: dict[tuple[tuple[int, ...], int], list[tuple[int, Trajectory]]] = {}
        for row in rows:
            trajectory = read_trajectory(row)
            if trajectory is not None:
                key = (tuple(row["prompt_ids"]), row["seed"])
                found.setdefault(key, []).append((row["sample"], trajectory))
        self.trajectories = {
            key: [t for _, t in sorted(pairs, key=lambda pair: pair[0])]
            for key, pairs in found.items()
        }

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        scorer = pl_module.scorer
        score = scorer.score
        recorded = self.trajectories

        def with_trajectories(
            generated: GeneratedGroup,
            row: dict[str, Any],
            prompt_ids: list[int],
            held_out: bool = False,
        ) -> Any:
            found = recorded.get((tuple(prompt_ids), generated.seed))
            if found is not None and not generated.trajectories:
                generated.trajectories = list(found)
            return score(generated, row, prompt_ids, held_out)

        scorer.score = with_trajectories  # this fit's scorer only: setup builds a new one


@dataclass
class TokenMismatch:
    """A token whose behaviour log-prob differs from the trainer's by more than the
    tolerance."""

    group: int
    sample: int
    position: int
    behaviour: float
    trainer: float

    @property
    def difference(self) -> float:
        return self.trainer - self.behaviour


@dataclass
class ReplayReport:
    """What the replay of one iteration found (:func:`replay`)."""

    iteration: int
    digest_difference: float  # largest relative difference of the gradient digests
    digest_tolerance: float
    groups: int
    tokens: int
    reward_differences: list[tuple[int, int, float, float]] = field(default_factory=list)
    trainer_logprob_difference: float = 0.0  # largest |replayed - recorded| trainer log-prob
    token_mismatches: list[TokenMismatch] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # the replayed iteration's

    @property
    def exact(self) -> bool:
        """The replayed update is the recorded one (up to float summation order), with the
        same rewards."""
        return self.digest_difference <= self.digest_tolerance and not self.reward_differences

    def describe(self, max_tokens: int = 10) -> str:
        verdict = "reproduced" if self.exact else "NOT reproduced"
        lines = [
            f"iteration {self.iteration}: update {verdict} ({self.groups} groups, "
            f"{self.tokens} tokens; gradient digest difference {self.digest_difference:.2e}, "
            f"tolerance {self.digest_tolerance:.0e})",
            "trainer log-probs: largest difference from the run's "
            f"{self.trainer_logprob_difference:.2e}",
        ]
        for group, sample, recorded, replayed in self.reward_differences[:max_tokens]:
            lines.append(
                f"group {group} sample {sample}: reward {recorded:g} recorded, {replayed:g} now"
            )
        for name in ("mismatch/abs_logp", "mismatch/ratio_max", "mismatch/ratio_min",
                     "mismatch/ess", "mismatch/missing_tokens"):  # fmt: skip
            if name in self.metrics:
                lines.append(f"{name}: {self.metrics[name]:.4g}")
        worst = sorted(self.token_mismatches, key=lambda t: -abs(t.difference))
        for t in worst[:max_tokens]:
            lines.append(
                f"group {t.group} sample {t.sample} token {t.position}: behaviour log-prob "
                f"{t.behaviour:.4f}, trainer {t.trainer:.4f} (difference {t.difference:+.4f})"
            )
        if len(worst) > max_tokens:
            lines.append(f"... {len(worst) - max_tokens} more tokens over the tolerance")
        return "\n".join(lines)


def digest_difference(recorded: list[GradientDigest], replayed: list[GradientDigest]) -> float:
    """The largest difference of two runs' digests, relative to the gradient's size: per
    parameter, with ``norm`` its gradient's L2 norm, ``|d sum| / (sqrt(numel) norm)`` (the
    sum's float error is at most ``eps sqrt(numel) norm``) and ``|d norm| / norm``; inf when
    the steps or parameters differ."""
    if len(recorded) != len(replayed):
        return math.inf
    worst = 0.0
    for a, b in zip(recorded, replayed, strict=True):
        if set(a) != set(b):
            return math.inf
        for name, (total, squares, numel) in a.items():
            other_total, other_squares, _ = b[name]
            norm = max(math.sqrt(squares), 1e-30)
            worst = max(
                worst,
                abs(total - other_total) / (math.sqrt(numel) * norm),
                abs(math.sqrt(squares) - math.sqrt(other_squares)) / norm,
            )
    return worst


def checkpoint_of(module: L.LightningModule, checkpoints: str | Path, iteration: int) -> Path:
    """The checkpoint in ``checkpoints`` taken at the start of ``iteration`` (its global step
    is ``iteration * num_iterations``)."""
    step = iteration * module.hparams.get("num_iterations", 1)
    found = sorted(Path(checkpoints).glob(f"*step={step}.ckpt"))
    if not found:
        raise FileNotFoundError(
            f"no checkpoint of step {step} (the start of iteration {iteration}) in "
            f"{checkpoints}: save one each iteration (ModelCheckpoint(every_n_train_steps=1, "
            "save_top_k=-1)) or give --checkpoint"
        )
    return found[-1]


def replay(
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    record: str | Path,
    iteration: int,
    checkpoint: str | Path | None = None,
    seed: int | None = None,
    token_tolerance: float = TOKEN_TOLERANCE,
    digest_tolerance: float = DIGEST_TOLERANCE,
) -> ReplayReport:
    """Recompute ``iteration`` of a recorded run and compare it with the record (module
    docstring). ``module`` and ``datamodule`` are built as for the run (a fresh module: its
    weights come from ``checkpoint``, which is required for ``iteration > 0``); ``seed``: the
    run's global seed (``seed_everything``), set before the fit as the run set it (it decides
    a LoRA adapter's initial weights, which iteration 0 starts from)."""
    from periodic_rl.strategies import PeriodicAsyncStrategy

    recorded_files = record_files(record, iteration)
    if iteration > 0 and checkpoint is None:
        raise ValueError(f"replaying iteration {iteration} needs the checkpoint taken before it")
    steps = module.hparams.get("num_iterations", 1)
    with tempfile.TemporaryDirectory(prefix="periodic_rl_replay_") as folder:
        again = RolloutRecord(dirpath=folder)
        trajectories = RecordedTrajectories(read_rows(recorded_files))
        trainer = L.Trainer(
            strategy=PeriodicAsyncStrategy(
                engine="periodic_rl.provenance.replay:RecordedEngine",
                engine_kwargs={"record": str(record), "iteration": iteration},
                use_ray=False,
                overlap=False,
            ),
            max_steps=(iteration + 1) * steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[again, trajectories],
        )
        if seed is not None:
            L.seed_everything(seed, verbose=False)
        ckpt_path = None if checkpoint is None else str(checkpoint)
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        replayed_files = record_files(folder, iteration)
        replayed_rows = read_rows(replayed_files)
        replayed_digest = [d for f in replayed_files for d in read_gradient_digest(f)]
        stats = getattr(module, "last_iteration", None)
        metrics = stats.metrics() if stats is not None else {}
    recorded_rows = read_rows(recorded_files)
    recorded_digest = [d for f in recorded_files for d in read_gradient_digest(f)]
    return compare(
        iteration, recorded_rows, replayed_rows, recorded_digest, replayed_digest,
        metrics, token_tolerance, digest_tolerance,
    )  # fmt: skip


def compare(
    iteration: int,
    recorded: list[dict[str, Any]],
    replayed: list[dict[str, Any]],
    recorded_digest: list[GradientDigest],
    replayed_digest: list[GradientDigest],
    metrics: dict[str, float],
    token_tolerance: float = TOKEN_TOLERANCE,
    digest_tolerance: float = DIGEST_TOLERANCE,
) -> ReplayReport:
    """The :class:`ReplayReport` of two records of the same iteration."""
    again = {(r["group"], r["sample"]): r for r in replayed}
    report = ReplayReport(
        iteration=iteration,
        digest_difference=digest_difference(recorded_digest, replayed_digest),
        digest_tolerance=digest_tolerance,
        groups=len({r["group"] for r in recorded}),
        tokens=sum(len(r["completion_ids"]) for r in recorded),
        metrics=metrics,
    )
    for row in recorded:
        key = (row["group"], row["sample"])
        other = again.get(key)
        if other is None or other["completion_ids"] != row["completion_ids"]:
            raise ValueError(f"the replay did not train group {key[0]} sample {key[1]}")
        if other["reward"] != row["reward"]:
            report.reward_differences.append((*key, row["reward"], other["reward"]))
        trainer = other["trainer_logprobs"] or []
        trajectory = read_trajectory(row)
        if row["trainer_logprobs"]:
            diffs = [abs(a - b) for a, b in zip(row["trainer_logprobs"], trainer, strict=True)]
            report.trainer_logprob_difference = max([report.trainer_logprob_difference, *diffs])
        for position, (behaviour, value) in enumerate(
            zip(row["behaviour_logprobs"] or [], trainer, strict=False)
        ):
            if trajectory is not None and not trajectory.loss_mask[position]:
                continue  # an environment token: not sampled, no behaviour log-prob
            if abs(value - behaviour) > token_tolerance:
                report.token_mismatches.append(TokenMismatch(*key, position, behaviour, value))
    return report
