"""Run untrusted Python (a policy's generated code) in a limited subprocess, for code rewards.

:func:`run_python` starts ``sys.executable -I -S`` (isolated mode, no site-packages: the code gets
the standard library only) in a fresh temporary directory, removed afterwards, with a minimal
environment (``PATH``, ``LANG``, ``HOME``/``TMPDIR`` = that directory: no inherited secrets),
stdin from a file or ``/dev/null``, and stdout/stderr captured to files of which the first
``max_output_bytes`` are read back. A small bootstrap, trusted code run before the user's, sets:

* limits: CPU time (``RLIMIT_CPU``: SIGXCPU, then SIGKILL a second later), address space
  (``RLIMIT_AS``: allocations fail, Python raises ``MemoryError``), size of any written file
  (``RLIMIT_FSIZE``: Python ignores SIGXFSZ, so the write raises ``OSError: File too large``; this
  bounds stdout/stderr too), no core files; the parent kills everything at ``timeout_s`` (wall).
* isolation, where the kernel lets an unprivileged process create user namespaces (checked each
  run, reported as ``network_isolated``): new user + network + PID namespaces. The network
  namespace has only a loopback that is down, so nothing can connect anywhere, including the
  host's 127.0.0.1. In the PID namespace the bootstrap is process 1 and the code process 2; when
  process 1 exits (the code ended, or the parent killed it), the kernel kills every process left
  in the namespace, daemonized or not, so forked children cannot outlive the run.
* otherwise a *fallback*, ``network_isolated=False``, in an interpreter that never imported
  ``ctypes``: a ``sys.addaudithook`` hook refuses socket creation/connect/bind/DNS, process
  creation (``os.fork``/``exec*``/``system``/``posix_spawn``, ``subprocess``), signals to any
  other process (``os.kill``, ``os.killpg``, ``signal.pthread_kill``; the unaudited
  ``os.pidfd_open`` and ``signal.pidfd_send_signal`` are removed), changing limits
  (``resource.setrlimit``/``prlimit``: root could raise its own) and ``ctypes``. It only covers
  what the Python interpreter audits (a fresh copy of a builtin module brings the pidfd functions
  back), so where the kernel has Landlock ABI 6 (Linux >= 6.12) the code also runs in a Landlock
  domain: no signal, ``ptrace`` (``/proc/<pid>/mem``, ``pidfd_getfd``) or abstract Unix socket
  reaches a process outside the sandbox, however it is called. Without Landlock it is a guard
  against accidents and ordinary model outputs, not against an adversary; with it, the file
  system is still the user's. Run such code in a container or VM.
* process count: in a user namespace ``RLIMIT_NPROC`` counts the namespace's processes only (on
  kernels >= 5.14), but it never applies to root; when the parent runs as root and may create a
  cgroup (v1 ``pids`` hierarchy or v2), the run gets one with ``pids.max``. Without either, a fork
  bomb is still bounded in time (wall kill, PID namespace) but not in count.

What the result says comes from the parent's own observation or from trusted code, never from
the code under test: ``wait4`` on the child gives the CPU time and, in the fallback, the exit
status; the bootstrap reports ``isolated`` before any untrusted code runs, and with namespaces
the PID namespace's supervisor reports the code's exit status. They write to a Unix socket
(unlike a pipe, it cannot be reopened through ``/proc/<pid>/fd``) that the code's process closes
before it runs the code; anything on it beyond that protocol raises :class:`SandboxBreach`.

The child always runs in its own session (``start_new_session``); at the limit or on exit the
parent kills that process group and every descendant psutil finds. The code runs as the caller's
user (it can read what that user can read): this is not a filesystem sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["SandboxBreach", "SandboxResult", "run_python", "run_tests"]

_USE_NAMESPACES = True  # tests set this False to exercise the audit-hook fallback
_CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")
_MEMORY_EXIT = 121  # the bootstrap's exit status for an uncaught MemoryError
_PROTOCOL = re.compile(  # the whole status channel, as the trusted writers send it
    rb'(?:\{"isolated": false\}\n'
    rb'|\{"isolated": (?P<isolated>true)\}\n(?:\{"returncode": (?P<returncode>-?\d+)\}\n)?)?'
)

_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))

_HARNESS = r"""
import io, json, sys, traceback
out, sys.stdout, ns, passed = sys.stdout, io.StringIO(), {"__name__": "__main__"}, 0
try:
    tests = json.load(open("tests.json"))
    exec(compile(open("solution.txt").read(), "solution.py", "exec"), ns)
