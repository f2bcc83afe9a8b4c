"""The LightningCLI class of ``periodic-rl`` (:class:`PeriodicRLCLI`), and :func:`build_cli`,
which builds a configuration's classes without running them (``periodic-rl verify``)."""

from __future__ import annotations

import sys
from typing import Any

from jsonargparse import lazy_instance
from lightning.pytorch.cli import LightningCLI

from periodic_rl.cli_parser import (
    CONFIG_ERRORS,
    PeriodicRLArgumentParser,
    debug,
    exit_with_error,
    instantiation_error,
)
from periodic_rl.data import PromptDataModule
from periodic_rl.module import RLModule

# Importing the strategies registers their names (``trainer.strategy: periodic_async_ddp``).
from periodic_rl.strategies import PeriodicAsyncStrategy


class PeriodicRLCLI(LightningCLI):
    """LightningCLI with periodic_rl's defaults: the periodic-async strategy, no sanity check.

    The default strategy is a ``PeriodicAsyncStrategy`` (``class_path`` and ``init_args``), so
    ``--print_config`` lists its options and ``--trainer.strategy.init_args.engine hf`` (or the
    same key in YAML) changes one of them without restating the class.

    A configuration error (a value outside a choice, a misspelt option, a setting a class
    refuses while it is built) ends the command with one line naming the option and the fix,
    and exit status 2, before anything starts (:mod:`periodic_rl.cli_parser`).
    """

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except CONFIG_ERRORS as error:
            if debug():
                raise
            prog = " ".join(filter(None, (self.parser.prog, self.subcommand)))
            exit_with_error(prog, instantiation_error(error))

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse parser
        parser.help_classes = {
            "model": RLModule,
            "data": PromptDataModule,
            "trainer.strategy": PeriodicAsyncStrategy,
        }
        parser.set_defaults(
            {
                "trainer.strategy": lazy_instance(PeriodicAsyncStrategy),
                # One training device (the strategy refuses more); "auto" would take every GPU.
                "trainer.devices": 1,
                # The module evaluates before the first iteration (eval_at_start): Lightning's
                # sanity check would only repeat it on one prompt.
                "trainer.num_sanity_val_steps": 0,
                # One step is one iteration, seconds to minutes long: log every one of them.
                "trainer.log_every_n_steps": 1,
            }
        )


def build_cli(config: dict[str, Any]) -> PeriodicRLCLI:
    """The module, data module and trainer of a ``fit`` configuration (a dict, as the YAML
    reads), built by the CLI's own parser, not run (``periodic-rl verify``). The command line
    is not read (LightningCLI would warn that it was given both)."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return PeriodicRLCLI(
            RLModule,
            PromptDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_class=PeriodicRLArgumentParser,
            args=config,
            run=False,
            save_config_callback=None,
            auto_configure_optimizers=False,
        )
    finally:
        sys.argv = argv
