"""`python -m bench.model_parity`: how far our logits are from transformers' on the real models.

For each named model (default: the Qwen2.5-Coder pair), on the eight prompts of the real-model parity
test (tests/integration/test_qwen_models.py asserts their greedy equality): transformers' greedy
`generate` gives `--new-tokens` tokens and its logits at each step; our model, in float32 over the
paged cache, runs the prompt plus those tokens in one prefill and its logits at the same positions
are compared. The record holds, per model and over all positions, the largest absolute logit
difference, the largest relative to the position's logit range, and how many positions agree on the
top token. It writes bench/results/model-parity-cpu.json. This module measures; it must not judge
parity (the test does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from bench.stats import save_record
from strata.cli.model_convert import transformers_kwargs

MODELS_ROOT = Path("models")
DEFAULT_MODELS = "qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct"
BLOCK_SIZE = 16
CHAT_PROMPTS = (
    "Write a Python function is_prime(n) that returns True when n is prime.",
    "What does the `yield` keyword do in Python? Answer in one sentence.",
    "Write a SQL query that counts the rows of the table users.",
    "Reverse a string in JavaScript.",
)
PLAIN_PROMPTS = (
    "def fibonacci(n):\n    ",
    "import numpy as np\n\n# the mean of each row of a matrix\ndef row_means(matrix):\n",
    "#include <stdio.h>\n\nint main(void) {\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
)


def prompt_ids(model_dir: Path) -> list[list[int]]:
    """The eight prompts' ids: the chat ones through the model's chat template, the plain ones as text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts: list[list[int]] = []
    for text in CHAT_PROMPTS:
        chat = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(str(rendered), add_special_tokens=False)["input_ids"])
    return prompts + [tokenizer(text)["input_ids"] for text in PLAIN_PROMPTS]


def our_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Our float32 logits [len(ids), vocab] of one prefill over a paged cache."""
    from services.worker.model.attention import AttentionMetadata
    from services.worker.model.kv_cache import KVCache

    blocks = -(-len(ids) // BLOCK_SIZE)
    cache = KVCache.allocate(model.config, blocks, BLOCK_SIZE, torch.float32, "cpu")
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], BLOCK_SIZE, "cpu", 0)
    with torch.inference_mode():
        logits: torch.Tensor = model.compute_logits(
            model(torch.tensor(ids), torch.arange(len(ids)), meta, cache)
        )
    return logits


def measure(model_dir: Path, new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from services.worker.model.loader import load_model

    prompts = prompt_ids(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, **transformers_kwargs(model_dir)
    )
    hf.eval()
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True
    )
    references = []
    with torch.inference_mode():
        for ids in prompts:
            ids_tensor = torch.tensor([ids])
            out = hf.generate(
                ids_tensor, attention_mask=torch.ones_like(ids_tensor), generation_config=config
            )
            references.append(
                (out.sequences[0, len(ids) :].tolist(), torch.stack([s[0] for s in out.logits]))
            )
    del hf
    ours = load_model(model_dir).model
    worst_abs, worst_rel, agree, positions = 0.0, 0.0, 0, 0
    for ids, (tokens, ref) in zip(prompts, references, strict=True):
        logits = our_logits(ours, ids + tokens)[len(ids) - 1 : len(ids) - 1 + len(tokens)]
        diff = (logits - ref.float()).abs()
        spread = (ref.amax(dim=-1) - ref.amin(dim=-1)).clamp_min(1e-9)
        worst_abs = max(worst_abs, float(diff.max()))
        worst_rel = max(worst_rel, float((diff.amax(dim=-1) / spread).max()))
        agree += int((logits.argmax(dim=-1) == ref.argmax(dim=-1)).sum())
        positions += len(tokens)
    return {
        "prompts": len(prompts),
        "positions": positions,
        "max_abs_logit_error": worst_abs,
        "max_error_over_logit_range": worst_rel,
        "top1_agreement": agree / positions,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.model_parity", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated fetch-model names")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from bench.provenance import finish_provenance, start_provenance
    from strata.cli.model_sources import source

    provenance = start_provenance(threads=torch.get_num_threads())
    results = {}
    for name in args.models.split(","):
        entry = source(name)
        results[entry.name] = measure(MODELS_ROOT / entry.folder, args.new_tokens)
        print(f"bench.model_parity: {entry.name}: {results[entry.name]}", file=sys.stderr, flush=True)
    record = {
        "provenance": finish_provenance(provenance),
        # Accuracy only: no figure depends on the machine's load.
        "timed": False,
        "benchmark": "bench.model_parity",
        "new_tokens": args.new_tokens,
        "models": results,
    }
    save_record(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