except BaseException:
    traceback.print_exc()
else:
    for test in tests:
        try:
            exec(compile(test, "test", "exec"), ns)
            passed += 1
        except BaseException:
            traceback.print_exc()
out.write("TOKEN %d\n" % passed)
"""


class SandboxBreach(RuntimeError):
    """The status channel carried what no trusted process wrote: the code got out of its limits."""


@dataclass(frozen=True)
class _Status:
    """What trusted processes reported: ``isolated``, and the supervisor's ``returncode``."""

    isolated: bool
    returncode: int | None


@dataclass(frozen=True)
class SandboxResult:
    """How a :func:`run_python` run ended.

    ``returncode`` is the code's exit status, ``-N`` when signal N killed it, ``None`` when the
    wall limit did. ``killed_by`` is ``"wall"``, ``"cpu"`` (RLIMIT_CPU), ``"memory"`` (an
    uncaught ``MemoryError``) or ``None``. ``truncated``: stdout or stderr was longer than
    ``max_output_bytes`` and was cut. An uncaught ``MemoryError`` reads as ``returncode=1``
    (the bootstrap ends such a run with exit status 121: code that exits with 121 itself, like
    code that raises ``MemoryError`` itself, reads as ``killed_by="memory"`` too).
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_by: str | None
    network_isolated: bool
    duration_s: float
    truncated: bool = False


def run_python(
    code: str,
    *,
    stdin: str | None = None,
    timeout_s: float = 10.0,
    cpu_s: int = 5,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    max_file_mb: int = 16,
    max_processes: int = 64,
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh directory with ``files`` beside it, under limits."""
    root = Path(tempfile.mkdtemp(prefix="periodic_rl_sandbox_"))
    cgroup = _make_cgroup(root.name, max_processes) if os.geteuid() == 0 else None
    channel, child_end = socket.socketpair()
    try:
        work = root / "work"
        work.mkdir()
        for name, text in {**(files or {}), "main.py": code}.items():
            path = (work / name).resolve()
            if work.resolve() not in path.parents:
                raise ValueError(f"sandbox file {name!r} is outside the working directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        (root / "stdin").write_text(stdin or "", encoding="utf-8")
        config = {
            "status_fd": child_end.fileno(),
            "stage": "start",
            "memory_exit": _MEMORY_EXIT,
            "cgroup": cgroup,
            "namespaces": _USE_NAMESPACES,
            "cpu_s": int(cpu_s),
            "memory_mb": int(memory_mb),
            "max_file_mb": int(max_file_mb),
            "max_processes": int(max_processes),
        }
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}
        start = time.monotonic()
        with (
            open(root / "stdin", "rb") as fin,
            open(root / "stdout", "wb") as fout,
            open(root / "stderr", "wb") as ferr,
        ):
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _CHILD, json.dumps(config)],
                cwd=work,
                env=env,
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                pass_fds=(child_end.fileno(),),
                start_new_session=True,
            )
        child_end.close()
        timed_out = not _wait_unreaped(proc.pid, start + timeout_s)
        exit_code, cpu_used = _kill_tree(proc)
        duration = time.monotonic() - start
        status = _read_status(channel)
        stdout, cut_out = _read_capped(root / "stdout", max_output_bytes)
        stderr, cut_err = _read_capped(root / "stderr", max_output_bytes)
    finally:
        channel.close()
        child_end.close()
        if cgroup:
            _remove_cgroup(cgroup)
        shutil.rmtree(root, ignore_errors=True)
    returncode = status.returncode if status.isolated else exit_code
    killed_by = None
    if timed_out:
        returncode, killed_by = None, "wall"
    elif returncode == _MEMORY_EXIT:
        returncode, killed_by = 1, "memory"
    elif returncode in (-signal.SIGXCPU, -signal.SIGKILL) and cpu_used >= cpu_s / 2:
        # rusage can read well under the clock RLIMIT_CPU uses (loaded VMs): half is margin enough
        killed_by = "cpu"
    return SandboxResult(
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        killed_by=killed_by,
        network_isolated=status.isolated,
        duration_s=duration,
        truncated=cut_out or cut_err,
    )


