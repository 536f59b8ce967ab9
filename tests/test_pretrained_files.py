"""specvit.from_pretrained on model directories whose files are not what they seem: every file (config,
index, each shard) is refused with a SpecError naming it before it is read when it is not a regular file
(a FIFO never blocks, /dev/zero is never read), an index cannot name a file outside its directory, and a
damaged, incomplete or quantised shard is named with what is wrong with it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_pretrained import write_hf

import specvit
from specvit.errors import SpecError
from specvit.weights import Weights

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf("gpt2_sharded", tmp_path_factory.mktemp("sharded") / "gpt2")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf("llama_gqa", tmp_path_factory.mktemp("single") / "llama")


def _copy(directory: Path, tmp_path: Path) -> Path:
    target = tmp_path / directory.name
    shutil.copytree(directory, target)
    return target


def _refusal(directory: Path) -> str:
    with pytest.raises(SpecError) as info:
        specvit.from_pretrained(directory)
    return str(info.value)


def _shard(directory: Path, n: int = 2) -> Path:
    return directory / f"model-0000{n}-of-00004.safetensors"


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


@pytest.mark.parametrize(
    ("make", "what"), [(_fifo, "a FIFO"), (_dev_zero, "a character device")], ids=["fifo", "dev_zero"]
)
@pytest.mark.parametrize("file", ["shard", "index", "config", "single"])
def test_a_file_that_is_not_a_regular_file_is_refused_unread(
    file: str, make: Callable[[Path], None], what: str, sharded: Path, single: Path, tmp_path: Path
) -> None:
    directory = _copy(single if file == "single" else sharded, tmp_path)
    path = {"shard": _shard(directory), "index": directory / INDEX, "config": directory / "config.json",
            "single": directory / "model.safetensors"}[file]  # fmt: skip
    make(path)
    message = _refusal(directory)
    assert f"{path}: " in message and f"is not a regular file but {what}" in message


def test_an_index_cannot_name_a_file_outside_its_directory(sharded: Path, tmp_path: Path) -> None:
    directory = _copy(sharded, tmp_path)
    index = json.loads((directory / INDEX).read_text())
    for bad in ("../../etc/passwd", "/etc/passwd", ".."):
        index["weight_map"]["transformer.wte.weight"] = bad
        (directory / INDEX).write_text(json.dumps(index))
        message = _refusal(directory)
        assert f"{directory / INDEX}: names shards that are not files of its directory: {bad!r}" in message


def test_a_missing_shard_is_named(sharded: Path, tmp_path: Path) -> None:
    directory = _copy(sharded, tmp_path)
    _shard(directory, 3).unlink()
    message = _refusal(directory)
    assert f"{_shard(directory, 3)}: safetensors file '{_shard(directory, 3).name}' does not exist" in message
    assert "the index names it: copy it into the directory" in message


def test_a_shard_missing_a_tensor_is_named(sharded: Path, tmp_path: Path) -> None:
    directory = _copy(sharded, tmp_path)
    tensors = load_file(_shard(directory, 4))
    del tensors["transformer.ln_f.weight"]
    save_file(tensors, _shard(directory, 4), metadata={"format": "pt"})
    message = _refusal(directory)
    assert (
        f"{_shard(directory, 4)}: has no tensor 'transformer.ln_f.weight', which {INDEX} says it holds"
        in message
    )


def test_a_shard_holding_what_the_index_does_not_list_is_named(sharded: Path, tmp_path: Path) -> None:
    directory = _copy(sharded, tmp_path)
    tensors = load_file(_shard(directory, 1))
    tensors["transformer.h.0.extra"] = torch.zeros(3)
    save_file(tensors, _shard(directory, 1), metadata={"format": "pt"})
    message = _refusal(directory)
    assert (
        f"{_shard(directory, 1)}: holds 'transformer.h.0.extra', which {directory / INDEX} does not list"
        in message
    )


def test_float8_weights_are_refused_by_name(single: Path, tmp_path: Path) -> None:
    directory = _copy(single, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    message = _refusal(directory)
    assert (
        f"{directory / 'model.safetensors'}: tensor '{key}' is stored as F8_E4M3, a quantised format"
        in message
    )
    assert "dequantise the checkpoint" in message


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (
            lambda p: os.truncate(p, p.stat().st_size - 1),
            "holds {cut:,} bytes, its header describes {size:,}",
        ),
        (lambda p: p.write_bytes(os.urandom(4096)), "is not a safetensors file"),
        (lambda p: p.write_bytes(b""), "is not a safetensors file (a header of -1 bytes in 0)"),
        (lambda p: p.write_bytes((5).to_bytes(8, "little") + b"[1,2]"), "its header is not a JSON object"),
        (lambda p: p.write_bytes((2).to_bytes(8, "little") + b"{]"), "its header is not JSON"),
    ],
    ids=["truncated", "random", "empty", "list_header", "bad_json"],
)
def test_a_damaged_weights_file_is_named(
    damage: Callable[[Path], object], said: str, single: Path, tmp_path: Path
) -> None:
    directory = _copy(single, tmp_path)
    size = (directory / "model.safetensors").stat().st_size
    damage(directory / "model.safetensors")
    message = _refusal(directory)
    assert f"{directory / 'model.safetensors'}: " in message
    assert said.format(cut=size - 1, size=size) in message


def test_offsets_that_overlap_are_refused(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    text = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + bytes(12))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    message = _refusal(tmp_path)
    assert "tensor 'b' has data_offsets from 4, where the tensor before it ends at 8" in message
    assert "overlap or leave a gap" in message


def test_a_directory_without_weights_or_config_says_what_it_lacks(single: Path, tmp_path: Path) -> None:
    directory = _copy(single, tmp_path)
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    message = _refusal(directory)
    assert (
        "has neither model.safetensors nor model.safetensors.index.json (it has pytorch_model.bin" in message
    )
    (directory / "config.json").unlink()
    assert "has no config.json (a transformers model directory) nor checkpoint.json" in _refusal(directory)


def test_a_config_that_is_a_file_not_a_directory_is_refused(single: Path) -> None:
    assert f"{single / 'config.json'}: is not a directory" in _refusal(single / "config.json")


def test_weights_of_another_model_name_every_key(single: Path, sharded: Path, tmp_path: Path) -> None:
    directory = _copy(single, tmp_path)
    shutil.copy(sharded / "config.json", directory / "config.json")  # GPT-2's config beside Llama's weights
    message = _refusal(directory)
    assert message.startswith(
        f"{directory}: the weights do not fit the spec made of its config: cannot convert"
    )
    assert len(message.splitlines()) >= 2 and "model.layers.0.self_attn.q_proj.weight" in message


def test_the_reader_gives_what_safetensors_gives(tmp_path: Path) -> None:
    """Every dtype specvit reads, empty tensors included, as safetensors' own loader reads them."""
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 2).to(torch.float16),
        "f64": torch.randn(4, dtype=torch.float64),
        "i64": torch.arange(-3, 3),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    expected = load_file(tmp_path / "w.safetensors")
    with Weights([tmp_path / "w.safetensors"]) as weights:
        assert sorted(weights) == sorted(expected)
        for key, tensor in expected.items():
            got = weights[key]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), key
    with Weights([tmp_path / "w.safetensors"], dtype=torch.float32) as weights:
        assert weights["bf16"].dtype == torch.float32 and weights["i64"].dtype == torch.int64
        assert torch.equal(weights["bf16"], expected["bf16"].float())


