"""The column mapping and the user's preprocessing function: applied to every row before the
checks; a bad path or mapping fails early, naming the problem and the fix."""

from __future__ import annotations

import pytest
from data_helpers import question_rows, write_jsonl

from periodic_rl.data import PromptDataModule


def loaded(path, **kwargs) -> PromptDataModule:
    dm = PromptDataModule(source=str(path), batch_size=2, val_fraction=0, **kwargs)
    dm.setup("fit")
    return dm


@pytest.fixture
def rows_file(tmp_path):
    return write_jsonl(tmp_path / "rows.jsonl", question_rows("main", "train", 4))


def test_preprocess_by_path_sees_mapped_rows_and_its_rows_are_checked(rows_file, user_module):
    dm = loaded(rows_file, columns={"question": "prompt"}, preprocess=f"{user_module}:add_hint")
    assert dm.source.train[1] == {
        "prompt": "main train: what is 1 + 1? Reply with only the number.",
        "answer": "2",
        "hint": "add",
    }


def test_preprocess_as_a_callable_builds_the_prompt_column(rows_file):
    def ask(row):
        return {"prompt": f"Q: {row['question']}", "answer": row["answer"]}

    dm = loaded(rows_file, preprocess=ask)
    assert dm.source.train[0]["prompt"] == "Q: main train: what is 0 + 1?"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:f", r"cannot import 'no_such_module_xyz:f' \(ModuleNotFoundError"),
        ("{m}:missing", r"cannot import '{m}:missing' \(AttributeError.*'package.module:function'"),
        ("{m}:NOT_CALLABLE", r"'{m}:NOT_CALLABLE' is a int, not a function"),
    ],
    ids=["module", "function", "not-callable"],
)
def test_a_bad_preprocess_path_fails_at_construction(spec, message, user_module):
    with pytest.raises(ValueError, match=message.format(m=user_module)):
        PromptDataModule(source="missing.jsonl", preprocess=spec.format(m=user_module))


def test_preprocess_that_returns_no_dict_or_raises_names_the_row(rows_file, user_module):
    with pytest.raises(ValueError, match=r"not_a_row returned a list for row 0 of .*rows.jsonl"):
        loaded(rows_file, preprocess=f"{user_module}:not_a_row")

    def broken(row):
        return {**row, "prompt": row["nope"]}

    with pytest.raises(ValueError, match=r"broken failed on row 0 .*\(KeyError: 'nope'\)") as err:
        loaded(rows_file, preprocess=broken)
    assert isinstance(err.value.__cause__, KeyError)


def test_a_mapped_column_the_data_lacks_names_the_columns_and_the_fix(rows_file):
    with pytest.raises(ValueError) as err:
        loaded(rows_file, columns={"problem": "prompt"})
    message = str(err.value)
    assert "maps ['problem'], which it does not have" in message
    assert "['question', 'answer']" in message and "the dataset's own column names" in message


def test_a_mapping_onto_a_kept_column_or_twice_onto_one_name_is_refused(rows_file):
    with pytest.raises(ValueError, match=r"to \['answer'\], a column it already has"):
        loaded(rows_file, columns={"question": "answer"})
    with pytest.raises(ValueError, match=r"several dataset columns to \['prompt'\]"):
        PromptDataModule(source=str(rows_file), columns={"question": "prompt", "answer": "prompt"})


def test_the_mapping_applies_to_the_held_out_file_too(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", question_rows("main", "train", 6))
    val = write_jsonl(tmp_path / "val.jsonl", question_rows("main", "test", 2))
    dm = PromptDataModule(
        source=str(train),
        val_source=str(val),
        columns={"question": "prompt", "answer": "solution"},
    )
    dm.setup("fit")
    assert dm.held_out()[0] == {"prompt": "main test: what is 0 + 1?", "solution": "1"}
