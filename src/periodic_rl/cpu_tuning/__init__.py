"""The hardware tuner of CPU runs: which cores each side gets, lending idle cores, the engine's
dtype, the heap (:class:`CPUTuning`, behind :mod:`periodic_rl.rollout.tuning`'s seam)."""

from periodic_rl.cpu_tuning.plugin import CPUTuning, CPUWorkerTuning

__all__ = ["CPUTuning", "CPUWorkerTuning"]
