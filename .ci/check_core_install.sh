#!/usr/bin/env bash
# The core install, from nothing: a new virtual environment on Python 3.11 in a temporary folder,
# the CPU torch (as the Makefile installs it), then `pip install -e <repo>` with no extra, then
# `import periodic_rl` and a 2-iteration fit of a tiny model built from a config (a byte-level
# tokenizer trained on the spot, saved to disk) with the transformers engine on Ray workers, a
# built-in task and a lambda reward, with Lightning's default logger and the module's default
# callbacks. Exits 0 when all of it works. Downloads the core's
# dependencies from the package index: not part of the test suite (`make check-install`).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
WORK="$(mktemp -d -t periodic-rl-core-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
began=$SECONDS

"$PYTHON" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade "pip>=24"
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e "$REPO"
"$PY" -m pip check

cd "$WORK"
"$PY" - <<'EOF'
import importlib.util
import sys

import periodic_rl  # noqa: F401  (registers the strategy names)

missing = [m for m in ("vllm", "gguf", "math_verify", "matplotlib", "tensorboard") if importlib.util.find_spec(m)]
assert not missing, f"the core install brought packages of the extras: {missing}"

import lightning as L
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule

# A byte-level BPE tokenizer with a chat template, and a tiny random Llama, saved to disk.
texts = [f"What is {a} + {b}? Reply with only the number. {a + b}" for a in range(20) for b in range(20)]
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(
    texts,
    trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ),
)
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
)
tokenizer.chat_template = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
config = LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).save_pretrained("tiny-model")
tokenizer.save_pretrained("tiny-model")

module = RLModule(
    model="tiny-model",
    reward_funcs=[lambda prompts, completions, **columns: [float(len(c)) for c in completions]],
    num_generations=2,
    micro_batch_size=2,
    max_new_tokens=4,
    shared_prompt=False,
)
trainer = L.Trainer(
    max_steps=2,
    strategy=PeriodicAsyncStrategy(engine="hf", num_workers=1),
    default_root_dir="run",  # Lightning's default logger: CSV, as the core has no TensorBoard
    enable_checkpointing=False,
    enable_progress_bar=False,
)
trainer.fit(module, datamodule=PromptDataModule("builtin:arithmetic", batch_size=2, num_train=8, num_val=2))
assert trainer.global_step == 2, trainer.global_step
assert "lightning" in sys.modules
print(f"core install: trained {trainer.global_step} iterations with periodic_rl {periodic_rl.__version__}")
EOF

echo "check_core_install: exit 0 after $((SECONDS - began)) s"
