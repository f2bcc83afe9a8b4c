import json

import pytest

from periodic_rl.data import PromptDataModule


def test_builtin_source_batches_prompt_rows():
    dm = PromptDataModule(source="builtin:arithmetic", batch_size=4, num_train=40, num_val=8)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert len(batch) == 4 and all("prompt" in r and "answer" in r for r in batch)
    assert len(dm.held_out()) == 8
    assert len(dm.train_dataloader()) == 10  # sized: Lightning never prefetches a stale rollout


def test_jsonl_file_with_chat_messages_and_extra_columns(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [
        {"question": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(6)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    dm = PromptDataModule(
        source=str(path), batch_size=3, prompt_column="question", shuffle=False, val_fraction=0
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch[0]["prompt"] == [{"role": "user", "content": "q0"}]
    assert batch[0]["solution"] == "0"


def test_missing_prompt_column_names_the_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "hi"}) + "\n")
    dm = PromptDataModule(source=str(path))
    with pytest.raises(ValueError, match="no 'prompt' column"):
        dm.setup("fit")


def test_unknown_builtin_and_bad_batch_size():
    with pytest.raises(ValueError, match="builtin:arithmetic"):
        PromptDataModule(source="builtin:nope").setup("fit")
    with pytest.raises(ValueError, match="batch_size"):
        PromptDataModule(batch_size=0)
