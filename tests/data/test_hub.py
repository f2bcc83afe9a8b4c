"""Hub datasets offline: a config name, splits, data_files, a revision-free local repository,
and directories written by save_to_disk; with a column mapping."""

from __future__ import annotations

import datasets
import pytest
from data_helpers import question_rows, write_jsonl

from periodic_rl.data import PromptDataModule

MAPPING = {"question": "prompt", "answer": "solution"}


def loaded(**kwargs) -> PromptDataModule:
    dm = PromptDataModule(batch_size=2, **kwargs)
    dm.setup("fit")
    return dm


def prompts(rows) -> list[str]:
    return [row["prompt"] for row in rows]


def test_hub_repository_config_name_and_its_test_split(hub_repo):
    dm = loaded(source=str(hub_repo), name="main", columns=MAPPING)
    assert prompts(dm.source.train) == prompts(
        {"prompt": r["question"]} for r in question_rows("main", "train", 12)
    )
    assert prompts(dm.held_out()) == [r["question"] for r in question_rows("main", "test", 4)]
    assert dm.source.train[3] == {"prompt": "main train: what is 3 + 1?", "solution": "4"}


def test_the_other_config_without_a_test_split_is_carved(hub_repo):
    dm = loaded(source=str(hub_repo), name="socratic", columns=MAPPING, val_fraction=0.2)
    everything = prompts(dm.source.train) + prompts(dm.held_out())
    assert sorted(everything) == sorted(
        r["question"] for r in question_rows("socratic", "train", 10)
    )
    assert len(dm.held_out()) == 2


def test_a_missing_config_name_lists_the_configs(hub_repo):
    with pytest.raises(ValueError, match=r"\['main', 'socratic'\].*set PromptDataModule's `name`"):
        loaded(source=str(hub_repo))
    with pytest.raises(ValueError, match=r"'nope' not found.*\['main', 'socratic'\].*`name`"):
        loaded(source=str(hub_repo), name="nope")


def test_data_files_select_the_files_of_a_builder(tmp_path):
    train = write_jsonl(tmp_path / "a" / "train.jsonl", question_rows("main", "train", 6))
    test = write_jsonl(tmp_path / "b" / "test.jsonl", question_rows("main", "test", 3))
    dm = loaded(
        source="json",
        data_files={"train": str(train), "test": str(test)},
        prompt_column="question",
    )
    assert len(dm.source.train) == 6 and len(dm.held_out()) == 3
    assert set(dm.source.train[0]) == {"prompt", "answer"}


def test_data_files_on_a_single_file_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", question_rows("main", "train", 4))
    with pytest.raises(ValueError, match=r"single file .*takes none: remove data_files"):
        loaded(source=str(path), data_files=str(path), prompt_column="question")


@pytest.fixture
def saved(tmp_path):
    """One directory holding two saved DatasetDicts side by side (the configs of a hub
    dataset), and a single saved Dataset."""
    root = tmp_path / "saved"
    for config, splits in {"main": ("train", "test"), "socratic": ("train",)}.items():
        parts = {s: question_rows(config, s, 10 if s == "train" else 3) for s in splits}
        dd = datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in parts.items()})
        dd.save_to_disk(str(root / config))
    datasets.Dataset.from_list(question_rows("single", "train", 20)).save_to_disk(
        str(tmp_path / "single")
    )
    return root


def test_save_to_disk_directories_with_a_name_and_a_column_mapping(saved):
    dm = loaded(source=str(saved), name="main", columns=MAPPING)
    assert prompts(dm.source.train)[0] == "main train: what is 0 + 1?"
    assert prompts(dm.held_out()) == [r["question"] for r in question_rows("main", "test", 3)]
    assert dm.source.train[0]["solution"] == "1"

    dm = loaded(source=str(saved / "socratic"), columns=MAPPING)  # the directory itself
    assert len(dm.source.train) + len(dm.held_out()) == 10 and len(dm.held_out()) == 1

    with pytest.raises(ValueError, match=r"no saved dataset 'nope' .*\['main', 'socratic'\]"):
        loaded(source=str(saved), name="nope", columns=MAPPING)


def test_a_saved_dataset_has_no_splits_and_is_carved(saved):
    single = str(saved.parent / "single")
    dm = loaded(source=single, prompt_column="question", val_fraction=0.1)
    assert len(dm.held_out()) == 2 and len(dm.source.train) == 18
    with pytest.raises(ValueError, match=r"has no configs; name='main'"):
        loaded(source=single, name="main", prompt_column="question")
    with pytest.raises(ValueError, match=r"save_to_disk: data_files and revision .*remove them"):
        loaded(source=single, revision="v1", prompt_column="question")
