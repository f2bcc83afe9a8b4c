"""The training parts of the GPU check: overlapped == synchronous, DeepSpeed == one device.

Both train a tiny Llama (built from a config, the byte tokenizer of ``gpu_check_models``) with
the in-process rollouts and the HF engine: no Ray, no vLLM. Plain SGD and no clipping, so that
the update is the summed gradient itself and any normalisation error shows.

Overlap in one process: ``use_ray=False`` refuses ``overlap=True`` (one engine cannot generate
while the trainer of the same process trains, on a CPU), so :class:`StreamTuning`, a hardware
tuner, turns the controller's ``overlap`` on after set-up, as the CPU tuner may (the JSON
records the setting each run trained with). The trainer then takes each group from the stream as
the pipeline's thread hands it over, without waiting for the iteration, and back-propagates it as
its own micro-batch; the synchronous run waits for the whole iteration and back-propagates it as
one micro-batch. The update path is the overlapped one; only the timing is not (the in-process
engine generates the whole iteration in one call). Both must end with the same weights: within
1e-5 in fp32, and in bf16-mixed within 5% of the update itself (the largest parameter
change of the synchronous run), the rounding of differently shaped bf16 micro-batches. The
completions must be identical, or the comparison would be meaningless: in fp32 always; in bf16
that rounding may move a later iteration's weights enough to flip a sampled token, so when the
runs first sample differently at iteration ``d >= 1`` both are run again for ``d`` iterations and
those are compared (recorded as ``diverged_at``). Different completions in the first iteration,
generated from the same weights, fail the check.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from gpu_check_common import Budget, CheckFailed, NotRun, Setting
from gpu_check_models import save_training_model

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.rollout.tuning import HardwareTuning, TunedRun

FP32_ATOL = 1e-5
BF16_RELATIVE = 0.05


class ByteRewardSGD(RLModule):
    """Reward = the sum of the completion's code points mod 10, over 10 (spread inside every
    group even when every completion reaches ``max_new_tokens``); plain SGD; records each
    iteration's completions and the order its groups were back-propagated in."""

    def reward(self, prompts, completions, **columns):  # noqa: ANN001, ANN201, D102
        return [sum(map(ord, c)) % 10 / 10.0 for c in completions]

    def configure_optimizers(self):  # noqa: ANN201, D102
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.hparams.learning_rate)

    def on_fit_start(self) -> None:  # noqa: D102
        self.history: list[dict[int, list[list[int]]]] = []
        self.orders: list[list[int]] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201, D102
        out = super().training_step(batch, batch_idx)
        stats = self.last_iteration
        self.history.append({g.index: g.completion_ids for g in stats.groups})
        self.orders.append([g.index for g in stats.groups])
        return out


class StreamTuning(HardwareTuning):
    """Turns the controller's ``overlap`` on once the in-process engine holds the first weights
    (module docstring)."""

    def after_setup(self, run: TunedRun) -> None:  # noqa: D102
        run.rollouts.overlap = True


