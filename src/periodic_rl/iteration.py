"""Per-iteration bookkeeping: what streamed in, what it cost, and the metrics it logs."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from periodic_rl.algorithms.mismatch import mismatch_metrics
from periodic_rl.rollout.dynamic_sampling import SamplingReport
from periodic_rl.rollout.types import RolloutGroup


def micro_batch_tensors(
    groups: list[RolloutGroup], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages ``[N]`` and rewards ``[N]`` of a micro-batch, completions in group order."""
    advantages = torch.tensor([a for g in groups for a in g.advantages], dtype=torch.float32)
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    return advantages.to(device), rewards.to(device)


@dataclass
class IterationStats:
    """Sums over the groups and micro-batches of one iteration (all stream-friendly)."""

    started: float = 0.0
    finished: float = 0.0
    policy_version: int = 0  # the version trained; groups may be older (bounded staleness)
    num_groups: int = 0
    num_sequences: int = 0
    num_tokens: int = 0
    zero_std_groups: int = 0
    truncated: int = 0  # completions that hit max_new_tokens without EOS
    truncated_tokens: int = 0
    prompts_truncated: int | None = None  # cut to max_prompt_length (None: no limit set)
    rewards: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    loss: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    groups: list[RolloutGroup] = field(default_factory=list)
    staleness: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # -> groups
    dynamic_sampling: SamplingReport | None = None  # what dynamic sampling dropped and added
    # failing reward calls per reward since the last iteration (reward_on_error: zero); with
    # max_staleness the calls scored during this iteration, whichever iteration they are for
    reward_failures: dict[str, int] | None = None
    micro_batch: dict[int, int] = field(default_factory=dict)  # group index -> micro-batch
    micro_batches: int = 0
    # group index -> per completion, the trainer's log-prob of each token at the first update
    trainer_logprobs: dict[int, list[list[float]]] = field(default_factory=dict)

    def add_groups(self, groups: list[RolloutGroup]) -> None:
        """Add one micro-batch's groups (called once per micro-batch, in training order)."""
        for group in groups:
            self.micro_batch[group.index] = self.micro_batches
            self.groups.append(group)
            self.staleness[self.policy_version - group.version] += 1
            self.num_groups += 1
            self.num_sequences += len(group.completion_ids)
            self.num_tokens += sum(len(c) for c in group.completion_ids)
            self.rewards.extend(group.rewards)
            if group.truncated:
                self.truncated += sum(group.truncated)
                self.truncated_tokens += sum(
                    len(c) for c, t in zip(group.completion_ids, group.truncated, strict=True) if t
                )
            if max(group.rewards) == min(group.rewards):
                self.zero_std_groups += 1
            for name, values in group.reward_components.items():
                self.components[name].extend(values)
        self.micro_batches += 1

    def add_trainer_logprobs(self, groups: list[RolloutGroup], logps: torch.Tensor) -> None:
        """Keep the trainer's log-probs of a micro-batch's tokens (``[N, T]``: completion ``i``
        of the micro-batch, in group order, in row ``i``, its tokens from column 0)."""
        rows = logps.detach().float().cpu().tolist()
        for group in groups:
            lengths = [len(c) for c in group.completion_ids]
            self.trainer_logprobs[group.index] = [
                row[:n] for row, n in zip(rows[: len(lengths)], lengths, strict=True)
            ]
            rows = rows[len(lengths) :]

    def loss_tokens(self, mask_truncated_completions: bool) -> int:
        """Completion tokens in the loss normaliser: without the truncated completions' when
        they are masked (:mod:`periodic_rl.truncation`)."""
        return self.num_tokens - (self.truncated_tokens if mask_truncated_completions else 0)

    def add_loss(self, stats: dict[str, float]) -> None:
        """Add a micro-batch's loss statistics: sums, except the extremes (``*_max``,
        ``*_min``), which keep the largest or smallest value seen."""
        for name, value in stats.items():
            if name.endswith("_max"):
                self.loss[name] = max(self.loss.get(name, value), value)
            elif name.endswith("_min"):
                self.loss[name] = min(self.loss.get(name, value), value)
            else:
                self.loss[name] += value

    def metrics(self) -> dict[str, float]:
        seconds = max(self.finished - self.started, 1e-9)
        tokens = max(self.loss.get("tokens", self.num_tokens), 1.0)
        out = {
            "reward": statistics.fmean(self.rewards),
            "reward_std": statistics.pstdev(self.rewards),
            "completion_length": self.num_tokens / max(self.num_sequences, 1),
            "frac_zero_std_groups": self.zero_std_groups / max(self.num_groups, 1),
            "frac_truncated": self.truncated / max(self.num_sequences, 1),
            "rollouts_per_s": self.num_sequences / seconds,
            "tokens_per_s": self.num_tokens / seconds,
            "iteration_s": seconds,
        }
        if self.prompts_truncated is not None:
            out["prompts_truncated"] = float(self.prompts_truncated)
        for name, values in self.components.items():
            out[f"rewards/{name}"] = statistics.fmean(values)
        if self.reward_failures is not None:
            out["rewards/failures"] = float(sum(self.reward_failures.values()))
            for name, count in self.reward_failures.items():
                out[f"rewards/{name}/failures"] = float(count)
        if "clipped_tokens" in self.loss:
            out["clip_fraction"] = self.loss["clipped_tokens"] / tokens
        if "kl_sum" in self.loss:
            out["kl"] = self.loss["kl_sum"] / tokens
        if "entropy_sum" in self.loss:
            out["entropy"] = self.loss["entropy_sum"] / tokens
        if self.staleness:
            counts = self.staleness
            out["staleness/mean"] = sum(s * n for s, n in counts.items()) / self.num_groups
            out["staleness/max"] = float(max(counts))
            for lag, n in sorted(counts.items()):  # the histogram: share of groups per lag
                out[f"staleness/{lag}"] = n / self.num_groups
        out.update(mismatch_metrics(self.loss))  # engine vs trainer log-probs, when reported
        if self.dynamic_sampling is not None:  # dynamic_sampling/*: groups dropped, spares
            out.update(self.dynamic_sampling.metrics())
        return out
