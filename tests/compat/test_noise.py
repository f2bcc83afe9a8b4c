"""Each known third-party message is hidden by ``import periodic_rl``, and only that message:
the same logger's other records and other warnings of the same category still pass. Every
filter is named in docs/troubleshooting.md."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

import periodic_rl  # noqa: F401 - installs the filters
from periodic_rl.compat.noise import KNOWN_NOISE, Noise, quiet_known_noise

LOGGED = [n for n in KNOWN_NOISE if n.logger is not None]
WARNED = [n for n in KNOWN_NOISE if n.category is not None]


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("noise", LOGGED, ids=lambda n: n.starts[:40])
def test_a_known_log_message_is_hidden_and_its_loggers_others_pass(noise: Noise):
    logger = logging.getLogger(noise.logger)
    kept = Kept()
    logger.addHandler(kept)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        logger.warning(noise.starts + " and the rest of the message")
        logger.warning("something else from %s", noise.library)
    finally:
        logger.removeHandler(kept)
        logger.setLevel(level)
    assert kept.messages == [f"something else from {noise.library}"]


@pytest.mark.parametrize("noise", WARNED, ids=lambda n: n.starts[:40])
def test_a_known_warning_is_hidden_and_other_warnings_pass(noise: Noise):
    with warnings.catch_warnings(record=True) as caught:
        quiet_known_noise()  # as a fit's start does (pytest resets warning filters per test)
        warnings.warn(noise.starts + " and the rest", noise.category, stacklevel=1)
        warnings.warn("another warning", noise.category, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another warning"]


def test_every_filter_is_named_in_the_troubleshooting_page():
    page = (Path(__file__).parents[2] / "docs" / "troubleshooting.md").read_text()
    for noise in KNOWN_NOISE:
        assert noise.starts in page, noise.starts
