"""One soak fit and the checks on it: a real Lightning fit (``PeriodicAsyncStrategy``, the HF
engine in two Ray workers, a tiny Llama built from a config) whose :class:`SoakMonitor` SIGKILLs
a worker on a seeded plan and records, per iteration, the groups the trainer received, a digest
of the update, the resident memory of the trainer and of each worker, ``/dev/shm`` and the
process tree. :func:`run_soak` runs it with kills and again without, compares the two, and
checks that nothing (processes, ``/dev/shm`` files) outlived either fit.

Imported by ``benchmarks/soak.py`` (the 200-iteration soak) and ``tests/test_soak.py`` (20).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import torch
import xxhash
from common import bare_trainer  # benchmarks/ is on sys.path (soak.py, tests/test_soak.py)

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.rollout.processes import descendants
from periodic_rl.weight_sync.fingerprint import weights_fingerprint

MIB = 2**20
#: Where an iteration's kill lands: before its generation starts, after that many of its
#: micro-batches reached the trainer (workers still generating), or in the optimizer step
#: (generation over: the death is found by the weight push that follows).
KILL_POINTS = ("start", "mid", "mid", "step")
#: Two runs' update digests agree when they differ by less than this share of their own
#: noise scale (gradients summed in another completion order differ in the last bits only).
DIGEST_RTOL = 1e-2


def length_reward(prompts, completions, **columns):
    """A reward with spread inside every group, so every iteration has a non-zero update."""
    return [len(c) / 10.0 for c in completions]


def make_tiny_model(path: str | Path) -> str:
    """The tests' tiny Llama (``tests/conftest.py``): random weights, SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from periodic_rl.models import SMOLLM2_ALIAS, resolve_model

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(resolve_model(SMOLLM2_ALIAS)).save_pretrained(path)
    return str(path)


