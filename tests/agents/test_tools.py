"""Tools from functions and environment objects (TRL's environment_factory contract), their
schemas, and the runner: concurrency, errors and timeouts as replies, async tools, ordering of
one object's calls."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from periodic_rl.agents.tools import (
    Tool,
    ToolResult,
    ToolRunner,
    ToolSchemaError,
    Toolset,
    encode_result,
)


def add(a: int, b: int = 0) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def fail(message: str) -> str:
    """Raise an error.

    Args:
        message: what the error says
    """
    raise RuntimeError(message)


class Counter:
    """A TRL-style environment: public methods are tools, ``reset`` and ``get_reward`` not."""

    def __init__(self) -> None:
        self.value = 0
        self.log: list[int] = []
        self.inside = 0
        self.most_inside = 0

    def reset(self, **columns: object) -> str | None:
        self.value = 0
        return "start"

    def get_reward(self) -> float:
        return float(self.value)

    def increment(self, by: int) -> int:
        """Increment the counter, slowly.

        Args:
            by: how much to add
        """
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        time.sleep(0.02)
        self.value += by
        self.log.append(by)
        self.inside -= 1
        return self.value

    def _helper(self) -> None:
        pass


def test_schema_from_type_hints_and_docstring():
    tool = Tool.from_function(add)
    assert tool.name == "add"
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first number"},
                    "b": {"type": "integer", "description": "the second number"},
                },
                "required": ["a"],
            },
            "return": {"type": "integer"},
        },
    }
    assert tool.parameters_text() == "a (integer, required), b (integer, optional)"


def test_undescribable_functions_are_refused_by_name():
    def bare(x: int) -> int:
        return x

    def undocumented_arg(x: int, y: int) -> int:
        """Sum.

        Args:
            x: a number
        """
        return x + y

    with pytest.raises(ToolSchemaError, match=r"bare.*no docstring.*'Args:' section"):
        Toolset.from_functions([bare])
    with pytest.raises(ToolSchemaError, match=r"undocumented_arg.*argument 'y'"):
        Toolset.from_functions([undocumented_arg])


def test_from_object_takes_the_public_methods_but_reset_and_get_reward():
    tools = Toolset.from_object(Counter())
    assert tools.names() == ["increment"]
    merged = Toolset.from_functions([add]).merged(tools)
    assert merged.names() == ["add", "increment"]
    assert [s["function"]["name"] for s in merged.schemas()] == ["add", "increment"]
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        Toolset.from_functions([add]).merged(Toolset.from_functions([add]))


@pytest.fixture
def runner():
    runner = ToolRunner(Toolset.from_functions([add, fail]), max_workers=4, timeout_s=10)
    yield runner
    runner.close()


def test_calls_return_text(runner):
    result = runner.submit("add", {"a": 2, "b": 3}).result(timeout=10)
    assert result.content == "5"
    assert not result.error and not result.timed_out
    assert result.seconds >= 0


def test_return_values_are_json_encoded():
    assert encode_result("plain") == "plain"
    assert encode_result({"a": [1, "é"]}) == '{"a": [1, "é"]}'
    assert encode_result(None) == "null"
    assert encode_result({1, 2}) in ("{1, 2}", "{2, 1}")  # JSON cannot: str()


def test_unknown_tool_names_the_available_ones(runner):
    result = runner.submit("mul", {"a": 1}).result(timeout=10)
    assert result.error
    assert "unknown tool 'mul'" in result.content
    assert "add, fail" in result.content


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [({"b": 1}, "missing a required argument: 'a'"), ({"a": 1, "c": 2}, "unexpected keyword")],
)
def test_bad_arguments_name_the_expected_parameters(runner, arguments, problem):
    result = runner.submit("add", arguments).result(timeout=10)
    assert result.error
    assert problem in result.content
    assert "a (integer, required), b (integer, optional)" in result.content


def test_non_object_arguments_are_an_error(runner):
    result = runner.submit("add", [1, 2]).result(timeout=10)  # type: ignore[arg-type]
    assert result.error and "must be a JSON object, got list" in result.content


def test_a_raising_tool_replies_with_its_message(runner):
    result = runner.submit("fail", {"message": "disk full"}).result(timeout=10)
    assert result.error and not result.timed_out
    assert "RuntimeError: disk full" in result.content


def test_on_error_raise_sets_the_exception():
    with ToolRunner(Toolset.from_functions([fail]), on_error="raise") as runner:
        future = runner.submit("fail", {"message": "boom"})
        with pytest.raises(RuntimeError, match="boom"):
            future.result(timeout=10)
        unknown = runner.submit("nope", {}).result(timeout=10)  # the model's mistake: a reply
        assert unknown.error


def test_a_hanging_tool_times_out_without_blocking():
    release = threading.Event()

    def hang() -> str:
        """Never answers in time."""
        release.wait(30)
        return "late"

    runner = ToolRunner(Toolset.from_functions([hang, add]), max_workers=1, timeout_s=0.5)
    try:
        began = time.monotonic()
        future = runner.submit("hang", {})
        assert time.monotonic() - began < 5  # submit does not wait for the tool
        result = future.result(timeout=15)
        assert result.timed_out and result.error
        assert "did not answer within 0.5 s" in result.content
        assert 0.4 <= result.seconds < 15
        # the hung call no longer takes the only worker place
        assert runner.submit("add", {"a": 1}).result(timeout=10).content == "1"
    finally:
        release.set()
        runner.close()


def test_calls_run_concurrently(runner):
    barrier = threading.Barrier(4, timeout=10)

    def meet() -> str:
        """Wait until four calls are running."""
        barrier.wait()
        return "met"

    tools = Toolset.from_functions([meet])
    futures = [runner.submit("meet", {}, toolset=tools) for _ in range(4)]
    assert [f.result(timeout=15).content for f in futures] == ["met"] * 4


def test_at_most_max_workers_run_at_once():
    lock = threading.Lock()
    state = {"inside": 0, "most": 0}

    def busy() -> None:
        """Be busy for a moment."""
        with lock:
            state["inside"] += 1
            state["most"] = max(state["most"], state["inside"])
        time.sleep(0.05)
        with lock:
            state["inside"] -= 1

    with ToolRunner(Toolset.from_functions([busy]), max_workers=2) as runner:
        futures = [runner.submit("busy", {}) for _ in range(8)]
        assert all(f.result(timeout=15).content == "null" for f in futures)
    assert state["most"] == 2


def test_an_objects_calls_run_one_at_a_time_in_order():
    counter = Counter()
    with ToolRunner(Toolset.from_object(counter), max_workers=8) as runner:
        futures = [runner.submit("increment", {"by": by}) for by in range(1, 7)]
        results = [f.result(timeout=15).content for f in futures]
    assert counter.log == [1, 2, 3, 4, 5, 6]
    assert counter.most_inside == 1
    assert results == ["1", "3", "6", "10", "15", "21"]


def test_async_tools_run_and_time_out():
    cancelled = threading.Event()

    async def double(x: int) -> int:
        """Double a number.

        Args:
            x: the number
        """
        await asyncio.sleep(0.01)
        return 2 * x

    async def stall() -> str:
        """Never answers."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    with ToolRunner(Toolset.from_functions([double, stall]), timeout_s=0.5) as runner:
        assert runner.submit("double", {"x": 21}).result(timeout=10).content == "42"
        result = runner.submit("stall", {}).result(timeout=15)
    assert result.timed_out and result.error
    assert cancelled.wait(10)


def test_close_answers_waiting_calls_and_refuses_new_ones():
    release = threading.Event()

    def wait_for_release() -> str:
        """Wait."""
        release.wait(30)
        return "done"

    runner = ToolRunner(Toolset.from_functions([wait_for_release]), max_workers=1, timeout_s=10)
    running = runner.submit("wait_for_release", {})
    waiting = runner.submit("wait_for_release", {})
    runner.close()
    assert waiting.result(timeout=5) == ToolResult(
        "error: 'wait_for_release' did not run", error=True
    )
    release.set()
    assert running.result(timeout=10).content == "done"
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit("wait_for_release", {})
