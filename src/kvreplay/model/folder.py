"""A model folder read without transformers, for the core install (design: core install
vs extras): its decoder config, its generation config's EOS ids, and its tokenizer.

The tokenizer is the folder's ``tokenizer.json`` run by the ``tokenizers`` library (the
engine transformers' fast tokenizers run on), its special tokens read from
``tokenizer_config.json`` (or ``special_tokens_map.json``), and its chat template
(``chat_template.jinja`` or the config's) rendered with jinja2 in a sandbox set up as
transformers sets up its own, then encoded without special tokens, as transformers
does. Tests hold its token ids, decoded text and special ids equal to transformers' on
the embedded SmolLM2 and the tiny models, with and without the chat template; and the
http backend compares every prompt's ids with the server's own before a run starts.
What this reader cannot model as transformers would (a folder without tokenizer.json,
or a tokenizer that cleans up decoded spaces) is refused, naming ``kvreplay[hf]``.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.extras import INSTALL
from kvreplay.core.jsonio import read_json

# Where transformers finds a decoder's config inside a composite model's (in this order).
TEXT_CONFIG_NAMES = ("decoder", "generator", "text_config")
# The config fields kvreplay reads (transformers fills absent ones from class defaults,
# which this reader does not know, so an absent one is refused).
TEXT_FIELDS = ("model_type", "num_hidden_layers", "max_position_embeddings", "vocab_size")
NAMED_SPECIAL = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def needs_hf(spec: str, why: str) -> KvreplayError:
    return KvreplayError(
        f"Model {spec!r} {why}, which the core install cannot read as transformers does; "
        f"install transformers with: {INSTALL['hf']}"
    )


def _json(path: Path, spec: str) -> dict[str, Any]:
    data = read_json(path, f"{path.name} of model {spec!r}")
    if not isinstance(data, dict):
        raise KvreplayError(f"{path.name} of model {spec!r} is not a JSON object.")
    return data


def text_config(folder: Path, spec: str) -> SimpleNamespace:
    """The decoder's config as ``config.json`` writes it (a composite model's text part)."""
    config = _json(folder / "config.json", spec)
    nested = [config[n] for n in TEXT_CONFIG_NAMES if isinstance(config.get(n), dict)]
    if len(nested) > 1:
        raise KvreplayError(f"The config of model {spec!r} holds more than one text config.")
    text = nested[0] if nested else config
    absent = [name for name in TEXT_FIELDS if name not in text]
    if absent:
        raise needs_hf(spec, f"has no {absent[0]!r} in its config.json")
    return SimpleNamespace(**text)


def generation_config(folder: Path) -> SimpleNamespace | None:
    """The folder's generation config (what decoding reads of it: its EOS ids), or None."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    return SimpleNamespace(**_json(path, str(folder)))


def _content(token: Any) -> str | None:
    """A special token as a config writes it: a string, or an AddedToken's dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    """transformers' ``tojson`` filter: JSON without jinja's HTML escaping."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


class FolderTokenizer:
    """The tokenizer of a model folder, with the interface kvreplay uses of transformers'
    (``encode``, ``decode``, ``apply_chat_template``, special ids, vocabulary)."""

    def __init__(self, folder: Path, spec: str) -> None:
        from tokenizers import Tokenizer

        if not (folder / "tokenizer.json").is_file():
            raise needs_hf(spec, "has no tokenizer.json")
        config_path = folder / "tokenizer_config.json"
        config = _json(config_path, spec) if config_path.is_file() else {}
        if config.get("clean_up_tokenization_spaces"):
            raise needs_hf(spec, "cleans up decoded spaces (clean_up_tokenization_spaces)")
        special_map = folder / "special_tokens_map.json"
        fallback = _json(special_map, spec) if special_map.is_file() else {}
        try:
            self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise KvreplayError(f"Could not read the tokenizer of model {spec!r} ({exc}).") from exc
        self.special_tokens = {
            f"{name}_token": token
            for name in NAMED_SPECIAL
            if (token := _content(config.get(f"{name}_token", fallback.get(f"{name}_token"))))
        }
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        extra = extra or fallback.get("additional_special_tokens") or []
        # A dict names model-specific special tokens (transformers adds them as attributes).
        self.extra_special_tokens = [
            t for t in map(_content, extra.values() if isinstance(extra, dict) else extra) if t
        ]
        self.chat_template = self._template(folder, config)

    @staticmethod
    def _template(folder: Path, config: dict[str, Any]) -> str | None:
        """The chat template: ``chat_template.jinja`` first, as transformers reads it."""
        path = folder / "chat_template.jinja"
        if path.is_file():
            return path.read_text(encoding="utf-8")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def _id(self, token: str | None) -> int | None:
        """A token's id, or the unknown token's for one outside the vocabulary."""
        if token is None:
            return None
        found = self._tokenizer.token_to_id(token)
        return found if found is not None else self.unk_token_id

    @property
    def unk_token_id(self) -> int | None:
        unk = self.special_tokens.get("unk_token")
        return None if unk is None else self._tokenizer.token_to_id(unk)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.special_tokens.get("bos_token"))

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.special_tokens.get("eos_token"))

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.special_tokens.get("pad_token"))

    @property
    def all_special_ids(self) -> list[int]:
        tokens = dict.fromkeys([*self.special_tokens.values(), *self.extra_special_tokens])
        return [i for i in map(self._id, tokens) if i is not None]

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled(self) -> Any:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
        return environment.from_string(self.chat_template or "")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
    ) -> list[int] | str:
        """The messages rendered through the chat template (None-valued keys dropped, the
        named special tokens in scope) and encoded without special tokens."""
        if not self.chat_template:
            raise KvreplayError("This model has no chat template; pass --no-chat.")
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self._compiled.render(
            messages=plain, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special_tokens,
        )  # fmt: skip
        return self.encode(text, add_special_tokens=False) if tokenize else text