def kill_plan(iterations: int, kill_every: int, seed: int, workers: int) -> dict[int, dict]:
    """``{iteration: {"slot", "point", "after"}}``: one kill near every ``kill_every``-th
    iteration (jittered by up to a quarter of it), a random worker, a random point."""
    rng = random.Random(seed)
    plan: dict[int, dict] = {}
    jitter = kill_every // 4
    for k in range(1, iterations // kill_every + 1):
        it = k * kill_every + rng.randint(-jitter, jitter)
        slot, point, after = rng.randrange(workers), rng.choice(KILL_POINTS), rng.randint(1, 3)
        if 1 <= it < iterations:
            plan[it] = {"slot": slot, "point": point, "after": after}
    return plan


def rss_mib(pid: int) -> float | None:
    try:
        return round(psutil.Process(pid).memory_info().rss / MIB, 2)
    except psutil.Error:
        return None


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


class SoakMonitor(L.Callback):
    """Kills workers on ``plan`` (see :func:`kill_plan`) and records every iteration."""

    def __init__(self, plan: dict[int, dict], max_restarts: int) -> None:
        self.plan, self.max_restarts = plan, max_restarts
        self.records: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None
        self._prev: torch.Tensor | None = None
        self._probe: torch.Tensor | None = None

    # ---- set-up: the rollouts, the micro-batch stream, the first weights -------------------
    def on_train_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        self.backend = strategy.rollouts.backend
        self.backend.max_restarts = self.max_restarts
        original = strategy.rollout_micro_batches

        def micro_batches(*args: Any, **kwargs: Any):
            for count, groups in enumerate(original(*args, **kwargs), start=1):
                pending = self._pending
                if pending and pending["point"] == "mid" and count >= pending["after"]:
                    self._kill(f"after micro-batch {count}")
                yield groups

        strategy.rollout_micro_batches = micro_batches
        self._prev = self._flat(pl_module)
        gen = torch.Generator().manual_seed(1234)
        self._probe = torch.randn(self._prev.numel(), generator=gen, dtype=torch.float64)

    @staticmethod
    def _flat(pl_module) -> torch.Tensor:
        params = [p.detach().reshape(-1) for p in pl_module.policy.parameters() if p.requires_grad]
        return torch.cat(params).to(torch.float64)

    # ---- per iteration ------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        it = len(self.records)
        pids = self.backend.worker_pids()  # no generation runs now: the workers are settled
        me = os.getpid()
        tree = [pid for pid, _ in descendants(me)]
        self.records.append({
            "iteration": it,
            "t": time.time(),
            "trainer_rss_mib": rss_mib(me),
            "workers": [{"slot": i, "pid": p, "rss_mib": rss_mib(p)} for i, p in enumerate(pids)],
            "tree_rss_mib": round(sum(rss_mib(p) or 0 for p in [me, *tree]), 1),
            "processes": len(tree),
            "shm_entries": len(shm_entries()),
            "kill": None,
        })  # fmt: skip
        planned = self.plan.get(it)
        self._pending = dict(planned, pid=pids[planned["slot"]]) if planned else None
        if planned and planned["point"] == "start":
            self._kill("before generation")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._pending is not None:  # "step", or "mid" after fewer micro-batches than planned
            self._kill("in the optimizer step")

    def _kill(self, where: str) -> None:
        kill, self._pending = self._pending, None
        os.kill(kill["pid"], signal.SIGKILL)
        kill = {"iteration": len(self.records) - 1, **kill, "where": where}
        self.records[-1]["kill"] = kill
        self.kills.append(kill)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = pl_module.last_iteration
        flat = self._flat(pl_module)
        delta, self._prev = flat - self._prev, flat
        weighted = delta * self._probe
        named = {n: p.detach() for n, p in pl_module.policy.named_parameters() if p.requires_grad}
        self.records[-1].update(
            groups=[
                [
                    g.index,
                    g.seed,
                    g.worker,
                    xxhash.xxh3_64_hexdigest(repr(g.completion_ids).encode()),
                ]
                for g in stats.groups
            ],
            fingerprint=weights_fingerprint(named),
            update_l1=delta.abs().sum().item(),
            update_probe=weighted.sum().item(),
            update_probe_scale=weighted.square().sum().sqrt().item(),
            loss={k: float(v) for k, v in stats.loss.items()},
            restarts=self.backend.restarts,
            redispatched_calls=self.backend.redispatched_calls,
            seconds=round(time.time() - self.records[-1]["t"], 3),
        )


def fit_once(model_path: str, config: dict[str, Any], plan: dict[int, dict]) -> dict[str, Any]:
    """One fit with ``plan``'s kills; its records, its kills and what it left behind."""
    me = os.getpid()
    before_procs = {pid for pid, _ in descendants(me)}
    before_shm = shm_entries()
    L.seed_everything(config["seed"], verbose=False)
    module = RLModule(
        model=model_path,
        num_generations=config["num_generations"],
        max_new_tokens=config["max_new_tokens"],
        micro_batch_size=config["micro_batch_size"],
        learning_rate=config["learning_rate"],
        reward_funcs=[length_reward],
        eval_at_start=False,
        eval_at_end=False,
        seed=config["seed"],
    )
    strategy = PeriodicAsyncStrategy(
        engine="hf",
        num_workers=config["num_workers"],
        overlap=True,
        groups_per_call=config["groups_per_call"],
        cpus_per_worker=config["cpus_per_worker"],
    )
    monitor = SoakMonitor(plan, config["max_restarts"])
    trainer = bare_trainer(strategy, config["iterations"], [monitor])
    datamodule = PromptDataModule(
        batch_size=config["batch_size"], num_train=config["num_train"], num_val=0,
        seed=config["seed"],
    )  # fmt: skip
    began = time.time()
    trainer.fit(module, datamodule=datamodule)
    fit_s = time.time() - began
    restarts, redispatched = monitor.backend.restarts, monitor.backend.redispatched_calls
    del trainer, strategy, module
    leftovers = leftover_processes(me, before_procs, [k["pid"] for k in monitor.kills])
    new_shm = leftover_shm(before_shm)
    return {
        "fit_s": round(fit_s, 1),
        "kills": monitor.kills,
        "restarts": restarts,
        "redispatched_calls": redispatched,
        "records": monitor.records,
        "leftover_processes": leftovers,
        "leftover_shm": new_shm,
    }


def leftover_processes(me: int, before: set[int], killed: list[int], wait_s: float = 15.0):
    """Processes this fit started that still run (waits ``wait_s`` for them to go): new
    descendants of this process, and killed workers that are not gone."""
    deadline = time.time() + wait_s
    while True:
        left = [
            {"pid": p, "name": _name(p), "cmdline": _cmdline(p)}
            for p in sorted({pid for pid, _ in descendants(me)} - before | set(killed))
            if _running(p)
        ]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def leftover_shm(before: set[str], wait_s: float = 5.0) -> list[str]:
    """``/dev/shm`` entries created since ``before`` that no live process holds (leaked)."""
    from periodic_rl.rollout.processes import shm_files

    deadline = time.time() + wait_s
    while True:
        new = shm_entries() - before
        if new:
            held = {os.path.basename(f) for f in shm_files(int(p) for p in os.listdir("/proc")
                                                              if p.isdigit())}  # fmt: skip
            new -= held
        if not new or time.time() > deadline:
            return sorted(new)
        time.sleep(0.5)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:160]
    except psutil.Error:
        return "?"


