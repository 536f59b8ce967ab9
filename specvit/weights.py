"""Weights read tensor by tensor from safetensors files: one file, or the shards an HF index names.

:class:`Weights` is a read-only mapping of tensor names to tensors. A tensor is read from its file when it
is asked for, into memory of its own, and the mapping keeps no strong reference to it: a converter that
renames and repacks a state dict one tensor at a time (:func:`specvit.convert_state_dict`) into a model
built on the meta device therefore holds every weight once, plus the few tensors it is combining, never
the whole file beside the model (``tests/test_pretrained.py`` measures the peak resident memory).

Each tensor is read with ``readinto`` into its own buffer rather than viewed through a memory map: pages
of a map count in the resident size for as long as the map lives (the file's bytes beside the model's
copies), a model whose parameters were views of a map would read whatever later replaces the file on
disk (and die of SIGBUS if it is truncated), and a file that shrinks while it is read is a clear error
here, not a signal. The bytes are still copied only once, from the page cache into the tensor, as a
memory-mapped ``get_tensor`` copies them.

Every file goes through :func:`specvit.io.open_regular` (a FIFO, a device or a link to one is refused
before a byte is read) and stays open while the mapping lives, so what is read is the file that was
checked. Each header is checked as safetensors checks it (known dtypes, offsets that tile the data
exactly, a file of the size the header describes) before any tensor is read.
"""

from __future__ import annotations

import io
import json
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specvit.errors import Location, Problem, SpecError, SpecFileError
from specvit.io import Unreadable, open_regular, read_regular

