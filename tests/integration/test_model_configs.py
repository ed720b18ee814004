"""Issue 34, item 6: model configs transformers rejects, cannot build a model from, or
builds one that would run wrong. Each is refused through the CLI in one sentence naming
the model and the field, exit 2, before the manifest is written."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import QUICK, check, copy_model, invoke, run_args

Edit = Callable[[dict[str, Any]], None]


def _set(**fields: Any) -> Edit:
    return lambda config: config.update(fields)


def _drop_a_layer_type(config: dict[str, Any]) -> None:
    config["layer_types"] = config["layer_types"][:-1]


# case: (arch, the file edited, edit, what the sentence says)
CONFIGS: dict[str, tuple[str, str, Edit, str]] = {
    "layers_disagree_with_layer_types": ("gemma3", "config.json", _drop_a_layer_type,
        "`num_hidden_layers` (3) must be equal to the number of `layer_types` (2)"),
    "unknown_rope_type": ("qwen2", "config.json",
        _set(rope_parameters={"rope_type": "bogus", "rope_theta": 1e4}),
        "gives rope_type 'bogus'; it must be one of default, "),
    "unknown_rope_type_per_layer_kind": ("gemma3", "config.json",
        _set(rope_parameters={"full_attention": {"rope_type": "bogus", "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        "gives rope_type 'bogus'"),
    "negative_hidden_size": ("qwen2", "config.json", _set(hidden_size=-64),
        "gives hidden_size -64; it must be a positive integer"),
    "zero_layers": ("llama", "config.json", _set(num_hidden_layers=0, layer_types=None),
        "gives num_hidden_layers 0; it must be a positive integer"),
    "vocab_size_a_string": ("qwen2", "config.json", _set(vocab_size="320"),
        "(TypeError: Field 'vocab_size' expected int, got str"),
    "heads_do_not_divide_hidden": ("qwen2", "config.json",
        _set(num_attention_heads=5, num_key_value_heads=5),
        "gives hidden_size 64; it must be a multiple of num_attention_heads (5)"),
    "kv_heads_do_not_divide_heads": ("qwen2", "config.json", _set(num_key_value_heads=3),
        "gives num_attention_heads 4; it must be a multiple of num_key_value_heads (3)"),
    "eos_outside_the_vocabulary": ("qwen2", "config.json", _set(eos_token_id=10_000),
        "config.json of model '{model}' gives eos_token_id 10000, outside the vocabulary of 320"),
    "eos_list_outside_the_vocabulary": ("qwen2", "generation_config.json",
        _set(eos_token_id=[256, 320]),
        "generation_config.json of model '{model}' gives eos_token_id 320, outside"),
    "pad_past_the_vocabulary": ("llama", "config.json", _set(pad_token_id=320),
        "gives pad_token_id 320, outside the vocabulary"),
    "unknown_activation": ("gemma3", "config.json", _set(hidden_activation="bogus"),
        "gives hidden_activation 'bogus'; it must be an activation transformers knows"),
    "unknown_model_type": ("qwen2", "config.json", _set(model_type="no_such_model"),
        "is not one transformers accepts (The checkpoint you are trying to load has model "
        "type `no_such_model`"),
    "unknown_dtype": ("qwen2", "config.json", _set(dtype="float99"),
        "has no attribute 'float99'"),
    # the class: a config transformers accepts but cannot build a model from
    "rope_theta_a_string": ("qwen2", "config.json",
        _set(rope_parameters={"rope_type": "default", "rope_theta": "x"}),
        "is not a causal language model transformers can build from its config.json "
        "(TypeError: "),
    "query_scalar_zero": ("gemma3", "config.json", _set(query_pre_attn_scalar=0),
        "can build from its config.json (ZeroDivisionError: "),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_config_that_no_model_runs_from_is_refused_before_the_manifest(
    case: str, tmp_path: Path, tiny_dirs: dict[str, Path]
) -> None:
    arch, file, edit, expected = CONFIGS[case]
    model = copy_model(tiny_dirs[arch], tmp_path / "model")
    config = json.loads((model / file).read_text())
    edit(config)
    (model / file).write_text(json.dumps(config))
    args, out = run_args("matched", tmp_path, model)
    check(invoke(*args, *QUICK), expected.format(model=model), out)
    assert not (out / "manifest.json").exists()


def test_a_negative_pad_id_is_left_alone(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    """Published configs write pad_token_id -1 for "none": such a model still runs."""
    model = copy_model(tiny_dirs["qwen2"], tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["pad_token_id"] = -1
    (model / "config.json").write_text(json.dumps(config))
    args, out = run_args("matched", tmp_path, model)
    result = invoke(*args, *QUICK)
    assert result.exit_code == 0, result.output
    assert (out / "matched_live_prefill.csv").is_file()
