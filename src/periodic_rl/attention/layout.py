"""Where every token of a packed shared-prompt sequence sits, and the index tensors built from it.

A micro-batch of prompt groups is packed into ONE row, group after group::

    [ prompt_0 | r_0,0 | r_0,1 | ... | prompt_1 | r_1,0 | ... ]

Each response attends to its own group's prompt and causally to itself, nothing else. The
layout is plain Python lengths; every attention backend derives the index tensors it needs from
it once per forward (they are cached per device and dtype, so 30 layers share one copy).

The layout object travels to the attention function through the model's ``**kwargs`` (see
:mod:`periodic_rl.attention.integration`), which is why it is a small mutable object rather than
a bundle of tensors: it also counts how many layers used it, so a model that bypasses the
attention interface is caught instead of silently computing plain causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch


@dataclass
class SharedPromptLayout:
    """Segment lengths of a packed row: one prompt and its responses per group.

    Attributes:
        prompt_lens: length of each group's prompt (each >= 1).
        response_lens: per group, the lengths of its responses (each >= 1) in packed order.
        backend: name of the attention backend that will read this layout.
        calls: how many attention layers have consumed the layout (checked after the forward).
        consumers: ``id`` of each attention module that consumed it (a layer may call twice).
    """

    prompt_lens: list[int]
    response_lens: list[list[int]]
    backend: str = "split"
    calls: int = 0
    consumers: set[int] = field(default_factory=set, repr=False, compare=False)
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.prompt_lens) != len(self.response_lens):
            raise ValueError("prompt_lens and response_lens must have one entry per group")
        if any(p < 1 for p in self.prompt_lens):
            raise ValueError("every prompt needs at least one token")
        if any(r < 1 for rs in self.response_lens for r in rs):
            raise ValueError("packed responses need at least one token each")

    # ---- plain-Python geometry -------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.prompt_lens)

    @property
    def num_responses(self) -> int:
        return sum(len(rs) for rs in self.response_lens)

    @property
    def group_lens(self) -> list[int]:
        """Packed length of each group: P + sum of its responses."""
        return [p + sum(rs) for p, rs in zip(self.prompt_lens, self.response_lens, strict=True)]

    @property
    def total_len(self) -> int:
        return sum(self.group_lens)

    @property
    def max_prompt_len(self) -> int:
        return max(self.prompt_lens)

    @property
    def max_response_len(self) -> int:
        return max((r for rs in self.response_lens for r in rs), default=0)

    @property
    def max_span(self) -> int:
        """Longest virtual sequence ``prompt + one response``: what a sliding window must cover."""
        return max(
            p + max(rs, default=0)
            for p, rs in zip(self.prompt_lens, self.response_lens, strict=True)
        )

    def segments(self) -> list[tuple[int, int, int, int]]:
        """``(start, length, group, kind)`` per packed segment; kind 0 = prompt, 1 = response."""
        out: list[tuple[int, int, int, int]] = []
        pos = 0
        for g, (p, rs) in enumerate(zip(self.prompt_lens, self.response_lens, strict=True)):
            out.append((pos, p, g, 0))
            pos += p
            for r in rs:
                out.append((pos, r, g, 1))
                pos += r
        return out

    def group_starts(self) -> list[int]:
        return [0, *accumulate(self.group_lens)][:-1]

    def position_ids(self) -> torch.Tensor:
        """``[1, L]``: 0..P-1 over the prompt, P..P+R-1 over every response (for RoPE)."""
        parts: list[torch.Tensor] = []
        for p, rs in zip(self.prompt_lens, self.response_lens, strict=True):
            parts.append(torch.arange(p))
            parts.extend(torch.arange(p, p + r) for r in rs)
        return torch.cat(parts).unsqueeze(0)

    # ---- cached index tensors --------------------------------------------------------------

    def cached(self, key: Any, build: Any) -> Any:
        """Memoise ``build()`` under ``key`` for the lifetime of this layout (one forward)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def segment_ids(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: its segment id, and the segment id of its group's prompt (both ``[L]``)."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            seg, pseg = [], []
            prompt_seg = 0
            for i, (_, length, _, kind) in enumerate(self.segments()):
                if kind == 0:
                    prompt_seg = i
                seg.append(torch.full((length,), i, dtype=torch.int32))
                pseg.append(torch.full((length,), prompt_seg, dtype=torch.int32))
            return torch.cat(seg).to(device), torch.cat(pseg).to(device)

        return self.cached(("segment_ids", device), build)

    def dense_mask(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[1, 1, L, L]`` float additive mask (0 = attend, dtype min = blocked). O(L^2) memory."""

        def build() -> torch.Tensor:
            seg, pseg = self.segment_ids(device)
            idx = torch.arange(self.total_len, device=device)
            same = (seg[None, :] == seg[:, None]) | (seg[None, :] == pseg[:, None])
            allowed = same & (idx[None, :] <= idx[:, None])
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
            mask.masked_fill_(~allowed, torch.finfo(dtype).min)
            return mask[None, None]

        return self.cached(("dense_mask", device, dtype), build)

    def split_indices(self, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Gather/scatter indices and the small masks of the split form.

        Keys:
            ``prompt_q`` ``[num_groups, Pmax]``: packed index of each prompt token (right padded);
            ``resp_q`` ``[N, Rmax]``: packed index of each response token (right padded);
            ``resp_kv`` ``[N, Pmax + Rmax]``: the keys each response sees: its prompt, left padded
            to Pmax, then itself, right padded;
            ``resp_mask`` ``[N, 1, Rmax, Pmax + Rmax]``: float additive mask (prompt padding
            blocked, causal over the response part, aligned bottom-right);
            ``inverse`` ``[L]``: where each packed token's output sits in
            ``cat(prompt outputs, response outputs)`` (flattened), to put the output back in order.
        Padding entries point at token 0; their outputs are never read back.
        """

        def build() -> dict[str, torch.Tensor]:
            pmax, rmax = self.max_prompt_len, self.max_response_len
            n_groups, n_resp = self.num_groups, self.num_responses
            prompt_q = torch.zeros(n_groups, pmax, dtype=torch.long)
            resp_q = torch.zeros(n_resp, rmax, dtype=torch.long)
            resp_kv = torch.zeros(n_resp, pmax + rmax, dtype=torch.long)
            key_ok = torch.zeros(n_resp, pmax + rmax, dtype=torch.bool)
            inverse = torch.empty(self.total_len, dtype=torch.long)
            n = 0
            for g, start in enumerate(self.group_starts()):
                p = self.prompt_lens[g]
                prompt_pos = torch.arange(start, start + p)
                prompt_q[g, :p] = prompt_pos
                inverse[start : start + p] = g * pmax + torch.arange(p)
                pos = start + p
                for r in self.response_lens[g]:
                    resp_pos = torch.arange(pos, pos + r)
                    resp_q[n, :r] = resp_pos
                    resp_kv[n, pmax - p : pmax] = prompt_pos
                    resp_kv[n, pmax : pmax + r] = resp_pos
                    key_ok[n, pmax - p : pmax + r] = True
                    inverse[pos : pos + r] = n_groups * pmax + n * rmax + torch.arange(r)
                    pos += r
                    n += 1
            # query i (absolute key column pmax + i) may see key column j <= pmax + i
            causal = torch.arange(pmax + rmax)[None, :] <= (pmax + torch.arange(rmax))[:, None]
            allowed = key_ok[:, None, :] & causal[None, :, :]
            mask = torch.zeros(allowed.shape, dtype=dtype)
            mask.masked_fill_(~allowed, torch.finfo(dtype).min)
            return {
                "prompt_q": prompt_q.to(device),
                "resp_q": resp_q.to(device),
                "resp_kv": resp_kv.to(device),
                "resp_mask": mask[:, None].to(device),
                "inverse": inverse.to(device),
            }

        return self.cached(("split", device, dtype), build)

    def varlen_indices(self, device: torch.device) -> dict[str, Any]:
        """flash-attn varlen metadata: separate query and key boundaries plus the key gather.

        Query segments are the packed segments themselves (a prompt, then each response). A prompt
        segment's keys are the prompt; a response segment's keys are its prompt followed by the
        response, gathered by ``kv_index``. flash-attn's causal mask is aligned bottom-right when
        the key segment is longer than the query segment, which is exactly "whole prompt, then
        causal over the response".
        """

        def build() -> dict[str, Any]:
            kv_parts: list[torch.Tensor] = []
            q_lens: list[int] = []
            k_lens: list[int] = []
            prompt: torch.Tensor = torch.empty(0, dtype=torch.long)
            for start, length, _, kind in self.segments():
                own = torch.arange(start, start + length)
                if kind == 0:
                    prompt = own
                    kv_parts.append(own)
                    k_lens.append(length)
                else:
                    kv_parts.append(torch.cat([prompt, own]))
                    k_lens.append(len(prompt) + length)
                q_lens.append(length)
            cu_q = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32)
            cu_k = torch.tensor([0, *accumulate(k_lens)], dtype=torch.int32)
            return {
                "kv_index": torch.cat(kv_parts).to(device),
                "cu_seqlens_q": cu_q.to(device),
                "cu_seqlens_k": cu_k.to(device),
                "max_seqlen_q": max(q_lens),
                "max_seqlen_k": max(k_lens),
            }

        return self.cached(("varlen", device), build)
