"""What a compiled model takes: its forward arguments, their sizes and limits, example values.

Read from the graph's placeholder nodes, whose shapes name their free dims: ``B`` (batch) and the
sequence lengths ``S``, ``S_src``, ``S_tgt``. An export keeps exactly those dims dynamic.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any

from specvit.errors import SpecError
from specvit.graph.ir import ArchGraph
from specvit.ops.base import MAX_LEN
from specvit.spec.schema import Spec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from specvit.ops.structure import InputParams

__all__ = [
    "AXIS_NAMES",
    "MAX_BATCH",
    "InputError",
    "check_inputs",
    "dynamic_axes",
    "example_inputs",
    "input_names",
    "sequence_limits",
]

MAX_BATCH = 4096  # the batch range an export is valid for
AXIS_NAMES = {"B": "batch", "S": "seq_len", "S_src": "src_len", "S_tgt": "tgt_len"}
"""The graph's free dims, by the names exported files and messages give them."""


def input_names(graph: ArchGraph) -> list[str]:
    """The model's required forward arguments, in order (``x``; ``src``, ``tgt``): what an export takes.

    Args:
        graph: the model's graph.
    """
    return [graph[n]["p"].arg for n in graph.placeholders() if graph[n]["p"].required]


def sequence_limits(source: ArchGraph | Spec) -> dict[str, int]:
    """The longest length each sequence dim may take: a learned table's rows less the prefix it covers.

    Args:
        source: the model's graph (or its spec): each stack's resolved ``max_len``.

    Returns:
        ``{"S": 1024}`` for GPT-2; ``{"S_src": ..., "S_tgt": ...}`` for an encoder-decoder.
    """
    if isinstance(source, ArchGraph):
        kind, facts = source.kind, source.facts
    else:
        kind, facts = source.model, {role: stack.facts for role, stack in source.stacks.items()}
    if kind == "encoder_decoder":
        limits = {"S_src": facts["encoder"].max_len, "S_tgt": facts["decoder"].max_len}
        spec = source.spec if isinstance(source, ArchGraph) else source
        if getattr(spec.stacks["decoder"].input, "shifted_source", None) is not None:  # it reads S_src ids
            limits["S_src"] = min(limits.values())
        return limits
    return {"S": facts["encoder" if kind == "encoder" else "decoder"].max_len}


def dynamic_axes(graph: ArchGraph) -> dict[str, dict[int, str]]:
    """The free dims of each required input: ``{"x": {0: "batch", 1: "seq_len"}}``.

    Args:
        graph: the model's graph.
    """
    out = {}
    for n in graph.placeholders():
        p = graph[n]["p"]
        if p.required:
            out[p.arg] = {i: AXIS_NAMES.get(d, d) for i, d in enumerate(p.shape) if isinstance(d, str)}
    return out


