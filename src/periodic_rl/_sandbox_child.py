"""The trusted bootstrap :mod:`periodic_rl.sandbox` runs (``python -I -S``) before the user's code.

It joins the run's pids cgroup if there is one, tries new user + network + PID namespaces, forks
a supervisor that reports how the code ended on the status pipe (one JSON object a line), sets
the resource limits, installs the audit-hook fallback when there are no namespaces, and runs
``main.py`` of the working directory as ``__main__``. Standard library only: ``-S`` hides
site-packages, and nothing here may import :mod:`periodic_rl`.
"""

import json
import os
import resource
import sys

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
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
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "ctypes.call_function",
    }
)
BLOCKED_IMPORTS = frozenset({"_posixsubprocess", "_ctypes"})  # fork_exec is not audited


def _audit_hook(event: str, args: tuple) -> None:
    if event in BLOCKED_EVENTS or (event == "import" and args[0] in BLOCKED_IMPORTS):
        raise PermissionError(f"sandbox: {event} is not allowed")


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


def main() -> None:
    cfg = json.loads(sys.argv[1])

    def report(**fields: object) -> None:
        os.write(cfg["status_fd"], (json.dumps(fields) + "\n").encode())

    if cfg["cgroup"]:
        try:
            with open(cfg["cgroup"] + "/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass
    isolated = bool(cfg["namespaces"]) and _enter_namespaces()
    report(isolated=isolated)
    if isolated and os.fork():  # this process stays outside the new PID namespace
        os.wait()
        os._exit(0)
    pid = os.fork()
    if pid:  # the supervisor (process 1 of the namespace): wait for the code, report its end
        _, status, usage = os.wait4(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        report(returncode=code, cpu_s=usage.ru_utime + usage.ru_stime)
        os._exit(0)  # as process 1, its exit kills whatever the code left in the namespace
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["max_file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if isolated:  # counts this user namespace's processes only (never enforced for root)
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["max_processes"],) * 2)
    else:
        sys.addaudithook(_audit_hook)
    sys.path.insert(0, os.getcwd())
    sys.argv = ["main.py"]
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
    except MemoryError:
        report(memory=True)
        raise


if __name__ == "__main__":
    main()
