"""Rewards that misbehave: each way a reward call can fail, under ``reward_on_error: raise``
(an error naming the reward, the sample and the fix) and ``zero`` (scored 0, counted exactly),
the per-call timeout, the settings' checks, and a training run whose reward fails on some
calls (:mod:`periodic_rl.rewards`, :class:`~periodic_rl.scoring.Scorer`)."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

import pytest
from rl_helpers import SGDModule, train

from periodic_rl import RLModule
from periodic_rl.rewards import RewardError, RewardTimeoutError, check_rewards
from periodic_rl.scoring import STOP_AFTER_FAILED_ITERATIONS, Scorer

PROMPT = "What is 2+2? Answer with a number."
COMPLETIONS = ["4", "four", "5", "I think it is 4"]
PROMPTS = [PROMPT] * len(COMPLETIONS)
FIX = "set reward_on_error: zero"


def ok(prompts, completions, **columns):
    return [1.0] * len(completions)


def wrong_length(prompts, completions, **columns):
    return [1.0]


def not_a_list(prompts, completions, **columns):
    return 1.0


def nan_at_2(prompts, completions, **columns):
    return [float("nan") if i == 2 else 1.0 for i in range(len(completions))]


def inf_at_1(prompts, completions, **columns):
    return [float("inf") if i == 1 else 1.0 for i in range(len(completions))]


def none_at_3(prompts, completions, **columns):
    return [None if i == 3 else 1.0 for i in range(len(completions))]


def string_at_0(prompts, completions, **columns):
    return ["1.0" if i == 0 else 1.0 for i in range(len(completions))]


def raises(prompts, completions, **columns):
    return [float(int(c)) for c in completions]  # ValueError on "four"


def hangs(prompts, completions, **columns):
    """Far longer than the tests' timeouts (module-level: it runs in the reward pool)."""
    time.sleep(20)
    return [1.0] * len(completions)


def scorer(*funcs, on_error="raise", timeout=None, weights=None):
    return Scorer(
        tokenizer=None,
        reward_funcs=list(funcs),
        reward_weights=weights or [1.0] * len(funcs),
        reward_timeout_s=timeout,
        reward_on_error=on_error,
    )


@pytest.fixture
def never_returns():
    """A reward blocked on an Event until the test ends (then released, so no thread stays).
    The 60 s bound only stops a broken timeout from hanging the test: it then returns 1.0s."""
    release = threading.Event()
    threads = []

    def never_returns(prompts, completions, **columns):
        threads.append(threading.current_thread())
        release.wait(timeout=60)
        return [1.0] * len(completions)

    yield never_returns
    release.set()
    for thread in threads:
        thread.join(timeout=10)


# ---- reward_on_error: raise ------------------------------------------------------------------
BAD_OUTPUT = [  # (reward, what the message says is wrong)
    (wrong_length, "returned 1 values for 4 completions"),
    (not_a_list, r"returned a float \(1.0\), not a list"),
    (nan_at_2, "returned NaN for completion 2 of 4"),
    (inf_at_1, "returned inf for completion 1 of 4"),
    (none_at_3, "returned None for completion 3 of 4"),
    (string_at_0, r"returned a str \('1.0'\) for completion 0 of 4"),
]


@pytest.mark.parametrize(("reward", "what"), BAD_OUTPUT, ids=[r.__name__ for r, _ in BAD_OUTPUT])
def test_bad_output_raises_naming_reward_entry_sample_and_fix(reward, what):
    with pytest.raises(RewardError, match=what) as caught:
        scorer(ok, reward).rewards(PROMPTS, COMPLETIONS, {})
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert f"reward '{reward.__name__}' " in message
    assert "return a" in message and "float" in message  # what to return instead
    assert FIX in message
    assert f"prompt: {PROMPT!r}" in message  # the sample that caused it
    index = int(what.split("completion ")[1].split()[0]) if "for completion" in what else 0
    assert f"completion {index}: {COMPLETIONS[index]!r}" in message


def test_check_rewards_alone_names_the_reward_and_index():
    with pytest.raises(ValueError, match=r"reward 'r' returned None for completion 1 of 2;"):
        check_rewards("r", [0.5, None], 2)
    assert check_rewards("r", [1, True, 0.5], 3) == [1.0, 1.0, 0.5]


def test_an_exception_raises_chained_naming_reward_sample_and_fix():
    with pytest.raises(RewardError) as caught:
        scorer(ok, raises).rewards(PROMPTS, COMPLETIONS, {})
    message = str(caught.value)
    assert message.startswith("reward 'raises' raised ValueError: invalid literal")
    assert FIX in message
    assert f"prompt: {PROMPT!r}" in message and "completion 1: 'four'" in message
    assert isinstance(caught.value.__cause__, ValueError)  # the original error, chained
    assert "invalid literal for int()" in str(caught.value.__cause__)


