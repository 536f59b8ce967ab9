"""Deployment: ``torch.export`` and ONNX export of compiled models, with a dynamic batch dimension.

``specvit export SPEC -o model.onnx`` does the same from the command line.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch

from specvit.graph.ir import ArchGraph
from specvit.model import SpecModel

__all__ = ["example_inputs", "export_onnx", "export_program", "input_names"]


def input_names(graph: ArchGraph) -> list[str]:
    """The model's required forward arguments, in order (``x``; ``src``, ``tgt``): what an export takes."""
    return [graph[n]["p"].arg for n in graph.placeholders() if graph[n]["p"].required]


def example_inputs(
    source: SpecModel | ArchGraph, batch: int = 2, device: torch.device | str | None = None
) -> tuple[torch.Tensor, ...]:
    """Random values of the model's required forward arguments at the graph's sizes: ids below the
    vocabulary for token inputs, else normal floats.

    Args:
        source: a compiled model (its graph and device are used) or a graph.
        batch: the batch size.
        device: where to make them; default the model's device, or the CPU for a graph.
    """
    graph = source.graph if isinstance(source, SpecModel) else source
    if device is None and isinstance(source, SpecModel):
        device = next(source.parameters()).device
    out = []
    for n in graph.placeholders():
        p = graph[n]["p"]
        if not p.required:
            continue
        shape = (batch, *graph.concrete(p.shape)[1:])
        if p.dtype == "long":
            out.append(torch.randint(0, p.vocab, shape, device=device))
        else:
            out.append(torch.randn(shape, device=device))
    return tuple(out)


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
    """
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
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        program.save(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
