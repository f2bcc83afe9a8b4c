"""RLModule: configuration errors surface before any engine starts, naming the field."""

import threading

import lightning as L
import pytest

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.rollout.types import GeneratedGroup


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_generations": 1}, "num_generations"),
        ({"num_generations": 4, "micro_batch_size": 6}, "micro_batch_size"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"scale_rewards": "global"}, "scale_rewards"),
        ({"advantage_baseline": "mean"}, "advantage_baseline"),
        ({"temperature": 0.0}, "temperature"),
        ({"dtype": "int8"}, "dtype"),
        ({"reward_funcs": ["math:nope"]}, "reward_funcs"),
        ({"reward_funcs": ["math:floor"], "reward_weights": [1.0, 2.0]}, "reward_weights"),
    ],
)
def test_bad_config_names_the_field(tiny_llama_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        RLModule(model=tiny_llama_path, **kwargs)


def _length(prompts, completions, **columns):
    return [len(c) / 10 for c in completions]


def _wrong_length(prompts, completions, **columns):
    return [1.0]


def _nan_reward(prompts, completions, **columns):
    return [float("nan")] * len(completions)


@pytest.mark.parametrize(
    ("reward", "message"),
    [(_wrong_length, "returned 1 values for 2 completions"), (_nan_reward, "NaN")],
)
def test_bad_reward_fails_before_engines_start(tiny_llama_path, reward, message):
    module = RLModule(
        model=tiny_llama_path, num_generations=2, micro_batch_size=2, reward_funcs=[reward]
    )
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    trainer = L.Trainer(strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False)
    data = PromptDataModule(batch_size=2, num_train=8, num_val=2)
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, datamodule=data)
    assert strategy.rollouts.backend is None  # nothing expensive was started


def test_missing_prompt_in_rows_fails_before_engines_start(tiny_llama_path, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "hi"}\n')
    module = RLModule(
        model=tiny_llama_path, num_generations=2, micro_batch_size=2, reward_funcs=[_nan_reward]
    )
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    trainer = L.Trainer(strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="'prompt' column"):
        trainer.fit(module, datamodule=PromptDataModule(source=str(path), batch_size=1))
    assert strategy.rollouts.backend is None


def test_module_without_our_strategy_says_what_to_do(tiny_llama_path):
    module = RLModule(model=tiny_llama_path, num_generations=2, micro_batch_size=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, accelerator="cpu")
    with pytest.raises(TypeError, match="PeriodicAsyncStrategy"):
        trainer.fit(module, datamodule=PromptDataModule(batch_size=2, num_train=4, num_val=0))


class SlowRollouts:
    """A rollout backend stand-in that counts the groups it generates: the first at once, the
    second after a long generation (30 s; the later ones 0.5 s) that cancelling stops at once.
    The timeouts only bound how long a broken cancellation takes to fail the test."""

    def __init__(self) -> None:
        self.generated = 0
        self.version = 0

    def push_weights(self, state_dict, version, keep=None):
        self.version = version
        return "fake-weights"

    def weights_will_change(self) -> None:
        pass

    def generate(
        self, jobs, sampling, version, groups_per_call=None, ramp_groups=None, cancel=None
    ):
        cancel = cancel if cancel is not None else threading.Event()  # never set
        for k, job in enumerate(jobs):
            if k and cancel.wait(timeout=30 if k == 1 else 0.5):
                return  # cancelled: the rest of the iteration is never generated
            self.generated += 1
            yield GeneratedGroup(job.index, [[7, 8, 2]] * job.n, version, "fake-weights", 0, 0)

    def shutdown(self) -> None:
        pass


class AtTheError(L.Callback):
    """What was still running when Lightning first saw the training step's error."""

    def __init__(self) -> None:
        self.before = set(threading.enumerate())  # other tests' threads are not this run's

    def on_exception(self, trainer, pl_module, exception):
        rollouts = trainer.strategy.rollouts.backend
        self.generated = rollouts.generated
        threads = set(threading.enumerate()) - self.before
        self.producers_alive = [t for t in threads if t.name == "periodic-rl-rollouts"]


class LossFails(RLModule):
    def _backward_micro_batch(self, groups):
        raise FloatingPointError("the loss failed on the first micro-batch")


def test_failing_training_step_stops_the_iteration_generation(tiny_llama_path, monkeypatch):
    rollouts = SlowRollouts()
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=True, overlap=True)
    strategy.rollouts.backend = rollouts  # started instead of building real engines
    module = LossFails(
        model=tiny_llama_path, num_generations=2, max_new_tokens=4, reward_funcs=[_length]
    )
    seen = AtTheError()
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        callbacks=[seen],
    )
    groups = 8
    with pytest.raises(FloatingPointError):
        trainer.fit(module, datamodule=PromptDataModule(batch_size=groups, num_train=8, num_val=0))
    # When the error left training_step, the producer had already stopped (the step closed its
    # micro-batches, which cancelled the stream), having generated only the group the failing
    # micro-batch held, of the iteration's eight.
    assert seen.producers_alive == [] and seen.generated == 1
    assert rollouts.generated == 1
