"""The tool path of the agent loop: a TRL-style environment class (``environment_factory``: its
public methods are tools, ``reset(**columns)`` opens the trajectory), tool calls parsed from
the model's turn, replies appended as ``tool`` messages, errors and timeouts answered.

The engine here is scripted (an untrained tiny model never writes a tool call): it answers
each turn from a fixed script, so the test is of the loop, the parsing and the rendering.
"""

from __future__ import annotations

import time

import pytest

from periodic_rl.agents.build import agent_loop
from periodic_rl.agents.config import AgentConfig
from periodic_rl.agents.prompts import job_row
from periodic_rl.rollout.engine import InferenceEngine
from periodic_rl.rollout.types import GroupJob, SamplingConfig

SCRIPT = [
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>'
    '<tool_call>\n{"name": "wait", "arguments": {"seconds": 30}}\n</tool_call>'
    "<tool_call>not json</tool_call><|im_end|>",
    "The answer is 5.<|im_end|>",
]


class Calculator:
    """Written to TRL's ``environment_factory`` contract: no constructor arguments, ``reset``
    with the row's columns as keywords, public methods as tools."""

    def reset(self, **kwargs) -> str | None:
        self.answer = kwargs["answer"]
        self.calls = 0
        return "Use the tools."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer.
            b: the second integer.
        """
        self.calls += 1
        return a + b

    def divide(self, a: int, b: int) -> float:
        """Divide a by b.

        Args:
            a: the dividend.
            b: the divisor.
        """
        return a / b

    def wait(self, seconds: float) -> str:
        """Wait.

        Args:
            seconds: how long.
        """
        time.sleep(seconds)
        return "waited"


class ScriptedEngine(InferenceEngine):
    """Answers turn ``k`` of every trajectory with ``SCRIPT[k]`` (log-prob -1 per token)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.turns = [tokenizer.encode(text, add_special_tokens=False) for text in SCRIPT]

    def generate_with_logprobs(self, requests, sampling):
        out = []
        for request in requests:
            text = self.tokenizer.decode(request.prompt_ids)
            turn = self.turns[text.count("<|im_start|>assistant") - 1][: sampling.max_new_tokens]
            out.append(([turn] * request.n, [[-1.0] * len(turn)] * request.n))
        return out

    def generate(self, requests, sampling):
        return [group for group, _ in self.generate_with_logprobs(requests, sampling)]

    def load_weights(self, state_dict, partial=False):
        return ""

    def fingerprint(self):
        return ""

    def prompt_logprobs(self, token_ids):
        return []


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_a_trl_environment_class_runs_unchanged_through_the_tool_loop(tokenizer):
    config = AgentConfig(environment_factory=Calculator, max_turns=4, tool_timeout_s=0.5)
    loop = agent_loop(config, tokenizer, {tokenizer.eos_token_id})
    row = job_row({"prompt": "What is 2 + 3?", "answer": "5"}, None)
    prompt_ids = loop.renderer.prompt_ids(row["prompt"], add_generation_prompt=False)
    assert "add" in loop.renderer.decode(prompt_ids)  # the schemas reach the model
    job = GroupJob(index=0, prompt_ids=prompt_ids, n=2, seed=1, row=row)
    (out,) = loop.run(ScriptedEngine(tokenizer), [job], SamplingConfig(max_new_tokens=200))
    trajectory = out.trajectories[0]
    assert trajectory.stop == "done" and len(trajectory.turns) == 3
    roles = [m["role"] for m in trajectory.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "tool", "tool", "assistant"]
    replies = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert replies[0] == "5"
    assert "division by zero" in replies[1]
    assert "did not answer within 0.5 s" in replies[2]
    assert "not json" in replies[3] or "JSON" in replies[3]
    first, second, last = trajectory.turns
    assert (first.tool_calls, first.tool_errors, first.tool_timeouts) == (1, 0, 0)
    assert (second.tool_calls, second.tool_errors, second.tool_timeouts) == (3, 3, 1)
    assert last.tool_calls == 0 and last.env_tokens == 0
    loop.renderer.check_whole(row["prompt"], trajectory.messages, prompt_ids + out.completions[0])
    ids = out.completions[0]
    model = [i for i, m in enumerate(trajectory.loss_mask) if m]
    assert tokenizer.decode([ids[i] for i in model]) == "".join(SCRIPT)  # exactly the model's
    assert out.logprobs[0] == [-1.0 if m else 0.0 for m in trajectory.loss_mask]


def test_a_raising_tool_stops_the_run_when_asked(tokenizer):
    config = AgentConfig(environment_factory=Calculator, on_tool_error="raise")
    loop = agent_loop(config, tokenizer, {tokenizer.eos_token_id})
    engine = ScriptedEngine(tokenizer)
    engine.turns = [engine.turns[1], engine.turns[2]]
    row = job_row({"prompt": "What is 1 / 0?", "answer": "x"}, None)
    prompt_ids = loop.renderer.prompt_ids(row["prompt"], add_generation_prompt=False)
    job = GroupJob(index=0, prompt_ids=prompt_ids, n=1, seed=1, row=row)
    with pytest.raises(ZeroDivisionError):
        loop.run(engine, [job], SamplingConfig(max_new_tokens=200))
