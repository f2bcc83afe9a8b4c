"""An inference engine on transformers ``generate``: no extra dependency, any device, slow.

Reproducibility: transformers has no per-row random generator, so a batched ``generate`` call's
samples depend on which rows share the batch. Here each prompt group is one ``generate`` call of
its ``n`` rows (the same prompt repeated: no padding), and the sampling itself is done by a logits
processor that draws row ``i`` with its own ``torch.Generator`` seeded
``sample_seed(request.seed, i)``, then hands ``generate`` a one-hot score so that its greedy step
picks the drawn token. A group's samples therefore depend only on its prompt, ``n``, its seed and
the weights: never on the other groups, the call order or the global RNG.

The sampling knobs of :class:`~periodic_rl.rollout.types.SamplingConfig` (``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``) are applied by this module's own code,
:func:`processed_logits`, in vLLM's order and with vLLM's definitions, so that both engines draw
from the same distribution and report its log-probs. ``generate`` itself runs greedy
(``do_sample=False``): transformers' sampling warpers (``top_k``, ``top_p``, ``min_p``,
``temperature``), including the ``top_k=50`` default that ``GenerationConfig`` and a model's
``generation_config.json`` carry, only run under ``do_sample=True``, so they never apply here,
and ``repetition_penalty`` (which would apply) is set to 1 in the ``GenerationConfig``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from periodic_rl.rollout.engine import InferenceEngine, sample_seed
from periodic_rl.rollout.types import GenerationRequest, SamplingConfig
from periodic_rl.weight_sync.fingerprint import loaded_fingerprint, weights_fingerprint
from periodic_rl.weight_sync.names import WeightNames

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``, ``"bfloat16"``, ... (or a ``torch.dtype``) as a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to ``-inf`` the logits outside the smallest set of tokens whose probability reaches
    ``top_p`` (nucleus sampling; the most likely token is always kept)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token when the tokens before it already reach top_p.
    drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set to ``-inf`` the logits below the ``top_k``-th highest of their row (ties with it are
    kept, as vLLM does). ``top_k`` 0, or at least the vocabulary size: unchanged."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Set to ``-inf`` the logits of the tokens whose probability is below ``min_p`` times the
    most likely token's (vLLM's ``MinPLogitsProcessor``). ``min_p`` 0: unchanged."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def repetition_penalty_filter(
    logits: torch.Tensor, input_ids: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Penalise the tokens already in each row's ``input_ids`` (prompt and completion so far):
    a positive logit is divided by ``penalty``, a negative one multiplied by it (vLLM's and
    transformers' definition). ``penalty`` 1: unchanged."""
    if penalty == 1.0:
        return logits
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, input_ids.to(logits.device), True)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def processed_logits(
    scores: torch.Tensor, input_ids: torch.Tensor, sampling: SamplingConfig
) -> torch.Tensor:
    """The logits a token is drawn from, float32, one row per sequence: ``scores`` (the raw
    next-token logits) after ``repetition_penalty`` (over ``input_ids``), ``/ temperature``,
    ``min_p``, ``top_k`` and ``top_p``, in vLLM's order (``Sampler.forward``: penalties, then
    temperature, then the min-p processor, then top-k/top-p). Filtered tokens are ``-inf``; the
    behaviour log-probs are the ``log_softmax`` of the result. Needs ``temperature > 0``."""
    logits = repetition_penalty_filter(scores.float(), input_ids, sampling.repetition_penalty)
    logits = logits / sampling.temperature
    logits = min_p_filter(logits, sampling.min_p)
    logits = top_k_filter(logits, sampling.top_k)
    return top_p_filter(logits, sampling.top_p)


class RepetitionPenalty(LogitsProcessor):
    """Greedy decoding's only processor: :func:`repetition_penalty_filter` (``top_k``,
    ``min_p`` and ``top_p`` cannot change an argmax), so that greedy is the argmax vLLM takes."""

    def __init__(self, penalty: float) -> None:
        self.penalty = penalty

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        return repetition_penalty_filter(scores.float(), input_ids, self.penalty)


