"""Tools the model can call: plain functions or the public methods of an environment object.

A tool is described to the model by the JSON schema that ``transformers.utils.get_json_schema``
builds from its type hints and its Google-style docstring (a summary, then an ``Args:`` section
describing each parameter). :meth:`Toolset.from_object` takes an environment the way TRL's
``environment_factory`` does: every public method except ``reset`` (and ``get_reward``, the
environment's own reward hook, not something for the model) is a tool, so a TRL environment
class runs unchanged; its calls run one at a time, in order, as TRL runs them.

:class:`ToolRunner` runs calls on daemon threads, each with a timeout, and always answers: an
unknown tool, bad arguments, a raising tool or one that does not return in time all become
replies the model reads (``error=True``), so that the trajectory goes on and the model can
learn from its mistake. Python cannot kill a thread: a tool that hangs keeps its thread until
it returns (the runner stops counting it and starts another); give tools that block on I/O
timeouts of their own.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

#: Public methods of an environment object that are not tools.
NOT_TOOLS = frozenset({"reset", "get_reward"})


class ToolSchemaError(ValueError):
    """A function that cannot be described to the model as a tool."""


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by ``name``, described by ``schema``
    (``{"type": "function", "function": {"name", "description", "parameters"}}``). Tools of the
    same ``group`` (the methods of one object) run one call at a time, in submission order."""

    name: str
    function: Callable[..., object]
    schema: dict[str, Any]  # JSON
    group: object | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_function(cls, function: Callable[..., object], group: object | None = None) -> Tool:
        """The tool for ``function``, its schema from its type hints and docstring."""
        from transformers.utils import get_json_schema

        label = getattr(function, "__qualname__", None) or repr(function)
        try:
            schema = get_json_schema(function)
        except Exception as exc:
            raise ToolSchemaError(
                f"cannot describe tool {label!r} to the model ({exc}): a tool needs a type hint "
                "on every parameter and a Google-style docstring: a summary line, then an "
                "'Args:' section with a 'name: description' line for each parameter"
            ) from exc
        return cls(schema["function"]["name"], function, schema, group)

    def parameters_text(self) -> str:
        """The parameters as the model should pass them, for error replies."""
        parameters = self.schema["function"].get("parameters", {})
        required = set(parameters.get("required", []))
        described = [
            f"{name} ({spec.get('type', 'any')}, {'required' if name in required else 'optional'})"
            for name, spec in parameters.get("properties", {}).items()
        ]
        return ", ".join(described) or "none"


class Toolset:
    """Tools by name (unique)."""

    def __init__(self, tools: Iterable[Tool]) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ValueError(f"two tools are named {tool.name!r}: tool names must be unique")
            self._tools[tool.name] = tool

    @classmethod
    def from_functions(cls, functions: Iterable[Callable[..., object]]) -> Toolset:
        """One tool per function, named after it; calls run concurrently."""
        return cls(Tool.from_function(function) for function in functions)

    @classmethod
    def from_object(cls, environment: object) -> Toolset:
        """The public methods of ``environment`` except ``reset`` and ``get_reward``, as TRL's
        ``environment_factory`` takes them. They share the object's state, so their
        (synchronous) calls run one at a time, in the order submitted; a call that times out
        lets the next one start."""
        group = object()
        methods = inspect.getmembers(environment, predicate=inspect.ismethod)
        chosen = [m for name, m in methods if not name.startswith("_") and name not in NOT_TOOLS]
        return cls(Tool.from_function(method, group) for method in chosen)

    def merged(self, other: Toolset) -> Toolset:
        """These tools and ``other``'s (names must not clash)."""
        return Toolset([*self, *other])

    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The JSON schemas, for ``apply_chat_template(tools=...)``."""
        return [tool.schema for tool in self._tools.values()]

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)


@dataclass(frozen=True)
class ToolResult:
    """A call's reply: ``content`` is what the model reads; ``error``: the call failed (the
    content says why); ``timed_out``: it did not return within the timeout; ``seconds``: how
    long it ran."""

    content: str
    error: bool = False
    timed_out: bool = False
    seconds: float = 0.0


def encode_result(value: object) -> str:
    """A tool's return value as text: a string as it is, anything else as JSON (``str()`` of
    what JSON cannot encode)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


@dataclass(eq=False)
class _Call:
    future: Future[ToolResult]
    tool: Tool
    arguments: dict[str, object]
    on_thread: bool = False  # counted against max_workers while it runs
    settled: bool = False


