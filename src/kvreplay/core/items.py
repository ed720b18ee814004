"""Items: the built-in ``arith`` and ``arith-easy`` sets, user JSONL (prompts or
pre-generated trajectories), validation that names the offending line, prompt encoding.
"""

from __future__ import annotations

import errno
import hashlib
import json
import random
import unicodedata
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.core.canonical import canonical
from kvreplay.core.errors import KvreplayError
from kvreplay.core.jsonio import JsonError, parse_json
from kvreplay.core.paths import check_name, read_regular

Prompt = str | list[dict[str, str]] | list[int]
"""Text, chat messages, or token ids taken as they are (no template: a cut-and-refeed
item's prompt is a generation's ids, template included)."""


def is_token_ids(prompt: Prompt | None) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


@dataclass(frozen=True)
class Item:
    """One problem. ``prefix_token_ids`` is set for trajectories produced elsewhere."""

    id: str
    prompt: Prompt | None
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    prefix_token_ids: tuple[int, ...] | None = None
    prompt_token_count: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.prefix_token_ids is None:
            del data["prefix_token_ids"], data["prompt_token_count"]
        else:
            data["prefix_token_ids"] = list(self.prefix_token_ids)
        return data


def frozen_text(items: list[Item]) -> str:
    """A run's items.jsonl as it writes it, byte for byte (an audit holds the file to it)."""
    return "".join(json.dumps(item.to_dict(), sort_keys=True) + "\n" for item in items)


