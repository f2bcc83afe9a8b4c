"""Turning prompt groups into model inputs: packed (shared prompt) or padded (the reference).

Both layouts produce the same bookkeeping: which hidden states go through ``lm_head``
(``logits_to_keep``, positions along the sequence) and, for every completion token, which of those
rows predicts it (``rows``) and what the target is. The log-prob code after the forward is then
identical for both paths.

Token ``t`` of a completion is predicted by the hidden state of the token before it: ``t = 0`` by
the LAST prompt token, ``t > 0`` by completion token ``t - 1``. In the packed layout, the first
token of every response of a group is predicted from the same hidden state (the shared prompt's
last one), so that row is projected once and read G times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from periodic_rl.attention.layout import SharedPromptLayout

Group = tuple[list[int], list[list[int]]]


@dataclass
class ModelBatch:
    """Inputs of one forward plus the map from projected rows back to completion tokens.

    Attributes:
        input_ids: ``[B, S]`` (``B = 1`` when packed).
        position_ids: ``[B, S]`` (packed), None (padded: the model's own, see
            :func:`pad_groups`).
        attention_mask: ``[B, S]`` padding mask (padded path) or None (packed path).
        logits_to_keep: ``[K]`` sequence positions whose hidden states are projected.
        rows: ``[N, T]`` index into the flattened ``[B * K]`` projected rows, per completion token.
        targets: ``[N, T]`` the completion tokens (0 on padding).
        mask: ``[N, T]`` 1.0 on real completion tokens.
        layout: segment lengths of the packed row (None for the padded path).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    logits_to_keep: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    layout: SharedPromptLayout | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the model runs over (the cost the packing reduces)."""
        if self.attention_mask is not None:
            return int(self.input_ids.numel())
        return int(self.input_ids.shape[-1])

    def to(self, device: torch.device) -> ModelBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return ModelBatch(
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            attention_mask=move(self.attention_mask),
            logits_to_keep=move(self.logits_to_keep),
            rows=move(self.rows),
            targets=move(self.targets),
            mask=move(self.mask),
            layout=self.layout,
        )


def validate_groups(groups: list[Group]) -> tuple[int, int]:
    """Check the ``(prompt_ids, [completion_ids, ...])`` structure; returns ``(N, T)``."""
    if not isinstance(groups, (list, tuple)):
        raise TypeError("groups must be a list of (prompt_ids, [completion_ids, ...])")
    n, t = 0, 0
    for i, group in enumerate(groups):
        if not (isinstance(group, (list, tuple)) and len(group) == 2):
            raise TypeError(f"group {i} is not a (prompt_ids, completions) pair")
        prompt, completions = group
        if len(prompt) == 0 and any(len(c) for c in completions):
            raise ValueError(f"group {i} has an empty prompt: the first token has no context")
        n += len(completions)
        t = max([t, *(len(c) for c in completions)])
    return n, t


def _completion_tables(groups: list[Group], n: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    targets = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t, dtype=torch.float32)
    i = 0
    for _, completions in groups:
        for c in completions:
            if c:
                targets[i, : len(c)] = torch.as_tensor(c, dtype=torch.long)
                mask[i, : len(c)] = 1.0
            i += 1
    return targets, mask


def pack_groups(groups: list[Group], backend: str = "split") -> ModelBatch:
    """One packed row ``[p_0 | r_0,0 | ... | p_1 | r_1,0 | ...]`` for all groups.

    Empty completions take no space (their mask row is all zeros); a group whose completions are
    all empty is left out entirely.
    """
    n, t = validate_groups(groups)
    targets, mask = _completion_tables(groups, n, t)
    rows = torch.zeros(n, t, dtype=torch.long)
    ids: list[int] = []
    keep: list[int] = []
    prompt_lens: list[int] = []
    response_lens: list[list[int]] = []
    i = 0
    for prompt, completions in groups:
        real = [c for c in completions if len(c) > 0]
        if not real:
            i += len(completions)
            continue
        prompt_lens.append(len(prompt))
        response_lens.append([len(c) for c in real])
        ids.extend(prompt)
        last_prompt_row = len(keep)
        keep.append(len(ids) - 1)
        for c in completions:
            if c:
                rows[i, 0] = last_prompt_row
                start = len(ids)
                ids.extend(c)
                # rows for completion tokens 1..T-1: the hidden states of tokens 0..T-2
                first = len(keep)
                keep.extend(range(start, start + len(c) - 1))
                rows[i, 1 : len(c)] = torch.arange(first, first + len(c) - 1)
            i += 1
    layout = SharedPromptLayout(prompt_lens, response_lens, backend=backend)
    input_ids = torch.as_tensor(ids, dtype=torch.long).view(1, -1)
    return ModelBatch(
        input_ids=input_ids,
        position_ids=layout.position_ids() if prompt_lens else input_ids.clone(),
        attention_mask=None,
        logits_to_keep=torch.as_tensor(keep, dtype=torch.long),
        rows=rows,
        targets=targets,
        mask=mask,
        layout=layout,
    )


def pad_groups(groups: list[Group], pad_token_id: int = 0) -> ModelBatch:
    """The ordinary layout: a row per completion, ``[prompt | completion | right pad]``.

    Right padding keeps every real token where a forward of that sequence alone puts it: the
    positions are ``0..len-1`` whether or not the model reads ``position_ids`` (GPT-2 style
    learned positions, OPT's mask-derived ones, models that count from the pad token), and the
    padding comes after every real token, so causal attention, recurrences and convolutions
    never see it. ``position_ids`` is therefore left to the model (None).

    ``logits_to_keep`` is one range shared by all rows: from the last prompt token of the
    shortest prompt to the second-to-last token of the longest row; with prompts of unequal
    length a row projects a few columns it does not need.
    """
    n, t = validate_groups(groups)
    targets, mask = _completion_tables(groups, n, t)
    prompt_lens = [len(p) for p, cs in groups for _ in cs]
    lo = min(prompt_lens, default=1) - 1
    seq = max((len(p) + len(c) for p, cs in groups for c in cs), default=1)
    input_ids = torch.full((n, seq), pad_token_id, dtype=torch.long)
    attention = torch.zeros(n, seq, dtype=torch.long)
    i = 0
    for prompt, completions in groups:
        for c in completions:
            row = [*prompt, *c]
            input_ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            attention[i, : len(row)] = 1
            i += 1
    keep = max(seq - 1 - lo, 1)
    # completion token j of row i is predicted by column P_i - 1 + j, projected row P_i - 1 + j - lo
    first = torch.as_tensor(prompt_lens, dtype=torch.long).view(n, 1) - 1 - lo
    cols = (first + torch.arange(t, dtype=torch.long)).clamp(max=keep - 1)
    rows = torch.arange(n, dtype=torch.long).view(n, 1) * keep + cols
    return ModelBatch(
        input_ids=input_ids,
        position_ids=None,
        attention_mask=attention,
        logits_to_keep=torch.arange(lo, lo + keep, dtype=torch.long),
        rows=rows,
        targets=targets,
        mask=mask,
    )
