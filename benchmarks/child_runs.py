"""Running one measurement in a fresh child process, on a machine as quiet as it gets.

A benchmark's parent waits for quiet (:func:`wait_for_quiet`), runs each configuration as
``script --child FILE`` (:func:`run_child`: the machine settled first, the process tree's memory
watched, what it left running reaped after) and reads the result back. Nothing here imports
torch or vLLM.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import load_average  # the benchmarks folder is on sys.path (not a package)


def other_benchmarks() -> list[str]:
    """Command lines of other benchmarks' measurement processes running now (a process whose
    arguments name a ``benchmarks/*.py`` script and ``--child``, the convention of this folder),
    excluding this process and its parent."""
    mine = {os.getpid(), os.getppid()}
    found = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid in mine:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        script = any("benchmarks/" in a and a.endswith(".py") for a in args)
        if script and "--child" in args:
            found.append(" ".join(args)[:160])
    return found


def wait_for_quiet(
    max_load: float, max_wait_s: float, poll_s: float = 15.0, log=print
) -> dict[str, Any]:
    """Wait until the 1-minute load average is at most ``max_load`` and no other benchmark is
    measuring (:func:`other_benchmarks`), or until ``max_wait_s`` passed.

    Other processes (a test suite, another benchmark) on a 2-core machine distort timings. This
    waits a little for them rather than measuring their noise; what it saw is returned so that
    the result file can say how quiet the machine was. Two benchmarks waiting for the same quiet
    moment would start together: after the machine looks quiet, a random pause of up to
    ``poll_s`` seconds and a second look let the later one see the other's measurement.
    """
    began = time.monotonic()
    rng = random.Random(os.getpid())

    def busy() -> tuple[list[float], list[str], bool]:
        load, others = load_average(), other_benchmarks()
        return load, others, bool(others) or (bool(load) and load[0] > max_load)

    load, others, is_busy = busy()
    while time.monotonic() - began < max_wait_s:
        if not is_busy:
            time.sleep(rng.uniform(0.0, poll_s))
            load, others, is_busy = busy()
            if not is_busy:
                break
        reason = f"another benchmark is running ({others[0]})" if others else f"load {load}"
        log(f"{reason}; max load {max_load}: waiting for the machine to quieten ...")
        time.sleep(poll_s)
        load, others, is_busy = busy()
    return {
        "load_average": load,
        "waited_s": round(time.monotonic() - began, 1),
        "quiet": not is_busy,
        "max_load": max_load,
        "other_benchmarks": others,
    }


def idle_priority() -> None:
    """Run the calling thread only when a core is otherwise idle (Linux ``SCHED_IDLE``).

    Reading every process's ``smaps`` for PSS took 6-20% of a core with Ray's dozen processes
    and a 4 GiB trainer; at normal priority the sampler took that from the run it measured,
    more from a run with more processes. Linux applies scheduling to the thread id given."""
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


class TreeMemory:
    """Peak memory of a process and all its descendants, sampled every ``interval`` seconds.

    PSS splits shared pages among the processes mapping them (the sum is what the tree really
    costs); RSS counts them in every process (an upper bound). Ray's GCS and raylet are children
    of the driver and the vLLM actor a child of the raylet, so all of them are in the tree."""

    def __init__(self, pid: int, interval: float = 0.5, gpu: bool = False) -> None:
        import psutil

        self.gpu = gpu
        self.peak_gpu_mib = 0
        self.psutil = psutil
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak_pss = 0
        self.peak_rss = 0
        self.peak_root_rss = 0
        self.peak_by_name: dict[str, int] = {}
        self.max_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        idle_priority()
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except self.psutil.Error:
            return
        pss = rss = 0
        names: dict[str, int] = {}
        for proc in procs:
            try:
                info = proc.memory_full_info()
                name = proc.name()
            except self.psutil.Error:
                continue
            pss += getattr(info, "pss", info.rss)
            rss += info.rss
            names[name] = names.get(name, 0) + getattr(info, "pss", info.rss)
            if proc.pid == self.root.pid:
                self.peak_root_rss = max(self.peak_root_rss, info.rss)
        self.max_processes = max(self.max_processes, len(procs))
        if pss > self.peak_pss:
            self.peak_pss = pss
            self.peak_by_name = names
        self.peak_rss = max(self.peak_rss, rss)
        if self.gpu:  # the whole GPU: meant for a machine that runs nothing else
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                used = max(int(x) for x in out.stdout.split())
                self.peak_gpu_mib = max(self.peak_gpu_mib, used)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        gib = 2**30
        return {
            "peak_tree_pss_gib": round(self.peak_pss / gib, 2),
            "peak_tree_rss_gib": round(self.peak_rss / gib, 2),
            "peak_trainer_rss_gib": round(self.peak_root_rss / gib, 2),
            "at_peak_pss_by_process_gib": {
                k: round(v / gib, 2) for k, v in sorted(self.peak_by_name.items()) if v > 2**26
            },
            "max_processes": self.max_processes,
            **({"peak_gpu_used_gib": round(self.peak_gpu_mib / 1024, 2)} if self.gpu else {}),
        }


def reap_session(sid: int, wait_s: float = 30.0) -> tuple[int, float]:
    """Wait for the processes a finished run left in its session ``sid`` (engine or Ray helpers
    still exiting after the run's process returned) to exit, killing them after ``wait_s``
    seconds, so that the next run starts on a machine with nothing of this one still running.
    Returns how many were left when the run's process exited and the seconds until all were
    gone."""
    import psutil

    def left() -> list[Any]:
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (OSError, psutil.Error):
                continue
        return found

    began = time.monotonic()
    first = left()
    remaining = first
    while remaining and time.monotonic() - began < wait_s:
        time.sleep(0.5)
        remaining = left()
    for proc in remaining:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(remaining, timeout=10)
    return len(first), round(time.monotonic() - began, 1)


def settle(max_busy_percent: float = 20.0, quiet_s: int = 3, max_wait_s: float = 30.0) -> float:
    """Wait until the whole machine's CPU use stays at most ``max_busy_percent`` for ``quiet_s``
    one-second samples in a row (at most ``max_wait_s``): a run that follows another starts on
    an idle machine rather than on the tail of the previous run's work (the load average lags
    by a minute, too slow to tell). Returns the seconds waited."""
    import psutil

    began, quiet = time.monotonic(), 0
    while quiet < quiet_s and time.monotonic() - began < max_wait_s:
        quiet = quiet + 1 if psutil.cpu_percent(interval=1.0) <= max_busy_percent else 0
    return round(time.monotonic() - began, 1)


def run_child(
    script: str | Path,
    config: dict[str, Any],
    timeout: float,
    gpu: bool = False,
    prefix: str = "prl-bench-run-",
) -> dict[str, Any]:
    """One run of ``script --child FILE`` in a fresh interpreter, its process tree's memory
    watched (:class:`TreeMemory`; the whole GPU's too when ``gpu``).

    ``FILE`` holds ``config`` as JSON (it needs a ``"config"`` key); the child writes it back
    with its results added. A run past ``timeout`` seconds is killed with its whole process
    group. When ``FILE`` no longer holds JSON with a ``"config"`` key the result is
    ``{**config, "ok": False, "error": ...}`` with the tail of the log; a child that never
    rewrote ``FILE`` leaves ``config`` itself as the result. Either way the result gets the
    memory peaks, the process time, the exit code, the log tail, the load averages at the start
    and the end, the seconds it waited to settle and the processes it left."""
    settle_s = settle()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        path = Path(tmp) / "run.json"
        path.write_text(json.dumps(config))
        log = Path(tmp) / "log.txt"
        load = load_average()
        began = time.time()
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, str(script), "--child", str(path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout kills the whole tree
            )
            memory = TreeMemory(proc.pid, gpu=gpu)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
        process_s = time.time() - began
        leftovers, reaped_s = reap_session(proc.pid)
        mem = memory.stop()
        text = log.read_text(errors="replace")
        try:
            result = json.loads(path.read_text())
            if "config" not in result:
                raise ValueError("the run wrote no result")
        except (ValueError, json.JSONDecodeError):
            result = {**config, "ok": False, "error": f"exit code {rc}; log tail:\n{text[-3000:]}"}
    result.update(mem)
    result["process_s"] = process_s
    result["settle_s"] = settle_s
    result["leftover_processes"] = leftovers
    result["reaped_s"] = reaped_s
    result["exit_code"] = rc
    result["log_tail"] = text[-1500:]
    result["started_at"] = began
    result["load_at_start"] = load
    result["load_at_end"] = load_average()
    return result
