"""Checking a run after the fact: replay a recorded iteration (:func:`replay`)."""

from periodic_rl.provenance.replay import RecordedEngine, ReplayReport, replay

__all__ = ["RecordedEngine", "ReplayReport", "replay"]