def test_a_call_that_never_returns_raises_a_timeout_naming_reward_and_limit(never_returns):
    with pytest.raises(RewardTimeoutError) as caught:
        scorer(never_returns, timeout=0.5).rewards(PROMPTS, COMPLETIONS, {})
    assert isinstance(caught.value, TimeoutError)
    message = str(caught.value)
    assert "reward 'never_returns' did not return within reward_timeout_s=0.5 s" in message
    assert "the call is abandoned (it runs in the trainer's process" in message  # a closure
    assert "runs in the reward pool, where a timeout stops it" in message and FIX in message
    assert f"prompt: {PROMPT!r}" in message


def test_long_prompt_and_completion_are_truncated_in_the_message():
    long = "x" * 5000
    with pytest.raises(RewardError) as caught:
        scorer(raises).rewards([long] * 2, [long, "1"], {})
    assert len(str(caught.value)) < 1500
    assert "..." in str(caught.value)


# ---- reward_on_error: zero -------------------------------------------------------------------
ZERO_CASES = [  # (reward, its values after the policy): entries 0, or the whole call 0
    (wrong_length, [0.0, 0.0, 0.0, 0.0]),
    (not_a_list, [0.0, 0.0, 0.0, 0.0]),
    (nan_at_2, [1.0, 1.0, 0.0, 1.0]),
    (inf_at_1, [1.0, 0.0, 1.0, 1.0]),
    (none_at_3, [1.0, 1.0, 1.0, 0.0]),
    (string_at_0, [0.0, 1.0, 1.0, 1.0]),
    (raises, [0.0, 0.0, 0.0, 0.0]),
]


@pytest.mark.parametrize(("reward", "values"), ZERO_CASES, ids=[r.__name__ for r, _ in ZERO_CASES])
def test_zero_scores_the_failure_0_and_counts_each_failing_call(reward, values):
    s = scorer(ok, reward, on_error="zero", weights=[1.0, 2.0])
    with pytest.warns(RuntimeWarning, match=f"reward '{reward.__name__}'"):
        totals, components = s.rewards(PROMPTS, COMPLETIONS, {})
    assert components[reward.__name__] == values
    assert components["ok"] == [1.0] * 4  # the other reward is untouched
    assert totals == [1.0 + 2.0 * v for v in values]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per reward: later failures only counted
        s.rewards(PROMPTS, COMPLETIONS, {})
        s.rewards(PROMPTS, COMPLETIONS, {})
    assert s.take_failures() == {"ok": 0, reward.__name__: 3}  # calls, not entries
    assert s.take_failures() == {"ok": 0, reward.__name__: 0}  # taken: reset


def test_zero_counts_a_call_that_never_returns(never_returns):
    s = scorer(ok, never_returns, on_error="zero", timeout=0.5)
    with pytest.warns(RuntimeWarning, match="did not return within reward_timeout_s=0.5"):
        totals, components = s.rewards(PROMPTS, COMPLETIONS, {})
    assert components == {"ok": [1.0] * 4, "never_returns": [0.0] * 4}
    assert totals == [1.0] * 4
    assert s.take_failures() == {"ok": 0, "never_returns": 1}


def test_zero_counts_exactly_the_failing_calls_not_probes():
    """Calls fail on odd-numbered completions sets; ``count=False`` (the set-up probe,
    held-out evaluation) scores 0 without counting."""
    calls = []

    def flaky(prompts, completions, **columns):
        calls.append(len(calls))
        if len(calls) % 3 == 0:
            raise RuntimeError("flaky backend")
        return [0.5] * len(completions)

    s = scorer(flaky, on_error="zero")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(10):
            s.rewards(PROMPTS, COMPLETIONS, {})
        s.rewards(PROMPTS, COMPLETIONS, {}, count=False)
        s.rewards(PROMPTS, COMPLETIONS, {}, count=False)  # the 12th call fails, uncounted
    assert len(calls) == 12
    assert s.take_failures() == {"flaky": 3}  # calls 3, 6, 9


def test_without_a_timeout_the_reward_runs_in_the_calling_thread():
    seen = []

    def where(prompts, completions, **columns):
        seen.append(threading.current_thread())
        return [0.0] * len(completions)

    scorer(where).rewards(PROMPTS, COMPLETIONS, {})
    scorer(where, timeout=30).rewards(PROMPTS, COMPLETIONS, {})
    assert seen[0] is threading.current_thread()
    assert seen[1] is not threading.current_thread() and seen[1].daemon


