"""The agent loop: every trajectory of a call's prompt groups, turn by turn, token-in token-out.

Each trajectory continues from its exact token ids: the prompt's, then each model turn as the
engine sampled it, then the environment's reply rendered from the new messages only
(:class:`~periodic_rl.agents.rendering.ChatRenderer`). Trajectories progress independently:
while some wait on their tools (in a thread pool), the engine generates the turns of all the
others that are ready, in one batch. Each turn is sampled with its own seed, derived from the
group's seed, the sample and the turn, so a trajectory's tokens never depend on which others
share an engine batch or how long a tool took.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

from periodic_rl.agents.environment import Message, StepResult, TurnHandler
from periodic_rl.agents.rendering import ChatRenderer, truncate_reply
from periodic_rl.rollout.engine import InferenceEngine, generate_groups, sample_seed
from periodic_rl.rollout.types import (
    GenerationRequest,
    GroupJob,
    SamplingConfig,
    Trajectory,
    Turn,
)


@dataclass
class GroupOutput:
    """One job's trajectories: response ids, behaviour log-probs (``[]``: the engine gave
    none) and one :class:`Trajectory` per sample."""

    completions: list[list[int]]
    logprobs: list[list[float]]
    trajectories: list[Trajectory]
    agent_s: float = 0.0
    engine_idle_s: float = 0.0


@dataclass(frozen=True)
class LoopStats:
    """Time of one :meth:`AgentLoop.run`: in all, and with nothing for the engine to do
    (every unfinished trajectory waiting on its environment)."""

    seconds: float
    engine_waited_s: float


@dataclass
class _Trajectory:
    """One trajectory being generated."""

    job: GroupJob
    sample: int
    handler: TurnHandler
    budget: int
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    has_logprobs: bool = True
    messages: list[Message] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    stop: str | None = None
    submitted: float = 0.0

    @property
    def seed(self) -> int:
        return sample_seed(self.job.seed, self.sample)

    def turn_seed(self) -> int:
        return sample_seed(self.seed, len(self.turns) + 1)

    def append_environment(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def result(self) -> Trajectory:
        return Trajectory(
            loss_mask=self.mask,
            turns=tuple(self.turns),
            messages=self.messages,
            env_reward=self.reward,
            stop=self.stop or "done",
        )


class AgentLoop:
    """Runs the trajectories of prompt groups over an engine.

    Args:
        renderer: renders the prompt and each environment reply.
        handlers: builds one :class:`~periodic_rl.agents.environment.TurnHandler` per
            trajectory.
        eos_token_ids: the tokens that end a model turn.
        max_turns: model turns per trajectory.
        max_turn_tokens: a turn still going after this many tokens is cut and answered
            (``None``: no cap but the trajectory's budget).
        max_reply_tokens: cap on each environment reply (marked when cut).
        step_timeout_s: an environment step still running after this ends its trajectory
            (``"timeout"``; its thread cannot be stopped and is left to finish); ``None``: the
            steps bound their own time (tool calls each have their timeout).
        workers: environment steps running at once.
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        handlers: Callable[[], TurnHandler],
        eos_token_ids: set[int],
        max_turns: int,
        max_turn_tokens: int | None,
        max_reply_tokens: int,
        step_timeout_s: float | None,
        workers: int,
    ) -> None:
        self.renderer, self.handlers = renderer, handlers
        self.eos_token_ids = set(eos_token_ids)
        self.max_turns, self.max_reply_tokens = max_turns, max_reply_tokens
        self.max_turn_tokens = max_turn_tokens
        self.step_timeout_s = step_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent-env")
        self.last_stats = LoopStats(0.0, 0.0)

    def run(
        self, engine: InferenceEngine, jobs: list[GroupJob], sampling: SamplingConfig
    ) -> list[GroupOutput]:
        """Every job's ``n`` trajectories; ``sampling.max_new_tokens`` is each trajectory's
        budget of model tokens over all its turns."""
        started = time.monotonic()
        waited = 0.0
        states = [
            _Trajectory(job, i, self.handlers(), sampling.max_new_tokens)
            for job in jobs
            for i in range(job.n)
        ]
        pending: dict[Future[Any], _Trajectory] = {}
        for state in states:
            if state.job.row is None:
                raise ValueError(f"job {state.job.index} carries no row for its environment")
            state.submitted = time.monotonic()
            pending[self.pool.submit(self._open, state)] = state
        ready: list[_Trajectory] = []
        while pending or ready:
            if not ready:
                began = time.monotonic()
                wait(pending, timeout=self._next_deadline(pending), return_when=FIRST_COMPLETED)
                waited += time.monotonic() - began
            for future in [f for f in pending if f.done()]:
                state = pending.pop(future)
                if self._answered(state, future.result()):
                    ready.append(state)
            self._expire(pending)
            if ready:
                for state in self._generate(engine, ready, sampling):
                    state.submitted = time.monotonic()
                    pending[self.pool.submit(self._step, state)] = state
                ready = []
        self.last_stats = LoopStats(time.monotonic() - started, waited)
        outputs = [self._output(job, states) for job in jobs]
        for out in outputs:  # each group's share of the call
            out.agent_s = self.last_stats.seconds / len(outputs)
            out.engine_idle_s = waited / len(outputs)
        return outputs

    def close(self) -> None:
        """Stop taking steps (a hung one is left to finish in its thread)."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- the steps of one trajectory ---------------------------------------------------------
    def _open(self, state: _Trajectory) -> tuple[str, Any]:
        return "open", state.handler.open(dict(state.job.row or {}), state.seed)

    def _step(self, state: _Trajectory) -> tuple[str, Any]:
        text = state.messages[-1]["content"]
        return "step", state.handler.step(text)

    def _answered(self, state: _Trajectory, outcome: tuple[str, Any]) -> bool:
        """Append the environment's answer; whether the trajectory goes on."""
        kind, value = outcome
        prompt = list((state.job.row or {})["prompt"])
        if kind == "open":
            messages = self._capped(value)
            state.messages += messages
            state.append_environment(self.renderer.opening(prompt, messages))
            return True
        result: StepResult = value
        if result.reward is not None:
            state.reward = (state.reward or 0.0) + result.reward
        messages = self._capped(result.messages)
        last = state.turns[-1]
        ends = result.done or len(state.turns) >= self.max_turns or state.budget <= 0
        ids: list[int] = []
        if not ends:
            model_text = state.messages[-1]["raw"]
            earlier = [_plain(m) for m in state.messages[:-1]]
            ids = self.renderer.continuation(prompt + earlier, model_text, messages)
            state.messages += messages
            state.append_environment(ids)
        state.turns[-1] = replace(
            last,
            env_tokens=len(ids),
            tool_calls=result.tool_calls,
            tool_errors=result.tool_errors,
            tool_timeouts=result.tool_timeouts,
            tool_seconds=result.tool_seconds,
            env_truncated=any(m.get("truncated") for m in messages),
        )
        if ends:
            state.stop = (
                "done" if result.done else "max_turns" if state.budget > 0 else "token_budget"
            )
        return not ends

    def _capped(self, messages: list[Message]) -> list[Message]:
        capped = []
        for message in messages:
            text, cut = truncate_reply(
                self.renderer.tokenizer, str(message.get("content", "")), self.max_reply_tokens
            )
            capped.append({**message, "content": text, **({"truncated": True} if cut else {})})
        return capped

    def _generate(
        self, engine: InferenceEngine, ready: list[_Trajectory], sampling: SamplingConfig
    ) -> list[_Trajectory]:
        """One engine call for the next turn of every ready trajectory; those whose turn
        asks the environment for an answer."""
        ready.sort(key=lambda s: (s.job.index, s.sample))
        requests = [
            GenerationRequest(prompt_ids=s.job.prompt_ids + s.ids, n=1, seed=s.turn_seed())
            for s in ready
        ]
        caps = [self._turn_cap(s) for s in ready]
        # one call for all: each turn is cut to its own cap (a prefix of a sample is the sample
        # a smaller cap would have drawn, with the same seed)
        outputs = generate_groups(engine, requests, replace(sampling, max_new_tokens=max(caps)))
        asking = []
        for state, cap, (completions, logprobs) in zip(ready, caps, outputs, strict=True):
            tokens = completions[0][:cap]
            start = len(state.ids)
            state.ids += tokens
            state.mask += [1] * len(tokens)
            if logprobs:
                state.logprobs += logprobs[0][: len(tokens)]
            else:
                state.has_logprobs = False
                state.logprobs += [0.0] * len(tokens)
            state.budget -= len(tokens)
            state.turns.append(Turn(start=start, model_tokens=len(tokens)))
            raw = self.renderer.decode(tokens)
            ended = bool(tokens) and tokens[-1] in self.eos_token_ids
            content = self.renderer.strip_end(raw) if ended else raw
            state.messages.append({"role": "assistant", "content": content, "raw": raw})
            if ended or (len(tokens) == cap and state.budget > 0):
                asking.append(state)  # a turn cut at max_turn_tokens is answered too
            else:
                state.stop = "token_budget" if state.budget <= 0 else "length"
        return asking

    def _turn_cap(self, state: _Trajectory) -> int:
        if self.max_turn_tokens is None:
            return state.budget
        return min(state.budget, self.max_turn_tokens)

    def _next_deadline(self, pending: dict[Future[Any], _Trajectory]) -> float | None:
        if not pending or self.step_timeout_s is None:
            return None
        first = min(state.submitted for state in pending.values())
        return max(0.0, first + self.step_timeout_s - time.monotonic()) + 0.01

    def _expire(self, pending: dict[Future[Any], _Trajectory]) -> None:
        """End the trajectories whose environment has not answered within the timeout."""
        if self.step_timeout_s is None:
            return
        now = time.monotonic()
        for future, state in list(pending.items()):
            if now - state.submitted > self.step_timeout_s:
                del pending[future]
                state.stop = "timeout"
                if state.turns:
                    state.turns[-1] = replace(state.turns[-1], tool_timeouts=1)

    def _output(self, job: GroupJob, states: list[_Trajectory]) -> GroupOutput:
        mine = [s for s in states if s.job is job]
        logprobs = [s.logprobs for s in mine] if all(s.has_logprobs for s in mine) else []
        for state in mine:
            state.messages = [_plain(m) for m in state.messages]
        return GroupOutput([s.ids for s in mine], logprobs, [s.result() for s in mine])


def _plain(message: Message) -> Message:
    """A message as the chat template sees it (without the loop's own keys)."""
    return {k: v for k, v in message.items() if k not in ("raw", "truncated")}
