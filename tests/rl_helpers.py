"""Small training runs shared by the invariance tests."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from periodic_rl import CPUTuning, PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.weight_sync.fingerprint import weights_fingerprint
from periodic_rl.weight_sync.push import WeightPusher

#: Largest parameter difference between two runs that differ only in the order their
#: micro-batches were back-propagated (gradients are summed in completion order, so the bits
#: depend on it). Measured on the tiny model, 3 SGD steps, full and LoRA, packed or padded:
#: at most 1.2e-7 with the order reversed; parameters are of order 1.
ORDER_TOLERANCE = 1e-6


def length_reward(prompts, completions, **columns):
    """A reward with spread inside every group, so every advantage is non-zero."""
    return [len(c) / 10.0 for c in completions]


class SGDModule(RLModule):
    """Plain SGD, no clipping: the update is the gradient itself, so any normalisation error
    shows (Adam would hide a constant factor)."""

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.hparams.learning_rate)


@dataclass
class IterationRecord:
    """What one iteration consumed and pushed, as seen by the trainer."""

    version: int  # the policy version the iteration trained (before its step)
    fingerprint: str  # the fingerprint the workers confirmed for that version
    order: list[int]  # group indices in the order they were back-propagated
    stamps: list[tuple[int, str]]  # (version, fingerprint) each group was generated with
    loss: dict[str, float]  # the iteration's loss sums (tokens, kl_sum, ...)
    completions: dict[int, list[list[int]]]  # group index -> its completions' token ids
    pushed: str  # the fingerprint confirmed by the push after the step


class RecordingModule(SGDModule):
    """SGDModule that keeps an :class:`IterationRecord` per iteration in ``records``."""

    def on_fit_start(self) -> None:
        self.records: list[IterationRecord] = []

    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        version, fingerprint = strategy.policy_version, strategy.weights_fingerprint
        super().training_step(batch, batch_idx)
        stats = self.last_iteration
        self.records.append(
            IterationRecord(
                version=version,
                fingerprint=fingerprint,
                order=[g.index for g in stats.groups],
                stamps=[(g.version, g.fingerprint) for g in stats.groups],
                loss=dict(stats.loss),
                completions={g.index: g.completion_ids for g in stats.groups},
                pushed=strategy.weights_fingerprint,
            )
        )


class StaleRecording(RecordingModule):
    """Also keeps, per iteration, the weights it started from, the groups it trained on and
    the fingerprint the strategy confirmed for each group's version."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.started_from: list[dict[str, torch.Tensor]] = []
        self.confirmed: list[list[str | None]] = []
        self.trained_groups: list[list] = []

    def training_step(self, batch, batch_idx):
        self.started_from.append(
            {n: p.detach().clone() for n, p in self.policy.named_parameters() if p.requires_grad}
        )
        super().training_step(batch, batch_idx)
        strategy = self.trainer.strategy
        groups = self.last_iteration.groups
        self.confirmed.append([strategy.weights_fingerprint_of(g.version) for g in groups])
        self.trained_groups.append(groups)


class LyingPusher(WeightPusher):
    """After the first push, loads the engines with other weights than the policy's under the
    right version, and reports the fingerprint of the policy's own: a push that reports success
    for weights the engines do not hold. Only the fingerprint can tell."""

    def push(self, backend, policy, version):
        if version == 0:
            return super().push(backend, policy, version)
        state = policy.rollout_state_dict()
        name = sorted(state)[0]
        backend.push_weights({**state, name: state[name] + 1e-3}, version)
        return "full", weights_fingerprint(state)


CPU_TUNING_ARGS = ("worker_cores", "trainer_cores", "lend_idle_cores", "split_after")


def with_tuning(strategy: dict[str, Any]) -> dict[str, Any]:
    """The strategy's arguments, the CPU tuner's among them (``worker_cores`` ...) given to a
    :class:`~periodic_rl.cpu_tuning.CPUTuning` as ``tuning``."""
    tuning = {k: strategy[k] for k in CPU_TUNING_ARGS if k in strategy}
    if not tuning:
        return dict(strategy)
    rest = {k: v for k, v in strategy.items() if k not in CPU_TUNING_ARGS}
    return {**rest, "tuning": CPUTuning(**tuning)}


