"""Hostile input, third round: an HF config is input. Every field is read with its type checked, every
problem names ``config.<field>`` and the file, and a value the spec refuses is blamed on its field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specvit
from specvit import SpecError
from specvit.cli import main

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 100}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100, "n_positions": 32}
BERT = {"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 32}  # fmt: skip


def _refused(values: dict[str, Any], tmp_path: Path) -> str:
    """The first line of the SpecError ``from_hf`` gives for ``values`` written as a config.json."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    with pytest.raises(SpecError) as info:
        specvit.from_hf(path)
    return str(info.value).splitlines()[0]


@pytest.mark.parametrize(
    ("base", "change", "expected"),
    [
        (LLAMA, {"hidden_size": "64"}, "config.hidden_size: llama config has hidden_size='64': expected an integer "
         "(write the number without quotes: 64)"),
        (LLAMA, {"hidden_act": ["silu"]}, "config.hidden_act: llama config has hidden_act=['silu']: expected a string"),
        (LLAMA, {"rope_scaling": "linear"}, "config.rope_scaling: llama config has rope_scaling='linear': expected a "
         "mapping"),
        (LLAMA, {"rope_theta": "abc"}, "config.rope_theta: llama config has rope_theta='abc': expected a number"),
        (LLAMA, {"rope_theta": True}, "config.rope_theta: llama config has rope_theta=True: expected a number"),
        (LLAMA, {"num_attention_heads": 0}, "config.num_attention_heads: llama config has num_attention_heads=0: it "
         "must be 1 or more"),
        (LLAMA, {"num_hidden_layers": 2.5}, "config.num_hidden_layers: llama config has num_hidden_layers=2.5: "
         "expected an integer"),
        (LLAMA, {"attention_bias": "false"}, "config.attention_bias: llama config has attention_bias='false': "
         "expected a boolean"),
        (LLAMA, {"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
         "config.rope_parameters.rope_theta: llama config has rope_parameters.rope_theta='1e4': expected a number "
         "(write the number without quotes: 10000.0)"),
        (LLAMA, {"hidden_size": -64}, "config.hidden_size: llama config has hidden_size=-64: must be >= 1"),
        (LLAMA, {"vocab_size": 0}, "config.vocab_size: llama config has vocab_size=0: must be >= 1"),
        (GPT2, {"n_embd": "64"}, "config.n_embd: gpt2 config has n_embd='64': expected an integer (write the number "
         "without quotes: 64)"),
        (GPT2, {"layer_norm_epsilon": 1e400}, "config.layer_norm_epsilon: gpt2 config has layer_norm_epsilon=inf"),
        (BERT, {"num_attention_heads": 5}, "config.num_attention_heads: bert config has num_attention_heads=5: "
         "width 64 is not divisible by 5 heads"),
        ({"model_type": "vit", "architectures": ["ViTForImageClassification"], "id2label": {"0": "a", "1": "b"}},
         {"id2label": 3}, "config.id2label: vit config has id2label=3: expected a mapping"),
    ],
    ids=["str_int", "list_act", "str_rope_scaling", "str_theta", "bool_theta", "zero_heads", "float_depth",
         "str_bool", "nested_theta", "negative_width", "zero_vocab", "gpt2_str_width", "inf_eps", "derived",
         "int_id2label"],
)  # fmt: skip
def test_config_fields_are_typed_and_named(
    base: dict[str, Any], change: dict[str, Any], expected: str, tmp_path: Path
) -> None:
    line = _refused({**base, **change}, tmp_path)
    assert line.startswith(f"{tmp_path / 'config.json'}: "), line  # the file, always
    assert expected in line, line
    assert "64646464" not in line and "<from_hf>" not in line
    specvit.from_hf({**base})  # the control: the config without the change builds


def test_a_value_the_family_derives_is_said_to_come_from_the_config(tmp_path: Path) -> None:
    """GPT-2's MLP width is 4 * n_embd when n_inner is left out: a value of no field, but of the config."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT2, "n_embd": -64}))
    with pytest.raises(SpecError) as info:
        specvit.from_hf(path)
    lines = str(info.value).splitlines()
    assert any(line.startswith(f"{path}: config.n_embd: gpt2 config has n_embd=-64: ") for line in lines), (
        lines
    )
    assert any(
        line.startswith(f"{path}: decoder.block.mlp.hidden: ")
        and "(in the spec made of this gpt2 config)" in line
        for line in lines
    ), lines


def test_deeply_nested_arrays_are_a_spec_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(SpecError, match="the JSON nests too deeply to read"):
        specvit.from_hf(path)
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(
        SpecError,
        match=r"config\.hidden_act: llama config has hidden_act=\[\[\[\[\[\.\.\.\]\]\]\]\]: expected a string",
    ):
        specvit.from_hf({**LLAMA, "hidden_act": deep})  # the message shows a clipped repr, never recurses


def test_a_config_json_that_python_cannot_read_is_a_spec_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    for text, message in [
        ('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}", "a value cannot be read"),
        ('{"model_type": "llama",', "not valid JSON"),
        (b'{"model_type": "\xff"}', "not UTF-8"),
        ('{"model_type": "mamba"}', "config.model_type: model_type 'mamba' has no specvit family"),
    ]:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(SpecError) as info:
            specvit.from_hf(path)
        assert str(info.value).startswith(f"{path}") and message in str(info.value), str(info.value)


def test_the_cli_names_the_field_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT2, "n_embd": "64"}))
    run = subprocess.run(
        [sys.executable, "-m", "specvit.cli", "import", "hf", str(path), "-o", str(tmp_path / "s.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and "config.n_embd" in run.stderr, run.stderr
    assert not (tmp_path / "s.yaml").exists()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "dev_urandom", "sparse", "directory"])
def test_a_config_that_is_not_a_regular_file_is_refused(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "sparse":
        with path.open("wb") as f:
            f.truncate(4 << 30)
    else:
        path.symlink_to("/dev/" + kind.removeprefix("dev_"))
    with pytest.raises(SpecError) as info:
        specvit.from_hf(path)
    message = str(info.value)
    assert str(path) in message and "HF config" in message
    assert {"fifo": "FIFO", "dev_zero": "character device", "dev_urandom": "character device",
            "sparse": "4,294,967,296 bytes, over the", "directory": "is a directory"}[kind] in message  # fmt: skip
    assert main(["import", "hf", str(path), "-o", str(tmp_path / "s.yaml")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err
    assert not (tmp_path / "s.yaml").exists()


# ------------------------------------------------------------------------------------------ fuzzing

_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 4, 64, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["64", "silu", "gelu", "linear", "default", "abc"]),
    st.lists(st.integers(0, 4), max_size=3),
    st.dictionaries(st.sampled_from(["rope_type", "type", "rope_theta", "factor"]), st.sampled_from(["linear", "default", 1.0, "x", None]), max_size=3),
)  # fmt: skip
_FIELDS = sorted({*LLAMA, *GPT2, *BERT, "hidden_act", "activation_function", "rope_theta", "rope_scaling",
                  "rope_parameters", "num_key_value_heads", "head_dim", "rms_norm_eps", "layer_norm_eps",
                  "layer_norm_epsilon", "tie_word_embeddings", "n_inner", "type_vocab_size", "attention_bias",
                  "mlp_bias", "pretraining_tp", "position_embedding_type", "id2label", "architectures"} - {"model_type"})  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from([LLAMA, GPT2, BERT]),
    changes=st.dictionaries(st.sampled_from(_FIELDS), _VALUES, min_size=1, max_size=4),
)
def test_any_config_gives_a_spec_or_a_spec_error(base: dict[str, Any], changes: dict[str, Any]) -> None:
    """Random types per field of Llama, GPT-2 and BERT configs: a spec that builds, or a SpecError."""
    try:
        spec = specvit.from_hf({**base, **changes})
    except SpecError as exc:
        for problem in exc.problems:
            assert problem.location is not None and problem.location.file == "<dict>"
            assert problem.path.startswith("config.") or "(in the spec made of this" in problem.message
        return
    assert specvit.build_graph(spec).total_params > 0
