"""The weights transport between the trainer and the Ray rollout workers.

Weights travel as one Ray object holding a dict of numpy arrays (:func:`to_payload`):
``ray.put`` of numpy views is much faster than of torch tensors, and every worker on a node reads
the same shared-memory copy, turned back into tensors without copying (:func:`from_payload`).

Imports no torch at the top: the rollout worker imports this module before it pins its cores
(see :mod:`periodic_rl.rollout.workers.worker`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# numpy has no bfloat16: such tensors travel as int16 bit patterns and are viewed back.
_VIEW_AS_INT16 = ("bfloat16",)


def same_tensor_key(tensor: torch.Tensor) -> tuple | None:
    """A key equal for two names of one tensor (tied weights: the same storage, dtype, shape
    and strides); None for an empty tensor (every empty tensor may report address 0)."""
    if not tensor.numel():
        return None
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def to_payload(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``state_dict`` as numpy views (no copy for contiguous CPU tensors) for one ``ray.put``.

    Names that share one tensor (tied embeddings: ``lm_head.weight`` is
    ``model.embed_tokens.weight``) travel once and are re-tied on arrival (``aliases``).
    """
    import torch

    arrays: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        key = same_tensor_key(tensor) if tensor.device.type == "cpu" else None
        if key is not None:
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype in _VIEW_AS_INT16:
            tensor = tensor.view(torch.int16)
            dtypes[name] = dtype
        arrays[name] = tensor.numpy()
    return {"arrays": arrays, "dtypes": dtypes, "aliases": aliases}


def from_payload(payload: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors sharing memory with the payload's (read-only, shared-memory) numpy arrays.

    Engines must copy what they keep (both built-in engines do): a tensor kept alive here keeps
    the whole Ray object pinned in the object store.
    """
    import torch

    tensors: dict[str, torch.Tensor] = {}
    dtypes = payload.get("dtypes", {})
    with warnings.catch_warnings():
        # Arrays from the object store are read-only; the engines only read them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, array in payload["arrays"].items():
            tensor = torch.from_numpy(array)
            if name in dtypes:
                tensor = tensor.view(getattr(torch, dtypes[name]))
            tensors[name] = tensor
    for name, target in payload.get("aliases", {}).items():
        tensors[name] = tensors[target]
    return tensors
