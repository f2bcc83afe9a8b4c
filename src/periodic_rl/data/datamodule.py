"""`PromptDataModule`: the prompts of each RL iteration, and the held-out prompts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L

from periodic_rl.data.loader import PromptLoader
from periodic_rl.data.sources import PromptSource, load_source


class PromptDataModule(L.LightningDataModule):
    """Prompt rows for training (``batch_size`` prompts per iteration) and evaluation.

    Args:
        source: ``builtin:arithmetic``, a ``.jsonl``/``.json``/``.parquet`` file, or a `datasets`
            hub id. Rows need a prompt column (a string, or chat messages); every other column
            is handed to the reward functions as a keyword list.
        batch_size: prompts per iteration and training process (rank); each becomes a group of
            ``num_generations`` samples.
        val_source: held-out prompts from another file or hub dataset. Never the training rows:
            the same file as ``source`` (or the same hub split) is refused, and its rows whose
            prompt is also a training prompt are left out.
        split: split of ``source`` to train on.
        val_split: split held out for evaluation: of ``val_source`` when given, else of a hub
            ``source`` that has it (and it is not ``split``). A single file has no splits.
        num_train: rows generated for a built-in task.
        num_val: held-out rows used at most (``0``: no held-out evaluation).
        val_fraction: with no ``val_source`` and no usable ``val_split`` (always the case for a
            single ``.jsonl``/``.json``/``.parquet`` file), this fraction of the distinct
            prompts, at most ``num_val``, is carved out of ``source`` (seeded by ``seed``,
            deterministic) and removed from training. ``0``: no held-out set. The log says
            which rule was used and how many rows.
        prompt_column: the column holding the prompt.
        seed: seeds the built-in task, the held-out carve and the shuffling order.
        shuffle: shuffle training prompts (seeded) every epoch.
    """

    def __init__(
        self,
        source: str = "builtin:arithmetic",
        batch_size: int = 8,
        val_source: str | None = None,
        split: str = "train",
        val_split: str = "test",
        num_train: int = 4096,
        num_val: int = 64,
        val_fraction: float = 0.1,
        prompt_column: str = "prompt",
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (prompts per iteration), got {batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if num_val < 0:
            raise ValueError(f"num_val must be >= 0 (0: no held-out set), got {num_val}")
        if source.startswith("builtin:") and num_train < 1:
            raise ValueError(f"num_train must be >= 1 (rows of {source}), got {num_train}")
        self.save_hyperparameters()
        self._source: PromptSource | None = None

    @property
    def source(self) -> PromptSource:
        if self._source is None:
            h = self.hparams
            self._source = load_source(
                h.source,
                val_source=h.val_source,
                split=h.split,
                val_split=h.val_split,
                num_train=h.num_train,
                num_val=h.num_val,
                val_fraction=h.val_fraction,
                seed=h.seed,
                prompt_column=h.prompt_column,
            )
            if not self._source.train:
                raise ValueError(f"{h.source}: no training rows")
        return self._source

    def setup(self, stage: str) -> None:
        _ = self.source  # load and validate before any expensive work starts

    def train_dataloader(self) -> PromptLoader:
        """``batch_size`` prompts per iteration and rank: each rank its own slice of the
        iteration's ``world_size x batch_size`` prompts (:class:`PromptLoader`)."""
        trainer = self.trainer
        return PromptLoader(
            self.source.train,
            self.hparams.batch_size,
            self.hparams.seed,
            self.hparams.shuffle,
            rank=trainer.global_rank if trainer is not None else 0,
            world_size=trainer.world_size if trainer is not None else 1,
        )

    def held_out(self) -> list[dict[str, Any]]:
        """The held-out rows, evaluated greedily as validation (:meth:`val_dataloader`)."""
        return self.source.val

    def val_dataloader(self) -> OneBatch:
        """The held-out rows as Lightning's validation data: one batch holding them all, in
        order, so each rollout worker generates its share in one engine call (the best
        batching). No batch when there are no held-out rows: Lightning skips validation."""
        return OneBatch(self.held_out())


class OneBatch:
    """A validation loader of one batch (``rows``), or none when ``rows`` is empty; stateless,
    so every validation run sees every row (an iterable that is not a list or a tuple, which
    Lightning would take for several loaders)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return 1 if self.rows else 0

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        if self.rows:
            yield list(self.rows)
