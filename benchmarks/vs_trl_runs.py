"""What runs inside one child process of ``benchmarks/vs_trl.py``: one configuration, one run.

The parent (``vs_trl.py``) writes the run's settings to a JSON file and starts
``vs_trl.py --child FILE``; :func:`child_main` runs TRL (a, b) or periodic_rl (c, c2, d) with
them and writes the settings back with the results added. Torch, TRL and periodic_rl are imported
inside the functions, so the parent can import this module without them.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# the benchmarks folder is on sys.path: vs_trl.py's
from common import bare_trainer, iteration_clock, trl_step_clock

CONFIGS = {
    "a": "TRL GRPOTrainer, transformers generate",
    "b": "TRL GRPOTrainer, vLLM colocate",
    "c": "periodic_rl sync, vLLM, padded",
    "c2": "periodic_rl sync, vLLM, shared-prompt packing",
    "d": "periodic_rl periodic-async, vLLM, packing, pinned 0|1",
    "dl": "periodic_rl periodic-async, vLLM, packing, pinned 0|1, trainer borrows core 1",
    "e": "periodic_rl, vLLM, packing, worker_cores auto (overlap 0|1 or turn-taking, measured)",
}
PRL_SETTINGS = {
    "c": {"overlap": False, "shared_prompt": False, "worker_cores": "all", "trainer_cores": None},
    "c2": {"overlap": False, "shared_prompt": True, "worker_cores": "all", "trainer_cores": None},
    "d": {
        "overlap": True,
        "shared_prompt": True,
        "worker_cores": [[1]],
        "trainer_cores": [0],
        # the library's default: one group per micro-batch, so training starts on the first
        # finished group (the update is the same for any split: tests/test_training_invariants.py)
        "micro_batch_size": "one group",
        "lend_idle_cores": False,  # each side on its own core throughout
    },
    # d, and once the worker has generated the iteration the trainer also uses its core for
    # the last micro-batches and the optimizer step, until the push (lend_idle_cores)
    "dl": {
        "overlap": True,
        "shared_prompt": True,
        "worker_cores": [[1]],
        "trainer_cores": [0],
        "micro_batch_size": "one group",
        "lend_idle_cores": True,
    },
    # the library chooses: it starts taking turns on both cores and, after one measured
    # iteration (after one of warm-up), moves to overlap 0|1 only where its model predicts that
    # faster (the worker moves in place), then keeps the faster; micro-batches of c2's size
    # (two groups), so that taking turns it trains exactly as c2 does
    "e": {
        "overlap": True,
        "shared_prompt": True,
        "worker_cores": "auto",
        "trainer_cores": None,
        "split_after": 1,
    },
}
#: Filler for the long-prompt scan points: a system prompt of roughly ``words`` words.
FILLER = (
    "You are a careful assistant for arithmetic drills. Read the question, add the numbers "
    "exactly, and answer with the number alone on one line, without any explanation. "
)


def child_main(path: Path) -> None:
    began = time.time()
    config = json.loads(path.read_text())
    try:
        if config["config"] in ("a", "b"):
            result = run_trl(config, began)
        else:
            result = run_periodic_rl(config, began)
        result["ok"] = True
    except BaseException as error:  # the parent records the failure and carries on
        result = {"ok": False, "error": "".join(traceback.format_exception(error))[-4000:]}
        traceback.print_exc()
    import resource

    result["child_maxrss_gib"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2
    )
    path.write_text(json.dumps({**config, **result}))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (vLLM / Ray atexit hooks can hang after a failure)


def system_prompt(words: int) -> str | None:
    if words <= 0:
        return None
    filler = FILLER.split()
    return " ".join(filler[i % len(filler)] for i in range(words))


def prompt_rows(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's prompts: the same rows in every run (``data_seed``, not the sampling seed)."""
    from periodic_rl.data.arithmetic import arithmetic_problems

    n = config["steps"] * config["prompts_per_step"]
    return arithmetic_problems("train", n, seed=config["data_seed"])


def set_threads(config: dict[str, Any]) -> None:
    """Every core for the trainer's torch on the CPU (periodic_rl's pinned trainer resets it)."""
    import torch

    if config["device"] == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)


