"""Items: the built-in arith set, JSONL validation, prompt encoding."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tiny

from kvreplay import KvreplayError, arith_items, encode_prompt, load_items
from kvreplay.core.items import INSTRUCTION, Item, items_digest, load_jsonl

# Each template's answer from the numbers in its text, in order of appearance.
SOLVERS = {
    0: lambda n: n[0] - n[1] + n[2] * n[3],
    1: lambda n: n[0] * n[1] + n[2],
    2: lambda n: n[0] - n[1] * n[2],
    3: lambda n: n[0] // n[1] * n[2],
    4: lambda n: (n[0] + n[1]) * n[2] - n[3],
    5: lambda n: n[0] * n[1] + n[2] * n[3],
    6: lambda n: 4 * n[0] + 2 * n[1],
    7: lambda n: 2 * (n[0] - n[1]),
}


def test_arith_is_deterministic_with_stable_ids() -> None:
    items = arith_items()
    assert len(items) >= 200
    assert [i.id for i in items] == [f"r{k:04d}" for k in range(len(items))]
    assert items == arith_items()
    assert items_digest(items) == items_digest(arith_items())
    assert arith_items(seed=1) != items


def test_arith_answers_are_correct() -> None:
    items = arith_items()
    for item in items:
        assert item.prompt.startswith(INSTRUCTION)
        numbers = [int(x) for x in re.findall(r"\d+", item.prompt.removeprefix(INSTRUCTION))]
        assert str(SOLVERS[item.meta["template"]](numbers)) == item.answer, item.id
    assert len({i.meta["template"] for i in items}) == len(SOLVERS)
    assert sorted({i.meta["scale"] for i in items}) == [1, 2, 4, 8]


def test_builtin_name_loads_the_builtin_set() -> None:
    assert load_items("arith") == arith_items()


def _write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_jsonl_items_load_with_chat_prompts_and_trajectories(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "2+2?"}]
    path = _write(
        tmp_path,
        {"id": "a", "prompt": "What is 1+1?", "answer": 2, "meta": {"src": "x"}},
        "",
        {"id": "b", "prompt": chat, "answer": "4"},
        {"id": "c", "answer": "7", "prefix_token_ids": [5, 6, 7], "prompt_token_count": 2},
    )
    a, b, c = load_items(str(path))
    assert a == Item("a", "What is 1+1?", "2", {"src": "x"})
    assert b.prompt == chat
    assert c.prefix_token_ids == (5, 6, 7) and c.prompt_token_count == 2 and c.prompt is None
    assert c.to_dict()["prefix_token_ids"] == [5, 6, 7]
    assert "prefix_token_ids" not in a.to_dict()


GOOD = {"id": "ok", "prompt": "p", "answer": "1"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"id": "x", "prompt": ', "malformed JSON"),
        ("[1, 2]", "JSON object"),
        ({"prompt": "p", "answer": "1"}, "missing field 'id'"),
        ({"id": "x", "prompt": "p"}, "missing field 'answer'"),
        ({"id": "x", "answer": "1"}, "missing field 'prompt'"),
        ({"id": "ok", "prompt": "p", "answer": "1"}, "duplicate id 'ok' \\(first on line 1\\)"),
        ({"id": "x", "prompt": 5, "answer": "1"}, "'prompt' must be"),
        ({"id": "x", "prompt": "", "answer": "1"}, "'prompt' must be"),
        ({"id": "x", "prompt": [{"role": "user"}], "answer": "1"}, "'prompt' must be"),
        ({"id": "x", "prompt": [1, -2], "answer": "1"}, "'prompt' must be"),
        ({"id": "x", "prompt": [1, 2.5], "answer": "1"}, "'prompt' must be"),
        ({"id": "x", "prompt": [1, True], "answer": "1"}, "'prompt' must be"),
        ({"id": "x", "prompt": "p", "answer": "1", "meta": []}, "'meta' must be"),
        (
            {"id": "x", "answer": "1", "prefix_token_ids": [], "prompt_token_count": 1},
            "'prefix_token_ids' must be",
        ),
        (
            {"id": "x", "answer": "1", "prefix_token_ids": [1, "a"], "prompt_token_count": 1},
            "'prefix_token_ids' must be",
        ),
        (
            {"id": "x", "answer": "1", "prefix_token_ids": [1, 2], "prompt_token_count": 3},
            "'prompt_token_count' must be",
        ),
        ({"id": "x", "answer": "1", "prefix_token_ids": [1, 2]}, "'prompt_token_count' must be"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, bad: object, message: str) -> None:
    path = _write(tmp_path, GOOD, "", bad)
    with pytest.raises(KvreplayError, match=f"line 3: .*{message}") as info:
        load_jsonl(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_empty_or_missing_item_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KvreplayError, match="holds no items"):
        load_items(str(_write(tmp_path, "")))
    with pytest.raises(KvreplayError, match="neither a built-in set"):
        load_items(str(tmp_path / "missing.jsonl"))


def test_encode_prompt_uses_the_chat_template_when_there_is_one() -> None:
    tokenizer = tiny.byte_tokenizer()
    chat = encode_prompt(tokenizer, "hi")
    assert tokenizer.decode(chat) == "<|user|>hi\n<|assistant|>"
    assert encode_prompt(tokenizer, [{"role": "user", "content": "hi"}]) == chat
    assert tokenizer.decode(encode_prompt(tokenizer, "hi", chat=False)) == "hi"
    with pytest.raises(KvreplayError, match="chat template"):
        encode_prompt(tokenizer, [{"role": "user", "content": "hi"}], chat=False)


def test_token_id_prompts_are_fed_as_they_are(tmp_path: Path) -> None:
    """A cut-and-refeed prompt: its ids already hold the template, so none is added."""
    tokenizer = tiny.byte_tokenizer()
    ids = encode_prompt(tokenizer, "hi") + [104, 105]
    assert encode_prompt(tokenizer, ids) == ids == encode_prompt(tokenizer, ids, chat=False)
    path = _write(tmp_path, {"id": "c", "prompt": ids, "answer": 1})
    (item,) = load_jsonl(path)
    assert item.prompt == ids and item.to_dict()["prompt"] == ids


# ``arith``'s digest before ``arith-easy`` was added; runs on ``arith`` depend on it.
ARITH_DIGEST = "a1d025cee9c2af6b89c22cc28a1407c7f6361fa7df0d3e9e16488aac741953ae"

# Each arith-easy template's answer from its operands (meta), in order of appearance.
EASY_SOLVERS = {0: lambda n: n[0] + n[1], 1: lambda n: n[0] + n[1], 2: lambda n: n[0] * n[1]}


def test_arith_digest_is_unchanged() -> None:
    assert items_digest(arith_items()) == ARITH_DIGEST


def test_arith_easy_is_deterministic_with_stable_unique_ids() -> None:
    from kvreplay.core.items import arith_easy_items

    items = arith_easy_items()
    assert len(items) >= 240
    assert [i.id for i in items] == [f"e{k:04d}" for k in range(len(items))]
    assert len({i.prompt for i in items}) == len(items)
    assert items_digest(items) == items_digest(arith_easy_items())
    assert items_digest(arith_easy_items(seed=1)) != items_digest(items)
    assert load_items("arith-easy") == items
    assert {i.meta["template"] for i in items[:200]} == set(EASY_SOLVERS)
    with pytest.raises(KvreplayError, match="distinct items"):
        arith_easy_items(count=1000)  # finitely many prompts: refused, not an endless loop


def test_arith_easy_answers_are_correct() -> None:
    from kvreplay.core.items import arith_easy_items

    for item in arith_easy_items():
        solve = EASY_SOLVERS[item.meta["template"]]
        assert item.prompt.startswith(INSTRUCTION)
        assert item.meta["set"] == "arith-easy"
        assert item.meta["difficulty"] == max(item.meta["operands"])
        assert isinstance(item.meta["seed"], int)
        numbers = [int(x) for x in re.findall(r"\d+", item.prompt.removeprefix(INSTRUCTION))]
        assert numbers == item.meta["operands"], item.id
        assert str(solve(numbers)) == item.answer, item.id
        assert int(item.answer) >= 0
