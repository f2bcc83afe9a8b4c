"""Checking a run after the fact: replay a recorded iteration (:func:`replay`), compare a
configuration's run with its reference mode (:func:`verify`)."""

from periodic_rl.provenance.replay import RecordedEngine, ReplayReport, replay
from periodic_rl.provenance.verify import Verdict, verify

__all__ = ["RecordedEngine", "ReplayReport", "Verdict", "replay", "verify"]
