"""Periodic-async fits on 2 CPU ranks (gloo), run as a script by test_distributed.py.

Lightning's DDP launcher starts rank 1 by running this same script again, so every rank runs the
same fits in the same order. Rank 0 writes each run's outcome to ``<out>/<run>.pt``: the
trainable parameters after the fit, the push counts, and what every rank saw (each rank writes
``<out>/<run>-rank<r>.json`` itself). A run that raises is recorded, not fatal: the next runs go on.

Ray: rank 0 starts one local, loopback-only Ray before the first fit, with the library's own
``init_ray(ray_init_args(...))`` (what ``RayRollouts.start`` calls when no Ray is running), and
shuts it down after the last. Every fit's rollout workers join it (their ``RayRollouts`` does
not own it, so it stops only its workers and their placement group at the end of the fit)
instead of starting and stopping a Ray of their own: ~10 s less per fit. Ray's servers are
still children of rank 0, in the process tree that ``listening_addresses`` inspects.

Usage: python tests/strategies/distributed_runs.py MODEL_DIR OUT_DIR RUN [RUN ...]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "rollout")]  # rl_helpers, ray_fixtures
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE.parent / "rollout"), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
)  # the rollout workers import ray_fixtures too

import lightning as L  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from rl_helpers import LyingPusher, SGDModule, length_reward  # noqa: E402

from periodic_rl import PromptDataModule, StaleRolloutError  # noqa: E402
from periodic_rl.rollout.controller import RolloutController  # noqa: E402
from periodic_rl.strategies import (  # noqa: E402
    PeriodicAsyncDDPStrategy,
    PeriodicAsyncFSDPStrategy,
)

BATCH = 2  # prompts per rank and iteration: a one-rank run takes 2 x BATCH
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
MODULE = dict(
    num_generations=4,
    micro_batch_size=4,
    max_new_tokens=8,
    learning_rate=0.5,
    max_grad_norm=None,
    reward_funcs=[length_reward],
    shared_prompt=False,
)


class RecordedModule(SGDModule):
    """Writes down, per rank, the groups it trained on and any stale group it refused."""

    def on_fit_start(self) -> None:
        self.seen: dict[str, list] = {"groups": [], "refused": [], "versions": []}

    def _check_on_policy(self, groups, strategy) -> None:
        try:
            super()._check_on_policy(groups, strategy)
        except StaleRolloutError as error:
            self.seen["refused"].append(str(error))
            raise
        if "listening" not in self.seen:  # mid-run: every process of the run is up
            self.seen["listening"] = listening_addresses()
        self.seen["groups"] += [(self.trainer.global_step, g.index) for g in groups]
        self.seen["versions"] += [(self.trainer.global_step, g.version) for g in groups]


def listening_addresses() -> list[str]:
    """The addresses that this process and its descendants (Ray, the workers, rank 1 under
    rank 0) listen on."""
    me = psutil.Process()
    tree = {me.pid} | {p.pid for p in me.children(recursive=True)}
    return [
        c.laddr.ip
        for c in psutil.net_connections("inet")
        if c.pid in tree and c.status == psutil.CONN_LISTEN
    ]


class OtherWeightsController(RolloutController):
    """Rank 0 pushes through a :class:`LyingPusher`; every rank is told its fingerprint."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pusher = LyingPusher(self.options.adapter_pushes)


class KillingController(RolloutController):
    """In iteration 1, rank 0 holds worker 0's calls (GatedEngine) and SIGKILLs it as soon as
    worker 1 has generated a group: the held calls are lost and must be sent again."""

    hold_dir = ""

    def micro_batches(self, *args, **kwargs):
        if self.version != 1 or self.link.rank != 0:
            yield from super().micro_batches(*args, **kwargs)
            return
        workers = self.backend
        victim = workers.worker_pids()[0]
        Path(self.hold_dir, f"hold-{victim}").touch()
        resent, restarts = workers.redispatched_calls, workers.restarts
        generate = workers.generate

        def killing_generate(*a, **k):
            for index, group in enumerate(generate(*a, **k)):
                if index == 0:
                    self.first_from = group.worker
                    os.kill(victim, signal.SIGKILL)
                yield group

        workers.generate = killing_generate
        try:
            yield from super().micro_batches(*args, **kwargs)
        finally:
            del workers.generate
            self.resent = workers.redispatched_calls - resent
            self.restarted = workers.restarts - restarts