# ---- the comparison with the fault-free run -------------------------------------------------
def group_counts(run: dict[str, Any], jobs: int) -> dict[str, int]:
    """Groups lost (a job of an iteration never trained on) and duplicated (trained twice, or
    a group no job asked for), over every iteration of ``run``."""
    lost = duplicated = 0
    for record in run["records"]:
        indices = [g[0] for g in record.get("groups", [])]
        lost += len(set(range(jobs)) - set(indices))
        duplicated += len(indices) - len(set(indices)) + len(set(indices) - set(range(jobs)))
    return {"lost": lost, "duplicated": duplicated}


def compare_runs(faulty: dict[str, Any], clean: dict[str, Any]) -> dict[str, Any]:
    """Per iteration: the same groups (job, seed and completions, in any order), the same
    update (the bit fingerprint, else the digests within :data:`DIGEST_RTOL`)."""
    a, b = faulty["records"], clean["records"]
    different_groups, different_updates, bit_identical, worst = [], [], 0, 0.0
    for ra, rb in zip(a, b, strict=False):
        key = sorted((g[0], g[1], g[3]) for g in ra["groups"])
        if key != sorted((g[0], g[1], g[3]) for g in rb["groups"]):
            different_groups.append(ra["iteration"])
        if ra["fingerprint"] == rb["fingerprint"]:
            bit_identical += 1
            continue
        scale = max(ra["update_probe_scale"], rb["update_probe_scale"], 1e-30)
        l1 = max(ra["update_l1"], rb["update_l1"], 1e-30)
        probe_off = abs(ra["update_probe"] - rb["update_probe"]) / scale
        l1_off = abs(ra["update_l1"] - rb["update_l1"]) / l1
        worst = max(worst, probe_off, l1_off)
        if probe_off > DIGEST_RTOL or l1_off > DIGEST_RTOL:
            different_updates.append(ra["iteration"])
    return {
        "iterations_compared": min(len(a), len(b)),
        "same_length": len(a) == len(b),
        "iterations_with_different_groups": different_groups,
        "iterations_with_different_updates": different_updates,
        "iterations_bit_identical": bit_identical,
        "largest_digest_difference": worst,  # share of the digest's scale; see DIGEST_RTOL
        "digest_rtol": DIGEST_RTOL,
        "updates_equal": len(a) == len(b) and not different_groups and not different_updates,
    }


def run_soak(
    model_path: str,
    iterations: int,
    kill_every: int,
    seed: int = 0,
    *,
    batch_size: int = 4,
    num_generations: int = 2,
    max_new_tokens: int = 4,
    micro_batch_size: int = 4,
    groups_per_call: int = 1,
    learning_rate: float = 1e-5,
    num_workers: int = 2,
    cpus_per_worker: float = 1.0,
    plan: dict[int, dict] | None = None,
    log=print,
) -> dict[str, Any]:
    """The soak: a fit with a worker killed every ~``kill_every`` iterations (or on ``plan``,
    see :func:`kill_plan`), then the same fit without kills; both recorded, compared, and
    checked for leftovers."""
    if plan is None:
        plan = kill_plan(iterations, kill_every, seed, num_workers)
    config = {
        "iterations": iterations,
        "kill_every": kill_every,
        "seed": seed,
        "batch_size": batch_size,
        "num_train": batch_size * iterations,  # one epoch: every iteration new prompts
        "num_generations": num_generations,
        "max_new_tokens": max_new_tokens,
        "micro_batch_size": micro_batch_size,
        "groups_per_call": groups_per_call,
        "learning_rate": learning_rate,
        "num_workers": num_workers,
        "cpus_per_worker": cpus_per_worker,
        "max_restarts": len(plan) + 1,  # the default, 3 per worker, ends a long soak
        "engine": "hf",
        "overlap": True,
        "optimizer": "AdamW (RLModule's default), max_grad_norm 1.0",
    }
    log(f"soak: {iterations} iterations, kills at {sorted(plan)}")
    faulty = fit_once(model_path, config, plan)
    log(f"  with kills: {faulty['fit_s']} s, restarts {faulty['restarts']}")
    clean = fit_once(model_path, config, {})
    log(f"  fault-free: {clean['fit_s']} s")
    return {
        "config": config,
        "kill_plan": {str(k): v for k, v in sorted(plan.items())},
        "faulty": faulty,
        "fault_free": clean,
        "groups": {
            "faulty": group_counts(faulty, batch_size),
            "fault_free": group_counts(clean, batch_size),
        },  # fmt: skip
        "comparison": compare_runs(faulty, clean),
    }
