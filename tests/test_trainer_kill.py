"""The trainer SIGKILLed mid-iteration, then resumed with ``ckpt_path="last"`` in a new process:
the resumed run equals an uninterrupted one (parameters, data position, RNG, policy version,
every checkpoint after the kill), and the killed run leaves no process or /dev/shm file
behind. The fits run as scripts (tests/fault_fit.py) with one Ray rollout worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rl_helpers import max_diff

from periodic_rl.rollout.processes import alive as alive_process
from periodic_rl.rollout.processes import descendants, shm_files

pytest.importorskip("ray")

SCRIPT = Path(__file__).with_name("fault_fit.py")
STEPS, KILLED_AFTER = 3, 1  # killed in iteration 2, after step 1's checkpoint was written


def fit(model: str, root: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, RAY_ADDRESS="")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), model, str(root), str(STEPS), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(run: subprocess.Popen) -> None:
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-4000:]


def wait_for(path: Path, run: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if run.poll() is not None:
            raise AssertionError(f"the fit ended before {path.name}: {run.stderr.read()[-4000:]}")
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.05)


def alive(pids: list[int], within_s: float) -> list[int]:
    """Those of ``pids`` still running (not zombies) after waiting up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        left = [pid for pid in pids if alive_process(pid, None)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def steps(root: Path) -> dict[int, dict]:
    """The last record of each step (a killed iteration is recorded again when resumed)."""
    lines = (root / "steps.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_trainer_killed_mid_iteration_resumes_as_if_never_killed(tiny_llama_path, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run = fit(tiny_llama_path, killed, "--block-at", str(KILLED_AFTER))
    try:
        wait_for(killed / "blocked", run)
        workers = json.loads((killed / "blocked").read_text())
        family = [pid for pid, _ in descendants(run.pid)]  # Ray's processes and the worker
        shm = shm_files([run.pid, *family])
        assert workers and set(workers) <= set(family)
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    killed_at = time.monotonic()
    # The uninterrupted run and the resumed one train while Ray's agents of the killed run exit.
    reference = fit(tiny_llama_path, straight)
    # Generous bounds, not speed requirements. The rollout worker dies with its raylet,
    # which dies with the driver; Ray's two agents (dashboard, runtime env) see the raylet
    # die at once but first try to report it to the dead GCS, which takes about 60 s.
    assert alive(workers, within_s=60) == [], "the killed trainer's rollout worker lives on"
    workers_gone = time.monotonic() - killed_at
    checkpoint = killed / "ckpt" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == KILLED_AFTER
    assert not (killed / "result.pt").exists()  # it really died mid-run
    assert len(steps(killed)) == KILLED_AFTER + 1  # and inside the next iteration

    finish(fit(tiny_llama_path, killed, "--resume"))
    finish(reference)
    assert alive(family, within_s=120) == [], "processes of the killed trainer left running"
    print(f"\nkilled trainer: rollout worker gone within {workers_gone:.1f} s, all "
          f"{len(family)} processes within {time.monotonic() - killed_at:.0f} s; "
          f"/dev/shm files it held: {len(shm)}")  # fmt: skip
    assert [f for f in shm if os.path.exists(f)] == []

    a, b = torch.load(straight / "result.pt"), torch.load(killed / "result.pt")
    assert (b["global_step"], b["policy_version"]) == (STEPS, STEPS)
    assert (a["global_step"], a["policy_version"]) == (STEPS, STEPS)
    assert max_diff(a["params"], b["params"]) == 0.0
    # What each iteration started from: data position (its prompts), torch RNG and policy
    # version, as in the uninterrupted run (the killed iteration's record is the resumed one).
    assert steps(killed) == steps(straight) and len(steps(killed)) == STEPS
    # Every checkpoint written after the kill equals the uninterrupted run's: weights,
    # optimizer, loops (data position), RNG, policy version.
    for step in range(KILLED_AFTER + 1, STEPS + 1):
        name = f"epoch=0-step={step}.ckpt"
        x = torch.load(straight / "ckpt" / name, weights_only=True)
        y = torch.load(killed / "ckpt" / name, weights_only=True)
        for key in ("state_dict", "optimizer_states", "loops", "periodic_rl", "global_step"):
            assert same(x[key], y[key]), f"{name}: {key} differs"
