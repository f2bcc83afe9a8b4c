"""Bad data rows fail when the data loads, naming the file, the row (and line) and the fix
(docs/troubleshooting.md, "Bad input")."""

import json

import pytest

from periodic_rl.data import PromptDataModule
from periodic_rl.data.checks import check_rows


def load(path, **kwargs):
    dm = PromptDataModule(source=str(path), batch_size=1, val_fraction=0, **kwargs)
    dm.setup("fit")
    return dm


def write(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"prompt": "What is 2 + 2?", "answer": "4"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"answer": "4"}, r"row 1 of .*rows.jsonl \(line 2\) has no prompt .*prompt_column"),
        ({"prompt": None, "answer": "4"}, r"row 1 .* has no prompt"),
        ({"prompt": "", "answer": "4"}, r"row 1 .*\(line 2\): the prompt \('prompt'\) is empty"),
        ({"prompt": "   ", "answer": "4"}, r"row 1 .*: the prompt \('prompt'\) is empty"),
        ({"prompt": 7, "answer": "4"}, r"row 1 .*: the prompt .* is 7, of type int; a prompt is"),
        ({"prompt": [], "answer": "4"}, r"row 1 .*: the prompt .* is an empty list of messages"),
    ],
    ids=["missing", "null", "empty", "blank", "non-string", "no-messages"],
)
def test_bad_prompt_names_the_row_and_line(tmp_path, bad, message):
    path = write(tmp_path, [GOOD, bad, GOOD])
    with pytest.raises(ValueError, match=message) as err:
        load(path)
    assert "non-empty string" in str(err.value) or "prompt_column" in str(err.value)


def test_chat_message_with_a_bad_role_names_the_row_and_the_roles(tmp_path):
    chat = {"prompt": [{"role": "user", "content": "hi"}], "answer": "4"}
    bad = {"prompt": [{"role": "system", "content": "be brief"}, {"role": "bot", "content": "x"}],
           "answer": "4"}  # fmt: skip
    with pytest.raises(ValueError, match=r"row 1 .*\(line 2\): message 1 .* role 'bot'") as err:
        load(write(tmp_path, [chat, bad]))
    assert "['system', 'user', 'assistant', 'tool']" in str(err.value)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"role": "user"}, r"message 0 of the prompt is .*not a .*dict"),
        ("hello", r"message 0 of the prompt is 'hello', not a"),
        ({"role": "user", "content": ["a", "b"]}, r"content of type list; give the content as"),
    ],
    ids=["no-content", "not-a-dict", "non-string-content"],
)
def test_malformed_chat_message_names_the_row(tmp_path, message, expected):
    with pytest.raises(ValueError, match=expected):
        load(write(tmp_path, [GOOD | {"prompt": [message]}]))


def test_non_json_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:3: line 3 is not valid JSON") as err:
        load(path)
    assert "fix or remove that line" in str(err.value)


def test_json_line_that_is_not_an_object_names_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: line 2 is a JSON list, not an object"):
        load(path)


@pytest.mark.parametrize(("name", "text"), [("rows.jsonl", ""), ("rows.jsonl", "\n \n"),
                                            ("rows.json", "[]")])  # fmt: skip
def test_empty_file_says_no_rows(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"no rows in .*{name}"):
        load(path)


def test_missing_file_says_it_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file .*nope.jsonl does not exist"):
        load(tmp_path / "nope.jsonl")


def test_column_missing_from_some_rows_names_the_row_and_the_column(tmp_path):
    rows = [GOOD, GOOD, {"prompt": "What is 3 + 3?"}]
    with pytest.raises(ValueError, match=r"row 2 .*\(line 3\) has no column 'answer'") as err:  # noqa: E501
        load(write(tmp_path, rows))
    assert "add the value to every row" in str(err.value)


def test_a_null_value_is_a_value(tmp_path):
    """A hub dataset's optional column holds nulls: such rows load (the reward sees None)."""
    rows = load(write(tmp_path, [GOOD, GOOD | {"answer": None}]))
    assert [row["answer"] for row in rows._source.train].count(None) == 1


def test_column_only_in_later_rows_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"row 1 .* has column 'hint', which row 0 does not have"):
        load(write(tmp_path, [GOOD, GOOD | {"hint": "add"}]))


def test_held_out_file_with_other_columns_is_refused(tmp_path):
    train = write(tmp_path, [GOOD] * 4, "train.jsonl")
    val = write(tmp_path, [{"prompt": "What is 5 + 5?", "solution": "10"}], "val.jsonl")
    dm = PromptDataModule(source=str(train), val_source=str(val), batch_size=1)
    with pytest.raises(ValueError, match=r"val.jsonl have columns \['solution'\].*same columns"):
        dm.setup("fit")


def test_a_json_array_file_is_read_and_checked(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([GOOD, GOOD | {"prompt": 3}]))
    with pytest.raises(ValueError, match=r"row 1 of .*rows.json: the prompt .* of type int"):
        load(path)
    path.write_text(json.dumps([GOOD, GOOD | {"prompt": "What is 1 + 1?"}]))
    assert len(load(path).source.train) == 2


def test_prompt_column_is_named_in_the_message(tmp_path):
    path = write(tmp_path, [{"question": "q", "answer": "4"}, {"question": "", "answer": "4"}])
    with pytest.raises(ValueError, match=r"the prompt \('question'\) is empty"):
        load(path, prompt_column="question")


def test_good_rows_pass():
    check_rows([GOOD, GOOD | {"prompt": [{"role": "user", "content": "hi"}]}], "rows")
