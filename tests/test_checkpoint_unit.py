"""A checkpoint is one unit: concurrent, interrupted, mixed or damaged saves never load as a model.

Every load either gives back exactly the model one save wrote (spec and every weight, in its dtype) or
raises a CheckpointError (or a SpecError for a spec.yaml that is not a spec) saying what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

import specvit
from specvit import checkpoint as ck
from specvit.checkpoint import CheckpointError
from specvit.compile import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT / "specs" / "mnist_vit.yaml"
SMALL = {"encoder.width": 32, "encoder.block.heads": 2, "encoder.block.mlp.hidden": 64}


def _model(seed: int, **over: object) -> specvit.SpecModel:
    torch.manual_seed(seed)
    return specvit.build_model(MNIST, overrides={**SMALL, **over}).eval()


def _same(a: specvit.SpecModel, b: specvit.SpecModel) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return (
        a.spec == b.spec
        and sa.keys() == sb.keys()
        and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    )


@pytest.fixture(scope="module")
def pair() -> tuple[specvit.SpecModel, specvit.SpecModel]:
    """Two models of the same shapes whose specs differ (activation), so a mix would load silently."""
    return _model(0), _model(1, **{"encoder.block.mlp.activation": "relu"})


def test_a_save_loads_back_exactly(tmp_path: Path, pair: tuple[specvit.SpecModel, specvit.SpecModel]) -> None:
    a, _ = pair
    a.save_pretrained(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "checkpoint.json").read_text())
    assert set(manifest["files"]) == {"spec.yaml", "model.safetensors"}
    assert _same(load_pretrained(tmp_path / "ck"), a)


def test_weights_of_another_save_are_refused(
    tmp_path: Path, pair: tuple[specvit.SpecModel, specvit.SpecModel]
) -> None:
    """The mix the issue found: one save's spec beside another's weights, same shapes, different model."""
    a, b = pair
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    shutil.copy(tmp_path / "b" / "model.safetensors", tmp_path / "a" / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors is not the file checkpoint\.json was written"
    ):
        load_pretrained(tmp_path / "a")
    shutil.copy(tmp_path / "b" / "spec.yaml", tmp_path / "a" / "spec.yaml")
    with pytest.raises(CheckpointError, match=r"spec\.yaml is not the file checkpoint\.json was written for"):
        load_pretrained(tmp_path / "a")  # both files of b, a's manifest
    shutil.copy(tmp_path / "b" / "checkpoint.json", tmp_path / "a" / "checkpoint.json")
    assert _same(load_pretrained(tmp_path / "a"), b)  # the control: b whole loads as b


def test_an_interrupted_save_never_loads(
    tmp_path: Path, pair: tuple[specvit.SpecModel, specvit.SpecModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save of b over a's checkpoint stops after b's weights are in place (a crash, SIGKILL: signals are
    held while the files are renamed into place): neither a mix nor a half of b loads."""
    a, b = pair
    a.save_pretrained(tmp_path / "ck")
    real = ck._put

    def stop_at_spec(staged: Path, final: Path) -> None:
        if Path(final).name == "spec.yaml":
            raise KeyboardInterrupt
        real(staged, final)

    monkeypatch.setattr(ck, "_put", stop_at_spec)
    with pytest.raises(KeyboardInterrupt):
        b.save_pretrained(tmp_path / "ck", overwrite=True)
    monkeypatch.undo()
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() != (
        tmp_path / "ck" / "spec.yaml"
    ).read_bytes()
    with pytest.raises(CheckpointError, match=r"checkpoint\.json is missing: the checkpoint is incomplete"):
        load_pretrained(tmp_path / "ck")
    b.save_pretrained(tmp_path / "ck", overwrite=True)
    assert _same(load_pretrained(tmp_path / "ck"), b)


@contextlib.contextmanager
def _no_lock(path: Path, exclusive: bool) -> Iterator[None]:
    yield