class ToolRunner:
    """Runs tool calls concurrently, ``max_workers`` at a time, each for at most ``timeout_s``
    seconds (``None``: no limit); :meth:`submit` never blocks.

    ``on_error="reply"`` sends a raising tool's exception back to the model as its reply;
    ``"raise"`` sets it on the future instead (the model's own mistakes, an unknown tool or bad
    arguments, are always replies). Each synchronous call runs on a daemon thread of its own,
    so a hung tool never holds up the process's exit; one that times out no longer counts
    against ``max_workers``. ``async def`` tools run on one shared event-loop thread and are
    cancelled at their timeout; they must not block that thread.
    """

    def __init__(
        self,
        toolset: Toolset,
        max_workers: int = 8,
        timeout_s: float | None = 60.0,
        on_error: Literal["reply", "raise"] = "reply",
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        if on_error not in ("reply", "raise"):
            raise ValueError(f"on_error must be 'reply' or 'raise', got {on_error!r}")
        self.toolset, self.max_workers = toolset, max_workers
        self.timeout_s, self.on_error = timeout_s, on_error
        self._lock = threading.Lock()
        self._waiting: deque[_Call] = deque()
        self._running = 0
        self._busy: set[int] = set()  # the groups with a call running
        self._closed = False

    def submit(
        self, name: str, arguments: Mapping[str, object], *, toolset: Toolset | None = None
    ) -> Future[ToolResult]:
        """Start a call of tool ``name``; the future gets its :class:`ToolResult`. ``toolset``
        replaces the runner's for this call (one runner for the environment objects of many
        trajectories)."""
        toolset = toolset if toolset is not None else self.toolset
        future: Future[ToolResult] = Future()
        future.set_running_or_notify_cancel()
        if name not in toolset:
            available = ", ".join(toolset.names()) or "none"
            reply = f"error: unknown tool {name!r}; the available tools are: {available}"
            future.set_result(ToolResult(reply, error=True))
            return future
        tool = toolset[name]
        problem = _arguments_problem(tool, arguments)
        if problem is not None:
            expected = tool.parameters_text()
            reply = f"error: bad arguments for {name!r}: {problem}; expected parameters: {expected}"
            future.set_result(ToolResult(reply, error=True))
            return future
        call = _Call(future, tool, dict(arguments))
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool runner is closed")
            if inspect.iscoroutinefunction(tool.function):
                asyncio.run_coroutine_threadsafe(self._run_async(call), _event_loop())
            else:
                self._waiting.append(call)
                self._dispatch()
        return future

    def close(self) -> None:
        """Take no more calls and answer those still waiting with an error; running calls
        finish or time out, hung ones are left to their threads."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
        for call in waiting:
            self._settle(call, ToolResult(f"error: {call.tool.name!r} did not run", error=True))

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _dispatch(self) -> None:  # under self._lock
        for call in list(self._waiting):
            if self._running >= self.max_workers:
                return
            group = id(call.tool.group) if call.tool.group is not None else None
            if group in self._busy:
                continue  # its object is busy: it waits its turn
            self._waiting.remove(call)
            self._running += 1
            call.on_thread = True
            if group is not None:
                self._busy.add(group)
            threading.Thread(target=self._run, args=(call,), name="tool", daemon=True).start()

    def _settle(self, call: _Call, outcome: ToolResult | BaseException) -> bool:
        """Give the call its outcome unless it has one (whether this one counted), and start
        the calls waiting for its place."""
        with self._lock:
            if call.settled:
                return False
            call.settled = True
            if call.on_thread:
                self._running -= 1
                self._busy.discard(id(call.tool.group))
                self._dispatch()
        if isinstance(outcome, BaseException):
            call.future.set_exception(outcome)
        else:
            call.future.set_result(outcome)
        return True

    def _run(self, call: _Call) -> None:
        start = time.monotonic()
        timer = None
        if self.timeout_s is not None:
            timer = threading.Timer(
                self.timeout_s, lambda: self._settle(call, self._timeout(call, start))
            )
            timer.daemon = True
            timer.start()
        try:
            outcome = self._reply(call.tool.function(**call.arguments), start)
        except Exception as exc:
            outcome = self._failure(call, exc, start)
        if timer is not None:
            timer.cancel()
        self._settle(call, outcome)

    async def _run_async(self, call: _Call) -> None:
        start = time.monotonic()
        task = asyncio.ensure_future(call.tool.function(**call.arguments))
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            task.cancel()
            self._settle(call, self._timeout(call, start))
        elif (exc := task.exception()) is not None:
            self._settle(call, self._failure(call, exc, start))
        else:
            self._settle(call, self._reply(task.result(), start))

    def _reply(self, value: object, start: float) -> ToolResult:
        return ToolResult(encode_result(value), seconds=time.monotonic() - start)

    def _failure(self, call: _Call, exc: BaseException, start: float) -> ToolResult | BaseException:
        if self.on_error == "raise":
            return exc
        reply = f"error: {call.tool.name!r} raised {type(exc).__name__}: {exc}"
        return ToolResult(reply, error=True, seconds=time.monotonic() - start)

    def _timeout(self, call: _Call, start: float) -> ToolResult:
        reply = f"error: {call.tool.name!r} did not answer within {self.timeout_s:g} s"
        return ToolResult(reply, error=True, timed_out=True, seconds=time.monotonic() - start)


def _arguments_problem(tool: Tool, arguments: object) -> str | None:
    """What is wrong with ``arguments`` for ``tool`` (not an object, a parameter missing or
    unexpected), or ``None``."""
    if not isinstance(arguments, Mapping):
        return f"the arguments must be a JSON object, got {type(arguments).__name__}"
    try:
        inspect.signature(tool.function).bind(**arguments)
    except TypeError as exc:
        return str(exc)
    return None


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The event loop that every runner's ``async`` tools share, on a daemon thread."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="tool-loop", daemon=True).start()
        return _loop
