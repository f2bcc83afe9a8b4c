"""Two training ranks (DDP and FSDP2 on CPU, gloo) equal one rank over the same prompts.

The 2-rank fits run in one script, ``distributed_runs.py``, which Lightning's DDP launcher
starts twice (rank 0 and rank 1); rank 0 drives one (or two) real HF rollout workers for both
ranks, on one local loopback Ray that rank 0 starts once and every fit joins. Each 2-rank run
trains ``BATCH`` prompts per rank and iteration; the reference is a 1-rank run with
``2 x BATCH`` prompts per iteration, in this process. Every comparison is of the parameters
after the run, within ``RANKS_TOLERANCE`` (the two runs sum the same per-sequence gradients in
different orders and average over ranks).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_runs import BATCH, LORA
from rl_helpers import max_diff, train

from periodic_rl.strategies import PeriodicAsyncDDPStrategy, RolloutStrategy

SCRIPT = Path(__file__).with_name("distributed_runs.py")
RANKS_TOLERANCE = 1e-5
runs = pytest.mark.two_rank_runs


def selected_runs(session: pytest.Session) -> list[str]:
    """The fits the selected tests read (their ``two_rank_runs`` marks), in a fixed order."""
    wanted = {
        run
        for item in session.items
        for mark in item.iter_markers("two_rank_runs")
        for run in mark.args
    }
    order = ["full-overlap", "lora-overlap", "kill", "resume"]
    order += ["fsdp-overlap", "stale1-overlap", "budget1-overlap"]
    return [run for run in [*order, "stale"] if run in wanted]  # stale last: its fit fails


@pytest.fixture(scope="module")
def two_rank_runs(tiny_llama_path, tmp_path_factory, request) -> Path:
    """The 2-rank fits the selected tests need, in one launch of the script (all of them:
    ~2 min on 2 cores; ~10 s per fit after the first, most of it starting the rollout workers:
    the fits share one Ray)."""
    out = tmp_path_factory.mktemp("two-ranks")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), tiny_llama_path, str(out), *selected_runs(request.session)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if done.returncode != 0:
        pytest.fail(f"the 2-rank script failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return out


def result(out: Path, run: str) -> dict:
    return torch.load(out / f"{run}.pt", weights_only=False)


def seen(out: Path, run: str, rank: int) -> dict:
    return json.loads((out / f"{run}-rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def one_rank(tiny_llama_path):
    """1-rank references over the same 2 x BATCH prompts per iteration, by (lora, steps)."""
    cache: dict[tuple[bool, int], dict[str, torch.Tensor]] = {}

    def get(lora: bool, steps: int = 3, staleness: int = 0) -> dict[str, torch.Tensor]:
        if (lora, steps, staleness) not in cache:
            kwargs = {"lora": LORA} if lora else {}
            strategy = {"engine": "hf", "use_ray": False, "overlap": False}
            cache[lora, steps, staleness] = train(
                tiny_llama_path,
                steps=steps,
                batch_size=2 * BATCH,
                strategy={**strategy, "max_staleness": staleness},
                **kwargs,
            )[0]
        return cache[lora, steps, staleness]

    return get


def assert_equal_params(got: dict, expected: dict, what: str) -> None:
    assert sorted(got) == sorted(expected), what
    diff = max_diff(got, expected)
    assert diff <= RANKS_TOLERANCE, f"{what}: parameters differ by {diff:.3g}"


@pytest.mark.parametrize(
    "run",
    [pytest.param(r, marks=runs(r)) for r in ("full-overlap", "lora-overlap")],
)
def test_two_ddp_ranks_equal_one_rank(two_rank_runs, one_rank, run):
    outcome = result(two_rank_runs, run)
    assert outcome["error"] is None
    assert_equal_params(outcome["params"], one_rank(run.startswith("lora")), run)
    assert max_diff(outcome["params"], one_rank(run.startswith("lora"), 0)) > 1e-3  # it trained


@runs("full-overlap")
def test_each_rank_trains_on_its_own_groups(two_rank_runs):
    """Rank r trains on prompts r*BATCH .. (r+1)*BATCH-1 of every iteration, each once."""
    for rank in (0, 1):
        groups = seen(two_rank_runs, "full-overlap", rank)["groups"]
        expected = {(step, rank * BATCH + i) for step in range(3) for i in range(BATCH)}
        assert sorted(map(tuple, groups)) == sorted(expected)


@runs("full-overlap")
def test_a_two_rank_run_listens_on_loopback_only(two_rank_runs):
    """Mid-run, no process of the run (both ranks' rendezvous and gloo connections, the Ray
    that rank 0 started for all the fits, the rollout workers) listens beyond loopback."""
    from periodic_rl.compat.torch_distributed import is_loopback

    addresses = [
        ip for rank in (0, 1) for ip in seen(two_rank_runs, "full-overlap", rank)["listening"]
    ]
    assert addresses, "no listening socket found: the check would prove nothing"
    assert [ip for ip in addresses if not is_loopback(ip)] == []


@runs("full-overlap")
def test_held_out_evaluation_runs_on_every_rank_alike(two_rank_runs):
    """Rank 0 generates the held-out completions and broadcasts them: every rank logs the same
    evaluation, before the first and after the last iteration."""
    histories = [seen(two_rank_runs, "full-overlap", rank)["eval"] for rank in (0, 1)]
    assert [h["tag"] for h in histories[0]] == ["start", "end"]
    assert histories[0] == histories[1]


@runs("lora-overlap")
def test_lora_pushes_the_base_once_then_adapters(two_rank_runs):
    assert result(two_rank_runs, "lora-overlap")["push_counts"] == {
        "full": 0,
        "base+adapter": 1,
        "adapter": 3,
    }


@runs("stale")
def test_every_rank_refuses_a_stale_group(two_rank_runs):
    """After step 1 the workers get other weights than the policy's under the right version
    number: both ranks (each checking its own groups against the broadcast fingerprint) refuse
    the groups of iteration 1, before training on any of them."""
    for rank in (0, 1):
        record = seen(two_rank_runs, "stale", rank)
        assert record["refused"], f"rank {rank} trained on a stale group"
        assert "version 1" in record["refused"][0] and "policy is version 1" in record["refused"][0]
        assert "StaleRolloutError" in record["error"]
        assert all(step == 0 for step, _ in record["groups"])


@runs("kill")
def test_worker_killed_mid_iteration_gives_the_fault_free_update(two_rank_runs, one_rank):
    outcome = result(two_rank_runs, "kill")
    assert outcome["error"] is None
    assert outcome["first_from"] == 1  # worker 0 was held: it still had its calls when it died
    assert outcome["resent"] >= 1 and outcome["restarted"] == 1
    assert_equal_params(outcome["params"], one_rank(False), "worker killed")


@runs("resume")
def test_resume_from_2_equals_4_iterations(two_rank_runs, one_rank):
    """Two synchronous iterations on two ranks, a checkpoint, then two overlapped ones resumed
    from it: the update of one rank's four uninterrupted iterations (so the two-rank
    synchronous path is checked here too)."""
    first = result(two_rank_runs, "resume-first")
    resumed = result(two_rank_runs, "resume")
    assert first["error"] is None and resumed["error"] is None
    assert seen(two_rank_runs, "resume", 1)["version"] == 4
    assert_equal_params(first["params"], one_rank(False, 2), "two synchronous ranks")
    assert_equal_params(resumed["params"], one_rank(False, 4), "resumed")


@runs("fsdp-overlap")
def test_two_fsdp_ranks_equal_one_rank(two_rank_runs, one_rank):
    """FSDP2 (fully_shard on gloo): sharded training, pushes gathered onto rank 0."""
    outcome = result(two_rank_runs, "fsdp-overlap")
    assert outcome["error"] is None
    assert_equal_params(outcome["params"], one_rank(False), "fsdp")


@runs("stale1-overlap")
def test_bounded_staleness_on_two_ranks_equals_one_rank(two_rank_runs, one_rank):
    """k = 1 on two ranks: every rank's iteration j trains on groups of version max(0, j - 1)
    (rank 1 checks them against the fingerprints rank 0 sends), evaluation pauses the
    pipeline on both, and the update equals the one-rank k = 1 run's."""
    outcome = result(two_rank_runs, "stale1-overlap")
    assert outcome["error"] is None
    for rank in (0, 1):
        record = seen(two_rank_runs, "stale1-overlap", rank)
        assert record["error"] is None and record["version"] == 3
        assert sorted({tuple(v) for v in record["versions"]}) == [(0, 0), (1, 0), (2, 1)]
        assert [h["tag"] for h in record["eval"]] == ["start", "end"]
    assert_equal_params(outcome["params"], one_rank(False, 3, staleness=1), "stale1")
    assert max_diff(outcome["params"], one_rank(False, 3)) > 1e-4  # not the on-policy update


@runs("budget1-overlap")
def test_a_schedule_switch_on_rank_0_is_applied_on_every_rank(two_rank_runs):
    """``asynchrony: {max_staleness: 1}``, rank 0's chooser scripted to switch to k = 1 from
    iteration 2: both ranks train iteration 3 on groups of version 2 (generated ahead) and
    accept them, and iteration 2 on version 2 (the switch never makes a group older than the
    weights out at the switch)."""
    outcome = result(two_rank_runs, "budget1-overlap")
    assert outcome["error"] is None
    for rank in (0, 1):
        record = seen(two_rank_runs, "budget1-overlap", rank)
        assert record["error"] is None and record["version"] == 4
        versions = sorted({tuple(v) for v in record["versions"]})
        assert versions == [(0, 0), (1, 1), (2, 2), (3, 2)], rank


def test_strategies_are_rollout_strategies():
    strategy = PeriodicAsyncDDPStrategy(engine="hf", num_workers=1)
    assert isinstance(strategy, RolloutStrategy)
    assert strategy.rollouts.backend is None  # nothing starts before Trainer.fit
