"""``specvit.from_pretrained``: a model directory, a Hub id, or a timm model name with its weights file ->
the compiled model with those weights, loaded without ever holding them twice.

The model is built on the meta device (nothing allocated); its weights are read one tensor at a time
(:class:`specvit.weights.Weights`), renamed and repacked by :func:`specvit.convert_state_dict`, checked
against the model (keys, shapes, dtypes), then assigned (``load_state_dict(assign=True)``): each parameter
*is* the tensor read from the file, or the one packed from several (a fused qkv), so the peak is the
model's weights plus the few tensors being packed at a time.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specvit.checkpoint import MANIFEST_FILE, check_weights
from specvit.compile import build_model, load_pretrained
from specvit.convert import Source, convert_state_dict
from specvit.errors import Location, MissingDependencyError, Problem, SpecError, SpecFileError
from specvit.interop.hf import from_hf
from specvit.interop.timm import from_timm
from specvit.io import Unreadable, open_regular
from specvit.model import SpecModel
from specvit.progress import amount, enabled
from specvit.resources import memory_budget
from specvit.spec.schema import Spec
from specvit.weights import INDEX_FILE, WEIGHTS_FILE, Weights, directory_weights

__all__ = ["HUB_FILES", "from_pretrained"]

CONFIG_FILE = "config.json"
HUB_FILES = [CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE, "model-*-of-*.safetensors"]
"""What is downloaded of a Hub repository: the config and the safetensors weights, never a pickle (a
``pytorch_model.bin``) nor other copies of the weights some repositories carry."""

SHOWN_BYTES = 1 << 30
"""Checkpoints of more bytes than this show a bar while they are read."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # ``gpt2``, ``meta-llama/Llama-3.2-1B``


def from_pretrained(
    source: str | os.PathLike[str],
    *,
    weights: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
    **model_args: Any,
) -> SpecModel:
    """The model of a pretrained checkpoint, with its weights, in eval mode.

    Its outputs are those of the library's own model loaded from the same files (transformers'
    ``AutoModel*.from_pretrained(directory)``, or ``timm.create_model(name)`` with the weights loaded).

    Args:
        source: a model directory: a transformers one (``config.json`` with ``model.safetensors``, or the
            shards a ``model.safetensors.index.json`` names) or a specvit checkpoint (written by
            ``specvit.save_pretrained``); a Hugging Face Hub id (``org/name``), downloaded with
            huggingface_hub when it is installed; or, with ``weights``, a timm model name.
        weights: the weights file of the timm model ``source``: ``.safetensors``, or a ``torch.save`` file
            (``.pth``, ``.pt``) read with ``torch.load(weights_only=True)``; a ``{"state_dict": ...}`` or
            ``{"model": ...}`` wrapper is unwrapped.
        device: where the weights go (default CPU); each tensor is moved there as it is read.
        dtype: cast floating-point weights to this dtype (default: as stored, as transformers 5 loads them).
        revision: the branch, tag or commit of a Hub id.
        **model_args: arguments of ``timm.create_model`` for a timm name (``num_classes=10``).

    Raises:
        SpecError: naming the file (and the field or tensor), for a directory without a config or weights,
            a file that is not a regular file (a FIFO, a link to ``/dev/zero``), a damaged or quantised
            (float8) weights file, an index naming a file outside its directory or disagreeing with its
            shards, a config specvit cannot state, or weights that do not fit the spec; for a Hub id when
            huggingface_hub is missing or the Hub has no such model.
        MissingDependencyError: for a timm name when timm is not installed.
        TypeError: for ``model_args`` without ``weights``.
    """
    if weights is not None:
        return _from_timm(os.fspath(source), Path(weights), model_args, device, dtype)
    if model_args:
        raise TypeError(
            f"from_pretrained got {', '.join(sorted(model_args))}: model arguments go with a timm model "
            "name and its weights= file; a directory's config states its model"
        )
    directory = _directory(source, revision)
    if not os.path.lexists(directory / CONFIG_FILE) and os.path.lexists(directory / MANIFEST_FILE):
        return load_pretrained(directory, device=device, dtype=dtype)  # a specvit checkpoint
    if not os.path.lexists(directory / CONFIG_FILE):
        raise SpecFileError(
            Problem(
                "",
                f"has no {CONFIG_FILE} (a transformers model directory) nor {MANIFEST_FILE} (a specvit checkpoint)",
                "give the directory save_pretrained wrote",
                Location(str(directory)),
            )
        )
    spec = from_hf(directory / CONFIG_FILE)
    with directory_weights(directory, dtype=dtype, device=device) as tensors:
        if any(k.startswith("pooler.") for k in tensors):  # a base model saved with its pooler (BertModel's
            spec = from_hf(directory / CONFIG_FILE, pooler=True)  # default): read with both its outputs
        return _load(spec, tensors, "hf", str(directory), dtype)


def _directory(source: str | os.PathLike[str], revision: str | None) -> Path:
    """The local directory of ``source``: itself, or the snapshot of a Hub id."""
    path = Path(source)
    if path.is_dir():
        return path
    where = Location(os.fspath(source))
    if os.path.lexists(path):
        raise SpecFileError(
            Problem(
                "", "is not a directory", "give the model's directory, the one holding config.json", where
            )
        )
    if not isinstance(source, str) or not _HUB_ID.fullmatch(source):
        raise SpecFileError(Problem("", "does not exist", "check the path of the model directory", where))
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise SpecError(
            Problem(
                "",
                "is not a directory; reading it as a Hugging Face Hub id needs huggingface_hub, which is not installed",
                "pip install 'specvit[hub]', or give the path of a model directory (config.json and model.safetensors)",
                where,
            )
        ) from None
    try:
        return Path(snapshot_download(repo_id=source, revision=revision, allow_patterns=HUB_FILES))
    except (OSError, ValueError) as exc:  # not found, offline, gated, an invalid id: huggingface_hub's errors
        raise SpecError(
            Problem(
                "",
                f"is not a directory, and the Hugging Face Hub gave no model of that id ({type(exc).__name__}: {exc})",
                "check the id and the network, or give the path of a model directory",
                where,
            )
        ) from None


