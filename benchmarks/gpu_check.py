"""The GPU check: the CUDA paths checked on the lent machine in one run of at most 8 minutes.

It runs where torch is preinstalled and nothing can be downloaded (``make gpu-wheels`` prepares
the wheels that travel and prints the command that runs this there), with the in-process
rollouts and the HF engine (no Ray, no vLLM) and models built from configs. Correctness first,
the benchmark last:

1. ``overlap``: a few iterations of bf16-mixed training on CUDA, overlapped == synchronous;
2. ``packing``: shared-prompt packing against the padded forward, several model families, fp32
   and bf16, backends sdpa / split / flex, forward and backward;
3. ``probe``: the numerical probe accepts the exact packed path and refuses a broken one;
4. ``deepspeed``: ZeRO-2/3 equal to one device (not run unless ``import deepspeed`` works);
5. ``benchmark``: packed against padded forward-backward on a 0.5B Qwen2 shape (tokens/s, peak
   memory), skipped when the time left is short.

Each check gets a share of the time budget and records ``passed``, ``failed`` or ``not-run``
with its numbers and error; the run writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.log`` and
exits 1 when a check failed. ``--device cpu --quick`` runs the same code on tiny shapes in fp32
(bf16 and FlexAttention backward recorded as not run): how the code is exercised off-GPU.

    python benchmarks/gpu_check.py --out /tmp/gpu-check --device cpu --quick
    benchmarks/gpu_check_report.py /tmp/gpu-check/gpu_check.json   # the page
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import logging
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("periodic_rl") is None:  # not installed there: the checkout's own
    sys.path.insert(1, str(HERE.parent / "src"))

import torch  # noqa: E402
from gpu_check_common import Budget, CheckFailed, NotRun, Setting, summarise  # noqa: E402

log = logging.getLogger("gpu_check")
TOTAL_SECONDS = 480.0  # the whole run: 8 minutes
BENCHMARK_MINIMUM = 60.0  # the benchmark starts only with this much left


@dataclass(frozen=True)
class Check:
    """One part of the run: its name, what it checks, its function and its share of the time
    (seconds it may start work in; never more than what is left of the whole)."""

    name: str
    what: str
    run: Callable[[Setting, Budget], dict[str, Any]]
    seconds: float


def checks() -> list[Check]:
    """The parts, in the order they run (imported here: they import periodic_rl)."""
    from gpu_check_attention import benchmark, check_packing, check_probe
    from gpu_check_training import check_deepspeed, check_overlap

    return [
        Check("overlap", "training: overlapped == synchronous", check_overlap, 90.0),
        Check("packing", "shared-prompt packing == padded forward", check_packing, 180.0),
        Check("probe", "the numerical probe's tolerance", check_probe, 60.0),
        Check("deepspeed", "DeepSpeed ZeRO-2/3 == one device", check_deepspeed, 30.0),
        Check("benchmark", "packed vs padded forward-backward", benchmark, 120.0),
    ]


def run_check(check: Check, setting: Setting, total: Budget) -> dict[str, Any]:
    """Run one check inside its share of ``total``; the row of the JSON."""
    row: dict[str, Any] = {"name": check.name, "what": check.what}
    left = total.left()
    if check.name == "benchmark" and left < BENCHMARK_MINIMUM:
        row.update(status="not-run", reason=f"only {left:.0f} s of the budget left")
        return row
    if left <= 0:
        row.update(status="not-run", reason="time budget spent")
        return row
    started = time.monotonic()
    log.info("%s: %s (at most %.0f s)", check.name, check.what, min(check.seconds, left))
    try:
        row["numbers"] = check.run(setting, Budget(min(check.seconds, left)))
        row["status"] = "passed"
    except NotRun as reason:
        row.update(status="not-run", reason=str(reason))
    except CheckFailed as failure:
        row.update(status="failed", error=str(failure), numbers=failure.numbers)
    except Exception as error:  # any other error is a failure of this check, the rest still run
        row.update(status="failed", error=f"{type(error).__name__}: {error}")
        log.error("%s", traceback.format_exc())
    row["seconds"] = round(time.monotonic() - started, 2)
    log.info("%s: %s in %.1f s %s", check.name, row["status"], row["seconds"], row.get("error", ""))
    if setting.cuda:
        torch.cuda.empty_cache()
    return row


def environment(device: torch.device) -> dict[str, Any]:
    """What ran: versions, the device, where periodic_rl was imported from."""
    import lightning
    import transformers

    import periodic_rl

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "lightning": lightning.__version__,
        "periodic_rl": str(Path(periodic_rl.__file__).parent),
        "device": device.type,
        "device_name": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_gib=round(props.total_memory / 2**30, 1))
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the JSON and log")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the CPU mode)")
    parser.add_argument("--budget", type=float, default=TOTAL_SECONDS, help="seconds in all")
    parser.add_argument("--commit", default=None, help="the checkout's commit (for the page)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu --quick")
    names = {c.name for c in checks()}
    if args.only and not set(args.only) <= names:
        parser.error(f"--only: unknown check(s) {sorted(set(args.only) - names)}; from {names}")

    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
        handlers=[logging.StreamHandler(), logging.FileHandler(args.out / "gpu_check.log", "w")],
    )
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the 1e-4 tolerances)
        torch.backends.cudnn.allow_tf32 = False
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": args.commit,
        "quick": args.quick,
        "budget_s": args.budget,
        "finished": False,
        "environment": environment(device),
    }
    path = args.out / "gpu_check.json"
    total = Budget(args.budget)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        setting = Setting(device=device, quick=args.quick, workdir=workdir)
        for check in checks():
            if args.only is None or check.name in args.only:
                rows.append(run_check(check, setting, total))
                # written after each check: a run killed later still leaves what it found
                result.update(seconds=round(total.seconds - total.left(), 1),
                              counts=summarise(rows), checks=rows)  # fmt: skip
                path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["finished"] = True
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    log.info("%s: %s", path, result["counts"])
    return 1 if result["counts"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
