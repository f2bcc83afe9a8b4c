"""The trusted bootstrap :mod:`periodic_rl.sandbox` runs (``python -I -S``) before the user's code.

It joins the run's pids cgroup if there is one and tries new user + network + PID namespaces.
Where they are refused (or not asked for), it confines itself with Landlock where the kernel has
it (no signal, ``ptrace``, ``/proc/<pid>/mem``, ``pidfd_getfd`` or abstract Unix socket reaches a
process outside the sandbox; kept across ``exec``) and re-executes itself as the fallback: a
fresh interpreter that never imported ``ctypes``. Then it reports ``isolated`` on the status
channel, forks the namespace's supervisor, closes its own handle on the channel, sets the
resource limits, installs the audit-hook fallback when there are no namespaces, and runs
``main.py`` of the working directory as ``__main__``. Standard library only: ``-S`` hides
site-packages, and nothing here may import :mod:`periodic_rl`.

The status channel is a Unix socket (a pipe could be reopened for writing through
``/proc/<pid>/fd``; a socket cannot). Only trusted processes write to it, each before the code
under test runs or from outside it: this process (``isolated``) and, with namespaces, the
supervisor (the code's exit status, as ``wait`` saw it). The code's process closes its copy
before running anything it was given. An uncaught ``MemoryError`` ends the code with the exit
status the parent names ``memory_exit``, read from that status, not from anything the code says.
"""

import json
import os
import resource
import sys

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
# Landlock (linux/landlock.h; the same syscall numbers on every architecture)
LANDLOCK_CREATE_RULESET, LANDLOCK_RESTRICT_SELF, LANDLOCK_VERSION = 444, 446, 1 << 0
LANDLOCK_SCOPES = 1 | 2  # SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL: Landlock ABI 6
PR_SET_NO_NEW_PRIVS = 38
BLOCKED_EVENTS = frozenset(
    {
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "os.system",
        "os.fork",
        "os.forkpty",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        "pty.spawn",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "resource.setrlimit",
        "resource.prlimit",
    }
)
# fork_exec is not audited; re-importing posix or _signal would bring back what _strip removed
BLOCKED_IMPORTS = frozenset({"_posixsubprocess", "posix", "_signal"})
# Signal-sending functions the interpreter does not audit: removed from their modules instead
# (a /proc/<pid> directory fd works as a pidfd, so both go).
UNAUDITED = (("posix", "pidfd_open"), ("os", "pidfd_open"), ("_signal", "pidfd_send_signal"))


def _audit_hook(event: str, args: tuple) -> None:
    if event == "os.kill" and args[0] == os.getpid():
        return  # signalling itself reaches no other process
    if event.startswith("ctypes.") or (event == "import" and args[0] == "_ctypes"):
        raise PermissionError(f"sandbox: {event} (ctypes) is not allowed")
    if event in BLOCKED_EVENTS or (event == "import" and args[0] in BLOCKED_IMPORTS):
        raise PermissionError(f"sandbox: {event} is not allowed")


def _strip_unaudited() -> None:
    import _signal  # noqa: F401  (already loaded at startup: this only binds it in sys.modules)

    for module, name in UNAUDITED:
        if hasattr(sys.modules[module], name):
            delattr(sys.modules[module], name)


def _confine() -> bool:
    """Put this process in a Landlock domain scoped for signals and abstract Unix sockets.

    Whatever runs in it (after ``exec`` too, and in any child) cannot signal, ``ptrace`` (so
    neither open ``/proc/<pid>/mem`` nor take a descriptor with ``pidfd_getfd``) or connect to
    the abstract sockets of a process outside it: the kernel refuses, however the call is made.
    False where the kernel lacks Landlock ABI 6 (Linux < 6.12, or Landlock not enabled).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    long = ctypes.c_long
    if libc.syscall(long(LANDLOCK_CREATE_RULESET), None, long(0), long(LANDLOCK_VERSION)) < 6:
        return False
    attr = (ctypes.c_uint64 * 3)(0, 0, LANDLOCK_SCOPES)  # fs and net accesses: not handled
    ruleset = libc.syscall(
        long(LANDLOCK_CREATE_RULESET), ctypes.byref(attr), long(ctypes.sizeof(attr)), long(0)
    )
    if ruleset < 0:
        return False
    try:
        return (
            libc.prctl(PR_SET_NO_NEW_PRIVS, long(1), long(0), long(0), long(0)) == 0
            and libc.syscall(long(LANDLOCK_RESTRICT_SELF), long(ruleset), long(0)) == 0
        )
    finally:
        os.close(ruleset)


def _enter_namespaces() -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) != 0:
        return False
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def _supervise(channel: int) -> None:
    """With namespaces: fork the PID namespace's process 1, which reports how the code ended.

    Returns only in the code's process; the two trusted processes exit when their child does.
    """
    if os.fork():  # this process stays outside the new PID namespace
        os.wait()
        os._exit(0)
    pid = os.fork()
    if pid:  # process 1: its exit kills whatever the code left in the namespace
        _, status = os.waitpid(pid, 0)
        os.write(
            channel, (json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode()
        )
        os._exit(0)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    channel = cfg["status_fd"]
    if cfg["cgroup"] and cfg["stage"] == "start":
        try:
            with open(cfg["cgroup"] + "/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass
    isolated = cfg["stage"] == "start" and cfg["namespaces"] and _enter_namespaces()
    if cfg["stage"] == "start" and not isolated:  # the fallback: same process, fds, directory
        _confine()  # best effort: the audit hook below stands without it
        fallback = json.dumps({**cfg, "stage": "fallback"})
        os.execv(sys.executable, [sys.executable, "-I", "-S", sys.argv[0], fallback])
    os.write(channel, (json.dumps({"isolated": isolated}) + "\n").encode())
    if isolated:
        _supervise(channel)
    os.close(channel)  # the code under test gets no handle on the status channel
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["max_file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if isolated:  # counts this user namespace's processes only (never enforced for root)
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["max_processes"],) * 2)
    else:
        _strip_unaudited()
        sys.addaudithook(_audit_hook)
    sys.path.insert(0, os.getcwd())
    sys.argv = ["main.py"]
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
    except MemoryError:
        sys.excepthook(*sys.exc_info())
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(cfg["memory_exit"])


if __name__ == "__main__":
    main()
