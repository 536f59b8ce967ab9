"""Checkpoints: a directory with ``spec.yaml``, ``model.safetensors`` and ``checkpoint.json``. Never pickle.

A checkpoint is one unit. Each file is written whole or not at all (temporary file, then rename), and
``checkpoint.json``, the manifest, is written last: it holds the SHA-256 of the other two. A save first
removes the old manifest, so a save that is interrupted leaves a directory without one; saves into one
directory take an exclusive lock on it (``flock``), so two at once run one after the other; and a load
takes a shared lock, reads each file once, and checks the bytes it read against the manifest. A spec
from one save beside the weights of another therefore never loads: it is a :class:`CheckpointError`.

:func:`specvit.load_pretrained` rebuilds the model from the spec on the meta device, checks every key,
shape and dtype of the weights against it (:func:`check_weights`) before anything is allocated, then
assigns the loaded tensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specvit.errors import CheckpointError
from specvit.io import Unreadable, file_mode, read_regular
from specvit.signals import cleanup_on_signals, deferred_signals, temporary
from specvit.spec.yamlread import MAX_BYTES
from specvit.text import escape

__all__ = [
    "MANIFEST_FILE",
    "SPEC_FILE",
    "WEIGHTS_FILE",
    "CheckpointError",
    "Contents",
    "check_weights",
    "read_checkpoint",
    "read_weights",
    "save_pretrained",
]

SPEC_FILE = "spec.yaml"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "checkpoint.json"
FORMAT = "specvit-checkpoint/1"


@contextlib.contextmanager
def _locked(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold an advisory lock on the directory ``path`` (POSIX ``flock``; no lock where there is none)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the manifest still catches a mixed directory
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        # a filesystem without locks (some network mounts) goes unlocked: the manifest still guards loads
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _digest(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


STAGING = ".specvit-save-"  # the hidden directory a save writes its files in before they are put in place


def save_pretrained(
    model: Any,
    directory: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write the model's canonical spec, its weights and the manifest that binds them into ``directory``.

    Only the checkpoint's three files are written; other files in the directory are left alone. The files
    are first written whole in a hidden directory inside ``directory``, then renamed into place under an
    exclusive lock with signals held: until then the previous checkpoint stays as it was and loads, and a
    signal (SIGINT, SIGTERM, SIGHUP ...) during the save removes what it wrote.

    Args:
        model: a compiled model.
        directory: created if missing.
        overwrite: allow writing into a directory that already has files.
        state_dict: the weights to write; default ``model.state_dict()``.

    Raises:
        CheckpointError: when ``directory`` is a file, or is not empty and ``overwrite`` is False.
        TypeError: ``model`` is not a compiled model, ``state_dict`` not a mapping of names to tensors, or
            another argument of the wrong type.
        ValueError: ``state_dict`` is not the model's: every missing or unexpected key, shape or dtype that
            would make the checkpoint fail to load is named, and nothing is written.
    """
    from safetensors.torch import save

    _check_arguments(model, directory, overwrite, state_dict)
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{escape(str(path))} exists and is not a directory")
    with cleanup_on_signals():
        weights = model.state_dict() if state_dict is None else state_dict
        tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
        weight_bytes = save(tensors, metadata={"format": "pt", "specvit_spec": model.spec.name})
        spec_bytes = model.spec.to_yaml().encode("utf-8")
        manifest = {
            "format": FORMAT,
            "files": {SPEC_FILE: _digest(spec_bytes), WEIGHTS_FILE: _digest(weight_bytes)},
        }
        files = {
            WEIGHTS_FILE: weight_bytes,
            SPEC_FILE: spec_bytes,
            MANIFEST_FILE: (json.dumps(manifest, indent=2) + "\n").encode(),
        }
        path.mkdir(parents=True, exist_ok=True)
        if not overwrite:
            _refuse_files(path)  # before writing anything; checked again under the lock
        with temporary(path, STAGING, directory=True) as tmp:
            for name, data in files.items():
                _stage(tmp / name, data, path / name)
            with _locked(path, exclusive=True):
                if not overwrite:
                    _refuse_files(path)  # under the lock: two saves cannot both find it empty
                with deferred_signals():
                    (path / MANIFEST_FILE).unlink(
                        missing_ok=True
                    )  # a save killed between renames never loads
                    for name in files:  # the manifest last
                        _put(tmp / name, path / name)
                    _sync(path)
    return path