def _load(
    spec: Spec, tensors: Mapping[str, Tensor], source: Source, where: str, dtype: torch.dtype | None
) -> SpecModel:
    """The model of ``spec`` built on the meta device, with ``tensors`` converted from ``source`` and
    assigned: nothing is allocated but the tensors themselves."""
    model = build_model(spec, device="meta", dtype=dtype)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    size = tensors.nbytes() if isinstance(tensors, Weights) else 0
    if isinstance(tensors, Weights) and tensors.device.type == "cpu":
        _check_fits(size, where)
    try:
        with amount(f"read {Path(where).name}", size, show=enabled() and size > SHOWN_BYTES) as advance:
            state = convert_state_dict(_Reading(tensors, advance), source, spec)
    except SpecError:  # a weights file refused as it is read
        raise
    except ValueError as exc:  # the converter names every key it cannot place, one kind per line
        first, *lines = str(exc).splitlines()
        problems = [
            f"the weights do not fit the spec made of its config: {first}",
            *(ln.strip() for ln in lines),
        ]
        raise SpecError([Problem("", p, "", Location(where)) for p in problems]) from None
    for key, tensor in state.items():
        if not tensor.is_contiguous():  # a transposed view: a parameter of its own layout, as any model's
            state[key] = tensor.contiguous()
    problems = check_weights(state, expected, cast=dtype is not None)
    if problems:
        raise SpecError([Problem("", p, "", Location(where)) for p in problems])
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


class _Reading(Mapping[str, Tensor]):
    """``tensors``, telling ``advance`` the bytes of each tensor the first time it is read."""

    def __init__(self, tensors: Mapping[str, Tensor], advance: Callable[[int], None]):
        self.tensors, self.advance, self.seen = tensors, advance, set[str]()

    def __getitem__(self, key: str) -> Tensor:
        tensor = self.tensors[key]
        if key not in self.seen:
            self.seen.add(key)
            self.advance(tensor.nbytes)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, key: object) -> bool:  # without reading the tensor, as Mapping's would
        return key in self.tensors


def _check_fits(size: int, where: str) -> None:
    """Refuse weights of ``size`` bytes when they are more than the memory available, before any is read."""
    budget, what = memory_budget()
    if budget is not None and size > budget:
        raise SpecError(
            Problem(
                "",
                f"its weights take {size:,} bytes, more than {what} ({budget:,} bytes)",
                "load it where there is more memory, or pass dtype=torch.bfloat16 to halve float32 weights",
                Location(where),
            )
        )


def _from_timm(
    name: str,
    weights: Path,
    model_args: Mapping[str, Any],
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> SpecModel:
    """The model of the timm model ``name`` (built on the meta device to read its spec) with ``weights``."""
    try:
        import timm
    except ImportError:
        raise MissingDependencyError("timm", "timm", f"from_pretrained of the timm model {name!r}") from None
    try:
        with torch.device("meta"):
            reference = timm.create_model(name, pretrained=False, **model_args)
    except RuntimeError as exc:  # timm: "Unknown model (...)"
        raise SpecError(
            Problem(
                "",
                f"timm cannot build {name!r}: {exc}",
                "give a name timm.list_models() lists",
                Location(name),
            )
        ) from None
    spec = from_timm(reference)
    if weights.suffix == ".safetensors":
        with Weights([weights], dtype=dtype, device=device) as tensors:
            return _load(spec, tensors, "timm", str(weights), dtype)
    return _load(spec, _torch_file(weights, dtype, device), "timm", str(weights), dtype)


def _torch_file(
    path: Path, dtype: torch.dtype | None, device: torch.device | str | None
) -> dict[str, Tensor]:
    """The state dict in a ``torch.save`` file, read with ``weights_only=True`` (no code runs)."""
    where = Location(str(path))
    try:
        budget, _ = memory_budget()
        f = open_regular(path, "weights file", limit=budget)
    except Unreadable as exc:
        raise SpecFileError(Problem("", exc.message, exc.hint, where)) from None
    with f:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except (
            pickle.UnpicklingError,
            RuntimeError,
            EOFError,
            ValueError,
            OSError,
            zipfile.BadZipFile,
        ) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecError(
                Problem(
                    "",
                    f"is not a state dict torch.load(weights_only=True) reads: {first}",
                    "give a .safetensors file, or one written by torch.save(model.state_dict())",
                    where,
                )
            ) from None
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()
    ):
        raise SpecError(
            Problem("", "holds no state dict (names to tensors)", "save model.state_dict()", where)
        )
    quantised = [k for k, v in state.items() if v.dtype.is_floating_point and v.dtype.itemsize == 1]
    if quantised:
        raise SpecError(
            Problem(
                "",
                f"stores {quantised[0]!r} as {str(state[quantised[0]].dtype).removeprefix('torch.')}, a "
                "quantised format",
                "dequantise the checkpoint to float16, bfloat16 or float32 first",
                where,
            )
        )
    for k, v in state.items():  # one tensor at a time: the one it replaces is freed as it goes
        state[k] = (v.to(dtype) if dtype is not None and v.is_floating_point() else v).to(device or "cpu")
    return state
