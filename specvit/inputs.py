"""What a compiled model takes: its forward arguments, their sizes and limits, example values.

Read from the graph's placeholder nodes, whose shapes name their free dims: ``B`` (batch) and the
sequence lengths ``S``, ``S_src``, ``S_tgt``. An export keeps exactly those dims dynamic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specvit.graph.ir import ArchGraph
from specvit.ops.base import MAX_LEN
from specvit.spec.schema import LearnedPosition, Spec

if TYPE_CHECKING:
    import torch

    from specvit.model import SpecModel

__all__ = ["AXIS_NAMES", "MAX_BATCH", "dynamic_axes", "example_inputs", "input_names", "sequence_limits"]

MAX_BATCH = 4096  # the batch range an export is valid for
AXIS_NAMES = {"B": "batch", "S": "seq_len", "S_src": "src_len", "S_tgt": "tgt_len"}
"""The graph's free dims, by the names exported files and messages give them."""

_STACK_OF = {"S_src": "encoder", "S_tgt": "decoder"}


def input_names(graph: ArchGraph) -> list[str]:
    """The model's required forward arguments, in order (``x``; ``src``, ``tgt``): what an export takes.

    Args:
        graph: the model's graph.
    """
    return [graph[n]["p"].arg for n in graph.placeholders() if graph[n]["p"].required]


def sequence_limits(spec: Spec) -> dict[str, int]:
    """The longest length each sequence dim may take: a learned table's rows less the prefix it covers.

    Args:
        spec: the model's spec.

    Returns:
        ``{"S": 1024}`` for GPT-2; ``{"S_src": ..., "S_tgt": ...}`` for an encoder-decoder.
    """
    symbols = ("S_src", "S_tgt") if spec.model == "encoder_decoder" else ("S",)
    out = {}
    for symbol in symbols:
        stack = spec.stacks.get(_STACK_OF.get(symbol, spec.output_stack))
        limit = MAX_LEN
        if stack is not None and isinstance(stack.position, LearnedPosition) and stack.position.max_len:
            covered = stack.num_prefix if stack.position.include_prefix else 0
            limit = stack.position.max_len - covered
        out[symbol] = limit
    return out


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
    source: SpecModel | ArchGraph,
    batch: int = 2,
    device: torch.device | str | None = None,
    *,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Random values of the model's required forward arguments: ids below the vocabulary for token
    inputs, else normal floats.

    Args:
        source: a compiled model (its graph and device are used) or a graph.
        batch: the batch size.
        device: where to make them; default the model's device, or the CPU for a graph.
        seq_len: the length of every sequence input (default: the graph's, 128 unless built otherwise).

    Raises:
        ValueError: for a sequence longer than the model takes.
    """
    import torch

    from specvit.model import SpecModel

    graph = source.graph if isinstance(source, SpecModel) else source
    if device is None and isinstance(source, SpecModel):
        device = next(source.parameters()).device
    sizes = dict(graph.dims, B=batch)
    if seq_len is not None:
        for symbol, limit in sequence_limits(graph.spec).items():
            if seq_len > limit:
                raise ValueError(f"seq_len {seq_len} is longer than {graph.name} takes ({symbol} <= {limit})")
            sizes[symbol] = seq_len
    out = []
    for n in graph.placeholders():
        p = graph[n]["p"]
        if not p.required:
            continue
        shape = tuple(d if isinstance(d, int) else sizes[d] for d in p.shape)
        if p.dtype == "long":
            out.append(torch.randint(0, p.vocab, shape, device=device))
        else:
            out.append(torch.randn(shape, device=device))
    return tuple(out)