def _interleave(monkeypatch: pytest.MonkeyPatch, between: object) -> None:
    """Make the next save call ``between()`` after putting its weights in place, before its spec."""
    real = ck._put
    done = []

    def put(staged: Path, final: Path) -> None:
        if Path(final).name == "spec.yaml" and not done:
            done.append(True)
            between()  # type: ignore[operator]
        real(staged, final)

    monkeypatch.setattr(ck, "_put", put)


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "control-unverified"])
def test_a_save_inside_another_save_never_loads_as_a_mix(
    tmp_path: Path,
    pair: tuple[specvit.SpecModel, specvit.SpecModel],
    monkeypatch: pytest.MonkeyPatch,
    verify: bool,
) -> None:
    """Without the lock, a's save is interleaved with b's whole save: b's weights end beside a's spec.

    The manifest refuses that directory. The control shows the interleaving really makes a mix: with
    the check switched off, the model that loads is neither a nor b.
    """
    a, b = pair
    directory = tmp_path / "ck"
    monkeypatch.setattr(ck, "_locked", _no_lock)
    _interleave(monkeypatch, lambda: ck.save_pretrained(b, directory, overwrite=True))
    a.save_pretrained(directory, overwrite=True)
    if verify:
        with pytest.raises(CheckpointError, match=r"model\.safetensors is not the file checkpoint\.json"):
            load_pretrained(directory)
    else:
        monkeypatch.setattr(ck.Contents, "verify", lambda self: None)
        mixed = load_pretrained(directory)
        assert not _same(mixed, a) and not _same(mixed, b)


def test_a_second_save_waits_for_the_first(
    tmp_path: Path, pair: tuple[specvit.SpecModel, specvit.SpecModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the lock, b's save started in the middle of a's cannot finish until a's has: b wins whole."""
    a, b = pair
    directory = tmp_path / "ck"
    directory.mkdir()
    finished = threading.Event()
    other = threading.Thread(target=lambda: (b.save_pretrained(directory, overwrite=True), finished.set()))

    def start_b() -> None:
        other.start()
        assert not finished.wait(0.5), "a second save ran while the first held the directory"

    _interleave(monkeypatch, start_b)
    a.save_pretrained(directory, overwrite=True)
    other.join()
    assert finished.is_set()
    assert _same(load_pretrained(directory), b)


def test_concurrent_saves_and_loads_always_load_one_save_whole(
    tmp_path: Path, pair: tuple[specvit.SpecModel, specvit.SpecModel]
) -> None:
    """Two writers save a and b into one directory over and over while a reader loads it 30 times."""
    a, b = pair
    directory = tmp_path / "ck"
    a.save_pretrained(directory)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(model: specvit.SpecModel) -> None:
        try:
            while not stop.is_set():
                model.save_pretrained(directory, overwrite=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(m,)) for m in (a, b)]
    for t in threads:
        t.start()
    try:
        for _ in range(30):
            model = load_pretrained(directory)
            assert _same(model, a) or _same(model, b), "a load gave a mix of two saves"
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors


def _rewrite_weights(directory: Path, change: dict[str, torch.Tensor]) -> None:
    path = directory / "model.safetensors"
    state = load(path.read_bytes())
    state.update(change)
    path.write_bytes(save(state, metadata={"format": "pt"}))


def test_tensors_of_the_wrong_dtype_are_named(
    tmp_path: Path, pair: tuple[specvit.SpecModel, specvit.SpecModel]
) -> None:
    a, _ = pair
    a.save_pretrained(tmp_path / "ck")
    weight = a.state_dict()["encoder.blocks.0.mlp.fc1.weight"]
    _rewrite_weights(tmp_path / "ck", {"encoder.blocks.0.mlp.fc1.weight": weight.to(torch.int64)})
    with pytest.raises(
        CheckpointError,
        match=r"encoder\.blocks\.0\.mlp\.fc1\.weight: checkpoint has int64, the model needs a floating-point",
    ):
        load_pretrained(tmp_path / "ck")
    _rewrite_weights(tmp_path / "ck", {"encoder.blocks.0.mlp.fc1.weight": weight.to(torch.float64)})
    with pytest.raises(
        CheckpointError, match=r"fc1\.weight: checkpoint has float64 where the rest is float32"
    ):
        load_pretrained(tmp_path / "ck")


def test_a_checkpoint_of_one_dtype_loads_in_it_and_dtype_casts(tmp_path: Path) -> None:
    model = _model(0).to(torch.float64)
    model.save_pretrained(tmp_path / "ck")
    again = load_pretrained(tmp_path / "ck")
    assert {p.dtype for p in again.parameters()} == {torch.float64}
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    assert torch.equal(model(x), again(x))
    cast = load_pretrained(tmp_path / "ck", dtype=torch.float32)
    assert {p.dtype for p in cast.parameters()} == {torch.float32}


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", r"checkpoint\.json is missing"),
        ("not json", r"checkpoint\.json is not valid JSON"),
        ("a list", r"checkpoint\.json is not a specvit-checkpoint/1 manifest"),
        ("no files", r"checkpoint\.json is not a specvit-checkpoint/1 manifest"),
    ],
)
def test_a_damaged_manifest_is_refused(
    tmp_path: Path, pair: tuple[specvit.SpecModel, specvit.SpecModel], damage: str, message: str
) -> None:
    pair[0].save_pretrained(tmp_path / "ck")
    manifest = tmp_path / "ck" / "checkpoint.json"
    if damage == "missing":
        manifest.unlink()
    else:
        text = {"not json": "{", "a list": "[]", "no files": json.dumps({"format": ck.FORMAT})}[damage]
        manifest.write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(tmp_path / "ck")


