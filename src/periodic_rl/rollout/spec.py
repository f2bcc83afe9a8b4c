"""`EngineSpec`: how to build an inference engine, as a small picklable record.

A rollout worker is a Ray actor in another process, so it cannot be handed a live engine; it is
handed this spec and builds the engine itself. The spec is plain data (strings and a dict), so it
pickles cheaply, prints readably in logs and fits in a YAML config.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # importing the engines pulls in torch: workers must set threads first
    from periodic_rl.rollout.engine import InferenceEngine

#: The engines that ship with the library; ``engine`` may also be a ``module:Class`` path.
BuiltinEngine = Literal["vllm", "hf"]

# Short names of the engines that ship with the library, as ``module:Class`` paths.
BUILTIN_ENGINES: dict[str, str] = {
    "hf": "periodic_rl.rollout.engines.hf_engine:HFEngine",
    "vllm": "periodic_rl.rollout.engines.vllm_engine:VLLMEngine",
}


@dataclass(frozen=True)
class EngineSpec:
    """What engine a rollout worker builds: ``kind(model, **kwargs)``.

    Args:
        kind: ``"vllm"``, ``"hf"``, or ``"package.module:Class"`` naming a user's own
            :class:`~periodic_rl.rollout.engine.InferenceEngine` subclass (its module must be
            importable in the worker process: installed, or on the Ray rollouts' ``pythonpath``).
        model: model directory, hub id or alias, the engine's first argument.
        kwargs: further keyword arguments of the engine (``dtype``, ``max_model_len``, ...).
    """

    kind: str
    model: str
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"EngineSpec.kind must be a non-empty string, got {self.kind!r}")
        if self.kind not in BUILTIN_ENGINES:
            module, sep, name = self.kind.partition(":")
            if not sep or not module or not name.isidentifier():
                raise ValueError(
                    f"unknown engine kind {self.kind!r}: expected one of "
                    f"{sorted(BUILTIN_ENGINES)} or a 'package.module:ClassName' path"
                )
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"EngineSpec.model must be a non-empty string, got {self.model!r}")
        # A private copy: later edits of the caller's dict must not change a built spec.
        object.__setattr__(self, "kwargs", dict(self.kwargs or {}))

    @property
    def class_path(self) -> str:
        """The engine's ``module:Class`` path."""
        return BUILTIN_ENGINES.get(self.kind, self.kind)

    @property
    def uses_vllm(self) -> bool:
        """Whether the engine is vLLM (its environment variables must be set before import)."""
        return self.kind == "vllm"

    def engine_class(self) -> type[InferenceEngine]:
        """Import and return the engine class (raises ``ImportError``/``TypeError`` clearly)."""
        from periodic_rl.rollout.engine import InferenceEngine

        module_name, _, class_name = self.class_path.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImportError(
                f"engine {self.kind!r}: cannot import module {module_name!r} ({error}); "
                "is it installed, or on the Ray rollouts' pythonpath?"
            ) from error
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type) or not issubclass(cls, InferenceEngine):
            raise TypeError(
                f"engine {self.kind!r}: {class_name!r} in {module_name!r} is not an "
                "InferenceEngine subclass"
            )
        return cls

    def build(self) -> InferenceEngine:
        """Construct the engine: ``engine_class()(model, **kwargs)``."""
        return self.engine_class()(self.model, **self.kwargs)