def run_tests(code: str, tests: Sequence[str], **limits: object) -> float:
    """The fraction of ``tests`` (statements such as ``assert f(2) == 4``) that pass after ``code``.

    One :func:`run_python` run (``limits`` are its keywords): the code's top level, then each test
    in the same namespace; any exception (``SystemExit`` included) fails that test, an exception
    in the code fails all. The count is printed after a random token, so code that exits early
    (``sys.exit(0)``, ``os._exit``) or is killed scores 0. Code that inspects the interpreter
    could still forge the line: the sandbox protects the machine, not the reward's integrity.
    """
    if not tests:
        raise ValueError("run_tests needs at least one test")
    harness = _HARNESS.replace("TOKEN", token := secrets.token_hex(16))
    files = {"solution.txt": code, "tests.json": json.dumps(list(tests))}
    result = run_python(harness, files=files, **limits)  # type: ignore[arg-type]
    for line in result.stdout.splitlines():
        if line.startswith(token + " "):
            return int(line.split()[1]) / len(tests)
    return 0.0


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` exits without reaping it, so its process group id stays ours to kill."""
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.01)
    return False


def _kill_tree(proc: subprocess.Popen) -> tuple[int, float]:
    """SIGKILL the child's process group and every descendant still attached to it; reap it.

    Returns the child's exit code (``-N`` for signal N) and the CPU seconds it and the
    descendants it waited for used.
    """
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the group of the (unreaped) child: still its id
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()  # psutil checks the process is the one it saw (no pid reuse)
    _, wait_status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(wait_status)  # reaped here, not by Popen
    psutil.wait_procs(descendants, timeout=5)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _read_status(channel: socket.socket) -> _Status:
    """Parse the status channel, which carries exactly what the trusted writers send, or nothing.

    ``{"isolated": ...}`` from the bootstrap, then with namespaces the supervisor's
    ``{"returncode": N}`` (absent when the run was killed first). Nothing at all: the bootstrap
    died before its first report, so nothing ran isolated.
    """
    channel.setblocking(False)  # a writer that escaped the kill must not block the parent
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := channel.recv(65536):
            chunks.append(chunk)
    data = b"".join(chunks)
    match = _PROTOCOL.fullmatch(data)
    if match is None:
        raise SandboxBreach(
            f"sandbox: the status channel carried {data[:200]!r}, which no trusted process "
            "writes: the code under test reached it. Do not trust this run; run such code in a "
            "container or VM"
        )
    returncode = match["returncode"]
    return _Status(
        isolated=match["isolated"] is not None,
        returncode=None if returncode is None else int(returncode),
    )


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode(errors="replace"), len(data) > limit


def _make_cgroup(name: str, max_processes: int) -> str | None:
    """A pids cgroup limited to ``max_processes`` (root only, where cgroupfs is writable)."""
    for base in _CGROUP_ROOTS:
        path = os.path.join(base, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            if os.path.exists(os.path.join(path, "cgroup.procs")):  # not a plain directory
                Path(path, "pids.max").write_text(str(max_processes))
                return path
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.rmdir(path)
    return None


def _remove_cgroup(path: str) -> None:
    for _ in range(100):  # killed processes leave the cgroup a moment after they are reaped
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