def train(
    model_path: str,
    steps: int = 2,
    strategy: dict[str, Any] | None = None,
    batch_size: int = 3,
    module_cls: type[RLModule] = RecordingModule,
    strategy_cls: type[PeriodicAsyncStrategy] = PeriodicAsyncStrategy,
    data: PromptDataModule | None = None,
    **module_kwargs: Any,
) -> tuple[dict[str, torch.Tensor], RLModule, PeriodicAsyncStrategy]:
    """Train ``steps`` iterations; return the trainable parameters, the module and the strategy.

    Defaults: the in-process HF engine, synchronous; padded forwards (``shared_prompt=False``;
    tests that cover packing pass ``shared_prompt=True``)."""
    L.seed_everything(0, verbose=False)
    kwargs: dict[str, Any] = dict(
        model=model_path,
        num_generations=4,
        micro_batch_size=4,
        max_new_tokens=8,
        learning_rate=0.5,
        max_grad_norm=None,
        reward_funcs=[length_reward],
        shared_prompt=False,
    )
    kwargs.update(module_kwargs)
    module = module_cls(**kwargs)
    strategy_obj = strategy_cls(
        **with_tuning(strategy or {"engine": "hf", "use_ray": False, "overlap": False})
    )
    trainer = L.Trainer(
        strategy=strategy_obj,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if data is None:
        data = PromptDataModule(batch_size=batch_size, num_train=4 * batch_size, num_val=0)
    trainer.fit(module, datamodule=data)
    with strategy_obj.gathered_weights():  # whole parameters under ZeRO-3 (one rank: rank 0)
        params = {
            name: p.detach().to("cpu", copy=True)
            for name, p in module.policy.named_parameters()
            if p.requires_grad
        }
    return params, module, strategy_obj


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def assert_same_update(
    reference: tuple, other: tuple, what: str, same_threads: bool = True
) -> None:
    """Two runs of :func:`train` took the same steps: parameters equal up to the order of
    the gradient sums (:data:`ORDER_TOLERANCE`), and bit-identical when every iteration
    back-propagated its groups in the same order with the same number of torch threads
    (``same_threads``: CPU kernels split their sums by thread, so a trainer re-pinned to another
    number of cores sums in another order)."""
    params, module, _ = reference
    other_params, other_module, _ = other
    assert max_diff(params, other_params) <= ORDER_TOLERANCE, what
    same_order = [r.order for r in module.records] == [r.order for r in other_module.records]
    if same_order and same_threads:
        assert all(torch.equal(params[k], other_params[k]) for k in params), f"{what}: bits"


def starting_threads() -> int:
    """The OpenMP thread count this process started with (``OMP_NUM_THREADS``, else its cores):
    an in-process vLLM's CPU attention runs only while the host's count is that one."""
    return int(os.environ.get("OMP_NUM_THREADS", len(os.sched_getaffinity(0))))


def completion_logps(model, prompt_ids, completion_ids, temperature=1.0):
    """The log-probs of ``completion_ids`` after ``prompt_ids`` under ``model`` at
    ``temperature``, from one plain forward (a reference for the engines' behaviour log-probs)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion_ids)[:, None])[:, 0]


def fit_checkpointed(
    model_path: str,
    root: Any,
    steps: int,
    strategy: PeriodicAsyncStrategy,
    ckpt_path: str | None = None,
    callbacks: tuple[L.Callback, ...] | list[L.Callback] = (),
    **module_kwargs: Any,
) -> tuple[dict[str, torch.Tensor], L.Trainer]:
    """``steps`` iterations of an RLModule with a checkpoint after every one (``root/ckpt``,
    ``last.ckpt`` too), resumed from ``ckpt_path`` when given; the trainable parameters after
    the fit, and the trainer."""
    L.seed_everything(0, verbose=False)
    kwargs: dict[str, Any] = dict(
        model=model_path,
        num_generations=2,
        micro_batch_size=2,
        max_new_tokens=6,
        learning_rate=1e-3,
        reward_funcs=[length_reward],
    )
    module = RLModule(**{**kwargs, **module_kwargs})
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1)
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        callbacks=[checkpoint, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(batch_size=2, num_train=40, num_val=0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    params = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    return params, trainer
