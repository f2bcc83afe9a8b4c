"""docs/loggers.md's YAML: each logger's ``trainer.logger`` block, read by the CLI, builds the
loggers it shows (kept apart from test_loggers.py, whose mutation copies carry no docs/)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from periodic_rl.cli import PeriodicRLCLI
from periodic_rl.data import PromptDataModule
from periodic_rl.module import RLModule

DOC = Path(__file__).resolve().parents[2] / "docs" / "loggers.md"
RUN = """model:
  class_path: periodic_rl.RLModule
  init_args: {model: MODEL}
data:
  class_path: periodic_rl.PromptDataModule
"""


@pytest.mark.parametrize(
    ("name", "package"), [("WandbLogger", "wandb"), ("MLFlowLogger", "mlflow")]
)
def test_documented_yaml_builds_the_loggers(name, package, tiny_llama_path, tmp_path, monkeypatch):
    """docs/loggers.md's ``trainer.logger`` block for each logger, as the CLI reads it."""
    pytest.importorskip(package, reason=f"needs {package}: pip install 'periodic_rl[{package}]'")
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    [block] = [b for b in blocks if f"lightning.pytorch.loggers.{name}" in b]
    rest = RUN.replace("MODEL", tiny_llama_path)
    config = tmp_path / "run.yaml"
    config.write_text(block + rest)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["periodic-rl"])  # not pytest's arguments
    cli = PeriodicRLCLI(
        RLModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(config)],
        auto_configure_optimizers=False,
    )
    assert [type(lg).__name__ for lg in cli.trainer.loggers] == ["TensorBoardLogger", name]
    assert cli.trainer.log_every_n_steps == 1
