"""One split of a `datasets` source: a hub id or a local hub-format repository (a directory of
data files, optionally with a ``README.md`` whose YAML ``configs:`` block names its configs and
splits), a builder name with ``data_files`` (``json``, ``parquet``, ``csv``), or a directory
written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.

A hub dataset's config (GSM8K's ``main``) is ``name``. A ``save_to_disk`` directory has no
configs; ``name`` then selects the sub-directory ``<source>/<name>`` written by
``save_to_disk``, so one directory can hold several saved configs side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: ``data_files`` as `datasets.load_dataset` takes it: one path or pattern, a list of them, or
#: split name -> paths.
DataFiles = str | list[str] | dict[str, str | list[str]]

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class HubOptions:
    """What selects the rows of a `datasets` source besides its split.

    ``name``: the config (``load_dataset(source, name)``), or a saved sub-directory;
    ``data_files``: the files to read (a hub repository's or a builder's such as ``json``);
    ``revision``: a hub branch, tag or commit."""

    name: str | None = None
    data_files: DataFiles | None = None
    revision: str | None = None


def is_file(source: str) -> bool:
    """A single ``.jsonl``/``.json``/``.parquet`` file (it has no splits)."""
    return Path(source).suffix in _FILE_SUFFIXES


def saved_directory(source: str, options: HubOptions) -> Path | None:
    """The ``save_to_disk`` directory ``source`` (or ``source/name``) names, else None."""
    root = Path(source)
    if not root.is_dir():
        return None
    path = root / options.name if options.name else root
    if _is_saved(path):
        return path
    if options.name and _is_saved(root):
        raise ValueError(
            f"{source} was written by save_to_disk and has no configs; name={options.name!r} "
            "selects a saved sub-directory, and it has none of that name. Remove `name`, or "
            f"give the directory that holds the saved '{options.name}'"
        )
    if options.name and any(_is_saved(p) for p in root.iterdir()):
        saved = sorted(p.name for p in root.iterdir() if _is_saved(p))
        raise ValueError(
            f"{source} has no saved dataset '{options.name}' (saved sub-directories: {saved}); "
            "set `name` to one of them"
        )
    return None


def has_no_splits(source: str, options: HubOptions) -> bool:
    """A single file, or a single ``Dataset`` (not a ``DatasetDict``) written by
    ``save_to_disk``: the held-out rows are then carved out of it."""
    if is_file(source):
        return True
    saved = saved_directory(source, options)
    return saved is not None and not (saved / "dataset_dict.json").is_file()


def load_split(source: str, split: str, options: HubOptions) -> Any:
    """The ``split`` of ``source`` as a `datasets.Dataset`. A missing split raises a
    ``ValueError`` whose message starts with ``Unknown split`` (as `datasets` says it)."""
    import datasets

    if is_file(source):
        if not Path(source).is_file():
            raise FileNotFoundError(f"prompt file {source} does not exist")
        return datasets.load_dataset("parquet", data_files={split: source}, split=split)
    saved = saved_directory(source, options)
    if saved is not None:
        if options.data_files is not None or options.revision is not None:
            raise ValueError(
                f"{saved} was written by save_to_disk: data_files and revision are for hub "
                "datasets and data-file directories; remove them"
            )
        loaded = datasets.load_from_disk(str(saved))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f'Unknown split "{split}". Should be one of {list(loaded)}.')
            return loaded[split]
        return loaded
    try:
        return datasets.load_dataset(
            source,
            name=options.name,
            data_files=options.data_files,
            revision=options.revision,
            split=split,
        )
    except ValueError as error:
        text = str(error)
        if "BuilderConfig" in text or "Config name is missing" in text:
            raise ValueError(
                f"{source}: {text.splitlines()[0]} {_configs_hint(text)}; set PromptDataModule's "
                "`name` (YAML: data.init_args.name) to the config to train on"
            ) from error
        raise


def _configs_hint(text: str) -> str:
    """The configs `datasets` listed in its message (on a later line), when it did."""
    for line in text.splitlines()[1:]:
        if "[" in line:
            return line.strip().rstrip(".:")
    return ""


def _is_saved(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
