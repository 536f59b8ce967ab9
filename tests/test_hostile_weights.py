"""Hostile input, third round: safetensors files whose headers lie, in a stranger's model directory
(``from_pretrained``, read by :class:`specvit.weights.Weights`) and in a specvit checkpoint whose
manifest was forged to match them (``load_pretrained``, read by safetensors after the header is checked).

Every lie is refused with a SpecError or CheckpointError that names the file, after reading at most its
header: offsets past the end or beyond any file, overlapping or out of order, offsets that are not
integers, shapes that disagree with their bytes, dtypes nobody knows, header lengths beyond the file or
beyond what an int64 holds, headers that are not JSON objects.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import specvit
from specvit import SpecError
from specvit.checkpoint import FORMAT, MANIFEST_FILE, SPEC_FILE, WEIGHTS_FILE, CheckpointError
from specvit.weights import Weights

BERT = {"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
        "intermediate_size": 16, "vocab_size": 10, "max_position_embeddings": 8}  # fmt: skip
A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _file(header: Any, data: int, length: int | None = None) -> bytes:
    """A safetensors file of ``header`` (JSON, or raw bytes) and ``data`` zero bytes; ``length`` is the
    header length its first 8 bytes state (default: the true one)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    stated = len(text) if length is None else length
    return stated.to_bytes(8, "little") + text + bytes(data)


LIES: dict[str, bytes] = {
    "past_the_end": _file({"a": A}, 4),
    "beyond_any_file": _file({"a": {"dtype": "F32", "shape": [2**68], "data_offsets": [0, 2**70]}}, 8),
    "overlapping": _file({"a": A, "b": {**A, "data_offsets": [4, 12]}}, 12),
    "gap": _file({"a": A, "b": {**A, "data_offsets": [12, 20]}}, 20),
    "reversed": _file({"a": {**A, "data_offsets": [8, 0]}}, 8),
    "negative": _file({"a": {**A, "data_offsets": [-8, 0]}}, 8),
    "float_offsets": _file({"a": {**A, "data_offsets": [0.0, 8.0]}}, 8),
    "bool_shape": _file({"a": {**A, "shape": [True, 2]}}, 8),
    "shape_of_other_bytes": _file({"a": {**A, "shape": [3]}}, 8),
    "unknown_dtype": _file({"a": {**A, "dtype": "F128"}}, 8),
    "dtype_not_a_string": _file({"a": {**A, "dtype": 4}}, 8),
    "float8": _file({"a": {**A, "dtype": "F8_E4M3", "shape": [8]}}, 8),
    "header_length_huge": _file({"a": A}, 8, length=2**63 - 1),
    "header_past_the_file": _file({"a": A}, 8, length=4096),
    "header_length_zero": _file({"a": A}, 8, length=0),
    "header_not_json": _file(b"{]", 8),
    "header_not_utf8": _file(b'{"\xff": 1}', 8),
    "header_deeply_nested": _file(b"[" * 100_000 + b"]" * 100_000, 8),
    "header_a_list": _file([A], 8),
    "entry_not_an_object": _file({"a": [0, 8]}, 8),
}


@pytest.mark.parametrize("lie", LIES)
def test_a_lying_header_in_a_model_directory_is_named(lie: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BERT))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(LIES[lie])
    with pytest.raises(SpecError) as info:
        specvit.from_pretrained(tmp_path)
    lines = str(info.value).splitlines()
    assert lines and all(line.startswith(f"{weights}: ") for line in lines), lines
    assert not any("do not fit" in line for line in lines), lines  # refused as a file, not as weights


def test_the_header_the_lies_are_made_of_is_read(tmp_path: Path) -> None:
    """The control: the true header of the lies above opens and reads as safetensors writes it."""
    file = tmp_path / "w.safetensors"
    file.write_bytes(_file({"a": A, "b": {**A, "data_offsets": [8, 16]}}, 16))
    with Weights([file]) as weights:
        assert torch.equal(weights["a"], torch.zeros(2)) and sorted(weights) == ["a", "b"]


def _forged(directory: Path, weights: bytes, model: specvit.SpecModel) -> None:
    """A specvit checkpoint of ``weights`` whose manifest was written to match them, as a forger would."""
    directory.mkdir()
    spec = model.spec.to_yaml().encode()
    files = {SPEC_FILE: spec, WEIGHTS_FILE: weights}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    digests = {n: {"sha256": hashlib.sha256(d).hexdigest(), "bytes": len(d)} for n, d in files.items()}
    (directory / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, "files": digests}))


@pytest.fixture(scope="module")
def model() -> specvit.SpecModel:
    return specvit.build_model(specvit.from_hf(BERT))


@pytest.mark.parametrize("lie", LIES)
def test_a_lying_header_in_a_forged_checkpoint_is_named(
    lie: str, model: specvit.SpecModel, tmp_path: Path
) -> None:
    directory = tmp_path / "ck"
    _forged(directory, LIES[lie], model)
    with pytest.raises(CheckpointError) as info:
        specvit.load_pretrained(directory)
    message = str(info.value)
    assert str(directory / WEIGHTS_FILE) in message, message
    assert message.count("\n") == 0 or "do not match" in message, message


def test_a_forged_checkpoint_of_true_weights_loads(model: specvit.SpecModel, tmp_path: Path) -> None:
    """The control of the forgery: the manifest a forger writes is the one save_pretrained writes."""
    from safetensors.torch import save

    _forged(tmp_path / "ck", save({k: v.contiguous() for k, v in model.state_dict().items()}), model)
    loaded = specvit.load_pretrained(tmp_path / "ck")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
