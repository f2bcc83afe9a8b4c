"""The CLI: every example YAML parses into real objects; --print_config works."""

from pathlib import Path

import pytest

from periodic_rl.cli import main

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))


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
