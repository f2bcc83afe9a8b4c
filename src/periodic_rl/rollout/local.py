"""In-process rollouts: one engine in the trainer's process, no Ray (tests, debugging)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from periodic_rl.agents.build import run_jobs
from periodic_rl.agents.loop import AgentLoop
from periodic_rl.rollout.backend import JobSource
from periodic_rl.rollout.engine import InferenceEngine
from periodic_rl.rollout.timing import SpanRecorder, worker_lane
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, SamplingConfig
from periodic_rl.weight_sync.fingerprint import weights_fingerprint
from periodic_rl.weight_sync.merge import AdapterLoader
from periodic_rl.weight_sync.names import detached_cpu


class LocalRollouts:
    """A :class:`~periodic_rl.rollout.backend.RolloutBackend` served by one engine in this
    process.

    It cannot overlap generation with training (they share the process); it is the simplest
    backend, and the reference :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts` is
    compared with.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        spans: SpanRecorder | None = None,
        agent_loop: AgentLoop | None = None,
    ) -> None:
        self.engine = engine
        self.agent_loop = agent_loop  # multi-turn rollouts (periodic_rl.agents)
        self.spans = spans if spans is not None else SpanRecorder()
        self.version = -1
        self.fingerprint = ""
        self._adapter = AdapterLoader()

    def start(self) -> LocalRollouts:
        return self

    def push_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, keep: list[str] | None = None
    ) -> str:
        """Load ``state_dict`` and check the engine's fingerprint of what it holds against
        :func:`weights_fingerprint` of what was sent, as the Ray rollouts do (on a mismatch the
        version stays the old one, so the trainer refuses what the engine generates next).
        ``keep``: the LoRA-adapted names to keep for :meth:`push_adapter` (see
        :meth:`RayRollouts.push_weights <periodic_rl.rollout.workers.rollouts.RayRollouts>`)."""
        fingerprint = self.engine.load_weights(state_dict)
        expected = weights_fingerprint(detached_cpu(state_dict))
        if fingerprint != expected:
            raise RuntimeError(
                f"weight push (version {version}) failed: the engine reports fingerprint "
                f"{fingerprint} of what it holds after loading, expected {expected} (the weights "
                "sent); it would generate with other weights than the policy's"
            )
        self._adapter.keep_base(self.engine, state_dict, keep, fingerprint)
        self.fingerprint, self.version = fingerprint, version
        return fingerprint

    def weights_will_change(self) -> None:
        """Nothing reads the pushed weights after a push here (the engine copied them)."""

    def push_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> str:
        """Merge a LoRA adapter payload into the kept base and load it (as the Ray
        rollouts' workers do); returns
        :func:`~periodic_rl.weight_sync.fingerprint.adapter_fingerprint`."""
        self.fingerprint = self._adapter.load(self.engine, detached_cpu(adapter))  # CPU merge
        self.version = version
        return self.fingerprint

    def generate(
        self,
        jobs: list[GroupJob],
        sampling: SamplingConfig,
        version: int,
        groups_per_call: int | None = None,
        ramp_groups: int | None = None,
        cancel: threading.Event | None = None,
        more_jobs: JobSource | None = None,
    ) -> Iterator[GeneratedGroup]:
        """Every job in one engine call (``groups_per_call`` and ``ramp_groups`` are ignored:
        nothing streams; ``cancel`` is looked at before the call and between the groups).
        Groups carry the engine's behaviour log-probs, as the Ray workers' do.

        ``more_jobs``: after those, the jobs added to it meanwhile, in one engine call per
        batch taken, until it is closed."""
        if cancel is not None and cancel.is_set():
            return
        yield from self._generate(jobs, sampling, cancel)
        while more_jobs is not None and not (cancel is not None and cancel.is_set()):
            closed = more_jobs.closed  # read first: nothing put before the close is missed
            batch = more_jobs.next_jobs()
            if batch:
                yield from self._generate(batch, sampling, cancel)
            elif closed:
                return
            else:
                more_jobs.wait(0.1)

    def _generate(
        self, jobs: list[GroupJob], sampling: SamplingConfig, cancel: threading.Event | None
    ) -> Iterator[GeneratedGroup]:
        started = time.time()
        outputs = run_jobs(self.engine, jobs, sampling, self.agent_loop)
        finished = time.time()
        self.spans.add("generate", worker_lane(0), started, finished)
        for job, out in zip(jobs, outputs, strict=True):
            if cancel is not None and cancel.is_set():
                return
            yield GeneratedGroup(
                index=job.index,
                completion_ids=out.completions,
                version=self.version,
                fingerprint=self.fingerprint,
                worker=0,
                seed=job.seed,
                started=started,
                finished=finished,
                logprobs=out.logprobs,
                trajectories=out.trajectories,
                agent_s=out.agent_s,
                engine_idle_s=out.engine_idle_s,
            )

    def shutdown(self) -> None:
        if self.agent_loop is not None:
            self.agent_loop.close()
        self.engine.shutdown()
