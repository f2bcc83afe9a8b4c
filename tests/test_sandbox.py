"""periodic_rl.sandbox: untrusted code runs under CPU, memory, wall, file-size and process limits,
without network, in a temporary directory, and leaves no process behind."""

from __future__ import annotations

import importlib.util
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import psutil
import pytest

from periodic_rl import sandbox
from periodic_rl.sandbox import run_python, run_tests

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux rlimits")


def _namespaces_supported() -> bool:
    unshare = shutil.which("unshare")
    return bool(unshare) and subprocess.run([unshare, "-rn", "true"], check=False).returncode == 0


@pytest.fixture(params=["namespaces", "audit_hook"])
def mode(request, monkeypatch):
    """Run the test with user+net+PID namespaces (when the kernel allows) and with the fallback."""
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", request.param == "namespaces")
    return request.param


def _marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def test_normal_code_gets_stdin_files_and_returns_its_stdout():
    result = run_python(
        "import helper\nprint(helper.double(int(input())))",
        stdin="21\n",
        files={"helper.py": "def double(x):\n    return 2 * x\n"},
    )
    assert (result.returncode, result.stdout, result.killed_by) == (0, "42\n", None)
    assert not result.timed_out and not result.truncated


def test_an_exception_is_a_nonzero_returncode_with_its_traceback():
    result = run_python("raise ValueError('boom')")
    assert result.returncode == 1 and "ValueError: boom" in result.stderr


def test_cpu_loop_is_killed_at_the_cpu_limit(mode):
    result = run_python("while True:\n    pass", cpu_s=1, timeout_s=30)
    assert result.killed_by == "cpu" and not result.timed_out
    assert result.returncode is not None and result.returncode < 0


def test_sleeping_code_is_killed_at_the_wall_limit(mode):
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_s=3)
    assert result.killed_by == "wall" and result.timed_out and result.returncode is None
    assert result.stdout == "started\n"


def test_unbounded_allocation_is_a_memory_error_and_the_parent_is_unaffected(mode):
    limit_before = resource.getrlimit(resource.RLIMIT_AS)
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))"
    result = run_python(code + "\nprint('unreached')", memory_mb=256, timeout_s=30)
    assert result.killed_by == "memory" and "MemoryError" in result.stderr
    assert result.returncode == 1 and result.stdout == ""
    assert resource.getrlimit(resource.RLIMIT_AS) == limit_before
    assert len(bytearray(300 * 2**20)) == 300 * 2**20  # the parent still allocates past it


def test_forked_children_and_daemons_do_not_survive_the_run(monkeypatch):
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", True)
    marker = f"SANDBOX_TEST_{uuid.uuid4().hex}"
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(60)  # {marker}']"
    code = (
        "import os, subprocess, sys, time\n"
        f"for _ in range(3):\n    subprocess.Popen({sleeper})\n"
        "if os.fork() == 0:\n    os.setsid()\n"  # a daemon: own session, parent gone
        f"    if os.fork() == 0:\n        os.execv(sys.executable, {sleeper})\n    os._exit(0)\n"
        "time.sleep(0.5)\nprint('spawned', flush=True)\n"
    )
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for extra, killed_by in (("", None), ("time.sleep(60)\n", "wall")):
        result = run_python(code + extra, timeout_s=5)
        assert result.stdout == "spawned\n", result.stderr
        assert result.killed_by == killed_by
        assert _marked_processes(marker) == []
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_the_fallback_refuses_processes_and_ctypes(monkeypatch):
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)
    for code in (
        "import os\nos.fork()",
        "import subprocess",
        "import os\nos.system('true')",
        "import ctypes\nprint(ctypes.CDLL(None).getpid())",
    ):
        result = run_python(code)
        assert result.returncode == 1 and "PermissionError: sandbox:" in result.stderr, code
        assert not result.network_isolated and result.stdout == ""


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version (0 without Landlock): scoped signals need 6."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(0, libc.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1)))


# Run in the code under test: each attempt prints its name and which layer stopped it.
_ATTEMPT = (
    "try:\n    {call}\n    print('{name} done')\n"
    "except AttributeError:\n    print('{name} absent')\n"
    "except PermissionError as e:\n"
    "    print('{name}', 'hook' if str(e).startswith('sandbox:') else 'kernel', e)\n"
)


