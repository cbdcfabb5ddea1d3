"""A tiny byte-level BPE tokenizer with a ChatML chat template, written next to a tiny random model.

Byte-level, so any text (Chinese, emoji) tokenizes, and a multi-byte character often spans several
ids: exactly what incremental detokenization must get right. Trained in milliseconds on a fixed
corpus, so its files, and therefore its fingerprint, are the same in every run.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a function as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif message.tool_calls %}<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls %}{{ '\\n' }}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template that renders tools as Qwen2.5's does (its own words): the tools listed in the
system turn, earlier calls in `<tool_call>` blocks, tool answers in `<tool_response>` blocks."""
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Tell me a story about a robot who learns to paint.",
    "Hello world! Strata streams tokens through a gateway, a tokenizer and a model worker.",
    "你好，世界。今天天气很好。 Emoji: 🙂🚀✨ and accents: café, naïve, Zürich.",
    "def generate(prompt): return model(prompt)  # code, numbers 12345 67890",
]


THINK_TOKENS = ("<think>", "</think>")
"""Qwen3's reasoning tags, added as tokens of their own (not special: decoding keeps them)."""


def write_tiny_tokenizer(
    directory: Path,
    vocab_size: int = 384,
    chat_template: str = CHAT_TEMPLATE,
    added: tuple[str, ...] = (),
) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`; the
    `added` tokens come after the trained vocabulary, which shrinks to keep `vocab_size` ids in all."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 256,
        "chat_template": chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return directory
