"""The core install's model folder reader (kvreplay.model.folder) against transformers: the same
token ids with and without the chat template, the same decoded text, special ids, vocabulary,
decoder config and EOS ids, on the tiny models and the embedded SmolLM2. What the http
backend computes from them (prompt ids, opener ids, EOS ids, the model identity's special
ids) is compared through kvreplay's own functions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import arith_items, encode_prompt
from kvreplay.core.stages import Stage, eos_ids, opener_ids
from kvreplay.model import folder as plain
from kvreplay.model.identity import special_token_ids
from kvreplay.model.reading import generation_config, text_config

TEXTS = [
    "What is 2+3?",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Unicode: héllo wörld — ∑ 日本語 🙂",
    "A special token inside text: <|im_end|> and <|eos|> and <|user|>.",
    "",
]
CONVERSATIONS: list[Any] = [
    "Compute 4*5.",
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 7*6?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "And 7*7?"},
    ],
]


def assert_same_tokenizer(folder: Path, spec: str, class_defaults: bool = False) -> None:
    """``class_defaults``: the folder leaves special tokens to the defaults of the class
    transformers picks by model type (the tiny models' tokenizer was saved by another
    class), which transformers adds to the vocabulary and the folder does not name."""
    ours, theirs = plain.FolderTokenizer(folder, spec), AutoTokenizer.from_pretrained(folder)
    prompts = [*TEXTS, *(item.prompt for item in arith_items(8))]
    for text in prompts:
        for special in (True, False):
            assert ours.encode(text, special) == theirs.encode(text, add_special_tokens=special)
    for prompt in [*prompts, *CONVERSATIONS]:
        for chat in (None, True, False):
            if chat is False and not isinstance(prompt, str):
                continue
            if chat and not theirs.chat_template:
                continue
            assert encode_prompt(ours, prompt, chat) == encode_prompt(theirs, prompt, chat)
    ids = theirs.encode(TEXTS[3] + TEXTS[2])
    for skip in (True, False):
        assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    ours_ids, theirs_ids = special_token_ids(ours), special_token_ids(theirs)
    if class_defaults:
        added = {i for i in theirs.all_special_ids if i >= len(ours)}
        assert added and set(ours_ids["all"]) == set(theirs_ids["all"]) - added
        assert ours_ids["eos"] == theirs_ids["eos"] and ours_ids["bos"] == theirs_ids["bos"]
        assert ours.get_vocab() == {t: i for t, i in theirs.get_vocab().items() if i < len(ours)}
    else:
        assert ours_ids == theirs_ids
        assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    stage = Stage("answer", 4, opener="\nAnswer:")
    assert opener_ids(ours, stage) == opener_ids(theirs, stage)
    config = generation_config(folder)
    assert eos_ids(ours, plain.generation_config(folder)) == eos_ids(theirs, config)
    reference = text_config(str(folder))
    light = plain.text_config(folder, spec)
    for name in plain.TEXT_FIELDS:
        assert getattr(light, name) == getattr(reference, name), name


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3", "drift_qwen2"])
def test_the_folder_tokenizer_is_transformers_on_the_tiny_models(tiny_dirs, arch: str) -> None:
    assert_same_tokenizer(tiny_dirs[arch], arch, class_defaults=arch == "qwen2")


@pytest.mark.slow
def test_the_folder_tokenizer_is_transformers_on_smollm2(smollm2_cache, monkeypatch) -> None:
    from kvreplay.model.embedded import EMBEDDED, convert_embedded

    monkeypatch.setenv("KVREPLAY_CACHE", str(smollm2_cache))
    assert_same_tokenizer(convert_embedded(EMBEDDED["smollm2-135m"]), "smollm2-135m")


def test_what_the_folder_reader_cannot_read_as_transformers_does_is_refused(
    tiny_dirs, tmp_path: Path
) -> None:
    import shutil

    folder = shutil.copytree(tiny_dirs["qwen2"], tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "clean_up_tokenization_spaces": True})
    )
    with pytest.raises(KvreplayError, match=r"cleans up decoded spaces.*kvreplay\[hf\]"):
        plain.FolderTokenizer(folder, "m")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(KvreplayError, match=r"has no tokenizer.json.*pip install 'kvreplay\[hf\]'"):
        plain.FolderTokenizer(folder, "m")
    model = json.loads((folder / "config.json").read_text())
    del model["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(model))
    with pytest.raises(KvreplayError, match="has no 'max_position_embeddings' in its config"):
        plain.text_config(folder, "m")