# ---- named components ----------------------------------------------------------------------
def two_parts(prompts, completions, **columns):
    return {"fmt": [1.0] * len(completions), "num": [float(c.isdigit()) for c in completions]}


class PartsModule:
    """Stands for an RLModule whose reward() override returns named components."""

    def reward(self, prompts, completions, **columns):
        return {"fmt": [0.5] * len(completions), "num": [1.0] * len(completions)}


def test_named_components_each_logged_and_summed_times_the_weight():
    totals, components = scorer(two_parts, ok, weights=[2.0, 1.0]).rewards(PROMPTS, COMPLETIONS, {})
    assert components == {"fmt": [1.0] * 4, "num": [1.0, 0.0, 1.0, 0.0], "ok": [1.0] * 4}
    assert totals == [2.0 * (1.0 + n) + 1.0 for n in components["num"]]
    totals, components = scorer(PartsModule().reward).rewards(PROMPTS, COMPLETIONS, {})
    assert components == {"fmt": [0.5] * 4, "num": [1.0] * 4}  # the override's, by name
    assert totals == [1.5] * 4


def test_a_bad_component_names_the_reward_and_the_component():
    def bad_part(prompts, completions, **columns):
        return {"fmt": [1.0] * len(completions), "num": [None] * len(completions)}

    with pytest.raises(RewardError, match="reward 'bad_part' component 'num' returned None for"):
        scorer(bad_part).rewards(PROMPTS, COMPLETIONS, {})
    with pytest.raises(RewardError, match="component named 'fmt', a name another reward"):
        scorer(two_parts, PartsModule().reward).rewards(PROMPTS, COMPLETIONS, {})
    with pytest.raises(RewardError, match="returned an empty dict"):
        scorer(lambda p, c, **k: {}).rewards(PROMPTS, COMPLETIONS, {})


def test_zero_scores_each_known_component_of_a_failing_call_0():
    calls = []

    def flaky_parts(prompts, completions, **columns):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("down")
        return two_parts(prompts, completions)

    s = scorer(flaky_parts, on_error="zero")
    s.rewards(PROMPTS, COMPLETIONS, {})
    with pytest.warns(RuntimeWarning, match="reward 'flaky_parts' raised RuntimeError: down"):
        totals, components = s.rewards(PROMPTS, COMPLETIONS, {})
    assert components == {"fmt": [0.0] * 4, "num": [0.0] * 4} and totals == [0.0] * 4
    assert s.take_failures() == {"flaky_parts": 1}


# ---- a reward that fails on every call stops the run -----------------------------------------
def test_end_iteration_stops_after_iterations_whose_every_call_failed():
    fail = {"now": True}

    def broken(prompts, completions, **columns):
        if fail["now"]:
            raise KeyError(f"answer {len(completions)}")
        return [1.0] * len(completions)

    s = scorer(ok, broken, on_error="zero")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(STOP_AFTER_FAILED_ITERATIONS - 1):  # two failed iterations, then one good
            s.rewards(PROMPTS, COMPLETIONS, {})
            assert s.end_iteration() == {"ok": 0, "broken": 1}
        fail["now"] = False
        s.rewards(PROMPTS, COMPLETIONS, {})
        fail["now"] = True
        s.rewards(PROMPTS[:2], COMPLETIONS[:2], {})  # one good call in the iteration: no streak
        assert s.end_iteration() == {"ok": 0, "broken": 1}
        for i in range(STOP_AFTER_FAILED_ITERATIONS - 1):
            s.rewards(PROMPTS[: 4 - (i == 0)], COMPLETIONS[: 4 - (i == 0)], {})
            s.end_iteration()
        s.rewards(PROMPTS, COMPLETIONS, {})
        s.rewards(PROMPTS, COMPLETIONS, {})
        s.rewards(PROMPTS, COMPLETIONS, {}, count=False)  # not counted: no call of the run
        with pytest.raises(RewardError) as caught:
            s.end_iteration()
    message = str(caught.value)
    assert (
        f"reward 'broken' failed on every call for {STOP_AFTER_FAILED_ITERATIONS} iterations"
        in (message)
    )
    assert "raised KeyError: 'answer 3'" in message  # the streak's first failure


# ---- the settings ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["skip", "Zero", None, 0])
def test_bad_reward_on_error_is_refused_at_construction(tiny_llama_path, value):
    with pytest.raises(ValueError, match="reward_on_error must be .*'raise'.*'zero'"):
        RLModule(model=tiny_llama_path, reward_on_error=value)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "300", True])
