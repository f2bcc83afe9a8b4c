"""What the rollout record (``RLModule(record_rollouts=True)``) costs on the demo's workload.

The demo's run (``examples/arithmetic.yaml``: SmolLM2-135M, one vLLM worker, overlapped, 4
prompts x 8 samples an iteration) with the record on. The record works on the training thread
(a digest of the gradient at each optimizer step, the file at the end of each iteration), so its
cost is the time that work takes: measured around it, against the iteration's wall time (from
the end of one iteration to the end of the next; the first iteration, which includes the start
of the engine, is left out). Also: the Parquet bytes per 1,000 recorded completions.

    .venv/bin/python benchmarks/record_overhead.py            # 10 iterations, a few minutes
    .venv/bin/python benchmarks/record_overhead.py --iterations 4 --output /tmp/record.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402 - the benchmarks folder is not a package
    RESULTS_DIR,
    bare_trainer,
    demo_parts,
    demo_settings,
    machine_info,
    markdown_table,
    now_iso,
    write_json,
)

from periodic_rl.callbacks import RolloutRecord  # noqa: E402

TARGET = 0.03  # under 3% of the iteration's time


class TimedRecord(RolloutRecord):
    """The record, with the wall time of its work in each iteration (the gradient digest at
    each optimizer step and the file's write) and of each iteration."""

    def __init__(self, dirpath: str) -> None:
        super().__init__(dirpath)
        self.write_s: list[float] = []  # digest + write, per iteration
        self.digest_s = 0.0
        self.ends: list[float] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        start = time.perf_counter()
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.digest_s = time.perf_counter() - start

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, *args)
        self.write_s.append(time.perf_counter() - start + self.digest_s)
        self.ends.append(time.perf_counter())


def measure(iterations: int) -> dict[str, Any]:
    config = demo_settings()
    module, strategy, data = demo_parts(config)
    with tempfile.TemporaryDirectory() as folder:
        record = TimedRecord(folder)
        bare_trainer(strategy, iterations, [record]).fit(module, datamodule=data)
        files = sorted(Path(folder).glob("*.parquet"))
        size = sum(f.stat().st_size for f in files)
    completions = iterations * config["batch_size"] * config["num_generations"]
    wall = [b - a for a, b in zip(record.ends, record.ends[1:], strict=False)]
    writes = record.write_s[1:]
    return {
        "config": config,
        "iterations": iterations,
        "files": len(files),
        "completions": completions,
        "parquet_bytes": size,
        "bytes_per_1000_completions": size / completions * 1000,
        "write_s": record.write_s,
        "iteration_s": wall,
        "overhead": sum(writes) / sum(wall),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--output", default=str(RESULTS_DIR / "record_overhead.json"))
    args = p.parse_args(argv)
    if args.iterations < 3:
        p.error("--iterations must be >= 3 (the first is left out)")
    machine = machine_info()
    result = measure(args.iterations)
    data = {"date": now_iso(), "machine": machine, "target": TARGET, **result}
    rows = [
        [
            result["iterations"] - 1,
            sum(result["iteration_s"]) / len(result["iteration_s"]),
            1000 * sum(result["write_s"][1:]) / len(result["iteration_s"]),
            f"{100 * result['overhead']:.2f}%",
            f"{result['bytes_per_1000_completions'] / 1024:.0f} KiB",
        ]
    ]
    headers = ["iterations", "iteration s", "record ms", "overhead", "Parquet / 1000 completions"]
    print(markdown_table(headers, rows))
    print(f"git {machine['git']}; wrote {write_json(args.output, data)}")
    return 0 if result["overhead"] < TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
