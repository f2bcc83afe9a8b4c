"""Tools that ship with the library, ready for ``AgentConfig(tools=[...])``.

``"periodic_rl.agents.builtin_tools:python"`` runs the model's code in the sandbox of
:func:`periodic_rl.run_python` (limits on time, memory, processes; no network where the kernel
allows namespaces) and answers with what it printed.
"""

from __future__ import annotations

from periodic_rl.sandbox import run_python

#: Wall-clock limit of one ``python`` tool call, in seconds (its CPU limit is a bit lower).
PYTHON_TIMEOUT_S = 10.0


def python(code: str) -> str:
    """Run Python code and return what it printed.

    Args:
        code: a complete Python program; use print() to show results. Only the standard
            library is available, and there is no network.
    """
    result = run_python(code, timeout_s=PYTHON_TIMEOUT_S, cpu_s=int(PYTHON_TIMEOUT_S) - 2)
    parts = [result.stdout.rstrip()]
    if result.stderr.strip():
        parts.append(f"stderr:\n{result.stderr.rstrip()}")
    if result.timed_out or result.killed_by is not None:
        parts.append(f"(stopped: {result.killed_by or 'time limit'})")
    elif result.returncode not in (0, None):
        parts.append(f"(exit status {result.returncode})")
    return "\n".join(p for p in parts if p) or "(no output)"