def _run_attempts(attempts: dict[str, str], victim: subprocess.Popen) -> dict[str, str]:
    code = "import importlib.util, os, resource, signal, threading\n" + "".join(
        _ATTEMPT.format(name=name, call=call) for name, call in attempts.items()
    )
    try:
        result = run_python(code)
        assert victim.poll() is None, "the code under test killed another process"
    finally:
        victim.kill()
        victim.wait()
    return dict(line.split(" ", 2)[:2] for line in result.stdout.splitlines())


def test_the_fallback_hook_refuses_signals_to_other_processes(monkeypatch):
    """The audit hook refuses each signalling call before it reaches the kernel, and the
    unaudited pidfd functions are gone; signalling itself stays allowed."""
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    attempts = {
        "kill": f"os.kill({victim.pid}, signal.SIGKILL)",
        "killpg": f"os.killpg({victim.pid}, signal.SIGKILL)",
        "pidfd_open": f"os.pidfd_open({victim.pid})",
        "pidfd_send": "signal.pidfd_send_signal(0, signal.SIGKILL)",
        "thread": "signal.pthread_kill(threading.get_ident(), signal.SIGKILL)",
        "prlimit": f"resource.prlimit({victim.pid}, resource.RLIMIT_NOFILE, (3, 3))",
        "self": "os.kill(os.getpid(), 0)",
    }
    outcomes = _run_attempts(attempts, victim)
    assert outcomes == {
        **dict.fromkeys(attempts, "hook"),
        "pidfd_open": "absent",
        "pidfd_send": "absent",
        "self": "done",
    }


@pytest.mark.skipif(_landlock_abi() < 6, reason="scoped signals need Landlock ABI 6 (Linux 6.12)")
def test_the_fallback_is_confined_by_the_kernel_where_the_hook_cannot_see(monkeypatch):
    """What the audit hook cannot see, Landlock refuses: a fresh copy of a builtin module has
    the pidfd functions back, and opening another process's memory is not a signal at all."""
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    fresh = "importlib.util.module_from_spec(importlib.util.find_spec('{}'))"
    attempts = {
        "procfd": f"{fresh.format('_signal')}.pidfd_send_signal("
        f"os.open('/proc/{victim.pid}', os.O_RDONLY), signal.SIGKILL)",
        "pidfd": f"{fresh.format('_signal')}.pidfd_send_signal("
        f"{fresh.format('posix')}.pidfd_open({victim.pid}), signal.SIGKILL)",
        "memory": "os.close(os.open(f'/proc/{os.getppid()}/mem', os.O_RDWR))",
    }
    assert _run_attempts(attempts, victim) == dict.fromkeys(attempts, "kernel")


def test_the_code_cannot_reach_or_forge_the_status_channel(monkeypatch):
    """In the fallback the code's process holds no handle on the channel and cannot reopen the
    parent's end; a forged report (isolated, memory) on any descriptor it has changes nothing."""
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)
    forged = b'{"isolated": true}\n{"returncode": 121}\n{"memory": true}\n'
    code = (
        "import os\nwritten = reopened = 0\n"
        "for fd in map(int, os.listdir('/proc/self/fd')):\n"
        f"    if fd > 2:\n        try:\n            written += os.write(fd, {forged!r}) > 0\n"
        "        except OSError:\n            pass\n"
        "parent = f'/proc/{os.getppid()}/fd'\n"
        "try:\n    names = os.listdir(parent)\nexcept OSError:\n    names = []\n"
        "for name in names:\n"
        "    try:\n        os.close(os.open(f'{parent}/{name}', os.O_WRONLY))\n"
        "        reopened += 1\n    except OSError:\n        pass\n"
        "print(written, reopened)\n"
    )
    result = run_python(code)
    assert result.stdout == "0 0\n", result.stderr
    assert (result.returncode, result.killed_by, result.network_isolated) == (0, None, False)


