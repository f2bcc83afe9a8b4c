"""`FitReport`: what a run did, on one page, when it ends.

Did the held-out reward move, how fast were the rollouts, how much of the generation did the
trainer overlap, and where are the checkpoint and the exported model: the questions asked after
every run, answered in ``report.md`` (printed too) with ``reward_curve.png`` next to it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from periodic_rl.callbacks._common import (
    atomic_file,
    eval_history,
    finished_iteration,
    last_iteration,
    run_dir,
    span_recorder,
)
from periodic_rl.callbacks.export import HFExport
from periodic_rl.extras import available, install_hint, require

_NOT_SHOWN = {"tag", "step", "reward"}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _change(start: float | None, end: float | None) -> str:
    return "n/a" if start is None or end is None else f"{end - start:+.4g}"


def held_out(history: list[dict[str, Any]], tag: str) -> dict[str, Any] | None:
    """The last held-out evaluation tagged ``tag`` ("start" or "end"), if any."""
    found = [entry for entry in history if entry.get("tag") == tag]
    return found[-1] if found else None


def held_out_table(start: dict[str, Any] | None, end: dict[str, Any] | None) -> list[str]:
    """Markdown rows: reward, accuracy, then every other per-function mean."""
    names = ["reward"]
    for entry in (start, end):
        for key in entry or {}:
            if key not in _NOT_SHOWN and key not in names:
                names.append(key)
    names.sort(key=lambda n: (n != "reward", n != "accuracy", n))
    lines = ["| held-out | start | end | change |", "|---|---|---|---|"]
    for name in names:
        a = (start or {}).get(name)
        b = (end or {}).get(name)
        shown = f"`{name}`" if not name.replace("_", "").isalnum() else name  # <lambda>
        lines.append(f"| {shown} | {_fmt(a)} | {_fmt(b)} | {_change(a, b)} |")
    return lines


def curve_label(entry: dict[str, Any]) -> str:
    """A held-out point's label on the reward curve: its tag and the iteration it evaluated
    (``start 0``, ``iteration 10``, ``end 30``)."""
    return f"{entry.get('tag', '')} {entry['step']:g}".strip()


def reward_curve_png(
    history: list[dict[str, float]], evals: list[dict[str, Any]], path: Path
) -> Path:
    """Training reward per iteration and the held-out points, as a PNG (matplotlib, Agg)."""
    require("matplotlib", "the reward curve (reward_curve_png)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if history:
        xs = [h["iteration"] for h in history]
        ax.plot(xs, [h["reward"] for h in history], marker=".", label="training reward")
        if all("rewards/accuracy" in h for h in history):
            accuracy = [h["rewards/accuracy"] for h in history]
            ax.plot(xs, accuracy, linestyle="--", alpha=0.7, label="training accuracy")
    for key, marker in (("reward", "o"), ("accuracy", "s")):
        points = [(e["step"], e[key]) for e in evals if key in e and "step" in e]
        if points:
            ax.scatter(*zip(*points, strict=True), marker=marker, s=50, zorder=3,
                       label=f"held-out {key}")  # fmt: skip
            for (x, y), entry in zip(points, [e for e in evals if key in e], strict=True):
                ax.annotate(curve_label(entry), (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)  # fmt: skip
    ax.set_xlabel("iteration (policy version)")
    ax.set_ylabel("reward")
    ax.set_title("reward")
    ax.grid(linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def pipeline_shares(summaries: list[dict[str, float]]) -> dict[str, float]:
    """Idle and push shares over many iterations' span summaries
    (:meth:`~periodic_rl.rollout.timing.SpanRecorder.summary`), each weighted by its wall time:
    ``worker_idle`` (the fraction of the workers' time not generating), ``cores_lent`` (of the
    time, the fraction the idle workers' cores were the trainer's: ``lend_idle_cores``; a part
    of ``worker_idle``), ``trainer_idle`` (not training: waiting for rollouts, pushing, anything
    else) and ``push``."""
    wall = sum(s["wall_time"] for s in summaries)
    worker_wall = sum(s["wall_time"] * s["num_workers"] for s in summaries)
    if wall <= 0:
        return {"worker_idle": 0.0, "cores_lent": 0.0, "trainer_idle": 0.0, "push": 0.0}
    busy = sum(s["worker_busy_time"] for s in summaries)
    return {
        "worker_idle": 1.0 - busy / worker_wall if worker_wall > 0 else 0.0,
        "cores_lent": sum(s["cores_lent_time"] for s in summaries) / wall,
        "trainer_idle": 1.0 - sum(s["training_time"] for s in summaries) / wall,
        "push": sum(s["push_time"] for s in summaries) / wall,
    }


class FitReport(Callback):
    """At the end of fit, summarise the run in ``report.md`` and ``reward_curve.png``.

    Contents: held-out reward, accuracy and per-function means at the start and the end (from
    ``module.eval_history``), iterations, wall time, mean rollouts/s and tokens/s, mean overlap
    ratio and trainer idle time (from the strategy's spans, when it records them), the
    checkpoint paths, and the model folder an :class:`HFExport` callback wrote.

    It runs in ``on_fit_end``: Lightning calls the callbacks' ``on_train_end`` before the
    module's, and the module's final held-out evaluation happens in its ``on_train_end``.

    Args:
        output_dir: where to write (default: the run's log folder).
        print_report: print the report (with rich when available) as well as saving it.
    """

    def __init__(self, output_dir: str | None = None, print_report: bool = True) -> None:
        self.output_dir = output_dir
        self.print_report = print_report
        self.history: list[dict[str, float]] = []
        self.pipeline: list[dict[str, float]] = []
        self.report_path: Path | None = None
        self.curve_path: Path | None = None
        self._started = 0.0

    def resolve_output_dir(self, trainer: Any) -> Path:
        """The folder the report goes to."""
        return Path(self.output_dir) if self.output_dir is not None else run_dir(trainer)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # setup, not on_fit_start: the wall time then includes loading the model and starting
        # the rollout workers (the strategy's setup runs between the two).
        if stage != "fit":
            return
        self._started = time.perf_counter()
        self.history = []
        self.pipeline = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = last_iteration(pl_module)
        if stats is not None and stats.rewards:
            self.history.append({"iteration": finished_iteration(trainer), **stats.metrics()})
        recorder = span_recorder(trainer)
        if recorder is not None and recorder.iteration is not None:
            # Now, not at the end: the final evaluation is recorded under the last iteration.
            self.pipeline.append(recorder.summary(recorder.iteration))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero or getattr(pl_module, "nothing_to_train", False):
            return  # a resume at max_steps reports nothing new
        out = self.resolve_output_dir(trainer)
        evals = eval_history(pl_module)
        if available("matplotlib"):
            self.curve_path = reward_curve_png(self.history, evals, out / "reward_curve.png")
        else:  # a core install: the report without its chart
            rank_zero_info(f"reward_curve.png not drawn: no matplotlib ({install_hint('report')})")
        text = self.render(trainer, pl_module, time.perf_counter() - self._started)
        path = out / "report.md"
        with atomic_file(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
        self.report_path = path
        if self.print_report:
            _print_markdown(text)

    def render(self, trainer: Any, pl_module: Any, wall_s: float) -> str:
        """The report as Markdown."""
        evals = eval_history(pl_module)
        start, end = held_out(evals, "start"), held_out(evals, "end")
        lines = ["# periodic_rl fit report", ""]
        if start or end:
            lines += held_out_table(start, end)
        else:
            lines.append("No held-out evaluation (the data module has no held-out rows).")
        lines += ["", "## Run", ""]
        iterations = len(self.history)
        lines.append(f"- iterations: {iterations} (trainer global step {trainer.global_step})")
        lines.append(f"- wall time: {wall_s:.1f} s for the whole fit (model loading included)")
        if self.history:
            seconds = [h["iteration_s"] for h in self.history]
            rollouts = statistics.fmean(h["rollouts_per_s"] for h in self.history)
            tokens = statistics.fmean(h["tokens_per_s"] for h in self.history)
            lines.append(
                f"- iteration time: {sum(seconds):.1f} s in all, "
                f"{statistics.fmean(seconds):.2f} s mean, {seconds[-1]:.2f} s last"
            )
            lines.append(f"- throughput: {rollouts:.3g} rollouts/s, {tokens:.3g} tokens/s (mean)")
            lines.append(
                f"- training reward: {self.history[0]['reward']:.4g} (first iteration) -> "
                f"{self.history[-1]['reward']:.4g} (last)"
            )
        lines += self._pipeline_lines()
        lines += ["", "## Artefacts", ""]
        lines += self._artefact_lines(trainer)
        return "\n".join(lines) + "\n"

    def _pipeline_lines(self) -> list[str]:
        if not self.pipeline:
            return []

        def mean(key: str) -> float:
            return statistics.fmean(s[key] for s in self.pipeline)

        shares = pipeline_shares(self.pipeline)
        return [
            f"- pipeline (mean per iteration): overlap ratio {mean('overlap_ratio'):.0%}, "
            f"generation {mean('generation_time'):.2f} s, training {mean('training_time'):.2f} s,"
            f" trainer idle {mean('trainer_idle_time'):.2f} s, push {mean('push_time'):.2f} s",
            f"- shares of all iterations' time: worker idle {shares['worker_idle']:.0%} (its "
            f"cores the trainer's for {shares['cores_lent']:.0%} of the time: lend_idle_cores), "
            f"trainer idle {shares['trainer_idle']:.0%} (not training: waiting or pushing), "
            f"push {shares['push']:.0%}",
        ]

    def _artefact_lines(self, trainer: Any) -> list[str]:
        lines = []
        checkpoint = getattr(trainer, "checkpoint_callback", None)
        if checkpoint is not None:
            best = getattr(checkpoint, "best_model_path", "") or "none"
            last = getattr(checkpoint, "last_model_path", "") or "none"
            lines.append(f"- checkpoint: best `{best}`, last `{last}`")
        else:
            lines.append("- checkpoint: checkpointing disabled")
        exports = [cb for cb in trainer.callbacks if isinstance(cb, HFExport)]
        for cb in exports:
            path = cb.final_path or cb.last_export
            if path is not None:
                lines.append(f"- exported model: `{cb.model_path(path)}`")
        if not exports:
            lines.append("- exported model: none (add the HFExport callback)")
        if self.curve_path is not None:
            lines.append(f"- reward curve: `{self.curve_path}`")
        return lines


def _print_markdown(text: str) -> None:
    try:
        from rich.console import Console
        from rich.markdown import Markdown
    except ImportError:  # rich (the report extra) is optional: plain text then
        print(text)
        return
    Console().print(Markdown(text))
