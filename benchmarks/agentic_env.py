"""The tool workload of ``benchmarks/agentic.py``: an environment class written to TRL's
``environment_factory`` contract, its prompts, its reward and the chat template both sides use.

``ToolDesk`` takes no constructor arguments, ``reset(**row)`` opens each trajectory, and its
public methods are the tools (schemas from their type hints and Google docstrings):

* ``python(code)``: runs the model's code in the sandbox of :func:`periodic_rl.run_python`
  (a fresh isolated interpreter per call: real process start-up and CPU time);
* ``calculator(expression)``: a "remote service". Before answering it sleeps a latency drawn
  from a lognormal distribution (median :data:`LATENCY_MEDIAN_S`, log-sd :data:`LATENCY_SIGMA`,
  capped at :data:`LATENCY_CAP_S`), seeded by :data:`LATENCY_SEED`, the question, the call's
  place in the trajectory and its arguments: the same call gets the same latency in every
  framework and every run, whatever ran at the same time.

Both tools bound their own time (:data:`TOOL_TIMEOUT_S`): TRL 1.16 runs a tool without any
time limit, so the environment enforces the limit itself, the same in every configuration.

Nothing here imports torch, TRL or vLLM: the Ray rollout worker imports this module by name
(``agentic_env:ToolDesk``, the benchmarks folder on its ``PYTHONPATH``).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import operator
import random
import re
import time
from pathlib import Path
from typing import Any

#: The remote service's latency: lognormal, median 2 s, log-sd 0.5 (mean ~2.3 s, 95th percentile
#: ~4.6 s), capped so that no call reaches the tool timeout: the order of a web-search API or a
#: hosted code sandbox answering one request, the services multi-turn RL waits on.
LATENCY_MEDIAN_S = 2.0
LATENCY_SIGMA = 0.5
LATENCY_CAP_S = 8.0
LATENCY_SEED = 0
#: Each tool's own time limit (the sandbox's wall clock; the service is capped below it).
TOOL_TIMEOUT_S = 10.0

SYSTEM_PROMPT = (
    "You are a careful assistant. Always call a tool to compute, then reply with the number alone."
)
QUESTION = "What is {question}? Use a tool, then reply with only the number."


def _exchange(question: str, tool: str, argument: str, value: str, answer: str) -> list[dict]:
    call = {"name": tool, "arguments": {argument: value}}
    return [
        {"role": "user", "content": QUESTION.format(question=question)},
        {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]


#: Worked tool-use exchanges before each question. Without them SmolLM2-135M almost never calls
#: a tool: sampling 24 first turns (3 questions x 8), none began with a tool call under a system
#: prompt alone (even one showing the call format), none after one or two exchanges, and 14
#: after these three (12 with the calculator and python exchanges in another order).
EXCHANGES = [
    _exchange("4 + 9", "calculator", "expression", "4 + 9", "13"),
    _exchange("11 + 6", "python", "code", "print(11 + 6)", "17"),
    _exchange("8 + 15", "calculator", "expression", "8 + 15", "23"),
]
DEMOS = [message for exchange in EXCHANGES for message in exchange]

_FINAL_NUMBER = re.compile(r"(-?\d+)\s*\.?\s*$")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def latency(question: str, call: int, arguments: str) -> float:
    """The service's latency for one call: a fixed function of what is asked."""
    key = f"{LATENCY_SEED}|{question}|{call}|{arguments}".encode()
    rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
    return min(rng.lognormvariate(math.log(LATENCY_MEDIAN_S), LATENCY_SIGMA), LATENCY_CAP_S)


def evaluate(expression: str) -> float | int:
    """An arithmetic expression of numbers, + - * / and parentheses (nothing else runs)."""

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    if len(expression) > 200:
        raise ValueError("expression too long")
    result = value(ast.parse(expression, mode="eval"))
    return int(result) if float(result).is_integer() else result