@pytest.mark.parametrize(
    "data",
    [
        b'{"isolated": false}\n{"isolated": true}\n',  # the fallback never writes twice
        b'{"isolated": false}\n{"returncode": 0}\n',
        b'{"isolated": true}\n{"returncode": 0}\n{"returncode": 121}\n',
        b'{"isolated": true, "memory": true}\n',
    ],
)
def test_a_status_no_trusted_process_writes_is_a_breach(data):
    channel, writer = socket.socketpair()
    with channel, writer:
        writer.sendall(data)
        writer.close()
        with pytest.raises(sandbox.SandboxBreach, match="status channel carried"):
            sandbox._read_status(channel)


def test_the_number_of_processes_is_bounded(monkeypatch):
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", True)
    if os.geteuid() == 0:  # RLIMIT_NPROC never binds root: only a pids cgroup does
        probe = sandbox._make_cgroup(f"probe_{uuid.uuid4().hex}", 8)
        if probe is None:
            pytest.skip("running as root without a writable pids cgroup")
        sandbox._remove_cgroup(probe)
    elif not _namespaces_supported():
        pytest.skip("RLIMIT_NPROC is per user without a user namespace")
    code = (
        "import os, time\nn = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(600)\n"
        "    n += 1\nprint(n, flush=True)\n"
    )
    result = run_python(code, max_processes=16, timeout_s=20)
    assert 0 < int(result.stdout) < 16


def test_no_connection_leaves_the_sandbox(mode):
    accepted = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.2)
        port = server.getsockname()[1]
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                try:
                    accepted.append(server.accept()[0])
                except TimeoutError:
                    pass

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            code = (
                "import socket\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "    print('connected')\nexcept Exception as e:\n    print('failed', repr(e))\n"
            )
            result = run_python(code)
        finally:
            stop.set()
            thread.join()
    assert result.stdout.startswith("failed"), result.stdout + result.stderr
    assert accepted == []
    expected_isolation = mode == "namespaces" and _namespaces_supported()
    assert result.network_isolated == expected_isolation


def test_a_big_file_write_is_bounded_by_the_file_size_limit(mode):
    code = (
        "try:\n    with open('big', 'wb') as f:\n        f.write(b'x' * (3 * 2**20))\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
        "import os\nprint(os.path.getsize('big'))\n"
    )
    result = run_python(code, max_file_mb=1)
    lines = result.stdout.split()
    assert lines[:2] == ["refused", "27"]  # EFBIG
    assert int(lines[2]) <= 2**20


def test_the_working_directory_is_fresh_private_and_removed(monkeypatch):
    monkeypatch.setenv("PERIODIC_RL_TEST_SECRET", "hunter2")
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.listdir()))\nprint(dict(os.environ))"
    result = run_python(code)
    cwd, listing, environ = result.stdout.splitlines()
    assert listing == "['main.py']"
    assert "hunter2" not in environ and "PERIODIC_RL_TEST_SECRET" not in environ
    assert not Path(cwd).exists() and not Path(cwd).parent.exists()


def test_output_is_capped():
    result = run_python(
        "print('x' * 100_000)\nimport sys\nsys.stderr.write('y' * 100)", max_output_bytes=10
    )
    assert (result.stdout, result.stderr, result.truncated) == ("x" * 10, "y" * 10, True)


def test_run_tests_scores_the_fraction_passed_and_an_early_exit_as_zero():
    code = "def add(a, b):\n    print('noise')\n    return a + b if a else 0\n"
    tests = ["assert add(1, 2) == 3", "assert add(0, 2) == 2", "assert add(2, 2) == 4"]
    assert run_tests(code, tests) == pytest.approx(2 / 3)
    assert run_tests("import sys\nsys.exit(0)", tests) == 0.0
    assert run_tests("import os\nos._exit(0)", tests) == 0.0
    assert run_tests("while True:\n    pass", tests, cpu_s=1) == 0.0


def test_example_code_reward_scores_a_passing_and_a_failing_completion():
    spec = importlib.util.spec_from_file_location("code_reward", REPO / "examples/code_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    good = "Here:\n```python\ndef square(x):\n    return x * x\n```"
    bad = "```python\ndef square(x):\n    return x + x\n```"
    tests = ["assert square(3) == 9", "assert square(2) == 4"]
    scores = module.passes_tests(["p"] * 3, [good, bad, "no code"], [tests, tests, tests])
    assert scores == [1.0, 0.5, 0.0]
