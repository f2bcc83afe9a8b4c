"""The CLI: every example YAML parses and trains (briefly); the installed script exits 0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from periodic_rl.cli import main

REPO = Path(__file__).parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

# Every example's strategy, made cheap: the in-process transformers engine, no Ray, no pinning
# (the examples' CPU tuning would pin the test process itself).
HF_STRATEGY = [
    *("--trainer.strategy.init_args.engine", "hf"),
    *("--trainer.strategy.init_args.engine_kwargs", "null"),
    *("--trainer.strategy.init_args.use_ray", "false"),
    *("--trainer.strategy.init_args.overlap", "false"),
    *("--trainer.strategy.init_args.tuning", "null"),
]

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
    # it trained to the end: the final evaluation ran (logged, to stderr as Lightning's own)
    assert "[periodic_rl] held-out (end" in done.stderr


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.name)
def test_example_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "PeriodicAsyncStrategy" in printed or "periodic_async" in printed
    assert "class_path: periodic_rl.RLModule" in printed or "RLModule" in printed


@pytest.mark.parametrize(
    "strategy",
    ["PeriodicAsyncDDPStrategy", "PeriodicAsyncFSDPStrategy", "PeriodicAsyncDeepSpeedStrategy"],
)
def test_multi_device_strategy_from_yaml(strategy, tmp_path, capsys):
    """The rollout arguments and the training side's own arguments, in one init_args."""
    own = {
        "PeriodicAsyncDDPStrategy": "find_unused_parameters: true",
        "PeriodicAsyncFSDPStrategy": "save_distributed_checkpoint: false",
        "PeriodicAsyncDeepSpeedStrategy": "stage: 3",
    }[strategy]
    config = tmp_path / "multi.yaml"
    config.write_text(
        "trainer:\n  devices: 2\n  strategy:\n"
        f"    class_path: periodic_rl.{strategy}\n"
        f"    init_args:\n      engine: hf\n      num_workers: 3\n      {own}\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert f"class_path: periodic_rl.{strategy}" in printed
    assert "num_workers: 3" in printed and own in printed


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


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["periodic-rl"])  # LightningCLI warns about pytest's


@pytest.fixture
def in_run_dir(tmp_path, monkeypatch):
    """Run from a fresh folder that sees the repository's ``examples/`` (the examples use
    relative paths: ``runs/...`` for their output, ``examples/data/...`` for their data)."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # math_rewards (PYTHONPATH=examples)
    return tmp_path


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory, tiny_llama_path):
    """A random tiny sequence classifier (one label) with the tiny model's tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-reward")
    config = AutoConfig.from_pretrained(tiny_llama_path, num_labels=1, tie_word_embeddings=False)
    LlamaForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(path)
    return str(path)


def test_minimal_yaml_trains(in_run_dir, tiny_llama_path, caplog):
    """Only the model, the data and the length of the run in the YAML: every other value is a
    default (micro_batch_size None included; the strategy is the CLI's default one). The
    command line only makes it cheap: the transformers engine, small groups, short answers."""
    config = in_run_dir / "minimal.yaml"
    config.write_text(
        f"trainer:\n  max_steps: 2\n"
        f"model:\n  init_args:\n    model: {tiny_llama_path}\n"
        "data:\n  init_args:\n    source: builtin:arithmetic\n"
    )
    args = ["fit", "--config", str(config), *HF_STRATEGY]
    args += ["--model.init_args.num_generations", "2", "--model.init_args.max_new_tokens", "4"]
    args += ["--data.init_args.batch_size", "2", "--data.init_args.num_val", "2"]
    main(args)
    assert "held-out (end, iteration 2)" in caplog.text  # the periodic_rl logger, INFO
    assert (in_run_dir / "lightning_logs" / "version_0" / "config.yaml").exists()


