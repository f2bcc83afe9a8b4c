"""``periodic-rl``: the LightningCLI entry point (``periodic-rl fit --config run.yaml``)."""

from __future__ import annotations

import os
import warnings

from jsonargparse import lazy_instance
from lightning.pytorch.cli import LightningCLI

from periodic_rl.data import PromptDataModule
from periodic_rl.module import RLModule

# Importing the strategies registers their names (``trainer.strategy: periodic_async_ddp``).
from periodic_rl.strategies import PeriodicAsyncStrategy


class PeriodicRLCLI(LightningCLI):
    """LightningCLI with periodic_rl's defaults: the periodic-async strategy, no sanity check.

    The default strategy is a ``PeriodicAsyncStrategy`` (``class_path`` and ``init_args``), so
    ``--print_config`` lists its options and ``--trainer.strategy.init_args.engine hf`` (or the
    same key in YAML) changes one of them without restating the class.
    """

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse parser
        parser.set_defaults(
            {
                "trainer.strategy": lazy_instance(PeriodicAsyncStrategy),
                # One training device (the strategy refuses more); "auto" would take every GPU.
                "trainer.devices": 1,
                # The module evaluates before the first iteration (eval_at_start): Lightning's
                # sanity check would only repeat it on one prompt.
                "trainer.num_sanity_val_steps": 0,
            }
        )


def main(args: list[str] | None = None) -> None:
    """Run the CLI. Subclasses of RLModule / PromptDataModule are accepted by class_path.

    Returns None: the ``periodic-rl`` console script hands the return value to ``sys.exit``,
    which treats anything but None or an int as a failure (exit status 1).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # One optimizer step per training_step: the post-step state is the state to checkpoint.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    PeriodicRLCLI(
        RLModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
