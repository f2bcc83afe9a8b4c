"""`PromptDataModule`: the prompts of each RL iteration, and the held-out prompts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L

from periodic_rl.data import reasoning_gym
from periodic_rl.data.hub import DataFiles, HubOptions
from periodic_rl.data.loader import PromptLoader
from periodic_rl.data.sources import PromptSource, load_source
from periodic_rl.data.transform import Preprocess, RowTransform, resolve_preprocess


class PromptDataModule(L.LightningDataModule):
    """Prompt rows for training (``batch_size`` prompts per iteration) and evaluation.

    Args:
        source: ``builtin:arithmetic``; ``reasoning_gym:<task>`` (a `reasoning-gym` task with
            its verifier as the reward); a ``.jsonl``/``.json``/``.parquet`` file; a `datasets`
            hub id or local hub-format repository directory; a builder name with
            ``data_files`` (``json``, ``parquet``, ``csv``); or a ``save_to_disk`` directory.
            Rows need a prompt column (a string, or chat messages); every other column is
            handed to the reward functions as a keyword list.
        batch_size: prompts per iteration and training process (rank); each becomes a group of
            ``num_generations`` samples.
        val_source: held-out prompts from another file or hub dataset. Never the training rows:
            the same file as ``source`` (or the same hub split) is refused, and its rows whose
            prompt is also a training prompt are left out.
        split: split of ``source`` to train on.
        val_split: split held out for evaluation: of ``val_source`` when given, else of a hub
            ``source`` that has it (and it is not ``split``). A single file has no splits.
        num_train: rows generated for a built-in or reasoning-gym task.
        num_val: held-out rows used at most (``0``: no held-out evaluation).
        val_fraction: with no ``val_source`` and no usable ``val_split`` (always the case for a
            single ``.jsonl``/``.json``/``.parquet`` file), this fraction of the distinct
            prompts, at most ``num_val``, is carved out of ``source`` (seeded by ``seed``,
            deterministic) and removed from training. ``0``: no held-out set. The log says
            which rule was used and how many rows.
        prompt_column: the column holding the prompt.
        seed: seeds the generated tasks, the held-out carve and the shuffling order.
        shuffle: shuffle training prompts (seeded) every epoch.
        name: the dataset's config (GSM8K's ``main``): ``load_dataset(source, name)``. For a
            ``save_to_disk`` directory, the saved sub-directory ``source/name``.
        data_files: the data files to read (`datasets`' ``data_files``: a path or pattern, a
            list, or ``{split: paths}``), for a hub dataset, a directory or a builder name.
        revision: the hub branch, tag or commit of ``source``.
        columns: dataset column -> the name the library and the rewards see, e.g.
            ``{"question": "prompt", "answer": "solution"}``; other columns keep their names.
        preprocess: a function (or ``"package.module:function"``) taking a row dict (after
            ``columns``) and returning the row dict to use, applied to every row before the
            checks. Resolved here, so a bad path fails at once.
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
        name: str | None = None,
        data_files: DataFiles | None = None,
        revision: str | None = None,
        columns: dict[str, str] | None = None,
        preprocess: str | Preprocess | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (prompts per iteration), got {batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if num_val < 0:
            raise ValueError(f"num_val must be >= 0 (0: no held-out set), got {num_val}")
        generated = source.startswith(("builtin:", reasoning_gym.PREFIX))
        if generated and num_train < 1:
            raise ValueError(f"num_train must be >= 1 (rows of {source}), got {num_train}")
        if source.startswith(reasoning_gym.PREFIX):
            reasoning_gym.check_task(source.removeprefix(reasoning_gym.PREFIX))
        self.save_hyperparameters()
        self._hub = HubOptions(name=name, data_files=data_files, revision=revision)
        self._transform = RowTransform(columns or {}, resolve_preprocess(preprocess))
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
                hub=self._hub,
                transform=self._transform,
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