def test_bad_reward_timeout_is_refused_at_construction(tiny_llama_path, value):
    with pytest.raises(ValueError, match="reward_timeout_s must be a finite number of seconds"):
        RLModule(model=tiny_llama_path, reward_timeout_s=value)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_reward_workers_is_refused_at_construction(tiny_llama_path, value):
    with pytest.raises(ValueError, match="reward_workers must be an integer >= 0"):
        RLModule(model=tiny_llama_path, reward_workers=value)


def test_good_reward_settings_are_accepted(tiny_llama_path):
    RLModule(model=tiny_llama_path, reward_timeout_s=None, reward_on_error="zero")
    RLModule(model=tiny_llama_path, reward_timeout_s=2)
    with pytest.raises(ValueError, match="reward_on_error"):
        scorer(ok, on_error="ignore")


# ---- the module's settings reach its scorer ----------------------------------------------------
@pytest.mark.parametrize("on_error", ["zero", "raise"])
def test_the_module_cuts_a_hanging_reward_off_at_its_timeout(tiny_llama_path, on_error):
    """``RLModule(reward_timeout_s=..., reward_on_error=...)``: the scorer its set-up builds
    stops a reward call that hangs at the module's timeout (its pool worker killed), and
    handles it as the module's ``reward_on_error`` says."""
    module = RLModule(
        model=tiny_llama_path,
        reward_funcs=[ok, hangs],
        reward_timeout_s=0.5,
        reward_on_error=on_error,
    )
    module.setup("fit")
    try:
        if on_error == "raise":
            with pytest.raises(RewardTimeoutError, match="hangs' did not return within .*=0.5 s"):
                module.scorer.rewards(PROMPTS, COMPLETIONS, {})
        else:
            with pytest.warns(RuntimeWarning, match="=0.5 s .* worker process killed"):
                totals, components = module.scorer.rewards(PROMPTS, COMPLETIONS, {})
            assert components == {"ok": [1.0] * 4, "hangs": [0.0] * 4} and totals == [1.0] * 4
            assert module.scorer.take_failures() == {"ok": 0, "hangs": 1}
    finally:
        module.teardown("fit")


# ---- a training run ------------------------------------------------------------------------------
class LogRecordingModule(SGDModule):
    """Records what the module logs (``self.log``): (step, name, value)."""

    def on_fit_start(self) -> None:
        self.logged: list[tuple[int, str, float]] = []

    def log(self, name, value, *args, **kwargs):
        self.logged.append((self.trainer.global_step, name, float(value)))
        super().log(name, value, *args, **kwargs)


def test_training_run_with_a_failing_reward_finishes_and_logs_the_exact_count(tiny_llama_path):
    """3 iterations of 3 groups of 4: the reward raises on every other group call (the
    set-up probe, 2 completions, aside). The run finishes; the failed groups' rewards are 0;
    the logged failure counts sum to the number of calls that raised."""
    failed = []
    group_calls = []

    def sometimes_fails(prompts, completions, **columns):
        if len(completions) == 4:  # a training group (the probe has 2 completions)
            group_calls.append(prompts[0])
            if len(group_calls) % 2 == 0:
                failed.append(prompts[0])
                raise KeyError("answer")
        return [len(c) / 10.0 + 0.1 for c in completions]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _, module, _ = train(
            tiny_llama_path,
            steps=3,
            module_cls=LogRecordingModule,
            reward_funcs=[sometimes_fails],
            reward_on_error="zero",
            reward_timeout_s=60,
        )
    assert module.trainer.global_step == 3
    assert len(group_calls) == 9 and len(failed) == 4
    per_step = [v for _, name, v in module.logged if name == "rewards/failures"]
    per_reward = [v for _, name, v in module.logged if name == "rewards/sometimes_fails/failures"]
    assert len(per_step) == 3  # logged every iteration, zeros included
    assert sum(per_step) == len(failed) and per_reward == per_step
    assert per_step == [1.0, 2.0, 1.0]  # calls 2 | 4, 6 | 8 of 3 groups per iteration
    groups = module.last_iteration.groups
    zeroed = [g for g in groups if g.prompt in failed]
    assert len(zeroed) == 1 and zeroed[0].reward_components["sometimes_fails"] == [0.0] * 4
    assert all(r > 0 for g in groups if g not in zeroed for r in g.rewards)


def test_math_example_scores_in_the_reward_thread(monkeypatch):
    """examples/math_rewards.py's math-verify call works off the main thread (its signal-based
    timeouts would raise there, and every completion would score 0)."""
    pytest.importorskip("math_verify")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    from math_rewards import math_correct

    s = scorer(math_correct, timeout=60)
    completions = ["The answer is \\boxed{4}.", "It is 5."]
    _, components = s.rewards(["2+2?"] * 2, completions, {"solution": ["4", "4"]})
    assert components["math_correct"] == [1.0, 0.0]
