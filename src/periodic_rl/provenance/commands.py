"""``periodic-rl replay`` and ``periodic-rl verify``: check a run from the command line.

``periodic-rl replay --config run.yaml --record DIR --iteration I [--checkpoint CKPT]``
recomputes a recorded iteration (:func:`~periodic_rl.provenance.replay.replay`) and prints the
report; exit status 0 when the update is the recorded one, 1 when it is not.

``periodic-rl verify --config run.yaml [--iterations N]`` trains the configuration as
configured and in the reference mode (:func:`~periodic_rl.provenance.verify.verify`) and prints
the comparison; exit status 0 only when the two agree.

A missing record, checkpoint or configuration ends with one line naming it and exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from periodic_rl.cli_parser import exit_with_error


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="periodic-rl", description=__doc__.split("\n\n")[0])
    commands = main.add_subparsers(dest="command", required=True)
    replay = commands.add_parser("replay", help="recompute a recorded iteration")
    replay.add_argument("--config", required=True, help="the run's fit configuration (YAML)")
    replay.add_argument("--record", required=True, help="the run's rollout record folder")
    replay.add_argument("--iteration", type=int, required=True, help="0-based")
    replay.add_argument(
        "--checkpoint",
        help="the checkpoint taken at the iteration's start (default: <record>/../checkpoints)",
    )
    replay.add_argument("--token-tolerance", type=float, default=None)
    verify = commands.add_parser("verify", help="configured run against the reference mode")
    verify.add_argument("--config", required=True, help="the fit configuration (YAML)")
    verify.add_argument("--iterations", type=int, default=3)
    verify.add_argument("--tolerance", type=float, default=None)
    return main


def run_command(argv: list[str]) -> None:
    """Run ``replay`` or ``verify`` (``argv`` starts with the command); exits 1 on a
    disagreement, 2 on bad input."""
    args = parser().parse_args(argv)
    prog = f"periodic-rl {args.command}"
    try:
        if args.command == "replay":
            agree, text = _replay(args)
        else:
            agree, text = _verify(args)
    except (FileNotFoundError, LookupError, ValueError) as error:
        exit_with_error(prog, str(error))
    print(text)
    if not agree:
        raise SystemExit(1)


def _replay(args: argparse.Namespace) -> tuple[bool, str]:
    from periodic_rl.cli_app import build_cli
    from periodic_rl.provenance.replay import TOKEN_TOLERANCE, checkpoint_of, replay
    from periodic_rl.provenance.verify import load_config

    cli = build_cli(load_config(args.config))
    checkpoint = args.checkpoint
    if checkpoint is None and args.iteration > 0:
        checkpoint = checkpoint_of(
            cli.model, Path(args.record).parent / "checkpoints", args.iteration
        )
    tolerance = TOKEN_TOLERANCE if args.token_tolerance is None else args.token_tolerance
    report = replay(
        cli.model, cli.datamodule, args.record, args.iteration, checkpoint,
        token_tolerance=tolerance,
    )  # fmt: skip
    return report.exact, report.describe()


def _verify(args: argparse.Namespace) -> tuple[bool, str]:
    from periodic_rl.provenance.verify import TOLERANCE, verify

    tolerance = TOLERANCE if args.tolerance is None else args.tolerance
    verdict = verify(args.config, args.iterations, tolerance)
    return verdict.agree, verdict.table()