def gpu_memory(config: dict[str, Any]) -> dict[str, float]:
    if config["device"] != "cuda":
        return {}
    import torch

    return {"trainer_cuda_max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def run_trl(config: dict[str, Any], began: float) -> dict[str, Any]:
    """(a) or (b): TRL's GRPOTrainer with the shared settings."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from periodic_rl.data.arithmetic import correctness_reward, format_reward
    from periodic_rl.models import load_tokenizer

    set_threads(config)
    system = system_prompt(config["system_words"])

    def messages(prompt: str) -> list[dict[str, str]]:
        user = [{"role": "user", "content": prompt}]
        return ([{"role": "system", "content": system}] if system else []) + user

    rows = [{"prompt": messages(r["prompt"]), "answer": r["answer"]} for r in prompt_rows(config)]
    dataset = Dataset.from_list(rows)

    def text(completions: list[Any]) -> list[str]:
        return [c[-1]["content"] if isinstance(c, list) else c for c in completions]

    # TRL passes conversational completions as message lists; ours take the text.
    def format_reward_(prompts, completions, **kw):
        return format_reward(prompts, text(completions), **kw)

    def correctness_reward_(prompts, completions, answer, **kw):
        return correctness_reward(prompts, text(completions), answer=answer, **kw)

    format_reward_.__name__ = "format_reward"
    correctness_reward_.__name__ = "correctness_reward"

    vllm = config["config"] == "b"
    out_dir = tempfile.mkdtemp(prefix="prl-vs-trl-out-")
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=config["device"] == "cpu",
        bf16=config["precision"] == "bf16-mixed",
        fp16=False,
        seed=config["seed"],  # its RNGs; the data order is fixed (shuffle_dataset=False)
        max_steps=config["steps"],
        per_device_train_batch_size=config["micro_batch_size"],
        gradient_accumulation_steps=config["gradient_accumulation_steps"],
        num_generations=config["num_generations"],
        max_completion_length=config["max_new_tokens"],
        temperature=config["temperature"],
        top_p=config["top_p"],
        learning_rate=config["learning_rate"],
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=config["max_grad_norm"],
        beta=config["beta"],
        epsilon=config["epsilon"],
        loss_type=config["loss_type"],
        scale_rewards=config["scale_rewards"],
        reward_weights=[0.25, 1.0],
        gradient_checkpointing=config["gradient_checkpointing"],
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=vllm,
        vllm_mode="colocate",
        vllm_max_model_length=config["max_model_len"],
        vllm_gpu_memory_utilization=0.3,
    )
    tokenizer = load_tokenizer(config["model_path"])
    model = AutoModelForCausalLM.from_pretrained(config["model_path"], dtype=torch.float32)

    clock = trl_step_clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[format_reward_, correctness_reward_],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    # generation time per step: wrap the one method that generates
    generate_s: dict[int, float] = {}
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):
        start = time.time()
        try:
            return generate(*a, **kw)
        finally:
            step = trainer.state.global_step
            generate_s[step] = generate_s.get(step, 0.0) + time.time() - start

    trainer._generate_single_turn = timed_generate
    first_prompt_ids = list(trainer._tokenize_prompts([rows[0]["prompt"]])[0][0])
    # Sampling draws from the global RNGs: transformers generate (a) and vLLM colocate's unseeded
    # requests (b; its engine runs in this process). GRPOTrainer seeds them with GRPOConfig.seed,
    # but starting vLLM colocate re-seeds them with its engine seed (0), whatever the run's seed.
    set_seed(config["seed"])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    n = config["completions_per_step"]
    steps = len(clock.end)
    gen = [generate_s.get(i, 0.0) for i in range(steps)]
    ends = clock.end
    durations = [ends[0] - clock.begin[0]] + [b - a for a, b in zip(ends, ends[1:], strict=False)]
    shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "startup_s": clock.begin[0] - began,
        "step_begin": clock.begin,
        "step_end": ends,
        "rewards": [h["reward"] for h in logs],
        "correct": [h.get("rewards/correctness_reward/mean", float("nan")) for h in logs],
        "completions": [n] * steps,
        "completion_tokens": [h["completions/mean_length"] * n for h in logs],
        "generate_s": gen,
        "train_s": [d - g for d, g in zip(durations, gen, strict=True)],
        "prompt_tokens": len(first_prompt_ids),
        "first_prompt_ids": first_prompt_ids,
        "torch_threads": torch.get_num_threads(),
        **gpu_memory(config),
    }


def run_periodic_rl(config: dict[str, Any], began: float) -> dict[str, Any]:
    """(c), (c2) or (d): RLModule + PeriodicAsyncStrategy with the shared settings."""
    import torch

    from periodic_rl import CPUTuning, PeriodicAsyncStrategy, PromptDataModule, RLModule
    from periodic_rl.cpu_tuning.core_loan import LOAN_LANE
    from periodic_rl.rollout.timing import PUSH_NAMES, WAIT_NAMES, summarize

    set_threads(config)
    placement = PRL_SETTINGS[config["config"]]
    cuda = config["device"] == "cuda"
    worker_cores, trainer_cores = placement["worker_cores"], placement["trainer_cores"]
    if worker_cores == "all":  # the synchronous worker generates on every core
        worker_cores = [list(range(os.cpu_count() or 1))]
    if cuda:  # one GPU shared by the trainer and the worker: no core pinning
        worker_cores = trainer_cores = None
    tuning = None  # on the GPU: the library's default (no hardware tuning)
    if not cuda:
        tuning = CPUTuning(
            worker_cores=worker_cores,
            trainer_cores=trainer_cores,
            split_after=placement.get("split_after", 3),
            lend_idle_cores=placement.get("lend_idle_cores", True),  # the library's default
        )

    module = RLModule(
        model=config["model_path"],
        num_generations=config["num_generations"],
        max_new_tokens=config["max_new_tokens"],
        temperature=config["temperature"],
        top_p=config["top_p"],
        learning_rate=config["learning_rate"],
        weight_decay=0.0,
        micro_batch_size=(
            config["num_generations"]
            if placement.get("micro_batch_size") == "one group"
            else config["micro_batch_size"]
        ),
        loss_type=config["loss_type"],
        beta=config["beta"],
        epsilon=config["epsilon"],
        scale_rewards=config["scale_rewards"],
        max_grad_norm=config["max_grad_norm"],
        shared_prompt=placement["shared_prompt"],
        dtype=config["dtype"],
        tis_cap=None,  # TRL without vLLM has no correction; the recorded runs had none
        gradient_checkpointing=config["gradient_checkpointing"],
        system_prompt=system_prompt(config["system_words"]),
        seed=config["seed"],  # the base of every group's sampling seed
    )
    strategy = PeriodicAsyncStrategy(
        engine="vllm",
        engine_kwargs={
            "max_model_len": config["max_model_len"],
            "kv_cache_gb": config["kv_cache_gb"],
        },
        engine_dtype=config["vllm_dtype"],  # float32, bfloat16 or auto
        num_workers=1,
        overlap=placement["overlap"],
        tuning=tuning,
        gpus_per_worker=0.5 if cuda else 0.0,
        device="cuda:0" if cuda else "cpu",
    )
    clock = iteration_clock()
    precision = "bf16-mixed" if config["precision"] == "bf16-mixed" else "32-true"
    trainer = bare_trainer(strategy, config["steps"], [clock], precision=precision)
    datamodule = PromptDataModule(
        "builtin:arithmetic",
        batch_size=config["prompts_per_step"],
        num_train=config["steps"] * config["prompts_per_step"],
        num_val=0,
        seed=config["data_seed"],  # the prompts: the same rows as TRL's, in order
        shuffle=False,
    )
    trainer.fit(module, datamodule=datamodule)
    gen, train, push, other, lent = [], [], [], [], []
    for i, version in enumerate(clock.versions):
        spans = strategy.spans.spans(version)
        s = summarize(spans)
        trainer_spans = [x for x in spans if x.lane == "trainer"]
        micro_end = max(
            (x.end for x in trainer_spans if x.name not in WAIT_NAMES | PUSH_NAMES), default=0
        )
        push_start = min((x.start for x in spans if x.name in PUSH_NAMES), default=micro_end)
        step = max(push_start - micro_end, 0.0)  # normalise, clip, AdamW: between the two
        duration = clock.end[i] - (clock.end[i - 1] if i else clock.begin[0])
        gen.append(s["generation_time"])
        push.append(s["push_time"])
        train.append(s["training_time"] + step)  # overlapped: partly hidden behind generation
        other.append(duration - s["wall_time"])  # outside every span: Lightning, prompt encoding
        lent.append(sum(x.duration for x in spans if x.lane == LOAN_LANE))
    first = clock.stats[0]
    # engine_dtype: auto's measured choice (CPUTuning's; no tuner chooses one on the GPU)
    dtype_choice = getattr(strategy.tuning, "engine_dtype_choice", None)
    return {
        "startup_s": clock.begin[0] - began,
        "step_begin": clock.begin,
        "step_end": clock.end,
        "rewards": [statistics.fmean(st.rewards) for st in clock.stats],
        "correct": [
            statistics.fmean(st.components.get("correctness_reward", [float("nan")]))
            for st in clock.stats
        ],
        "completions": [st.num_sequences for st in clock.stats],
        "completion_tokens": [st.num_tokens for st in clock.stats],
        "generate_s": gen,
        "train_s": train,
        "push_s": push,
        "other_s": other,
        "cores_lent_s": lent,  # the trainer on the worker's cores too (lend_idle_cores)
        "prompt_tokens": len(first.groups[0].prompt_ids),
        "first_prompt_ids": list(first.groups[0].prompt_ids),
        "torch_threads": torch.get_num_threads(),
        "trainer_affinity": sorted(os.sched_getaffinity(0)),
        "worker_cores": worker_cores,
        "trainer_cores": trainer_cores,
        "engine_dtype": dtype_choice.dtype if dtype_choice is not None else config["vllm_dtype"],
        "engine_dtype_rates": dtype_choice.rates if dtype_choice is not None else {},
        "split": {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("split/")
        },
        **gpu_memory(config),
    }