def test_strategy_name_is_registered_by_the_cli_alone():
    """``trainer.strategy: periodic_async`` in a fresh process that imports only the CLI."""
    code = (
        "import periodic_rl.cli\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'periodic_async' in StrategyRegistry, sorted(StrategyRegistry)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.name)
def test_example_trains_briefly(config, in_run_dir, tiny_llama_path, tiny_reward_model, caplog):
    """Each example, as written, except: a tiny model, the transformers engine, 2 iterations
    of 2 prompts x 2 samples of 4 tokens, and 2 held-out prompts. Its callbacks stay."""
    args = ["fit", "--config", str(REPO / "examples" / config.name), *HF_STRATEGY]
    args += ["--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"]
    args += ["--model.init_args.model", tiny_llama_path]
    args += ["--model.init_args.num_generations", "2", "--model.init_args.max_new_tokens", "4"]
    args += ["--data.init_args.batch_size", "2", "--data.init_args.num_val", "2"]
    if config.name == "reward_model.yaml":
        args += ["--model.init_args.reward_model", tiny_reward_model]
    main(args)
    assert "held-out (end, iteration 2)" in caplog.text


# ---- configuration errors: a few lines, the library's message, exit status 2 -----------------
def _refused(args: list[str], capsys) -> str:
    """Run ``fit`` with ``args``; the CLI must exit with status 2 and no traceback. Returns
    the error part of stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err, err
    lines = err[err.index("error:") :].splitlines()
    assert len(lines) <= 2, err
    return lines[0]


def test_help_lists_the_allowed_values_of_every_choice(capsys):
    from periodic_rl import RLModule
    from periodic_rl.choices import choice_arguments
    from periodic_rl.rollout.options import RolloutOptions

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    for key, target in (("model", RLModule.__init__), ("trainer.strategy", RolloutOptions)):
        for name, allowed in choice_arguments(target).items():
            listed = ",".join(str(value) for value in allowed)
            assert f"--{key}.init_args.{name} {{{listed}}}" in printed, name
    assert "Literal['vllm', 'hf']" in printed  # engine: the built-in engines, or a class path
    assert "--data.init_args.source" in printed


def test_wrong_choice_is_refused_naming_the_allowed_values(capsys):
    error = _refused(["--model.init_args.model", "m", "--model.init_args.loss_type", "ppo"], capsys)
    assert error.endswith(
        "model.init_args.loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo'; got 'ppo'"
    ), error


def test_wrong_strategy_choice_in_yaml_is_refused(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  strategy:\n    init_args:\n      push_transport: nccl\n")
    error = _refused(["--config", str(config), "--model.init_args.model", "m"], capsys)
    assert "push_transport must be one of 'auto', 'object_store', 'broadcast'; got 'nccl'" in error


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["--model.init_args.lerning_rate", "1e-6"], "did you mean learning_rate?"),
        (["--trainer.strategy.init_args.enigne", "hf"], "did you mean engine?"),
        (["--trainer.max_stepz=3"], "did you mean --trainer.max_steps"),
    ],
)
def test_misspelt_option_gets_did_you_mean(args, hint, capsys):
    error = _refused(["--model.init_args.model", "m", *args], capsys)
    assert hint in error, error


def test_misspelt_option_in_yaml_gets_did_you_mean(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  max_stepz: 3\nmodel:\n  init_args:\n    model: m\n")
    error = _refused(["--config", str(config)], capsys)
    assert "has no option 'trainer.max_stepz'; did you mean trainer.max_steps" in error, error


def test_setting_refused_while_building_the_classes_is_one_line(tmp_path, tiny_llama_path, capsys):
    """A range the type cannot say (num_generations >= 2): the library's own message."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    args = ["--model.init_args.model", tiny_llama_path, "--model.init_args.num_generations", "1"]
    args += ["--data.init_args.source", str(data), "--trainer.default_root_dir", str(tmp_path)]
    error = _refused(args, capsys)
    assert error.endswith("num_generations must be >= 2 (group advantages need a group), got 1")


@pytest.mark.parametrize("budget", ["on_policy", "{max_staleness: 1}", "{max_mismatch_kl: 0.001}"])
def test_an_asynchrony_budget_in_yaml_reaches_the_strategy(budget, tmp_path, capsys):
    """Each form of ``asynchrony`` parses from a YAML file, and what the parser makes of it
    builds the strategy's budget."""
    import yaml  # noqa: PLC0415

    from periodic_rl import PeriodicAsyncStrategy  # noqa: PLC0415

    config = tmp_path / "budget.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: periodic_rl.PeriodicAsyncStrategy\n"
        f"    init_args:\n      engine: hf\n      asynchrony: {budget}\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    init_args = printed["trainer"]["strategy"]["init_args"]
    strategy = PeriodicAsyncStrategy(engine="hf", asynchrony=init_args["asynchrony"])
    expected = {"on_policy": 0, "{max_staleness: 1}": 1, "{max_mismatch_kl: 0.001}": 4}[budget]
    assert strategy.max_staleness == expected
    assert strategy.schedule_chooser.budget.max_staleness == expected