__all__ = ["INDEX_FILE", "WEIGHTS_FILE", "Weights", "directory_weights", "read_index"]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header
INDEX_BYTES = 1 << 24  # 16 MiB: an index lists one line per tensor (a few hundred KB for the largest models)

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
_QUANTISED = {"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"}
"""Storage formats of quantised checkpoints: their values mean something only with scales that a
quantisation library applies, so they are refused rather than cast."""


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, dtype and shape, and its bytes ``[start, start + nbytes)``.

    Args:
        file: the file, as named in messages.
        dtype: the stored dtype.
        shape: the tensor's shape.
        start: the offset of its first byte in the file.
        nbytes: its size in bytes.
    """

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def _problem(file: str, message: str, hint: str = "write the file again (save_pretrained)") -> Problem:
    return Problem("", message, hint, Location(file))


def _unreadable(exc: Unreadable, file: str, hint: str | None = None) -> SpecFileError:
    return SpecFileError(_problem(file, exc.message, hint if hint is not None else exc.hint))


def _entry(file: str, info: Any, base: int) -> tuple[Entry | None, str]:
    """The entry of one header item, or None and what is wrong with it."""
    if not isinstance(info, dict):
        return None, "is not an object"
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if isinstance(code, str) and code in _QUANTISED:
        return None, (
            f"is stored as {code}, a quantised format whose values need scales specvit does not apply "
            "(dequantise the checkpoint to float16, bfloat16 or float32 first)"
        )
    if not isinstance(code, str) or code not in _DTYPES:
        return None, f"has dtype {code!r}, which specvit does not read (it reads {', '.join(_DTYPES)})"
    if (
        not isinstance(shape, list)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(v) is int and v >= 0 for v in [*shape, *offsets])
    ):
        return None, "needs a shape of integers >= 0 and data_offsets [begin, end]"
    dtype = _DTYPES[code]
    begin, end = offsets
    numel = 1
    for n in shape:
        numel *= n
    if end - begin != numel * dtype.itemsize:
        return None, f"has data_offsets {offsets}, not the {numel * dtype.itemsize:,} bytes of {code} {shape}"
    return Entry(file, dtype, tuple(shape), base + begin, end - begin), ""


def _parse(f: io.BufferedReader, file: str) -> tuple[dict[str, Entry], list[Problem]]:
    """The tensors a safetensors file's header describes, or the problems that make it unreadable."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= length <= min(HEADER_BYTES, size - 8):
        return {}, [_problem(file, f"is not a safetensors file (a header of {length:,} bytes in {size:,})")]
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return {}, [_problem(file, f"is not a safetensors file (its header is not JSON: {exc})")]
    if not isinstance(header, dict):
        return {}, [_problem(file, "is not a safetensors file (its header is not a JSON object)")]
    header.pop("__metadata__", None)
    entries, problems = {}, []
    base = 8 + length  # data_offsets count from the end of the header
    for key, info in header.items():
        entry, why = _entry(file, info, base)
        if entry is None:
            problems.append(_problem(file, f"tensor {key!r} {why}"))
        else:
            entries[key] = entry
    if problems:
        return {}, problems
    spans = sorted((e.start, e.start + e.nbytes, k) for k, e in entries.items())
    end = base
    for begin, stop, key in spans:
        if begin != end:
            return {}, [
                _problem(
                    file,
                    f"tensor {key!r} has data_offsets from {begin - base:,}, where the tensor before it ends "
                    f"at {end - base:,}: the tensors overlap or leave a gap (the file is damaged)",
                )
            ]
        end = stop
    if end != size:
        return {}, [
            _problem(file, f"holds {size:,} bytes, its header describes {end:,} (truncated or damaged)")
        ]
    return entries, []


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index: tensor name -> shard file name.

    Args:
        path: the ``model.safetensors.index.json``.

    Raises:
        SpecError: naming the file, for a file that is not a regular file, not an index, or names a shard
            outside its directory (``../x``, an absolute path).
    """
    file = str(path)
    try:
        index = json.loads(read_regular(path, INDEX_BYTES, "HF weights index"))
    except Unreadable as exc:
        raise _unreadable(exc, file) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SpecError(_problem(file, f"is not valid JSON: {exc}")) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SpecError(_problem(file, 'has no "weight_map" of tensor names to shard file names'))
    outside = sorted({v for v in weight_map.values() if not _plain_name(v)})
    if outside:
        raise SpecError(
            _problem(
                file,
                f"names shards that are not files of its directory: {', '.join(map(repr, outside[:5]))}",
                "an index names the shards beside it by their file names (model-00001-of-00002.safetensors)",
            )
        )
    return weight_map


def _plain_name(name: str) -> bool:
    """Whether ``name`` is the name of a file in a directory: no path separator, not ``.`` or ``..``."""
    return (
        bool(name) and name not in (".", "..") and "/" not in name and os.sep not in name and "\0" not in name
    )


class Weights(Mapping[str, Tensor]):
    """The tensors of safetensors files, each read when asked for (see the module's docstring).

    Use it as a context manager, or call :meth:`close`: the files stay open while it lives.

    Args:
        files: the safetensors files (shards) to read.
        index: the tensor -> shard file name map of a sharded checkpoint and the index's path; each tensor
            must be in the shard it names, and each shard must hold only the tensors it names.
        dtype: cast floating-point tensors to this dtype as they are read (default: as stored).
        device: move tensors there as they are read (default: CPU).

    Raises:
        SpecError: naming the file, for a file that is not a regular file or not a safetensors file, a
            quantised or unknown dtype, a tensor in two files, or a shard that disagrees with the index;
            every problem of every file at once.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]],
        *,
        index: tuple[Mapping[str, str], str] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        self.dtype, self.device = dtype, torch.device(device or "cpu")
        self._files: dict[str, io.BufferedReader] = {}
        self._entries: dict[str, Entry] = {}
        self._alive: weakref.WeakValueDictionary[str, Tensor] = weakref.WeakValueDictionary()
        try:
            self._open(files, index)
        except BaseException:
            self.close()
            raise

    def _open(
        self, files: Sequence[str | os.PathLike[str]], index: tuple[Mapping[str, str], str] | None
    ) -> None:
        problems: list[Problem] = []
        for path in files:
            file = os.fspath(path)
            try:
                self._files[file] = f = open_regular(path, "safetensors file", shown=os.path.basename(file))
            except Unreadable as exc:
                why = (
                    "the index names it: copy it into the directory"
                    if index and exc.reason == "missing"
                    else None
                )
                problems.extend(_unreadable(exc, file, why).problems)
                continue
            entries, found = _parse(f, file)
            problems += found
            for key, entry in entries.items():
                if key in self._entries:
                    problems.append(
                        _problem(file, f"holds {key!r}, which {self._entries[key].file} holds too")
                    )
                self._entries[key] = entry
        if problems:
            raise SpecError(problems)
        if index is not None:
            self._agree(*index)

    def _agree(self, weight_map: Mapping[str, str], where: str) -> None:
        """Refuse shards that disagree with the index: a tensor missing from the shard it is said to be in,
        or one that the index does not place there."""
        problems = []
        for key, shard in weight_map.items():
            entry = self._entries.get(key)
            if entry is None or os.path.basename(entry.file) != shard:
                problems.append(
                    _problem(
                        os.path.join(os.path.dirname(where), shard),
                        f"has no tensor {key!r}, which {os.path.basename(where)} says it holds",
                        "the shard is from another save: download or copy the checkpoint's files again",
                    )
                )
        for key, entry in self._entries.items():
            if key not in weight_map:
                problems.append(_problem(entry.file, f"holds {key!r}, which {where} does not list"))
        if problems:
            raise SpecError(problems)

    def __getitem__(self, key: str) -> Tensor:
        """The tensor ``key``, read from its file now (or the one read before, while it is still in use)."""
        alive = self._alive.get(key)
        if alive is not None:
            return alive
        entry = self._entries[key]
        tensor = self._read(entry)
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        tensor = tensor.to(self.device)
        self._alive[key] = tensor
        return tensor

    def _read(self, entry: Entry) -> Tensor:
        """The bytes of ``entry`` read into a tensor of their own."""
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
        view = buffer.numpy().data  # the tensor's own memory
        f = self._files[entry.file]
        done = 0
        try:
            f.seek(entry.start)
            while done < entry.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise SpecError(
                        _problem(
                            entry.file,
                            f"ended at byte {entry.start + done:,}, before the end of a tensor "
                            "its header describes: the file was cut short while it was read",
                        )
                    )
                done += n
        except OSError as exc:
            raise SpecError(_problem(entry.file, f"cannot be read: {exc.strerror or exc}", "")) from None
        return buffer.view(entry.dtype).reshape(entry.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def nbytes(self) -> int:
        """The bytes every tensor takes once read (after the cast to ``dtype``)."""
        size = 0
        for e in self._entries.values():
            item = (
                self.dtype.itemsize
                if self.dtype is not None and e.dtype.is_floating_point
                else e.dtype.itemsize
            )
            size += e.nbytes // e.dtype.itemsize * item
        return size

    def close(self) -> None:
        """Close the files; tensors already read stay valid."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def directory_weights(
    directory: Path, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Weights:
    """The weights of an HF model directory: ``model.safetensors``, or the shards its index names.

    Args:
        directory: the model directory.
        dtype: cast floating-point tensors to this dtype as they are read.
        device: move tensors there as they are read.

    Raises:
        SpecError: naming the file, when the directory has neither file, or a file is refused (see
            :class:`Weights` and :func:`read_index`).
    """
    single, index_file = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if os.path.lexists(single) or not os.path.lexists(index_file):
        if not os.path.lexists(single):
            others = sorted(p.name for p in directory.glob("*.bin"))
            found = f" (it has {', '.join(others)}: pickles, which specvit does not read)" if others else ""
            raise SpecFileError(
                _problem(
                    str(directory),
                    f"has neither {WEIGHTS_FILE} nor {INDEX_FILE}{found}",
                    "save the model with save_pretrained(..., safe_serialization=True) (the default)",
                )
            )
        return Weights([single], dtype=dtype, device=device)
    weight_map = read_index(index_file)
    shards = [directory / name for name in dict.fromkeys(weight_map.values())]
    return Weights(shards, index=(weight_map, str(index_file)), dtype=dtype, device=device)
