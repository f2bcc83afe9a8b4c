"""Rows for the sandbox fallback (no namespaces): signals, Landlock, the status channel, ctypes."""

from __future__ import annotations

from mutation_rows.base import Mutation

SANDBOX_TESTS = "tests/test_sandbox.py"
CHILD = "src/periodic_rl/_sandbox_child.py"

ROWS: list[Mutation] = [
    Mutation(
        name="the fallback lets code under test call os.kill",
        file=CHILD,
        old='        "os.kill",\n',
        new="",
        tests=(SANDBOX_TESTS,),
    ),
    Mutation(
        name="the fallback keeps the unaudited pidfd signals",
        file=CHILD,
        old="            delattr(sys.modules[module], name)\n",
        new="            pass\n",
        tests=(SANDBOX_TESTS,),
    ),
    Mutation(
        name="the code under test can write the status pipe",
        file=CHILD,
        old="    os.close(channel)  # the code under test gets no handle on the status channel\n",
        new="",
        tests=(SANDBOX_TESTS,),
    ),
    Mutation(
        name="the fallback runs outside a Landlock domain",
        file=CHILD,
        old="        _confine()  # best effort: the audit hook below stands without it\n",
        new="",
        tests=(SANDBOX_TESTS,),
    ),
    Mutation(
        name="the fallback stops blocking ctypes",
        file=CHILD,
        old='    if event.startswith("ctypes.") or (event == "import" and args[0] == "_ctypes"):\n',
        new="    if False:\n",
        tests=(SANDBOX_TESTS,),
    ),
]