def example_inputs(
    source: nn.Module | ArchGraph,
    batch: int = 2,
    device: torch.device | str | None = None,
    *,
    seq_len: int | None = None,
    max_bytes: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Random values of the model's required forward arguments: ids below the vocabulary for token
    inputs, else normal floats.

    Args:
        source: a compiled model (a SpecModel: its graph and device are used) or a graph.
        batch: the batch size.
        device: where to make them; default the model's device, or the CPU for a graph.
        seq_len: the length of every sequence input (default: the graph's, 128 unless built otherwise).
        max_bytes: refuse inputs larger than this; default :data:`MAX_EXAMPLE_BYTES`, or half the memory
            available (under the cgroup limit too) if that is less.

    Raises:
        ValueError: for a sequence longer than the model takes, or a batch that is not an integer >= 1.
        SpecError: when the inputs would take more than ``max_bytes``, before anything is allocated.
    """
    import torch

    graph = source if isinstance(source, ArchGraph) else getattr(source, "graph", None)
    assert isinstance(graph, ArchGraph), "example_inputs takes a SpecModel or an ArchGraph"
    if device is None and not isinstance(source, ArchGraph):
        device = next(source.parameters()).device
    sizes = dict(graph.dims, B=_count(batch, "batch"))
    if seq_len is not None:
        for symbol, limit in sequence_limits(graph).items():
            if seq_len > limit:
                raise ValueError(f"seq_len {seq_len} is longer than {graph.name} takes ({symbol} <= {limit})")
            sizes[symbol] = seq_len
    specs = []
    for n in graph.placeholders():
        p = graph[n]["p"]
        if p.required:
            specs.append((p, tuple(d if isinstance(d, int) else sizes[d] for d in p.shape)))
    _check_size(graph, specs, max_bytes, torch.get_default_dtype().itemsize)
    out = []
    for p, shape in specs:
        if p.dtype == "long":
            out.append(torch.randint(0, p.vocab, shape, device=device))
        else:
            out.append(torch.randn(shape, device=device))
    return tuple(out)


MAX_EXAMPLE_BYTES = 1 << 28
"""256 MiB: the most the example inputs of an export may take (a 224 x 224 image batch takes 1.2 MB)."""


def _count(value: object, name: str) -> int:
    """``value`` as a positive int (NumPy integers too), or a TypeError / ValueError naming ``name``."""
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if isinstance(value, bool) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return n


def _check_size(
    graph: ArchGraph, specs: list[tuple[Any, tuple[int, ...]]], max_bytes: int | None, item: int
) -> None:
    """Refuse example inputs larger than ``max_bytes`` (default: MAX_EXAMPLE_BYTES, or less if the memory
    available is less) before anything is allocated."""
    from specvit.resources import memory_budget
    from specvit.units import format_count

    need = sum(math.prod(shape) * (8 if p.dtype == "long" else item) for p, shape in specs)
    limit, what = (
        (max_bytes, "the limit given") if max_bytes is not None else (MAX_EXAMPLE_BYTES, "the limit")
    )
    if max_bytes is None:
        free, free_what = memory_budget()
        if free is not None and free // 2 < limit:
            limit, what = free // 2, f"half of {free_what}"
    if need > limit:
        shapes = ", ".join(" x ".join(map(str, shape)) for _, shape in specs)
        raise SpecError.at(
            f"{graph.name}: its example inputs ({shapes}) need {format_count(need)}B, more than {what} for an "
            f"export ({format_count(limit)}B)",
            hint="export a model with smaller inputs (fewer tokens or a smaller image); the exported model "
            "keeps its batch and sequence dimensions dynamic",
        )


class InputError(ValueError):
    """A model input that does not match the spec: the message says what was expected and how to fix it."""


def _tracing() -> bool:
    """Inside torch.compile, torch.export or torch.fx tracing: the inputs are symbolic, checks are skipped."""
    import torch
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing

    compiler = torch.compiler
    return bool(compiler.is_compiling() or compiler.is_exporting() or is_fx_symbolic_tracing())


def _shown(shape: tuple[object, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def check_inputs(
    graph: ArchGraph,
    values: dict[str, object],
    offset: int = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> None:
    """Check a model's forward arguments against its graph before torch sees them: each required one given,
    every tensor of the shape, dtype and device the model computes with, masks boolean, ``offset`` an int
    and ``cache`` a KV cache.

    Args:
        graph: the model's graph.
        values: the forward's arguments by name (tensors, None for absent optional ones).
        offset: the decoding offset (positions already in a KV cache).
        dtype: the dtype of the model's weights, which floating-point inputs must have; None: any.
        device: the device of the model's weights, where every input tensor must be; None: any.

    Raises:
        InputError: naming the argument, what the spec expects and what was given, and what to pass.
    """
    import torch

    if _tracing():
        return
    limits = sequence_limits(graph)
    sizes: dict[str, tuple[int, str]] = {}  # symbol -> (size, the argument that set it)
    for n in graph.placeholders():
        p = graph[n]["p"]
        value = values.get(p.arg)
        if p.dtype in ("cache", "int"):
            _check_scalar(p, value)
            continue
        if value is None:
            if p.required:
                raise InputError(
                    f"{p.arg}: expected a tensor of {p.what or p.dtype} {_expected(p)}, got None"
                )
            continue
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{p.arg}: expected a tensor of {p.what or p.dtype}, got {type(value).__name__}")
        if device is not None and value.device != device and not _same_device(value.device, device):
            raise InputError(
                f"{p.arg}: the tensor is on {value.device} and the model's weights are on {device}; pass "
                f"{p.arg}.to({str(device)!r})"
                + (" (a tensor on meta holds no values)" if value.is_meta else "")
            )
        if not all(isinstance(d, int) for d in value.shape):  # symbolic sizes: a tracer's, not a user's
            continue
        _check_shape(p, tuple(value.shape), sizes)
        _check_dtype(p, value, dtype)
    for symbol, (size, arg) in sizes.items():
        limit = limits.get(symbol)
        decoding = symbol in ("S", "S_tgt") and offset
        if limit is not None and size + (offset if decoding else 0) > limit:
            at = f" from offset {offset}" if decoding else ""
            why = ", the learned position table's length" if limit < MAX_LEN else ""
            raise InputError(
                f"{arg}: {size} positions{at} are more than {graph.name} takes ({symbol} <= {limit}{why}); "
                "shorten the sequence or raise max_len in the spec"
            )


def _expected(p: InputParams) -> str:
    return _shown(tuple(AXIS_NAMES.get(d, d) if isinstance(d, str) else d for d in p.shape))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device when the current one is 0 (torch compares them unequal)."""
    import torch

    if a.type != b.type or a.type == "meta":
        return a.type == b.type == "meta"
    if a.index is None or b.index is None:
        module = getattr(torch, a.type, None)
        current = module.current_device() if module is not None and hasattr(module, "current_device") else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def _check_scalar(p: InputParams, value: object) -> None:
    """``offset`` an int >= 0; ``cache`` a KVCache or None."""
    if p.dtype == "int" and value is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(
                f"{p.arg}: expected an int (positions already decoded), got {type(value).__name__}"
            )
        if value < 0:
            raise InputError(f"{p.arg}: expected an int >= 0 (positions already decoded), got {value}")
    if p.dtype == "cache" and value is not None:
        from specvit.nn.cache import KVCache

        if not isinstance(value, KVCache):
            raise InputError(
                f"{p.arg}: expected a specvit.nn.attention.KVCache or None, got {type(value).__name__}"
            )


def _check_shape(p: InputParams, shape: tuple[int, ...], sizes: dict[str, tuple[int, str]]) -> None:
    want = p.shape
    arg, what = p.arg, p.what or p.dtype
    expected = _shown(tuple(AXIS_NAMES.get(d, d) if isinstance(d, str) else d for d in want))
    if want[:1] == ("B",) and _fits(want[1:], shape):
        raise InputError(
            f"{arg}: expected {expected} ({what}), got {_shown(shape)}: the batch dimension is missing; "
            f"pass {arg}.unsqueeze(0) for a single example"
        )
    last = _channels_last(p, shape)
    if last:
        raise InputError(f"{arg}: expected {expected} ({what}), got {_shown(shape)}: {last}")
    if len(shape) != len(want):
        raise InputError(f"{arg}: expected {len(want)} dimensions {expected} ({what}), got {_shown(shape)}")
    for i, (d, got) in enumerate(zip(want, shape, strict=True)):
        if isinstance(d, int) and d != got:
            raise InputError(
                f"{arg}: expected {expected} ({what}), got {_shown(shape)}: {_which(p, shape, i)}"
            )
        if isinstance(d, str):
            if got < 1:
                raise InputError(
                    f"{arg}: expected {expected}, got {_shown(shape)}: {AXIS_NAMES.get(d, d)} is 0"
                )
            seen = sizes.setdefault(d, (got, arg))
            if seen[0] != got:
                raise InputError(
                    f"{arg}: {AXIS_NAMES.get(d, d)} is {got} but {seen[1]} has {seen[0]}; they must agree"
                )


def _fits(want: tuple[int | str, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` has the dims ``want`` names: as many, and the fixed ones equal."""
    return len(shape) == len(want) and all(
        not isinstance(d, int) or d == g for d, g in zip(want, shape, strict=True)
    )


def _channels_last(p: InputParams, shape: tuple[int, ...]) -> str:
    """The fix for images (or signals) given channels last, ``(B, H, W, C)`` or one ``(H, W, C)``, else ``""``."""
    want = p.shape
    if p.local not in ("images", "signal") or _fits(want, shape):
        return ""
    moved = (want[0], *want[2:], want[1])  # (B, H, W, C)
    n = len(want)
    order = ", ".join(map(str, (n - 1, *range(1, n - 1))))
    if _fits(moved, shape):
        return f"the channels come last; pass {p.arg}.permute(0, {order})"
    if _fits(moved[1:], shape):
        order = ", ".join(map(str, (n - 2, *range(n - 2))))
        return f"one example with the channels last; pass {p.arg}.permute({order}).unsqueeze(0)"
    return ""


def _which(p: InputParams, shape: tuple[int, ...], i: int) -> str:
    """Which fixed dim differs, in words a user of the spec recognises."""
    want = p.shape
    d, got = want[i], shape[i]
    if p.local == "signal":  # (B, channels, length)
        key = "channels" if i == 1 else "length"
        return f"the spec's signals have {d} {'channels' if i == 1 else 'frames'}, not {got} (input.{key})"
    if len(want) == 4 and i == 1:
        return f"the spec's images have {d} channel{'s' if d != 1 else ''}, not {got} (input.channels)"
    if len(want) == 4 and i in (2, 3):
        return (
            f"the spec's images are {want[2]}x{want[3]} pixels, not {shape[2]}x{shape[3]} (input.size); "
            "resize the images or change the spec"
        )
    if len(want) == 3 and i == 2:  # (B, S, dim): features
        return f"the spec's features are {d} wide, not {got} (input.dim)"
    return f"dimension {i} must be {d}, not {got}"


_CASTS = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16"}
"""The Tensor / Module method that casts to a floating-point dtype, by the dtype's name."""


def _cast(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"{_CASTS[name]}()" if name in _CASTS else f"to({dtype})"


def _check_dtype(p: InputParams, value: torch.Tensor, weights: torch.dtype | None = None) -> None:
    import torch

    arg, dtype, vocab = p.arg, p.dtype, p.vocab
    if dtype == "float" and weights is not None and value.is_floating_point() and value.dtype != weights:
        raise InputError(
            f"{arg}: got {value.dtype} values, and the model's weights are {weights}; pass "
            f"{arg}.{_cast(weights)}, or convert the model with model.{_cast(value.dtype)}"
        )
    if dtype == "bool" and value.dtype != torch.bool:
        raise InputError(
            f"{arg}: expected a bool mask (True marks padding), got {value.dtype}; pass {arg}.bool() for a "
            f"1/0 mask of padding, or {arg} == 0 for HF's attention_mask (1 marks tokens)"
        )
    if dtype == "long":
        if value.dtype not in (torch.int64, torch.int32):  # what an embedding takes
            raise InputError(f"{arg}: expected integer token ids, got {value.dtype}; pass {arg}.long()")
        if vocab and value.numel() and value.device.type != "meta":
            low, high = int(value.min()), int(value.max())
            if low < 0 or high >= vocab:
                bad = high if high >= vocab else low
                raise InputError(
                    f"{arg}: token id {bad} is outside the vocabulary of {vocab} (ids 0..{vocab - 1})"
                )
    elif dtype == "float" and not value.is_floating_point():
        raise InputError(f"{arg}: expected floating-point values, got {value.dtype}; pass {arg}.float()")