def fit(out: Path, run: str, strategy, steps=3, lora=None, ckpt_dir=None, resume=None, num_val=0):
    L.seed_everything(0, verbose=False)
    module = RecordedModule(model=MODEL, lora=lora, **MODULE)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(ckpt_dir, save_last=True))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(batch_size=BATCH, num_train=8 * BATCH, num_val=num_val)
    error = None
    try:
        trainer.fit(module, datamodule=data, ckpt_path=resume)
    except Exception as exc:  # recorded; the test decides whether it was expected
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    rank = trainer.global_rank
    seen = {
        **getattr(module, "seen", {}),
        "error": error,
        "version": strategy.policy_version,
        "eval": module.eval_history,
    }
    (out / f"{run}-rank{rank}.json").write_text(json.dumps(seen))
    params = {}
    with strategy.gathered_weights():  # whole parameters on rank 0 under FSDP
        if rank == 0:
            params = {
                n: p.detach().to("cpu", copy=True)
                for n, p in module.policy.named_parameters()
                if p.requires_grad
            }
    if rank == 0:
        controller = strategy.rollouts
        extra = {k: getattr(controller, k, None) for k in ("first_from", "resent", "restarted")}
        torch.save(
            {"params": params, "push_counts": strategy.push_counts, "error": error, **extra},
            out / f"{run}.pt",
        )


def rollouts(cls=PeriodicAsyncDDPStrategy, controller=None, workers=1, overlap=True, **kwargs):
    strategy = cls(
        engine=kwargs.pop("engine", "hf"),
        num_workers=workers,
        overlap=overlap,
        groups_per_call=1,
        **kwargs,
    )
    if controller is not None:
        strategy.rollouts = controller(strategy.rollouts.options, strategy.rollouts.spans)
    return strategy


BUDGET = {"asynchrony": {"max_staleness": 1}, "asynchrony_window": 1}


def scripted_chooser(strategy):
    """Rank 0's chooser measures 10 s per on-policy iteration and 5 s per stale one, and
    predicts 6 s for any staleness: it switches to k = 1 after iteration 1 and keeps it. Rank 1
    only applies what rank 0 decides."""
    from periodic_rl.rollout import chooser  # noqa: PLC0415

    chooser.predict_period_s = lambda times, k, cycles=8: 6.0
    now = [0.0]

    def clock() -> float:
        now[0] += 10.0 if strategy.rollouts.schedule.max_staleness == 0 else 5.0
        return now[0]

    strategy.schedule_chooser.clock = clock
    return strategy


def gated(hold_dir: Path) -> dict:
    return {"engine": "ray_fixtures:GatedEngine", "engine_kwargs": {"gate_dir": str(hold_dir)}}


def run_named(run: str, out: Path) -> None:
    if run in ("full-overlap", "lora-overlap"):
        lora = LORA if run.startswith("lora") else None
        num_val = 4 if run == "full-overlap" else 0  # held-out evaluation at start and end
        fit(out, run, rollouts(), lora=lora, num_val=num_val)
    elif run == "stale1-overlap":  # bounded staleness, k = 1, two workers
        fit(out, run, rollouts(workers=2, max_staleness=1), num_val=2)
    elif run == "budget1-overlap":  # asynchrony {max_staleness: 1}, scripted: k = 1 from 2
        fit(out, run, scripted_chooser(rollouts(workers=2, **BUDGET)), steps=4)
    elif run == "fsdp-overlap":
        fit(out, run, rollouts(PeriodicAsyncFSDPStrategy))
    elif run == "stale":  # synchronous: every rank surely receives its groups before any raises
        fit(out, run, rollouts(controller=OtherWeightsController, overlap=False))
    elif run in ("kill-free", "kill"):
        hold = out / f"{run}-gates"
        hold.mkdir(exist_ok=True)
        controller = None
        if run == "kill":
            controller = type("Killer", (KillingController,), {"hold_dir": str(hold)})
        fit(out, run, rollouts(controller=controller, workers=2, **gated(hold)))
    elif run == "resume":  # 2 synchronous iterations, checkpoint, then resumed overlapped to 4
        ckpt = out / "resume-ckpt"
        fit(out, "resume-first", rollouts(overlap=False), steps=2, ckpt_dir=str(ckpt))
        fit(out, run, rollouts(), steps=4, ckpt_dir=str(ckpt), resume=str(ckpt / "last.ckpt"))
    else:
        raise SystemExit(f"unknown run {run!r}")


if __name__ == "__main__":
    MODEL, OUT = sys.argv[1], Path(sys.argv[2])
    OUT.mkdir(parents=True, exist_ok=True)
    # Lightning's launcher sets LOCAL_RANK for rank 1 (and for rank 0 only when its first fit
    # launches rank 1): without it, this is rank 0, the process that drives the workers.
    shared_ray = "LOCAL_RANK" not in os.environ
    if shared_ray:  # the local Ray a fit would start, started once: every fit joins it
        import ray

        from periodic_rl.rollout.workers.placement import init_ray, ray_init_args

        init_ray(ray_init_args(None, {}), None)
    try:
        for name in sys.argv[3:]:
            run_named(name, OUT)
    finally:
        if shared_ray:
            ray.shutdown()
