"""The CLI: every example YAML parses and trains (briefly); the installed script exits 0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from periodic_rl.cli import main

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))

# A 2-iteration run of a tiny model with the in-process transformers engine: the fastest real fit.
TINY_RUN = """
seed_everything: 0
trainer:
  max_steps: 2
  default_root_dir: {root}
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  strategy:
    class_path: periodic_rl.PeriodicAsyncStrategy
    init_args: {{engine: hf, use_ray: false, overlap: false}}
model:
  class_path: periodic_rl.RLModule
  init_args:
    model: {model}
    num_generations: 2
    micro_batch_size: 2
    max_new_tokens: 4
    shared_prompt: false
data:
  class_path: periodic_rl.PromptDataModule
  init_args: {{batch_size: 2, num_train: 8, num_val: 2}}
"""


def entry_point() -> str:
    """The installed ``periodic-rl`` console script of this environment."""
    beside = Path(sys.executable).with_name("periodic-rl")
    found = str(beside) if beside.exists() else shutil.which("periodic-rl")
    if found is None:
        pytest.fail("the periodic-rl console script is not installed (pip install -e .)")
    return found


def test_installed_script_trains_and_exits_zero(tmp_path, tiny_llama_path):
    config = tmp_path / "run.yaml"
    config.write_text(TINY_RUN.format(root=tmp_path / "run", model=tiny_llama_path))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [entry_point(), "fit", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "held-out" in done.stdout  # it trained to the end: the final evaluation ran


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.name)
def test_example_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "PeriodicAsyncStrategy" in printed or "periodic_async" in printed
    assert "class_path: periodic_rl.RLModule" in printed or "RLModule" in printed


def test_examples_exist():
    assert any(p.name == "arithmetic.yaml" for p in EXAMPLES)


def test_bad_value_in_config_is_refused(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "model:\n  class_path: periodic_rl.RLModule\n  init_args:\n    num_generations: many\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code != 0