class SeededSampler(LogitsProcessor):
    """A transformers logits processor that samples each row with its own generator.

    Row ``i`` is drawn with ``torch.Generator().manual_seed(seeds[i])`` from the softmax of
    :func:`processed_logits`. It returns scores that are ``0`` for the drawn token and ``-inf``
    elsewhere, so that ``generate(do_sample=False)`` emits exactly the token drawn here.
    ``sampling`` must have ``temperature > 0``.
    """

    def __init__(self, seeds: list[int], sampling: SamplingConfig) -> None:
        if sampling.temperature <= 0:
            raise ValueError("SeededSampler samples: it needs temperature > 0")
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.sampling = sampling
        # log-prob of each drawn token under the distribution it was drawn from, per row
        self.logprobs: list[list[float]] = [[] for _ in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        logits = processed_logits(scores, input_ids, self.sampling)
        probs = logits.softmax(dim=-1).cpu()
        drawn = torch.stack(
            [
                torch.multinomial(probs[row], 1, generator=gen)
                for row, gen in enumerate(self.generators)
            ]
        ).to(scores.device)
        picked = logits.log_softmax(dim=-1).gather(1, drawn)[:, 0].tolist()
        for row, value in enumerate(picked):
            self.logprobs[row].append(value)
        one_hot = torch.full_like(scores, float("-inf"))
        return one_hot.scatter_(1, drawn, 0.0)


class HFEngine(InferenceEngine):
    """Generation with transformers ``generate``, one prompt group per call.

    Args:
        model: a local model directory, a hub id, or an alias known to
            :func:`periodic_rl.models.resolve_model`.
        dtype: dtype the engine holds the weights in.
        device: where the model runs (``"cpu"``, ``"cuda"``, ...).
    """

    def __init__(
        self, model: str, dtype: str | torch.dtype = "float32", device: str = "cpu"
    ) -> None:
        from periodic_rl.models import load_causal_lm, load_tokenizer, resolve_model

        self.model_path = resolve_model(model)
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model = load_causal_lm(self.model_path, dtype=self.dtype).to(self.device)
        self.model.requires_grad_(False)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, self.model.generation_config)
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_ids[0]
        self._names = WeightNames.of_model(self.model)
        self._fingerprint: str | None = None  # computed lazily: hashing every parameter is not free

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[list[int]]]:
        """``request.n`` completions per request; see the module docstring on seeding."""
        return [self._generate_group(request, sampling)[0] for request in requests]

    def generate_with_logprobs(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """Like :meth:`generate`, plus the behaviour log-probs: the log-prob of every sampled
        token under the distribution it was drawn from, ``log_softmax`` of the processed scores
        (:func:`processed_logits`: ``repetition_penalty``, ``/ temperature``, ``min_p``,
        ``top_k``, ``top_p``) in float32, recorded by :class:`SeededSampler` as it draws (so at
        no extra cost). At ``temperature == 0`` (greedy) nothing is sampled: the log-probs are
        ``[]``."""
        return [self._generate_group(request, sampling) for request in requests]

    @torch.no_grad()
    def _generate_group(
        self, request: GenerationRequest, sampling: SamplingConfig
    ) -> tuple[list[list[int]], list[list[float]]]:
        if request.n <= 0:
            return [], []
        if not request.prompt_ids:
            raise ValueError("a prompt needs at least one token")
        if sampling.max_new_tokens <= 0:
            return [[] for _ in range(request.n)], [[] for _ in range(request.n)]
        from transformers import GenerationConfig, LogitsProcessorList

        prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        input_ids = prompt.expand(request.n, -1)
        processors = LogitsProcessorList()
        sampler = None
        if sampling.temperature > 0:
            seeds = [sample_seed(request.seed, i) for i in range(request.n)]
            sampler = SeededSampler(seeds, sampling)
            processors.append(sampler)
        elif sampling.repetition_penalty != 1.0:
            processors.append(RepetitionPenalty(sampling.repetition_penalty))
        # Every knob that could reshape the distribution is set explicitly: unset (None) fields
        # would be filled from the model's generation_config.json and change what is sampled.
        # The sampling warpers (top_k, whose default is 50, top_p, min_p, temperature) run only
        # under do_sample=True: never here, whatever generation_config.json says. The
        # distribution, ``sampling``'s knobs included, is made by the processors above.
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_new_tokens=0,
            use_cache=True,
        )
        sequences = self._live().generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            logits_processor=processors,
        )
        completions = [self._cut_at_eos(t) for t in sequences[:, prompt.shape[1] :].tolist()]
        if sampler is None:
            return completions, []
        return completions, [
            row[: len(c)] for row, c in zip(sampler.logprobs, completions, strict=True)
        ]

    def _cut_at_eos(self, tokens: list[int]) -> list[int]:
        """Drop the padding after the first EOS, keeping the EOS itself."""
        for position, token in enumerate(tokens):
            if token in self.eos_token_ids:
                return tokens[: position + 1]
        return tokens

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], partial: bool = False) -> str:
        """Copy ``state_dict`` (transformers names, any dtype) into the model in place.

        Names are checked strictly (tied aliases such as ``lm_head.weight`` may be absent;
        ``partial``: any subset of the model's names). Returns :func:`loaded_fingerprint` of the
        model's own state dict read back *after* the copy, under the received names: it equals
        the sender's ``weights_fingerprint(state_dict)`` only if every tensor landed (a tensor
        held in the engine's other dtype counts when it is exactly the received one converted).
        After a partial load :meth:`fingerprint` is recomputed from the model when asked.
        """
        own = self._live().state_dict()
        if partial:
            self._names.check_partial(state_dict)
        else:
            self._names.check(state_dict)
        for name, tensor in state_dict.items():
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(own[name].shape)}")
        self._copy_in(own, state_dict)
        held = self._live().state_dict()  # read back what the model holds now
        fingerprint = loaded_fingerprint(state_dict, {n: held[n] for n in state_dict if n in held})
        self._fingerprint = None if partial else fingerprint
        return fingerprint

    def _copy_in(self, own: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor]) -> None:
        """Copy each received tensor into the model's own (tests stand a faulty load in here)."""
        for name, tensor in state_dict.items():
            own[name].copy_(tensor.detach())

    def fingerprint(self) -> str:
        """What the last full :meth:`load_weights` returned, else (at start, after a partial
        load) the hash of the model's whole state dict."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self._live().state_dict())
        return self._fingerprint

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """``log p(token_ids[t] | token_ids[:t])`` for ``t >= 1``, from one fp32 log-softmax."""
        if len(token_ids) < 2:
            return []
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits = self._live()(input_ids=ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist()

    def shutdown(self) -> None:
        """Drop the model (the engine is unusable afterwards). Safe to call twice."""
        self.model = None

    def _live(self) -> Any:
        if self.model is None:
            raise RuntimeError("this HFEngine has been shut down")
        return self.model


def _eos_token_ids(tokenizer: Any, generation_config: Any) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS plus generation_config's."""
    ids: list[int] = []
    configured = getattr(generation_config, "eos_token_id", None)
    for candidate in [tokenizer.eos_token_id, configured]:
        values = candidate if isinstance(candidate, list | tuple) else [candidate]
        ids += [int(v) for v in values if v is not None and int(v) not in ids]
    if not ids:
        raise ValueError("the model defines no EOS token")
    return ids