def test_a_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    """A .pth is read with torch.load(weights_only=True): a pickle calling a function never runs it."""
    pytest.importorskip("timm")

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    torch.save({"weight": Evil()}, tmp_path / "evil.pth")
    with pytest.raises(SpecError) as info:
        specvit.from_pretrained("vit_small_patch16_224", weights=tmp_path / "evil.pth", depth=1)
    assert f"{tmp_path / 'evil.pth'}: is not a state dict torch.load(weights_only=True) reads" in str(
        info.value
    )
    assert not (tmp_path / "ran").exists()


def test_a_timm_weights_file_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("timm")
    os.mkfifo(tmp_path / "w.pth")
    with pytest.raises(SpecError, match="is not a regular file but a FIFO"):
        specvit.from_pretrained("vit_small_patch16_224", weights=tmp_path / "w.pth", depth=1)


def test_a_name_timm_does_not_know_is_named(tmp_path: Path) -> None:
    pytest.importorskip("timm")
    with pytest.raises(SpecError, match="timm cannot build 'vit_no_such_model': Unknown model"):
        specvit.from_pretrained("vit_no_such_model", weights=tmp_path / "w.safetensors")


def test_shards_linked_into_a_cache_load(sharded: Path, tmp_path: Path) -> None:
    """huggingface_hub's cache keeps a snapshot's files as links to ../../blobs/<hash>: a link to a regular
    file outside the directory is fine; only the names an index gives must be files of the directory."""
    snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(sharded.iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    tokens = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        assert torch.equal(
            specvit.from_pretrained(snapshot)(tokens), specvit.from_pretrained(sharded)(tokens)
        )


def test_weights_larger_than_the_memory_are_refused_before_reading(
    single: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import specvit.pretrained

    read: list[str] = []
    monkeypatch.setattr(specvit.pretrained, "memory_budget", lambda: (100_000, "the memory available"))
    monkeypatch.setattr(Weights, "_read", lambda self, entry: read.append(entry.file))
    message = _refusal(single)
    assert (
        f"{single}: its weights take 139,584 bytes, more than the memory available (100,000 bytes)" in message
    )
    assert read == []