def _refuse_files(path: Path) -> None:
    """Refuse a directory holding files (other saves' staging directories aside)."""
    if any(not entry.name.startswith(STAGING) for entry in path.iterdir()):
        raise CheckpointError(
            f"{escape(str(path))} is not empty; pass overwrite=True to replace its checkpoint"
        )


def _check_arguments(model: Any, directory: object, overwrite: object, state_dict: object) -> None:
    """What save_pretrained is given, checked before anything is written: a checkpoint it writes loads."""
    from specvit import argcheck
    from specvit.graph.ir import ArchGraph

    graph = getattr(model, "graph", None)
    if not (isinstance(model, torch.nn.Module) and isinstance(graph, ArchGraph)):
        raise TypeError(
            f"save_pretrained saves a model compiled by specvit (build_model, from_hf, ...), got "
            f"{type(model).__name__}; a plain nn.Module has no spec to load it by (torch.save its state_dict)"
        )
    argcheck.path(directory, "directory")
    argcheck.flag(overwrite, "overwrite")
    if state_dict is None:
        return
    argcheck.tensors(state_dict, "state_dict")
    expected = _expected(model)
    problems = check_weights(state_dict, expected)  # type: ignore[arg-type]
    if problems:
        shown = "\n  ".join(problems[:20]) + (
            f"\n  and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise ValueError(
            f"state_dict is not the weights of {graph.name}, and a checkpoint of it would not load:\n  {shown}"
        )


