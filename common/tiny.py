"""A tiny random-weight target and a locally built tokenizer, for the example pipeline and tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained in milliseconds on the texts
given, wrapped with a ChatML chat template (no `{% generation %}` tags, like most real
templates); the model is built from a transformers config. Run
`python -m common.tiny OUT_DIR` to write a loadable folder (config, weights, tokenizer).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

from common.logging import quiet_import_noise

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
EXAMPLE_DATA = Path(__file__).parent / "example_data" / "conversations.jsonl"


def example_texts() -> list[str]:
    """All message texts of the shipped example conversations (tokenizer training corpus)."""
    texts = []
    for line in EXAMPLE_DATA.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            texts += [m["content"] for m in row.get("messages", [])]
            texts += [row["text"]] if "text" in row else []
    return texts


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts`, with ChatML special tokens and chat template."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(texts), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_config(
    arch: str, vocab_size: int, num_layers: int = 4, hidden_size: int = 64
) -> PretrainedConfig:
    """A transformers config of a small Qwen3 or Llama model."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}; use qwen3 or llama")


def build_tiny_target(
    out_dir: str | Path,
    arch: str = "qwen3",
    num_layers: int = 4,
    hidden_size: int = 64,
    seed: int = 0,
    texts: Iterable[str] | None = None,
) -> Path:
    """Write a random-weight causal LM plus tokenizer to `out_dir`; return the folder."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(texts if texts is not None else example_texts())
    config = tiny_config(arch, len(tokenizer), num_layers, hidden_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=64)
    args = parser.parse_args()
    # scripts/example.sh starts with this: without it, an installed torchao's import warnings
    # (common/logging.py) were the first lines a newcomer saw
    quiet_import_noise()
    path = build_tiny_target(args.out_dir, args.arch, args.num_layers, args.hidden_size)
    print(f"tiny {args.arch} target written to {path}")


if __name__ == "__main__":
    main()