def fit(
    model_dir: str,
    setting: Setting,
    precision: str,
    *,
    streamed: bool,
    steps: int,
    strategy_cls: type[PeriodicAsyncStrategy] = PeriodicAsyncStrategy,
    **strategy_kwargs: Any,
) -> tuple[dict[str, torch.Tensor], ByteRewardSGD]:
    """Train ``steps`` iterations of 3 prompts x 4 samples; the final trainable parameters (on
    the CPU, fp32) and the module."""
    L.seed_everything(0, verbose=False)
    groups, samples = 3, 4
    module = ByteRewardSGD(
        model=model_dir,
        num_generations=samples,
        micro_batch_size=samples if streamed else groups * samples,
        max_new_tokens=8 if setting.quick else 16,
        learning_rate=0.5,
        max_grad_norm=None,
        eval_at_start=False,
        eval_at_end=False,
    )
    strategy = strategy_cls(
        engine="hf",
        use_ray=False,
        overlap=False,
        engine_dtype="float32",
        tuning=StreamTuning() if streamed else HardwareTuning(),
        **strategy_kwargs,
    )
    trainer = L.Trainer(
        accelerator=setting.device.type,
        devices=1,
        precision=precision,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    prompts = Path(model_dir).parent / "prompts.jsonl"  # no task rewards: the module's own
    rows = [{"prompt": f"Say something about {i}."} for i in range(groups * steps)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = PromptDataModule(str(prompts), batch_size=groups, num_val=0, shuffle=False)
    trainer.fit(module, datamodule=data)
    module.overlapped = strategy.rollouts.overlap  # the controller's setting the run trained with
    with strategy.gathered_weights():
        params = {
            name: p.detach().to("cpu", torch.float32, copy=True)
            for name, p in module.policy.named_parameters()
            if p.requires_grad
        }
    return params, module


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _initial(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _first_difference(a: list, b: list) -> int | None:
    """The first iteration whose completions differ between two histories, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def _compare(
    reference: tuple, other: tuple, initial: dict[str, torch.Tensor], bf16: bool
) -> dict[str, Any]:
    params, module = reference
    other_params, other_module = other
    update = _max_diff(params, {k: initial[k] for k in params})
    diff = _max_diff(params, other_params)
    same_samples = module.history == other_module.history
    numbers = dict(
        max_param_diff=diff,
        max_update=update,
        relative_diff=diff / update if update else None,
        tolerance=f"{BF16_RELATIVE} of the update" if bf16 else f"{FP32_ATOL} absolute",
        same_completions=same_samples,
        overlapped=[module.overlapped, other_module.overlapped],
        orders=[module.orders, other_module.orders],
    )
    within = diff <= BF16_RELATIVE * update if bf16 else diff <= FP32_ATOL
    streamed = numbers["overlapped"] == [False, True]
    numbers["passed"] = bool(same_samples and update > 1e-3 and within and streamed)
    return numbers


def check_overlap(setting: Setting, budget: Budget) -> dict[str, Any]:
    """The streamed (overlapped) run equals the synchronous one (module docstring)."""
    model_dir = save_training_model(Path(setting.workdir) / "train-llama")
    precision = "bf16-mixed" if setting.cuda else "32-true"
    steps = 2 if setting.quick else 3
    bf16 = precision.startswith("bf16")
    sync = fit(model_dir, setting, precision, streamed=False, steps=steps)
    if not budget.allows():
        raise NotRun("no time left for the overlapped run after the synchronous one")
    streamed = fit(model_dir, setting, precision, streamed=True, steps=steps)
    diverged = _first_difference(sync[1].history, streamed[1].history)
    if bf16 and diverged is not None and diverged >= 1 and budget.allows():
        steps = diverged  # the iterations both sampled alike (module docstring)
        sync = fit(model_dir, setting, precision, streamed=False, steps=steps)
        streamed = fit(model_dir, setting, precision, streamed=True, steps=steps)
    numbers = _compare(sync, streamed, _initial(model_dir), bf16=bf16)
    numbers.update(precision=precision, iterations=steps, device=str(setting.device))
    numbers["diverged_at"] = diverged
    if not numbers.pop("passed"):
        raise CheckFailed("the overlapped run's weights differ from the synchronous run's", numbers)
    return numbers


def check_deepspeed(setting: Setting, budget: Budget) -> dict[str, Any]:
    """ZeRO-2 and ZeRO-3 on one GPU train the weights of the plain one-device strategy."""
    if not setting.cuda:
        raise NotRun("DeepSpeed ZeRO needs a CUDA GPU")
    if importlib.util.find_spec("deepspeed") is None:
        raise NotRun("deepspeed is not installed here (its wheel did not travel)")
    from periodic_rl.strategies import PeriodicAsyncDeepSpeedStrategy

    model_dir = save_training_model(Path(setting.workdir) / "train-llama")
    reference = fit(model_dir, setting, "32-true", streamed=False, steps=2)
    numbers: dict[str, Any] = {}
    for stage in (2, 3):
        if not budget.allows():
            numbers[f"zero{stage}"] = {"status": "not-run", "reason": "time budget spent"}
            continue
        zero = fit(
            model_dir,
            setting,
            "32-true",
            streamed=False,
            steps=2,
            strategy_cls=PeriodicAsyncDeepSpeedStrategy,
            stage=stage,
        )
        diff = _max_diff(reference[0], zero[0])
        numbers[f"zero{stage}"] = {
            "max_param_diff": diff,
            "status": "passed" if diff <= FP32_ATOL else "failed",
        }
    if any(v["status"] == "failed" for v in numbers.values()):
        raise CheckFailed("a ZeRO stage trained other weights than one device", numbers)
    return numbers