def _expected(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of ``model``'s whole state dict. A split model's (DTensor parameters) is read
    from its parameters and persistent buffers, whose shapes are the whole ones: its ``state_dict()`` is a
    collective (a packed projection is gathered), and only rank 0 saves. A packed projection's rows are
    counted in one process's order (a key/value head copied over several ranks once)."""
    from torch.distributed.tensor import DTensor

    from specvit.parallel_styles import first_rows, packed_rows

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    rows = packed_rows(model)
    out = {}
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for key, value in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if key not in module._non_persistent_buffers_set:
                shape = tuple(value.shape)
                if prefix + key in rows:
                    shape = (len(first_rows(rows[prefix + key])), *shape[1:])
                out[prefix + key] = (shape, value.dtype)
    return out


def _stage(staged: Path, data: bytes, final: Path) -> None:
    """Write ``data`` to ``staged`` whole (flushed to disk), with the mode ``final`` has or would get."""
    with open(staged, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(staged, file_mode(final))


def _put(staged: Path, final: Path) -> None:
    """Rename a staged file into place (one step of the commit; tests interleave other saves here)."""
    os.replace(staged, final)


def _sync(path: Path) -> None:
    """Flush the directory's entries (the renames) to disk, where the platform can."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class Contents:
    """The files of a checkpoint as read once, under a shared lock, and checked against the manifest.

    Args:
        directory: the checkpoint directory.
        spec_text: the bytes of ``spec.yaml``.
        weights: the bytes of ``model.safetensors``.
    """

    directory: Path
    spec_text: bytes
    weights: bytes
    manifest: Mapping[str, Any]

    def verify(self) -> None:
        """Check the bytes read against the manifest.

        Raises:
            CheckpointError: when a file is not the one the manifest was written for: the directory mixes
                two saves (an interrupted or concurrent save), or a file was changed or damaged since.
        """
        for name, data in ((SPEC_FILE, self.spec_text), (WEIGHTS_FILE, self.weights)):
            if self.manifest["files"][name] != _digest(data):
                raise CheckpointError(
                    f"{escape(str(self.directory / name))} is not the file {MANIFEST_FILE} was written for "
                    "(its SHA-256 differs): the checkpoint mixes two saves (an interrupted or concurrent "
                    "save) or the file was changed or damaged since; save the model again"
                )


MANIFEST_BYTES = 1 << 20  # checkpoint.json holds two digests: a larger one is not a manifest


def _read(path: Path, limit: int, *, head: bool = False) -> bytes:
    """The bytes of one file of a checkpoint, read by :func:`specvit.io.read_regular` (at most ``limit``)."""
    try:
        return read_regular(path, limit, "checkpoint file", head=head)
    except Unreadable as exc:
        where = escape(str(path))
        if exc.reason == "missing":
            raise CheckpointError(
                f"{where} is missing (the checkpoint is incomplete; save the model again)"
            ) from None
        regular = "a checkpoint holds regular files only; save the model again"
        hint = {"special": regular, "directory": regular, "too_big": "save the model again"}.get(
            exc.reason, exc.hint
        )
        raise CheckpointError(escape(f"{exc.message} ({hint})" if hint else exc.message)) from None


def _manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest of the checkpoint in ``path``, or a CheckpointError saying what is wrong."""
    where = escape(str(path / MANIFEST_FILE))
    if not (path / MANIFEST_FILE).exists():
        raise CheckpointError(
            f"{where} is missing: the checkpoint is incomplete (its save did not finish, or it was not "
            "written by specvit's save_pretrained); save the model again"
        )
    try:
        manifest = json.loads(_read(path / MANIFEST_FILE, MANIFEST_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(
            f"{where} is not valid JSON ({escape(str(exc))}); save the model again"
        ) from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(files, dict)
        or not all(_entry(files.get(n)) for n in (SPEC_FILE, WEIGHTS_FILE))
    ):
        raise CheckpointError(f"{where} is not a {FORMAT} manifest; save the model again")
    return manifest


def _entry(entry: Any) -> bool:
    """Whether a manifest's entry for a file is ``{"sha256": str, "bytes": int >= 0}``."""
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        return False
    size = entry.get("bytes")
    return isinstance(size, int) and not isinstance(size, bool) and size >= 0


HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header


def _weights_limit(path: Path) -> int:
    """The size the weight file's safetensors header says it has, which memory must be able to hold.

    Read from the header (8 bytes of length, then JSON) before the tensors: a file of another size (a
    sparse file of zeros, one cut short, one with bytes appended) is refused without reading its body.
    """
    from specvit.resources import memory_budget

    weights = path / WEIGHTS_FILE
    where = escape(str(weights))
    try:
        length = int.from_bytes(_read(weights, 8, head=True).ljust(8, b"\0"), "little")
        if not 2 <= length <= HEADER_BYTES:
            raise ValueError(f"a header of {length:,} bytes")
        header = json.loads(_read(weights, 8 + length, head=True)[8:])
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        size = 8 + length + max(ends, default=0)
        if not all(isinstance(e, int) for e in ends) or size != weights.stat().st_size:
            raise ValueError(
                f"its header describes {size:,} bytes, the file holds {weights.stat().st_size:,}"
            )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OSError) as exc:
        raise CheckpointError(
            f"{where} is truncated or corrupted ({escape(str(exc))}); save the model again"
        ) from None
    budget, what = memory_budget()
    if budget is not None and size > budget:
        raise CheckpointError(
            f"{where} holds {size:,} bytes, more than {what} ({budget:,} bytes); load it where there is more memory"
        )
    return size


def read_checkpoint(directory: str | os.PathLike[str]) -> Contents:
    """Read a checkpoint's manifest, spec and weights once each, under a shared lock on the directory.

    Call :meth:`Contents.verify` before trusting the bytes together.

    Args:
        directory: the checkpoint directory.

    Raises:
        CheckpointError: when the directory or a file is missing, or the manifest is missing or damaged.
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{escape(str(path))} is not a checkpoint directory")
    with _locked(path, exclusive=False):
        manifest = _manifest(path)
        spec = _read(path / SPEC_FILE, MAX_BYTES)
        weights = _read(path / WEIGHTS_FILE, _weights_limit(path))
        return Contents(path, spec, weights, manifest)


COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The floating-point dtypes the model's layers compute in: float8 (a storage format) is not one of them."""


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_weights(
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    cast: bool = False,
) -> list[str]:
    """Every way ``state`` differs from ``expected``: missing, unexpected, shape and dtype mismatches.

    A floating-point parameter must be stored as a floating-point tensor, anything else in its own dtype;
    unless ``cast``, the floating-point tensors must share one dtype (as ``save_pretrained`` writes them),
    since a model of mixed precisions fails only later, in its forward. A dtype the layers cannot compute
    in (float8, a storage format) is refused unless ``cast``, for the same reason.

    Args:
        state: the loaded tensors.
        expected: the model's state_dict keys, shapes and dtypes.
        cast: the caller casts floating-point tensors to one dtype, so mixed ones are fine.
    """
    got = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    problems = [f"missing {k} {list(s)}" for k, (s, _) in expected.items() if k not in got]
    problems += [f"unexpected {escape(k)} {list(s)}" for k, (s, _) in got.items() if k not in expected]
    floats: dict[torch.dtype, list[str]] = {}
    for k, (shape, dtype) in expected.items():
        if k not in got:
            continue
        have_shape, have = got[k]
        if have_shape != shape:
            problems.append(f"{k}: checkpoint has {list(have_shape)}, the spec needs {list(shape)}")
        if dtype.is_floating_point and not have.is_floating_point:
            problems.append(f"{k}: checkpoint has {_dtype(have)}, the model needs a floating-point tensor")
        elif dtype.is_floating_point and have not in COMPUTE_DTYPES and not cast:
            problems.append(
                f"{k}: checkpoint has {_dtype(have)}, a dtype the model cannot compute in (its layers take "
                f"{', '.join(_dtype(d) for d in COMPUTE_DTYPES)}; pass dtype= to load_pretrained to cast)"
            )
        elif not dtype.is_floating_point and have != dtype:
            problems.append(f"{k}: checkpoint has {_dtype(have)}, the model needs {_dtype(dtype)}")
        elif dtype.is_floating_point:
            floats.setdefault(have, []).append(k)
    if len(floats) > 1 and not cast:
        common = max(floats, key=lambda d: len(floats[d]))
        for d, keys in floats.items():
            if d != common:
                shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
                problems.append(
                    f"{shown}: checkpoint has {_dtype(d)} where the rest is {_dtype(common)} (pass dtype= to "
                    "load_pretrained to cast every tensor to one dtype)"
                )
    return problems


def read_weights(
    directory: str | os.PathLike[str],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    device: str,
    *,
    data: bytes | None = None,
    cast: bool = False,
) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint directory, checked key by key, shape by shape and dtype by dtype.

    Args:
        directory: the checkpoint directory.
        expected: the model's state_dict keys, shapes and dtypes.
        device: where to load the tensors.
        data: the bytes of the weight file, already read and verified (:func:`read_checkpoint`); default:
            read the file.
        cast: the caller casts the floating-point tensors to one dtype (see :func:`check_weights`).

    Raises:
        CheckpointError: when the weight file is missing, truncated, corrupted, or its keys, shapes or
            dtypes do not match (every mismatch is named).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(directory)
    weights = path / WEIGHTS_FILE
    try:
        state = load(data if data is not None else _read(weights, _weights_limit(path)))
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"{escape(str(weights))} is truncated or corrupted ({escape(str(exc))})"
        ) from None
    state = {k: v.to(device) for k, v in state.items()}
    problems = check_weights(state, expected, cast=cast)
    if problems:
        shown = "\n  ".join(problems[:20]) + (
            f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise CheckpointError(
            f"the weights in {escape(str(weights))} do not match {escape(str(path / SPEC_FILE))}:\n  {shown}"
        )
    return state
