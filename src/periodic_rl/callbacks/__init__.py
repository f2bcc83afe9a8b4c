"""Lightning callbacks for RL runs: samples, timelines, pipeline metrics, export, report, and
the rollout record.

Each works from YAML, e.g.::

    trainer:
      callbacks:
        - class_path: periodic_rl.callbacks.RolloutSamples
          init_args: {every_n_iterations: 10}
        - class_path: periodic_rl.callbacks.HFExport
"""

from periodic_rl.callbacks.export import HFExport
from periodic_rl.callbacks.metrics import PipelineMetrics
from periodic_rl.callbacks.record import RolloutRecord
from periodic_rl.callbacks.report import FitReport
from periodic_rl.callbacks.rl_metrics import RLMetrics
from periodic_rl.callbacks.samples import RolloutSamples
from periodic_rl.callbacks.timeline import PipelineTimeline

__all__ = [
    "FitReport",
    "HFExport",
    "PipelineMetrics",
    "PipelineTimeline",
    "RLMetrics",
    "RolloutRecord",
    "RolloutSamples",
]
