"""Deployment: ``torch.export`` and ONNX export of compiled models, with a dynamic batch dimension.

``specvit export SPEC -o model.onnx`` does the same from the command line.
"""

from __future__ import annotations

import importlib
import logging
import math
import operator
import os
from pathlib import Path

import torch

from specvit.errors import MissingDependencyError, SpecError
from specvit.graph.ir import ArchGraph
from specvit.io import atomic_path
from specvit.model import SpecModel

__all__ = ["MAX_EXAMPLE_BYTES", "example_inputs", "export_onnx", "export_program", "input_names"]

MAX_EXAMPLE_BYTES = 1 << 28
"""256 MiB: the most the example inputs of an export may take (a 224 x 224 image batch takes 1.2 MB)."""


def input_names(graph: ArchGraph) -> list[str]:
    """The model's required forward arguments, in order (``x``; ``src``, ``tgt``): what an export takes."""
    return [graph[n]["p"].arg for n in graph.placeholders() if graph[n]["p"].required]


def example_inputs(
    source: SpecModel | ArchGraph,
    batch: int = 2,
    device: torch.device | str | None = None,
    *,
    max_bytes: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Random values of the model's required forward arguments at the graph's sizes: ids below the
    vocabulary for token inputs, else normal floats.

    Args:
        source: a compiled model (its graph and device are used) or a graph.
        batch: the batch size.
        device: where to make them; default the model's device, or the CPU for a graph.
        max_bytes: refuse inputs larger than this; default :data:`MAX_EXAMPLE_BYTES`, or half the memory
            available (under the cgroup limit too) if that is less.

    Raises:
        SpecError: when the inputs would take more than ``max_bytes``, before anything is allocated.
        ValueError: when ``batch`` is not a positive integer.
    """
    graph = source.graph if isinstance(source, SpecModel) else source
    if device is None and isinstance(source, SpecModel):
        device = next(source.parameters()).device
    batch = _count(batch, "batch")
    specs = []
    for n in graph.placeholders():
        p = graph[n]["p"]
        if p.required:
            specs.append((p, (batch, *graph.concrete(p.shape)[1:])))
    _check_size(graph, specs, max_bytes)
    out = []
    for p, shape in specs:
        if p.dtype == "long":
            out.append(torch.randint(0, p.vocab, shape, device=device))
        else:
            out.append(torch.randn(shape, device=device))
    return tuple(out)


def _count(value: object, name: str) -> int:
    """``value`` as a positive int (NumPy integers too), or a TypeError / ValueError naming ``name``."""
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if isinstance(value, bool) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return n


def _check_size(graph: ArchGraph, specs: list[tuple[object, tuple[int, ...]]], max_bytes: int | None) -> None:
    """Refuse example inputs larger than ``max_bytes`` (default: MAX_EXAMPLE_BYTES, or less if the memory
    available is less) before anything is allocated."""
    from specvit.diagram.text import format_count
    from specvit.resources import memory_budget

    need = sum(
        math.prod(shape) * (8 if getattr(p, "dtype", "") == "long" else torch.get_default_dtype().itemsize)
        for p, shape in specs
    )
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
            "keeps a dynamic batch dimension only",
        )


def _dynamic_batch(inputs: tuple[torch.Tensor, ...]) -> tuple[dict[int, torch.export.Dim], ...]:
    batch = torch.export.Dim("batch", min=1, max=4096)
    return tuple({0: batch} for _ in inputs)


def export_program(
    model: SpecModel, inputs: tuple[torch.Tensor, ...] | None = None
) -> torch.export.ExportedProgram:
    """``torch.export`` the model's forward with a dynamic batch dimension (eval mode).

    Args:
        model: a compiled model.
        inputs: example inputs; default :func:`example_inputs` (batch 2).
    """
    model = model.eval()
    args = inputs if inputs is not None else example_inputs(model)
    return torch.export.export(model, args, dynamic_shapes=_dynamic_batch(args))


def export_onnx(
    model: SpecModel, path: str | os.PathLike[str], inputs: tuple[torch.Tensor, ...] | None = None
) -> Path:
    """Write an ONNX file of the model's forward (dynamo exporter), batch dimension dynamic.

    The file is written whole or not at all. Inputs are named as the forward's arguments (``x``, ``src``,
    ``tgt``), the output ``output``.

    Args:
        model: a compiled model.
        path: the ``.onnx`` file to write.
        inputs: example inputs; default :func:`example_inputs` (batch 2).

    Raises:
        MissingDependencyError: when ``onnx`` or ``onnxscript`` is not installed (``specvit[export]``).
        SpecError: when the default example inputs would not fit (see :func:`example_inputs`).
    """
    for package in ("onnx", "onnxscript"):  # what torch.onnx's dynamo exporter needs
        try:
            importlib.import_module(package)
        except ImportError:
            raise MissingDependencyError(package, "export", "ONNX export") from None
    model = model.eval()
    args = inputs if inputs is not None else example_inputs(model)
    names = input_names(model.graph)
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # it warns about every torchvision op it cannot register
    try:
        program = torch.onnx.export(
            model,
            args,
            dynamo=True,
            dynamic_shapes=_dynamic_batch(args),
            input_names=names,
            output_names=["output"],
            verbose=False,
        )
    finally:
        exporter_log.setLevel(level)
    assert program is not None
    target = Path(path)
    with atomic_path(target) as tmp:
        program.save(tmp)
    return target