def test_saves_into_one_empty_directory_cannot_both_succeed_without_overwrite(
    tmp_path: Path, pair: tuple[specvit.SpecModel, specvit.SpecModel]
) -> None:
    """The emptiness check is made under the lock: of two saves racing for a new directory, one wins."""
    results: list[str] = []
    barrier = threading.Barrier(2)

    def save(model: specvit.SpecModel) -> None:
        barrier.wait()
        try:
            model.save_pretrained(tmp_path / "ck")
            results.append("saved")
        except CheckpointError:
            results.append("refused")

    threads = [threading.Thread(target=save, args=(m,)) for m in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["refused", "saved"]
    loaded = load_pretrained(tmp_path / "ck")
    assert _same(loaded, pair[0]) or _same(loaded, pair[1])


# ------------------------------------------------------------------------------------------ fuzzing

_FILES = ["spec.yaml", "model.safetensors", "checkpoint.json"]


@st.composite
def _damage(draw: st.DrawFn) -> list[tuple[str, str, int, int]]:
    """A few edits to a checkpoint directory: (what, file, position, byte)."""
    what = st.sampled_from(["flip", "truncate", "delete", "append", "other", "empty"])
    edit = st.tuples(what, st.sampled_from(_FILES), st.integers(0, 2**20), st.integers(1, 255))
    return draw(st.lists(edit, min_size=1, max_size=3))


@pytest.fixture(scope="module")
def saved(pair: tuple[specvit.SpecModel, specvit.SpecModel]) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        pair[0].save_pretrained(Path(tmp) / "a")
        pair[1].save_pretrained(Path(tmp) / "b")
        yield Path(tmp)


def _same_file(path: Path, saved: Path) -> bool:
    """Whether ``path`` holds what ``saved`` does: the same bytes, or for the manifest the same JSON.

    The manifest is the one file no digest covers; white space around its JSON changes none of what
    it says, so a manifest that differs only there describes the same checkpoint and must load.
    """
    if not path.exists():
        return False
    data, want = path.read_bytes(), saved.read_bytes()
    if data == want or path.name != ck.MANIFEST_FILE:
        return data == want
    try:
        return bool(json.loads(data) == json.loads(want))
    except ValueError:  # not JSON (nor UTF-8) any more
        return False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=_damage())
@example(edits=[("append", "checkpoint.json", 0, 9)])  # a tab after the manifest's JSON: still whole
@example(edits=[("flip", "checkpoint.json", 2, 0x29)])  # a space become a tab inside it
@example(edits=[("append", "checkpoint.json", 0, ord("}"))])  # no longer JSON: refused
def test_a_damaged_checkpoint_loads_whole_or_not_at_all(
    edits: list[tuple[str, str, int, int]],
    saved: Path,
    pair: tuple[specvit.SpecModel, specvit.SpecModel],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ck"
        shutil.copytree(saved / "a", directory)
        for what, name, at, byte in edits:
            path = directory / name
            if not path.exists():
                continue
            data = path.read_bytes()
            if what == "flip" and data:
                i = at % len(data)
                data = data[:i] + bytes([data[i] ^ byte]) + data[i + 1 :]
            elif what == "truncate":
                data = data[: at % (len(data) + 1)]
            elif what == "append":
                data += bytes([byte])
            elif what == "other":
                data = (saved / "b" / name).read_bytes()
            elif what == "empty":
                data = b""
            if what == "delete":
                path.unlink()
            else:
                path.write_bytes(data)
        unchanged = all(_same_file(directory / n, saved / "a" / n) for n in _FILES)
        both_b = all(_same_file(directory / n, saved / "b" / n) for n in _FILES)
        try:
            model = load_pretrained(directory)
        except (CheckpointError, specvit.SpecError):
            assert not unchanged and not both_b, "an intact checkpoint was refused"
            return
        assert unchanged or both_b, "a damaged checkpoint loaded"
        assert _same(model, pair[0] if unchanged else pair[1])