def items_digest(items: list[Item]) -> str:
    """SHA-256 of the frozen item set as canonical JSONL (order matters)."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(canonical(item.to_dict()))
        digest.update(b"\n")
    return digest.hexdigest()


INSTRUCTION = "Solve the problem step by step, then give the final answer as a single integer.\n\n"


def _templates(rng: random.Random, scale: int) -> list[tuple[str, int]]:
    """Word problems at one difficulty scale; each returns (text, integer answer)."""
    a, b, c, d = (rng.randint(2, 9 * scale) for _ in range(4))
    g = rng.randint(2, 6 + scale)
    per = rng.randint(2, 5 + scale)
    return [
        (
            f"A shop has {a + b} apples. It sells {b} apples and then receives {c} boxes "
            f"with {d} apples each. How many apples does it have now?",
            a + c * d,
        ),
        (
            f"Tom reads {a} pages a day for {g} days and then {c} pages on the last day. "
            "How many pages did he read in total?",
            a * g + c,
        ),
        (
            f"Anna has {b * per + a} dollars. She buys {per} books that cost {b} dollars each. "
            "How many dollars does she have left?",
            a,
        ),
        (
            f"There are {g * per} students split into groups of {per}. Each group gets {c} "
            "pencils. How many pencils are handed out?",
            g * c,
        ),
        (f"Compute ({a} + {b}) * {g} - {c}.", (a + b) * g - c),
        (
            f"A train travels {a} km per hour for {g} hours, then {b} km per hour for {per} "
            "hours. How many km does it travel in total?",
            a * g + b * per,
        ),
        (
            f"A farmer has {a} cows and {b} chickens. How many legs do the animals have together?",
            4 * a + 2 * b,
        ),
        (
            f"Mia had {a + d} stickers, gave away {d}, and then doubled what was left. "
            "How many stickers does she have?",
            2 * a,
        ),
    ]


def arith_items(count: int = 240, seed: int = 20261202) -> list[Item]:
    """Deterministic multi-step arithmetic word problems with stable ids ``r0000``...

    Difficulty grows with the index (numbers scale 1, 2, 4, 8 by quartile) so that a
    small model gets some right and some wrong.
    """
    rng = random.Random(seed)
    items = []
    for index in range(count):
        scale = 2 ** (4 * index // count)
        templates = _templates(rng, scale)
        template = rng.randrange(len(templates))
        text, answer = templates[template]
        items.append(
            Item(
                id=f"r{index:04d}",
                prompt=INSTRUCTION + text,
                answer=str(answer),
                meta={"set": "arith", "template": template, "scale": scale, "seed": seed},
            )
        )
    return items


PEOPLE = ("Sam", "Lily", "Tom", "Anna", "Ben", "Mia")
FRUITS = ("apples", "oranges", "pears", "plums")
COLORS = (("red", "blue"), ("green", "yellow"), ("black", "white"), ("pink", "gray"),
          ("orange", "purple"), ("brown", "silver"))  # fmt: skip
BAGS = (
    ("bags", "bag", "marbles"),
    ("boxes", "box", "crayons"),
    ("jars", "jar", "buttons"),
    ("cups", "cup", "beads"),
    ("baskets", "basket", "eggs"),
    ("packs", "pack", "cards"),
)
# Sums twice as often as products: SmolLM2-135M solves more sums than products.
EASY_CYCLE = (0, 1, 0, 1, 2)


def _easy_template(rng: random.Random, template: int) -> tuple[str, int, list[int]]:
    """One single-step word problem with small numbers: (text, answer, operands)."""
    name, fruit, (c1, c2), (bags, bag, what) = (
        rng.choice(PEOPLE), rng.choice(FRUITS), rng.choice(COLORS), rng.choice(BAGS)
    )  # fmt: skip
    a, b = rng.randint(2, 6), rng.randint(2, 6)
    x, y = rng.randint(2, 3), rng.randint(2, 6)
    if template == 0:
        text = f"{name} has {a} {fruit} and buys {b} more. How many {fruit} are there now?"
        return text, a + b, [a, b]
    if template == 1:
        text = f"A box has {a} {c1} balls and {b} {c2} balls. How many balls are in the box?"
        return text, a + b, [a, b]
    text = f"There are {x} {bags} with {y} {what} in each {bag}. How many {what} are there?"
    return text, x * y, [x, y]


def arith_easy_items(count: int = 240, seed: int = 20261215) -> list[Item]:
    """Single-step word problems with numbers 2-6 (ids ``e0000``...) that SmolLM2-135M
    half-solves live under the ``instruct`` plan, with a suffix after the boundary.

    Templates follow ``EASY_CYCLE`` by index (0 and 1 add, 2 multiplies), so every
    prefix of the set has the same mix; prompts are distinct. Tuned by measurement
    through the ``matched`` live path (docs/experiments/arith-easy.md): first 48 items
    23/48 correct in bf16 greedy, first 16 11/16 in fp32, mean suffix 46 tokens, never
    EOS before the boundary. Harder candidates (sums up to 40, subtractions, two steps)
    scored 14-26%; bare "What is a + b?" prompts ended with EOS before the boundary.
    ``meta`` holds the template, operands in order of appearance, ``difficulty`` (largest
    operand) and seed.
    """
    rng = random.Random(seed)
    items: list[Item] = []
    seen: set[str] = set()
    for _ in range(100 * count):  # bounded: a template has finitely many prompts
        if len(items) == count:
            break
        template = EASY_CYCLE[len(items) % len(EASY_CYCLE)]
        text, answer, operands = _easy_template(rng, template)
        if text in seen:
            continue
        seen.add(text)
        items.append(
            Item(
                id=f"e{len(items):04d}",
                prompt=INSTRUCTION + text,
                answer=str(answer),
                meta={
                    "set": "arith-easy",
                    "template": template,
                    "operands": operands,
                    "difficulty": max(operands),
                    "seed": seed,
                },
            )
        )
    if len(items) < count:
        raise KvreplayError(f"arith-easy has fewer than {count} distinct items.")
    return items


BUILTIN_ITEMS: dict[str, Callable[[], list[Item]]] = {
    "arith": arith_items,
    "arith-easy": arith_easy_items,
}


def _fail(path: Path, line: int, why: str) -> KvreplayError:
    return KvreplayError(f"{path} line {line}: {why}.")


ROLES = ("system", "user", "assistant", "tool")


def _parse_prompt(value: Any, path: Path, line: int) -> Prompt:
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        unknown = [m["role"] for m in value if m["role"] not in ROLES]
        if unknown:
            raise _fail(
                path, line, f"unknown chat role {unknown[0]!r} (use one of {', '.join(ROLES)})"
            )
        return [{"role": m["role"], "content": m["content"]} for m in value]
    if isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value):
        return list(value)
    raise _fail(
        path, line, "'prompt' must be a non-empty string, a list of chat messages or of token ids"
    )


# The longest item id: ids become row keys, CSV cells and snapshot names, and analyze
# reads no CSV cell longer than csv's field limit.
MAX_ID_LENGTH = 200
# The word that marks a prefix row's key (``{experiment}/prefix/{item}``, see UnitKey):
# an item of that id would share keys with other items' prefix rows.
PREFIX_KEY = "prefix"


def id_problem(item_id: str) -> str | None:
    """Why an id cannot be a part of a row key ``{experiment}/{item}/{precision}``, or None."""
    if len(item_id) > MAX_ID_LENGTH:
        return f"is {len(item_id)} characters long (at most {MAX_ID_LENGTH})"
    if "/" in item_id:
        return "holds '/', which separates the parts of a row key"
    if item_id == PREFIX_KEY:
        return "is the word that marks a prefix row in the ledger's row keys"
    if any(unicodedata.category(c) == "Cc" for c in item_id):
        return "holds a control character"
    return None


def _parse_item(data: Any, path: Path, line: int) -> Item:
    if not isinstance(data, dict):
        raise _fail(path, line, "each line must be a JSON object")
    if not isinstance(data.get("id"), str) or not data["id"]:
        raise _fail(path, line, "missing field 'id' (a non-empty string)")
    problem = id_problem(data["id"])
    if problem:
        raise _fail(path, line, f"the id {data['id'][:40]!r} {problem}")
    answer = data.get("answer")
    if not isinstance(answer, str | int) or isinstance(answer, bool):
        raise _fail(path, line, "missing field 'answer' (a string or integer)")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise _fail(path, line, "'meta' must be an object")
    if "prefix_token_ids" in data:
        ids, count = data["prefix_token_ids"], data.get("prompt_token_count")
        valid = isinstance(ids, list) and bool(ids)
        valid = valid and all(type(t) is int and t >= 0 for t in ids)
        if not valid:
            raise _fail(path, line, "'prefix_token_ids' must be a non-empty list of token ids")
        if not (isinstance(count, int) and 0 < count <= len(ids)):
            raise _fail(path, line, "'prompt_token_count' must be an integer in [1, len(prefix)]")
        # optional here; a run's frozen items.jsonl writes an absent prompt as null
        prompt = (
            _parse_prompt(data["prompt"], path, line) if data.get("prompt") is not None else None
        )
        return Item(data["id"], prompt, str(data["answer"]), meta, tuple(ids), count)
    if "prompt" not in data:
        raise _fail(path, line, "missing field 'prompt'")
    return Item(data["id"], _parse_prompt(data["prompt"], path, line), str(data["answer"]), meta)


def load_jsonl(path: Path) -> list[Item]:
    """Read and validate a JSONL item file; any problem names its line."""
    try:
        lines = read_regular(path).split(b"\n")  # not splitlines: U+2028 may be in a string
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise KvreplayError(
                f"The item file {path} is not a regular file (a FIFO, device, socket or "
                "folder would block or fail the read); give a JSONL file."
            ) from exc
        raise KvreplayError(f"Cannot read the item file {path}: {exc.__class__.__name__}.") from exc
    items: list[Item] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            data = parse_json(text)
        except JsonError as exc:
            raise _fail(path, number, str(exc)) from exc
        item = _parse_item(data, path, number)
        if item.id in seen:
            raise _fail(path, number, f"duplicate id {item.id!r} (first on line {seen[item.id]})")
        seen[item.id] = number
        items.append(item)
    if not items:
        raise KvreplayError(f"The item file {path} holds no items.")
    return items


def load_items(source: str) -> list[Item]:
    """A built-in set name or a JSONL path."""
    if source in BUILTIN_ITEMS:
        return BUILTIN_ITEMS[source]()
    path = check_name(Path(source), "The item file")
    if not path.exists():
        raise KvreplayError(
            f"Items {source!r} are neither a built-in set ({', '.join(BUILTIN_ITEMS)}) nor a file."
        )
    return load_jsonl(path)


def chat_messages(tokenizer: Any, prompt: Prompt, chat: bool | None = None) -> list | None:
    """The messages a prompt goes through the chat template as (a string becomes a user
    turn), or None when it is encoded as plain text: the template is used when the
    tokenizer has one, unless ``chat`` says otherwise."""
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if not use_chat or is_token_ids(prompt):
        return None
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: bool | None = None) -> list[int]:
    """Token ids of a prompt; chat messages (or a string, wrapped as a user turn) go through
    the tokenizer's chat template when it has one, unless ``chat`` is False; token ids are
    taken as they are."""
    if is_token_ids(prompt):
        return [int(t) for t in prompt]  # type: ignore[arg-type]
    messages = chat_messages(tokenizer, prompt, chat)
    if messages is not None:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = encoded["input_ids"] if isinstance(encoded, dict) else encoded
        return [int(t) for t in ids]
    if not isinstance(prompt, str):
        raise KvreplayError("Chat-message prompts need a tokenizer with a chat template.")
    return [int(t) for t in tokenizer.encode(prompt)]
