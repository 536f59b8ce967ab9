"""``build_model``: a spec, a spec file or a graph -> a PyTorch model, checked to fit in memory first.

The model is compiled from the graph alone (:mod:`specvit.codegen`): generated forwards, leaf modules
built on the meta device, then materialised and initialised by each op's init rule.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from specvit import argcheck
from specvit.codegen.build import compile_graph
from specvit.codegen.eject import eject_source
from specvit.errors import SpecError
from specvit.graph.ir import ArchGraph
from specvit.graph.lower import graph_of
from specvit.io import atomic_write
from specvit.model import MODEL_CLASSES, Block, SpecModel
from specvit.progress import enabled, stages
from specvit.resources import available_memory, memory_budget
from specvit.spec.loader import load_spec
from specvit.units import format_count

__all__ = ["available_memory", "build_graph", "build_model", "eject", "load_pretrained"]

SHOWN_PARAMS = 50_000_000
"""Builds of more parameters than this show their stages (ViT-L's, ~300M, takes seconds to initialise)."""

Source = Any  # a Spec, a mapping of spec keys, a spec file's path or a preset's name, or an ArchGraph


def _graph(source: Source, overrides: Mapping[str, Any] | None) -> ArchGraph:
    """The graph of any source a user may hand the API: mappings are validated like files."""
    if isinstance(source, Mapping):
        return graph_of(load_spec(source, overrides))
    return graph_of(source, overrides)


def build_graph(
    source: Source,
    overrides: Mapping[str, Any] | None = None,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    src_len: int | None = None,
    tgt_len: int | None = None,
) -> ArchGraph:
    """Lower a spec into its architecture graph: shapes, parameters and FLOPs on every node.

    Args:
        source: a Spec, a mapping of spec keys, a spec file or a preset's name.
        overrides: dotted-key overrides, e.g. ``{"encoder.depth": 2}``.
        batch: the batch size ``B`` FLOPs are counted at.
        seq_len: the sequence length ``S`` of a token or features input (default 128, or max_len if shorter).
        src_len: the encoder's length ``S_src`` in an encoder-decoder.
        tgt_len: the decoder's length ``S_tgt`` in an encoder-decoder.

    Raises:
        SpecError: for an invalid spec, each problem at its line (or key path, for a mapping).
    """
    from specvit.graph.lower import build_graph as lower

    return lower(load_spec(source, overrides), batch=batch, seq_len=seq_len, src_len=src_len, tgt_len=tgt_len)


def _check_fits(
    graph: ArchGraph, device: torch.device, dtype: torch.dtype | None, max_bytes: int | None
) -> None:
    if device.type == "meta":
        return
    item = torch.empty((), dtype=dtype or torch.get_default_dtype(), device="meta").element_size()
    need = graph.total_params * item
    limit, what = (max_bytes, "the limit given") if max_bytes is not None else (None, "")
    if limit is None and device.type == "cpu":
        limit, what = memory_budget()
    if limit is not None and need > limit:
        raise SpecError.at(
            f"{graph.name}: its {graph.total_params:,} parameters need {format_count(need)}B as "
            f"{str(dtype or torch.get_default_dtype()).removeprefix('torch.')}, more than {what} "
            f"({format_count(limit)}B)",
            hint='build it on device="meta" to inspect it without allocating, or on a machine with more memory',
        )


def build_model(
    source: Source,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    max_bytes: int | None = None,
    checkpointing: bool = False,
    progress: bool | None = None,
) -> SpecModel:
    """Compile a spec (or its graph, or a spec file) into a PyTorch model.

    Args:
        source: a Spec, a mapping of spec keys, a spec file, a preset's name, or an ArchGraph.
        device: where the weights live; ``"meta"`` builds without allocating (then ``to_empty()`` and
            ``init_weights()``). Default: CPU.
        dtype: parameter dtype (default: torch's default dtype).
        overrides: dotted-key overrides for a spec or spec file, e.g. ``{"encoder.depth": 2}``.
        max_bytes: refuse to allocate weights larger than this; on CPU the default limit is the memory
            available, under the process's cgroup (container) limit too. Building on the meta device is never refused.
        checkpointing: recompute each block's activations in the backward pass instead of storing
            them (``torch.utils.checkpoint``): less memory for one more forward per block in training.
        progress: show the build's stages on standard error (default: for a model of more than
            ``SHOWN_PARAMS`` parameters, when standard error is a terminal).

    Raises:
        SpecError: for an invalid spec, or weights that would not fit (before anything is allocated).
        TypeError, ValueError: for an argument of the wrong type or value (``dtype=torch.int64``: weights
            compute in floating point), naming it.

    Returns:
        An :class:`EncoderModel`, :class:`DecoderModel` or :class:`EncoderDecoderModel`, in train mode like
        any fresh ``nn.Module``.
    """
    target = argcheck.device(device)
    dtype = argcheck.compute_dtype(dtype)
    checkpointing = argcheck.flag(checkpointing, "checkpointing")
    if max_bytes is not None:
        max_bytes = argcheck.integer(max_bytes, "max_bytes", low=0)
    graph = _graph(source, overrides)
    _check_fits(graph, target, dtype, max_bytes)
    real = target.type != "meta"
    show = progress if progress is not None else (enabled() and real and graph.total_params > SHOWN_PARAMS)
    with stages(f"build {graph.name}", 3 if real else 1, show=show) as step:
        step("compile the modules")
        model = compile_graph(graph, MODEL_CLASSES[graph.kind], Block, dtype)
        assert isinstance(model, SpecModel)
        model.set_checkpointing(checkpointing)
        if real:
            step(f"allocate {format_count(graph.total_params)} parameters on {target}")
            model.to_empty(device=target)
            step("initialise the weights")
            model.init_weights()
    return model


def eject(
    source: Source,
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> str:
    """The model of a spec as one standalone, plain PyTorch file: generated from its graph, importing only
    torch (no private API, no fast paths), formatted as ruff formats it.

    ``Model()`` in the file takes no arguments, has the compiled model's state_dict keys and computes the
    same outputs; each layer class is written once, specialised to the features the spec uses, with a
    docstring naming its spec lines; a token decoder's ``Model`` has ``generate()``.

    Args:
        source: a Spec, an ArchGraph, or the path of a spec file.
        path: also write the file here (whole or not at all).
        overrides: dotted-key overrides for a spec or spec file, e.g. ``{"encoder.depth": 2}``.

    Returns:
        The file's text.
    """
    graph = _graph(source, overrides)
    origin = os.fspath(source) if isinstance(source, str | os.PathLike) else ""
    text = eject_source(graph, origin)
    if path is not None:
        atomic_write(path, text)
    return text


def load_pretrained(
    directory: str | os.PathLike[str],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> SpecModel:
    """Rebuild a model saved by ``save_pretrained``, in eval mode (as HF's ``from_pretrained``).

    Args:
        directory: the checkpoint directory.
        device: where the weights go (default CPU).
        dtype: cast the weights to this dtype (default: as stored).

    Raises:
        SpecError: when ``spec.yaml`` is invalid.
        CheckpointError: when a file or the manifest is missing, a file is not the one the manifest was
            written for (an interrupted or concurrent save), the weight file is truncated or corrupted, or
            its keys, shapes or dtypes do not match the spec (every mismatch is named).
    """
    return SpecModel.from_pretrained(directory, device=device, dtype=dtype)
