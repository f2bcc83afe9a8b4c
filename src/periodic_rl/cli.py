"""``periodic-rl``: the LightningCLI entry point (``periodic-rl fit --config run.yaml``), and
``periodic-rl replay`` / ``periodic-rl verify`` (:mod:`periodic_rl.provenance.commands`)."""

from __future__ import annotations

import os
import sys

from periodic_rl.cli_app import PeriodicRLCLI
from periodic_rl.cli_parser import PeriodicRLArgumentParser
from periodic_rl.data import PromptDataModule
from periodic_rl.module import RLModule

__all__ = ["PeriodicRLCLI", "main"]


def main(args: list[str] | None = None) -> None:
    """Run the CLI. Subclasses of RLModule / PromptDataModule are accepted by class_path.
    ``periodic-rl replay`` and ``periodic-rl verify`` check a run
    (:mod:`periodic_rl.provenance.commands`).

    Returns None: the ``periodic-rl`` console script hands the return value to ``sys.exit``,
    which treats anything but None or an int as a failure (exit status 1).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in ("replay", "verify"):
        from periodic_rl.provenance.commands import run_command

        run_command(argv)
        return
    # Known third-party messages are filtered by `import periodic_rl` (compat/noise.py).
    PeriodicRLCLI(
        RLModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_class=PeriodicRLArgumentParser,
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
