"""Trajectory items whose prefix is about ``--tokens`` long, for measuring how bf16
prefill drift grows with prefix length (issue 15, C1 on gemma3-270m).

Each item is an ``arith-easy`` question preceded by worked examples (other items with
their answers) until the prompt, encoded as kvreplay encodes prompts, reaches the length
asked for. The item's ``prompt_token_count`` covers only its first few tokens, so
``replay`` feeds every later token one at a time, as a decoder that had produced them
would, while ``prefill`` reads the whole prefix in one pass. The prefix is text the
model did not write; what is measured is the numerics of one-shot vs token-by-token
processing at that length.

Usage: .venv/bin/python bench/long_prefix_items.py --model gemma3-270m --tokens 1024 \
           --n 12 > runs/long-1024.jsonl
"""

from __future__ import annotations

import argparse
import json

from kvreplay.core.items import arith_easy_items, encode_prompt
from kvreplay.model.reading import load_tokenizer

HEADER_TOKENS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=12)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    items = arith_easy_items()
    questions, examples = items[: args.n], items[args.n :]
    for item in questions:
        shots: list[str] = []
        for example in examples:
            text = "\n\n".join([*shots, f"Question: {item.prompt}\nAnswer:"])
            ids = encode_prompt(tokenizer, text)  # as kvreplay encodes a prompt
            if len(ids) >= args.tokens:
                break
            shots.append(f"Question: {example.prompt}\nAnswer: {example.answer}")
        record = {
            "id": f"{item.id}-L{args.tokens}",
            "prefix_token_ids": list(ids),
            "prompt_token_count": HEADER_TOKENS,
            "answer": item.answer,
            "meta": {"tokens": len(ids), "examples": len(shots)},
        }
        print(json.dumps(record))


if __name__ == "__main__":
    main()
