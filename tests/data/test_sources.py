"""Held-out rows never overlap training rows: val_source, a real hub split, or a seeded carve."""

import json
import logging

import pytest

from periodic_rl.data import PromptDataModule, arithmetic
from periodic_rl.data.sources import prompt_key


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def numbered(n, offset=0):
    return [{"prompt": f"question {i}", "answer": str(i)} for i in range(offset, offset + n)]


@pytest.fixture
def log_lines():
    """Messages of Lightning's rank-zero logger (``rank_zero_info``), whatever its propagation."""
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler = Collect(level=logging.INFO)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def loaded(**kwargs):
    dm = PromptDataModule(**kwargs)
    dm.setup("fit")
    return dm


def assert_disjoint(dm, all_rows):
    held = [prompt_key(r["prompt"]) for r in dm.held_out()]
    train = [prompt_key(r["prompt"]) for r in dm.source.train]
    assert held, "expected a held-out set"
    assert not set(held) & set(train), "a held-out prompt is also a training prompt"
    # Nothing lost: every row of the file is on exactly one side.
    assert sorted(held + train) == sorted(prompt_key(r["prompt"]) for r in all_rows)


def test_single_jsonl_file_is_carved_disjoint(tmp_path, log_lines):
    rows = numbered(640)
    dm = loaded(source=write_jsonl(tmp_path / "data.jsonl", rows), num_val=64)
    assert_disjoint(dm, rows)
    assert len(dm.held_out()) == 64 and len(dm.source.train) == 576
    # The training rows keep the file order (the loader's resume relies on a fixed list).
    train_ids = [int(r["answer"]) for r in dm.source.train]
    assert train_ids == sorted(train_ids)
    assert any(
        "64 rows carved from" in line
        and "data.jsonl" in line
        and "val_fraction=0.1, seed 0" in line
        and "576 rows left for training" in line
        for line in log_lines
    ), log_lines


def test_single_parquet_file_is_carved_disjoint(tmp_path):
    import datasets

    rows = [
        {"question": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(50)
    ]
    path = tmp_path / "data.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    dm = loaded(source=str(path), prompt_column="question", num_val=64, batch_size=4)
    assert len(dm.held_out()) == 5  # ceil(0.1 * 50), under num_val
    assert_disjoint(dm, [{"prompt": r["question"]} for r in rows])


def test_carve_is_deterministic_per_seed_and_differs_between_seeds(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", numbered(200))

    def split(seed):
        dm = loaded(source=path, seed=seed, num_val=16)
        return [r["prompt"] for r in dm.source.train], [r["prompt"] for r in dm.held_out()]

    assert split(0) == split(0)
    assert split(1) == split(1)
    assert split(0)[1] != split(1)[1]


def test_duplicated_prompts_stay_on_one_side(tmp_path):
    rows = numbered(40) + numbered(40)  # every prompt twice
    dm = loaded(source=write_jsonl(tmp_path / "data.jsonl", rows), val_fraction=0.25)
    held = {r["prompt"] for r in dm.held_out()}
    assert len(held) == len(dm.held_out()) == 10  # each held-out prompt once
    assert not held & {r["prompt"] for r in dm.source.train}
    assert len(dm.source.train) == 60


def test_num_val_caps_the_carve_and_zero_fraction_holds_nothing_out(tmp_path, log_lines):
    rows = numbered(100)
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    dm = loaded(source=path, val_fraction=0.5, num_val=8)
    assert len(dm.held_out()) == 8 and len(dm.source.train) == 92
    dm = loaded(source=path, val_fraction=0.0)
    assert dm.held_out() == [] and len(dm.source.train) == 100
    assert any("held-out: none (val_fraction=0)" in line for line in log_lines), log_lines
    with pytest.raises(ValueError, match="val_fraction"):
        PromptDataModule(source=path, val_fraction=1.0)


def test_carving_every_prompt_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", numbered(1))
    with pytest.raises(ValueError, match="leaves none for training"):
        loaded(source=path, batch_size=1)


def test_val_source_that_is_the_training_file_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", numbered(20))
    with pytest.raises(ValueError, match="is the training file itself"):
        loaded(source=path, val_source=f"{tmp_path}/./data.jsonl", val_split="other")


def test_val_source_file_is_used_without_training_prompts(tmp_path, log_lines):
    train = write_jsonl(tmp_path / "train.jsonl", numbered(20))
    val = write_jsonl(tmp_path / "val.jsonl", numbered(3, offset=18) + numbered(5, offset=100))
    with pytest.warns(UserWarning, match="2 of 8 rows"):
        dm = loaded(source=train, val_source=val)
    assert [r["prompt"] for r in dm.held_out()] == [f"question {i}" for i in [20, *range(100, 105)]]
    assert len(dm.source.train) == 20  # a val_source takes nothing from training
    assert any("6 rows from val_source" in line for line in log_lines), log_lines


def test_dataset_directory_uses_its_val_split_or_carves(tmp_path, log_lines):
    """A dataset directory stands in for a hub dataset: splits come from its file names."""
    with_test = tmp_path / "with_test"
    with_test.mkdir()
    write_jsonl(with_test / "train.jsonl", numbered(30))
    write_jsonl(with_test / "test.jsonl", numbered(4, offset=500))
    dm = loaded(source=str(with_test))
    assert [r["prompt"] for r in dm.held_out()] == [f"question {i}" for i in range(500, 504)]
    assert len(dm.source.train) == 30
    assert any("4 rows from split 'test'" in line for line in log_lines), log_lines

    # The same directory and split as val_source is the training split: refused.
    with pytest.raises(ValueError, match="is the training split"):
        loaded(source=str(with_test), val_source=str(with_test), val_split="train")

    train_only = tmp_path / "train_only"
    train_only.mkdir()
    rows = numbered(30)
    write_jsonl(train_only / "train.jsonl", rows)
    dm = loaded(source=str(train_only))
    assert len(dm.held_out()) == 3
    assert_disjoint(dm, rows)
    assert any("no split 'test'" in line and "carved" in line for line in log_lines), log_lines


def test_builtin_arithmetic_is_unchanged():
    dm = loaded(source="builtin:arithmetic", num_train=40, num_val=8, seed=3)
    assert dm.source.train == arithmetic.arithmetic_problems("train", 40, seed=3)
    assert dm.held_out() == arithmetic.arithmetic_problems("test", 8, seed=3)


def test_loader_resumes_exactly_on_a_carved_file(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", numbered(100))
    first = loaded(source=path, batch_size=4).train_dataloader()
    batches = iter(first)
    for _ in range(5):
        next(batches)
    state = first.state_dict()
    expected = [next(batches) for _ in range(3)]

    resumed = loaded(source=path, batch_size=4).train_dataloader()
    resumed.load_state_dict(state)
    batches = iter(resumed)
    assert [next(batches) for _ in range(3)] == expected
