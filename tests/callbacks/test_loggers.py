"""Weights & Biases and MLflow through Lightning's own loggers, offline.

A tiny fit per logger, with RolloutSamples on every iteration; the metrics and the sample tables
are read back from what each logger wrote to disk (W&B: the run's ``.wandb`` record file and its
``files/`` folder; MLflow: a ``file:`` tracking store read with ``MlflowClient``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from callback_runs import STEPS, Run, fit

from periodic_rl.callbacks import RolloutSamples
from periodic_rl.callbacks.samples import TAG

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

GENERATIONS = 4  # callback_runs' num_generations; max_groups=1: one group per table
COLUMNS = {"iteration", "prompt", "completion", "reward", "rewards/length_reward", "advantage"}


def _jsonl(run: Run) -> list[dict[str, Any]]:
    path = run.callbacks["RolloutSamples"].resolve_jsonl_path(run.trainer)
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_table(columns: list[str], data: list[list[Any]], expected: list[dict[str, Any]]):
    """The table's rows are the JSONL rows: same iterations, completions, rewards, advantages."""
    assert COLUMNS <= set(columns)
    rows = [dict(zip(columns, values, strict=True)) for values in data]
    assert len(rows) == len(expected)
    for row, want in zip(rows, expected, strict=True):
        assert row["iteration"] == want["iteration"]
        assert row["completion"] == want["completion"]
        assert row["reward"] == pytest.approx(want["reward"])
        assert row["rewards/length_reward"] == pytest.approx(want["rewards"]["length_reward"])
        assert row["advantage"] == pytest.approx(want["advantage"])


def _last_reward(run: Run) -> float:
    return run.module.last_iteration.metrics()["reward"]


# ---- Weights & Biases ------------------------------------------------------------------------
def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB-log chunks (checksum,
    length, type: 1 whole, 2 first, 3 middle, 4 last) that never cross a 32 KiB block."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", f"{path} is not a W&B record file"
    pos, parts = 7, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record
        elif kind == 0:
            parts = []


def _wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """Every history row the run logged, values decoded from JSON."""
    [path] = run_dir.glob("run-*.wandb")
    rows = []
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


@pytest.fixture(scope="module")
def wandb_run(tiny_llama_path, tmp_path_factory) -> tuple[Run, Path]:
    """A fit with only a ``WandbLogger`` in offline mode; returns the run and its W&B folder."""
    wandb = pytest.importorskip("wandb", reason="needs wandb: pip install 'periodic_rl[wandb]'")
    from lightning.pytorch.loggers import WandbLogger

    root = tmp_path_factory.mktemp("wandb-run")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(name, str(root))
        logger = WandbLogger(project="periodic_rl-tests", save_dir=str(root), offline=True)
        samples = RolloutSamples(every_n_iterations=1, max_groups=1)
        run = fit(tiny_llama_path, root, [samples], STEPS, loggers=[logger])
        run_dir = Path(logger.experiment.dir).parent
        logger.experiment.finish()
        wandb.teardown()  # stops W&B's service process: the record file is complete on disk
    return run, run_dir


def test_wandb_gets_the_training_metrics(wandb_run):
    run, run_dir = wandb_run
    rows = [r for r in _wandb_history(run_dir) if "reward" in r]
    assert [r["trainer/global_step"] for r in rows] == list(range(STEPS))
    assert all("rewards/length_reward" in r and "lr" in r for r in rows)
    assert rows[-1]["reward"] == pytest.approx(_last_reward(run))


def test_wandb_gets_a_samples_table_per_iteration(wandb_run):
    run, run_dir = wandb_run
    history = _wandb_history(run_dir)
    rows = [r for r in history if f"{TAG}/path" in r]
    metric_steps = [r["trainer/global_step"] for r in history if "reward" in r]
    assert len(rows) == STEPS
    assert [r["trainer/global_step"] for r in rows] == metric_steps  # beside their reward
    expected = _jsonl(run)
    for iteration, row in enumerate(rows):
        assert row[f"{TAG}/_type"] == "table-file"
        table = json.loads((run_dir / "files" / row[f"{TAG}/path"]).read_text())
        mine = [r for r in expected if r["iteration"] == iteration]
        assert len(mine) == GENERATIONS
        _check_table(table["columns"], table["data"], mine)


# ---- MLflow ----------------------------------------------------------------------------------
@dataclass
class MLflowRun:
    run: Run
    client: MlflowClient
    run_id: str


@pytest.fixture(scope="module")
def mlflow_run(tiny_llama_path, tmp_path_factory) -> MLflowRun:
    """A fit with only an ``MLFlowLogger`` on a ``file:`` store in a temporary folder."""
    pytest.importorskip("mlflow", reason="needs mlflow: pip install 'periodic_rl[mlflow]'")
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow-run")
    uri = (root / "mlruns").as_uri()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for a database otherwise
        logger = MLFlowLogger(experiment_name="periodic_rl-tests", tracking_uri=uri)
        samples = RolloutSamples(every_n_iterations=1, max_groups=1)
        run = fit(tiny_llama_path, root, [samples], STEPS, loggers=[logger])
        client = MlflowClient(uri)
    return MLflowRun(run, client, logger.run_id)


def test_mlflow_gets_the_training_metrics(mlflow_run):
    client, run_id = mlflow_run.client, mlflow_run.run_id
    history = client.get_metric_history(run_id, "reward")
    assert [m.step for m in history] == list(range(STEPS))
    assert history[-1].value == pytest.approx(_last_reward(mlflow_run.run))
    assert {"rewards/length_reward", "lr"} <= client.get_run(run_id).data.metrics.keys()
    held_out = client.get_metric_history(run_id, "eval/reward")  # at start and at end
    assert [m.step for m in held_out] == [0, STEPS]  # the policy versions evaluated


def test_mlflow_gets_one_samples_table_of_every_iteration(mlflow_run, tmp_path):
    client, run_id = mlflow_run.client, mlflow_run.run_id
    path = client.download_artifacts(run_id, f"{TAG}.json", str(tmp_path))
    table = json.loads(Path(path).read_text())  # pandas' "split" orient: columns, data
    expected = _jsonl(mlflow_run.run)
    assert len(expected) == STEPS * GENERATIONS
    _check_table(table["columns"], table["data"], expected)
    logged = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": f"{TAG}.json", "type": "table"} in logged  # what the MLflow UI lists
