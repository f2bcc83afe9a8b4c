"""From an :class:`~periodic_rl.agents.config.AgentConfig` to what runs it: the chat renderer
(the trainer encodes prompts with it, the rollout side renders replies with it) and the agent
loop of a rollout worker or of the in-process rollouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from periodic_rl.agents.config import AgentConfig, resolve
from periodic_rl.agents.environment import EnvironmentHandler, ToolHandler, TurnHandler
from periodic_rl.agents.loop import AgentLoop, GroupOutput
from periodic_rl.agents.rendering import ChatRenderer
from periodic_rl.agents.tools import ToolRunner, Toolset
from periodic_rl.rollout.engine import InferenceEngine, generate_groups
from periodic_rl.rollout.types import GroupJob, SamplingConfig


def toolset(config: AgentConfig) -> Toolset | None:
    """The tools the model may call (``None``: an environment answers instead). The tools of
    ``environment_factory`` are read from its class; each trajectory's own instance runs them."""
    if not config.uses_tools:
        return None
    functions = [resolve(tool, "tool") for tool in config.tools]
    tools = Toolset.from_functions(functions)
    if config.environment_factory is not None:
        factory = resolve(config.environment_factory, "environment_factory")
        tools = tools.merged(Toolset.from_object(_schema_instance(factory, config)))
    return tools


def renderer(
    config: AgentConfig, tokenizer: Any, eos_token_ids: set[int] | None = None
) -> ChatRenderer:
    """The chat renderer of a run: the tokenizer (its template, or ``config.chat_template``),
    the tools' schemas, and the texts of the tokens that end a model turn."""
    tools = toolset(config)
    schemas = tools.schemas() if tools is not None else None
    ends = [tokenizer.decode([i]) for i in sorted(eos_token_ids)] if eos_token_ids else None
    return ChatRenderer(tokenizer, schemas, chat_template=config.chat_template, end_texts=ends)


def agent_loop(config: AgentConfig, tokenizer: Any, eos_token_ids: set[int]) -> AgentLoop:
    """The loop a rollout worker (or the in-process rollouts) runs its jobs through."""
    chat = renderer(config, tokenizer, eos_token_ids)
    handlers: Callable[[], TurnHandler]
    if config.uses_tools:
        functions = [resolve(tool, "tool") for tool in config.tools]
        factory = (
            resolve(config.environment_factory, "environment_factory")
            if config.environment_factory is not None
            else None
        )
        call_format = (
            chat.tool_call_format if config.tool_call_format == "auto" else config.tool_call_format
        )

        shared = Toolset.from_functions(functions)
        runner = ToolRunner(
            shared, config.tool_workers, config.tool_timeout_s, config.on_tool_error
        )

        kwargs = config.environment_kwargs

        def handlers() -> TurnHandler:
            instance = factory(**kwargs) if factory is not None else None
            tools = shared if instance is None else shared.merged(Toolset.from_object(instance))
            return ToolHandler(runner, call_format, tools, instance)

    else:
        environment = resolve(config.environment, "environment")

        def handlers() -> TurnHandler:
            return EnvironmentHandler(environment(**config.environment_kwargs))

    return AgentLoop(
        chat,
        handlers,
        eos_token_ids,
        max_turns=config.max_turns,
        max_turn_tokens=config.max_turn_tokens,
        max_reply_tokens=config.max_tool_response_tokens,
        step_timeout_s=None if config.uses_tools else config.tool_timeout_s,
        workers=config.tool_workers,
    )


def model_agent_loop(config: AgentConfig, model_path: str) -> AgentLoop:
    """:func:`agent_loop` with the tokenizer and end tokens of the model at ``model_path``
    (what a rollout worker builds next to its engine)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ends = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's end token only
        configured = None
    if configured is not None:
        ends |= set(configured) if isinstance(configured, list) else {configured}
    return agent_loop(config, tokenizer, ends)


def run_jobs(
    engine: InferenceEngine,
    jobs: list[GroupJob],
    sampling: SamplingConfig,
    loop: AgentLoop | None,
) -> list[GroupOutput]:
    """Each job's completions, behaviour log-probs and trajectories: one turn each without
    ``loop``, the agent loop's trajectories with it."""
    if loop is not None:
        return loop.run(engine, jobs, sampling)
    outputs = generate_groups(engine, [job.request() for job in jobs], sampling)
    return [GroupOutput(completions, logprobs, []) for completions, logprobs in outputs]


def _schema_instance(factory: Any, config: AgentConfig) -> Any:
    """An instance of ``factory`` to read the tool schemas from (TRL's environment classes
    take no constructor arguments)."""
    try:
        return factory(**config.environment_kwargs)
    except TypeError as error:
        raise TypeError(
            f"environment_factory {factory!r} must be callable without arguments (one instance "
            f"per trajectory, as TRL's environment_factory): {error}"
        ) from error
