"""Checking a pushed state dict against the names a model expects, before it is loaded.

A push whose names do not match the model must fail loudly: vLLM only logs a warning for weights
it did not receive and keeps the old ones, which is exactly the silent staleness the library
exists to prevent. Names are transformers parameter names; parameters that share one tensor
(tied embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight``) need only one of their
names to be present.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightNames:
    """The state-dict names of a model, grouped by the tensor they refer to.

    ``groups`` holds one tuple per distinct tensor; a tuple with more than one name is a set of
    tied aliases (any one of them is enough in a push, all may be present).
    """

    groups: tuple[tuple[str, ...], ...]

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> WeightNames:
        """Names of ``model.state_dict()``, aliases found by parameter identity.

        Works on a model built on the meta device too (no memory, no weights needed).
        """
        by_param: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            by_param.setdefault(id(param), []).append(name)
        aliased = {name for names in by_param.values() for name in names}
        groups = [tuple(names) for names in by_param.values()]
        # Persistent buffers are in the state dict too (Llama has none, others may).
        groups += [(name,) for name in model.state_dict() if name not in aliased]
        return cls(groups=tuple(groups))

    @property
    def all_names(self) -> set[str]:
        """Every name that may appear in a push."""
        return {name for group in self.groups for name in group}

    def check(self, names: Iterable[str]) -> None:
        """Raise ``KeyError`` unless ``names`` covers every tensor and holds no unknown name."""
        received = set(names)
        unexpected = sorted(received - self.all_names)
        missing = sorted(group[0] for group in self.groups if not received.intersection(group))
        if unexpected or missing:
            raise KeyError(
                "pushed weights do not match the model's parameter names (transformers names "
                f"expected): missing {_head(missing)}, unexpected {_head(unexpected)}"
            )

    def check_partial(self, names: Iterable[str]) -> None:
        """Raise ``KeyError`` if ``names`` (a partial load) holds a name the model lacks."""
        unexpected = sorted(set(names) - self.all_names)
        if unexpected:
            raise KeyError(
                "partially pushed weights hold names the model does not have (transformers "
                f"names expected): {_head(unexpected)}"
            )


def fused_groups(
    names: Iterable[str], known: Iterable[str], packed: Mapping[str, list[str]]
) -> set[str]:
    """``names`` completed to whole modules: every known weight of the module each name belongs
    to (its ``.weight`` and ``.bias``), and of the modules fused with it (``packed``: vLLM's
    ``packed_modules_mapping``, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``).

    vLLM's in-place reload fills a layer it received only part of from uninitialised memory:
    a partial load must carry whole fused layers.
    """
    by_module: dict[str, set[str]] = {}
    for name in known:
        by_module.setdefault(name.rpartition(".")[0], set()).add(name)
    fused_with = {member: members for members in packed.values() for member in members}
    result: set[str] = set()
    for name in names:
        module = name.rpartition(".")[0]
        parent, _, leaf = module.rpartition(".")
        for member in fused_with.get(leaf, [leaf]):
            result |= by_module.get(f"{parent}.{member}" if parent else member, set())
        result.add(name)
    return result


def meta_model_weight_names(model_path: str) -> WeightNames:
    """The :class:`WeightNames` of the transformers model at ``model_path``, built on the meta
    device from its config (cheap: no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return WeightNames.of_model(model)


def detached_cpu(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` as plain CPU tensors without autograd history (no copy when already so)."""
    return {name: tensor.detach().to("cpu") for name, tensor in state_dict.items()}


def _head(names: list[str], limit: int = 5) -> str:
    if not names:
        return "none"
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
