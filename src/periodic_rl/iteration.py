"""Per-iteration bookkeeping: what streamed in, what it cost, and the metrics it logs."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from periodic_rl.algorithms.mismatch import mismatch_metrics
from periodic_rl.loss_mask import environment_tokens
from periodic_rl.rollout.dynamic_sampling import SamplingReport
from periodic_rl.rollout.types import RolloutGroup, Trajectory

#: Why a trajectory ended (:class:`~periodic_rl.rollout.types.Trajectory`), each logged as the
#: share ``agent/stop/<reason>`` of the iteration's trajectories.
STOP_REASONS = ("done", "max_turns", "token_budget", "length")


def micro_batch_tensors(
    groups: list[RolloutGroup], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages ``[N]`` and rewards ``[N]`` of a micro-batch, completions in group order."""
    advantages = torch.tensor([a for g in groups for a in g.advantages], dtype=torch.float32)
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    return advantages.to(device), rewards.to(device)


@dataclass
class AgentTotals:
    """Sums over the multi-turn trajectories of an iteration's trained groups."""

    trajectories: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    env_truncated: int = 0  # environment replies cut to fit
    agent_s: float = 0.0  # the groups' shares of their agent loops' time
    engine_idle_s: float = 0.0  # and of the time their engines had nothing to generate
    stops: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, trajectories: list[Trajectory]) -> None:
        for trajectory in trajectories:
            self.trajectories += 1
            self.turns += len(trajectory.turns)
            self.stops[trajectory.stop] += 1
            for turn in trajectory.turns:
                self.tool_calls += turn.tool_calls
                self.tool_errors += turn.tool_errors
                self.tool_timeouts += turn.tool_timeouts
                self.tool_seconds += turn.tool_seconds
                self.env_truncated += int(turn.env_truncated)

    def metrics(self) -> dict[str, float]:
        """``agent/turns``, ``agent/tool_calls``, ``agent/tool_errors``,
        ``agent/tool_timeouts`` and ``agent/env_truncated`` per trajectory (means),
        ``agent/tool_latency_s`` (mean seconds per tool call, when there was one),
        ``agent/engine_idle_share`` (the share of the agent loops' time the engine had nothing
        to generate: every unfinished trajectory waited on its environment) and
        ``agent/stop/<reason>`` (share of the trajectories); none without trajectories."""
        n = self.trajectories
        if not n:
            return {}
        out = {
            "agent/turns": self.turns / n,
            "agent/tool_calls": self.tool_calls / n,
            "agent/tool_errors": self.tool_errors / n,
            "agent/tool_timeouts": self.tool_timeouts / n,
            "agent/env_truncated": self.env_truncated / n,
        }
        if self.tool_calls:
            out["agent/tool_latency_s"] = self.tool_seconds / self.tool_calls
        if self.agent_s > 0:
            out["agent/engine_idle_share"] = self.engine_idle_s / self.agent_s
        for reason in dict.fromkeys([*STOP_REASONS, *self.stops]):
            out[f"agent/stop/{reason}"] = self.stops.get(reason, 0) / n
        return out


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
    # environment tokens of multi-turn completions (loss mask 0), all and truncated ones'
    masked_tokens: int = 0
    truncated_masked_tokens: int = 0
    agent: AgentTotals = field(default_factory=AgentTotals)
    prompts_truncated: int | None = None  # cut to max_prompt_length (None: no limit set)
    rewards: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    loss: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    groups: list[RolloutGroup] = field(default_factory=list)
    staleness: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # -> groups
    tokens_updated: int = 0  # partial rollouts: tokens sampled after an in-flight weight update
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
            self.tokens_updated += sum(
                v != group.version for row in group.token_versions for v in row
            )
            self.num_groups += 1
            self.num_sequences += len(group.completion_ids)
            self.num_tokens += sum(len(c) for c in group.completion_ids)
            self.rewards.extend(group.rewards)
            if group.truncated:
                self.truncated += sum(group.truncated)
                self.truncated_tokens += sum(
                    len(c) for c, t in zip(group.completion_ids, group.truncated, strict=True) if t
                )
            if group.trajectories:
                environment = environment_tokens(group)
                self.masked_tokens += sum(environment)
                if group.truncated:
                    self.truncated_masked_tokens += sum(
                        e for e, t in zip(environment, group.truncated, strict=True) if t
                    )
                self.agent.add(group.trajectories)
                self.agent.agent_s += group.agent_s
                self.agent.engine_idle_s += group.engine_idle_s
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
        """Completion tokens in the loss normaliser: without the environment tokens of
        multi-turn completions (:mod:`periodic_rl.loss_mask`), and without the truncated
        completions' model tokens when they are masked (:mod:`periodic_rl.truncation`)."""
        model_tokens = self.num_tokens - self.masked_tokens
        if mask_truncated_completions:
            return model_tokens - (self.truncated_tokens - self.truncated_masked_tokens)
        return model_tokens

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
        if self.tokens_updated:  # partial rollouts: share of tokens drawn by newer weights
            out["staleness/tokens_updated"] = self.tokens_updated / max(1, self.num_tokens)
        if self.agent.trajectories:  # a multi-turn iteration
            out["rollout/masked_tokens"] = float(self.masked_tokens)
            out.update(self.agent.metrics())
        out.update(mismatch_metrics(self.loss))  # engine vs trainer log-probs, when reported
        if self.dynamic_sampling is not None:  # dynamic_sampling/*: groups dropped, spares
            out.update(self.dynamic_sampling.metrics())
        return out
