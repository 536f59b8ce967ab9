"""Deployment: ``torch.export`` and ONNX export of compiled models, batch and sequence dimensions dynamic.

``specvit export SPEC -o model.onnx`` does the same from the command line. The free dims of the inputs
(``B``, and ``S`` / ``S_src`` / ``S_tgt`` for token and feature sequences) stay dynamic, each bounded by
what the model takes (a learned position table's length); image sizes are fixed by the spec.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from specvit.errors import MissingDependencyError
from specvit.inputs import (
    AXIS_NAMES,
    MAX_BATCH,
    MAX_EXAMPLE_BYTES,
    dynamic_axes,
    example_inputs,
    input_names,
    sequence_limits,
)
from specvit.io import atomic_save
from specvit.model import SpecModel

__all__ = [
    "MAX_EXAMPLE_BYTES",
    "dynamic_shapes",
    "example_inputs",
    "export_onnx",
    "export_program",
    "input_names",
]

# Loggers of the exporters, which warn about every op they cannot register and every guard they add.
_NOISY = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx", "onnxscript")


def dynamic_shapes(model: SpecModel) -> tuple[dict[int, torch.export.Dim], ...]:
    """``torch.export`` dims for each required input: batch and sequence lengths dynamic, each bounded.

    Args:
        model: a compiled model.
    """
    limits = sequence_limits(model.graph)
    dims: dict[str, torch.export.Dim] = {}
    for symbol, name in AXIS_NAMES.items():
        top = MAX_BATCH if symbol == "B" else limits.get(symbol)
        if top is not None:
            dims[name] = torch.export.Dim(name, min=1, max=top)
    return tuple({i: dims[name] for i, name in axes.items()} for axes in dynamic_axes(model.graph).values())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep the exporters' warnings and log lines out of the terminal; errors still raise."""
    levels = {name: logging.getLogger(name).level for name in _NOISY}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in _NOISY:
                logging.getLogger(name).setLevel(logging.ERROR)
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _inputs(model: SpecModel, inputs: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...]:
    # example sizes of 2 or more: torch.export specialises a dim whose example is 1
    return inputs if inputs is not None else example_inputs(model, batch=2)


def export_program(
    model: SpecModel, inputs: tuple[torch.Tensor, ...] | None = None
) -> torch.export.ExportedProgram:
    """``torch.export`` the model's forward (eval mode), batch and sequence dimensions dynamic.

    Args:
        model: a compiled model.
        inputs: example inputs; default :func:`example_inputs` (batch 2, the graph's sequence length).
    """
    model = model.eval()
    args = _inputs(model, inputs)
    with _quiet():
        return torch.export.export(model, args, dynamic_shapes=dynamic_shapes(model))


def export_onnx(
    model: SpecModel,
    path: str | os.PathLike[str],
    inputs: tuple[torch.Tensor, ...] | None = None,
    *,
    progress: bool | None = None,
) -> Path:
    """Write an ONNX file of the model's forward (dynamo exporter), batch and sequence dimensions dynamic.

    The file (and its external weights file, for models over 2 GB) is written whole or not at all, with
    the mode any new file gets (0644 under the usual umask). Inputs are named as the forward's arguments
    (``x``, ``src``, ``tgt``), their free axes ``batch``, ``seq_len``, ``src_len``, ``tgt_len``; the output
    is ``output``, or a model returning a dict its keys (``last_hidden_state``, ``pooler_output``), in order. The exporters' warnings are kept out of the terminal.

    Args:
        model: a compiled model.
        path: the ``.onnx`` file to write.
        inputs: example inputs; default :func:`example_inputs` (batch 2, the graph's sequence length).
        progress: show progress on standard error (default: when it is a terminal).

    Raises:
        MissingDependencyError: when ``onnx`` or ``onnxscript`` is not installed (``specvit[export]``).
        SpecError: when the default example inputs would not fit (see :func:`example_inputs`).
    """
    from specvit.progress import stages

    for package in ("onnx", "onnxscript"):  # what torch.onnx's dynamo exporter needs
        try:
            importlib.import_module(package)
        except ImportError:
            raise MissingDependencyError(package, "export", "ONNX export") from None
    model = model.eval()
    args = _inputs(model, inputs)
    with stages(f"export {model.graph.name}", 2, show=progress) as step:
        step("tracing and translating to ONNX")
        with _quiet():
            onnx_program = torch.onnx.export(
                model,
                args,
                dynamo=True,
                dynamic_shapes=dynamic_shapes(model),
                input_names=input_names(model.graph),
                output_names=list(model.graph[model.graph.output]["p"].keys) or ["output"],
                verbose=False,
            )
        assert onnx_program is not None
        step(f"writing {path}")
        with _quiet():
            return atomic_save(path, lambda staged: onnx_program.save(staged))
