"""Rows for the first-day work: config (choices as Literal types, model_init_kwargs, CLI errors)."""

from __future__ import annotations

from mutation_rows.base import Mutation

CONFIG_TESTS = "tests/test_config_checks.py"
CLI_TESTS = "tests/test_cli.py"

ROWS: list[Mutation] = [
    Mutation(
        name="config: the module's choices are not checked from Python",
        file="src/periodic_rl/config_checks.py",
        old="    check_choices(signature, args)\n",
        new="",
        tests=(CONFIG_TESTS,),
    ),
    Mutation(
        name="config: a bool passes as an int choice",
        file="src/periodic_rl/choices.py",
        old="    return any(value == a and type(value) is type(a) for a in allowed)\n",
        new="    return any(value == a for a in allowed)\n",
        tests=(CONFIG_TESTS,),
    ),
    Mutation(
        name="config: model_init_kwargs do not reach the policy",
        file="src/periodic_rl/module_setup.py",
        old="    policy = load_causal_lm(model_path, dtype=DTYPES[dtype], **init_kwargs)\n",
        new="    policy = load_causal_lm(model_path, dtype=DTYPES[dtype])\n",
        tests=(CONFIG_TESTS,),
    ),
    Mutation(
        name="config: the CLI keeps jsonargparse's long union errors",
        file="src/periodic_rl/cli.py",
        old="        parser_class=PeriodicRLArgumentParser,\n",
        new="",
        tests=(CLI_TESTS,),
    ),
    Mutation(
        name="config: a misspelt option gets no did-you-mean",
        file="src/periodic_rl/cli_parser.py",
        old='    return f"; did you mean {\' or \'.join(close)}?" if close else ""\n',
        new='    return ""\n',
        tests=(CLI_TESTS,),
    ),
]
