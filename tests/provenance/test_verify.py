"""verify: a configuration trained as configured (overlapped, Ray workers) and in the reference
mode (synchronous, one worker) agrees, the demo's own YAML among them; with overlap broken on
purpose (a strategy that loses a group when it overlaps) ``periodic-rl verify`` exits 1 naming
the group."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import yaml

from periodic_rl import PeriodicAsyncStrategy
from periodic_rl.cli import main
from periodic_rl.provenance import verify
from periodic_rl.provenance.verify import RunResult, compare

pytestmark = pytest.mark.usefixtures("local_ray")
DEMO = Path(__file__).resolve().parents[2] / "examples" / "arithmetic.yaml"


class LosesAGroupWhenOverlapped(PeriodicAsyncStrategy):
    """Overlap broken on purpose: overlapped, iteration 1 trains without its group 1."""

    def rollout_micro_batches(self, request, micro_batch_size, ahead=()):
        batches = super().rollout_micro_batches(request, micro_batch_size, ahead)
        if not self.rollouts.options.overlap or self.policy_version != 1:
            return batches

        def without_group_1():
            for groups in batches:
                kept = [g for g in groups if g.index != 1]
                if kept:
                    yield kept

        return without_group_1()


def config(model_path: str, strategy: str = "periodic_rl.PeriodicAsyncStrategy") -> dict:
    return {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 30,  # verify trains its own number of iterations
            "strategy": {
                "class_path": strategy,
                "init_args": {"engine": "hf", "num_workers": 1, "overlap": True},
            },
        },
        "model": {
            "class_path": "periodic_rl.RLModule",
            "init_args": {
                "model": model_path,
                "num_generations": 4,
                "micro_batch_size": 4,
                "max_new_tokens": 6,
                "learning_rate": 1e-2,
                "temperature": 0.7,
                "reward_funcs": ["rl_helpers.length_reward"],
                "shared_prompt": False,
            },
        },
        "data": {
            "class_path": "periodic_rl.PromptDataModule",
            "init_args": {"batch_size": 2, "num_train": 16, "num_val": 4},
        },
    }


def test_overlapped_agrees_with_the_reference(tiny_llama_path):
    verdict = verify(config(tiny_llama_path), iterations=2)
    assert verdict.agree, verdict.table()
    assert verdict.configured.startswith("overlap=True") and "overlap=False" in verdict.reference
    assert verdict.versions == [[0], [1]]
    assert verdict.max_difference <= 1e-5
    assert "verdict: AGREE" in verdict.table()


@pytest.mark.vllm
@pytest.mark.pretrained
def test_the_demo_configuration_agrees(smollm2_path, capsys, monkeypatch):
    """``periodic-rl verify`` on the demo's own YAML (SmolLM2-135M, a vLLM worker on its own
    core, overlapped), two iterations: exit status 0, the same groups and the same parameters.
    In both runs every group of iteration *i* carries version *i* and the one fingerprint the
    vLLM worker reported for the weights it loaded; the weights moved between the iterations
    and from the pretrained ones."""
    from periodic_rl.models import load_causal_lm

    verify_module = importlib.import_module("periodic_rl.provenance.verify")  # not the function

    runs: list[RunResult] = []
    train = verify_module.train

    def kept(config, mode):
        runs.append(train(config, mode))
        return runs[-1]

    monkeypatch.setattr(verify_module, "train", kept)
    main(["verify", "--config", str(DEMO), "--iterations", "2"])  # returns: exit status 0
    out = capsys.readouterr().out
    assert "verdict: AGREE" in out
    assert "versions seen per iteration                   [0]; [1]" in out
    assert "groups alike, weights apart in the last bits  0" in out

    configured, reference = runs
    assert configured.mode.startswith("overlap=True") and reference.mode.startswith("overlap=F")
    fingerprints = []
    for run in runs:
        assert [sorted(groups) for groups in run.groups] == [[0, 1, 2, 3]] * 2
        per_iteration = []
        for version, groups in enumerate(run.groups):
            assert {stamp[1] for stamp in groups.values()} == {version}
            (fingerprint,) = {stamp[2] for stamp in groups.values()}
            per_iteration.append(fingerprint)
        assert per_iteration[0] != per_iteration[1]  # the step's weights were pushed
        fingerprints.append(per_iteration)
    assert fingerprints[0] == fingerprints[1]
    pretrained = dict(load_causal_lm(smollm2_path, dtype=torch.float32).named_parameters())
    moved = max((configured.parameters[n] - pretrained[n]).abs().max().item() for n in pretrained)
    assert 0 < moved < 1.0


def test_broken_overlap_exits_1_naming_the_group(tiny_llama_path, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    broken = config(tiny_llama_path, f"{__name__}.LosesAGroupWhenOverlapped")
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--config", str(path), "--iterations", "2"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert "iteration 1 group 1: trained in one run only" in out
    assert "verdict: DIFFER" in out


def test_a_bad_configuration_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"strategy": "periodic_async"}}))
    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--config", str(path)])
    assert exit_.value.code == 2


def test_parameters_beyond_the_tolerance_disagree_with_the_same_groups():
    """The same groups, parameters 1e-3 apart: the verdict is the tolerance's."""
    groups = [{0: (((1, 2),), 0, "f0")}, {0: (((3,),), 1, "f1")}]
    a = RunResult("a", {"w": torch.zeros(4)}, groups, [0.0, 0.0])
    b = RunResult("b", {"w": torch.full((4,), 1e-3)}, groups, [0.0, 0.0])
    assert not compare(a, b, tolerance=1e-5).agree
    assert compare(a, b, tolerance=1e-2).agree
    assert compare(a, b, tolerance=1e-5).max_difference == pytest.approx(1e-3)