class ToolDesk:
    """Arithmetic with tools: a sandboxed Python interpreter and a slow calculator service.
    TRL's ``environment_factory`` contract: no constructor arguments, ``reset(**row)`` first,
    public methods are tools.

    ``log`` (a class attribute) collects ``(tool, seconds)`` of every call made in this process
    (TRL's tools run in its training process; periodic_rl's in the rollout worker, which
    reports them itself)."""

    log: list[tuple[str, float]] = []

    def reset(self, **row: Any) -> str | None:
        self.question = str(row.get("question", ""))
        self.calls = 0
        self.service_s = 0.0
        return None  # the prompt says everything

    def python(self, code: str) -> str:
        """Run a Python program in a sandbox and return what it printed.

        Args:
            code: a complete Python program; print() the result. Standard library only.
        """
        from periodic_rl import run_python

        self.calls += 1
        started = time.monotonic()
        result = run_python(code, timeout_s=TOOL_TIMEOUT_S, cpu_s=int(TOOL_TIMEOUT_S) - 1)
        ToolDesk.log.append(("python", time.monotonic() - started))
        out = result.stdout.strip()
        if result.timed_out or result.killed_by is not None:
            return (out + f"\n(stopped: {result.killed_by or 'time limit'})").strip()
        if result.returncode not in (0, None):
            return (out + "\n" + result.stderr.strip()[-300:]).strip()
        return out or "(no output)"

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression on the remote calculator service.

        Args:
            expression: numbers with + - * / and parentheses, e.g. "12 + 7".
        """
        self.calls += 1
        wait = latency(self.question, self.calls, expression)
        self.service_s += wait
        time.sleep(wait)
        ToolDesk.log.append(("calculator", wait))
        try:
            return str(evaluate(str(expression)))
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError) as error:
            return f"error: {error}"


def prompt_rows(num: int, seed: int = 0) -> list[dict[str, Any]]:
    """``num`` rows ``{"prompt", "answer", "question"}``: the train problems of
    ``builtin:arithmetic`` (its operands and answers), as chat messages: the system prompt, the
    worked exchanges (:data:`DEMOS`), the question."""
    from periodic_rl.data.arithmetic import arithmetic_problems

    rows = []
    for problem in arithmetic_problems("train", num, seed=seed):
        a, op, b = re.match(r"What is (\d+) (\S) (\d+)\?", problem["prompt"]).groups()
        question = f"{a} {op} {b}"
        prompt = [
            {"role": "system", "content": SYSTEM_PROMPT},
            *DEMOS,
            {"role": "user", "content": QUESTION.format(question=question)},
        ]
        rows.append({"prompt": prompt, "answer": problem["answer"], "question": question})
    return rows


def final_answer(messages: list[dict[str, Any]]) -> str | None:
    """The number that ends the last assistant message, unless that message calls a tool."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if last is None or last.get("tool_calls"):
        return None
    content = last.get("content") or ""
    if isinstance(content, list):  # content blocks
        content = " ".join(str(part.get("text", "")) for part in content)
    if "<tool_call>" in content:
        return None
    match = _FINAL_NUMBER.search(content.strip())
    return match.group(1) if match else None


def correct_answer(
    prompts: list[Any], completions: list[Any], answer: list[str], **columns: Any
) -> list[float]:
    """1 when the trajectory's final answer (its last assistant message, a reply rather than a
    tool call) ends in the right number. TRL hands the completions as message lists;
    periodic_rl hands the text and the conversation as ``messages``."""
    conversations = columns.get("messages") or completions
    return [
        float(final_answer(c) == a) if isinstance(c, list) else 0.0
        for c, a in zip(conversations, answer, strict=True)
    ]


def qwen25_template() -> str:
    """TRL's copy of the Qwen2.5 chat template (``trl/chat_templates/qwen2_5.jinja``), read
    from the installed TRL without importing it.

    SmolLM2's own template ignores tools and tool calls, and TRL 1.16 refuses a template that
    does not render them (``supports_tool_calling``) or whose tool-call format it cannot parse
    (``add_response_schema`` knows Qwen, Llama 3.1, ...). Both sides get this one: the same
    prompt tokens, hermes ``<tool_call>`` calls, tool replies as ``<tool_response>`` blocks.
    SmolLM2 uses the same ``<|im_start|>``/``<|im_end|>`` tokens."""
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]' (trl==1.16.0)")
    root = Path(list(spec.submodule_search_locations)[0])
    return (root / "chat_templates" / "qwen2_5.jinja").read_text(encoding="utf-8")
