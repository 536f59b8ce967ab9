"""The keyword arguments people pass from HF transformers, PyTorch and x-transformers, as data: each with
the compiled model's argument it is. One of the same meaning is accepted in its place (``input_ids=`` is
``tokens=``); one of another meaning (HF's ``attention_mask`` is True where specvit's ``key_padding_mask`` is
False) is refused with the call to write instead."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specvit.graph.ir import ArchGraph
    from specvit.ops.structure import InputParams

__all__ = ["FOREIGN_ARGUMENTS", "ForeignArgument", "foreign_keywords"]


@dataclass(frozen=True)
class ForeignArgument:
    """A keyword argument of other libraries' models, and the compiled model's argument it is.

    Args:
        source: who names it so (``HF``), for the message.
        what: what it is, for the message (``token ids``).
        node: the graph input it is, of its stack: ``input`` or ``mask``; empty when specvit has none.
        side: ``source``: of the encoder of an encoder-decoder, else of the only stack; ``target``: of the
            decoder of an encoder-decoder.
        reads: the input it is must be token ids (``ids``) or ``images``; empty: either.
        fix: for an argument of another meaning, how to pass it instead (``{arg}`` is the model's argument);
            empty for one of the same meaning, which is passed as the model's argument.
    """

    source: str
    what: str
    node: str = ""
    side: str = "source"
    reads: str = ""
    fix: str = ""


def _inverse(name: str, whose: str) -> str:
    return f"True marks padding in {{arg}}, the inverse of {whose} {name}: pass {{arg}}={name} == 0"


FOREIGN_ARGUMENTS: dict[str, ForeignArgument] = {
    "input_ids": ForeignArgument("HF", "token ids", "input", reads="ids"),
    "pixel_values": ForeignArgument("HF", "images", "input", reads="images"),
    "decoder_input_ids": ForeignArgument("HF", "decoder token ids", "input", "target", "ids"),
    "attention_mask": ForeignArgument("HF", "attention mask", "mask", fix=_inverse("attention_mask", "HF's")),
    "decoder_attention_mask": ForeignArgument(
        "HF", "decoder attention mask", "mask", "target", fix=_inverse("decoder_attention_mask", "HF's")
    ),
    "src_key_padding_mask": ForeignArgument("PyTorch", "padding mask", "mask"),
    "mask": ForeignArgument("x-transformers", "mask", "mask", fix=_inverse("mask", "x-transformers'")),
    "labels": ForeignArgument(
        "HF",
        "training labels",
        fix="the model returns logits, not a loss: compute the loss from them (torch.nn.functional.cross_entropy)",
    ),
    "past_key_values": ForeignArgument(
        "HF", "KV cache", fix="a decoder takes its KV cache as cache= (specvit.nn.attention.KVCache)"
    ),
}
"""Keyword -> the model argument it is. Only names no compiled model takes: a model's own argument of the
same name (an encoder-decoder's ``src_key_padding_mask``) is never looked up here."""


def foreign_keywords(graph: ArchGraph, takes: Collection[str], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with other libraries' names for the model's arguments renamed (``input_ids`` -> ``tokens``).

    Args:
        graph: the model's graph.
        takes: the names of the model's forward arguments.
        kwargs: the keyword arguments of a call.

    Raises:
        TypeError: for a keyword the model does not take: what it is here and how to pass it, or what the
            model takes.
    """
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        arg = name if name in takes else _renamed(graph, takes, name)
        if arg in out or (arg != name and arg in kwargs):
            raise TypeError(f"{graph.name} got {arg} twice: as {arg}= and as {name}=")
        out[arg] = value
    return out


def _renamed(graph: ArchGraph, takes: Collection[str], name: str) -> str:
    """The model argument ``name`` stands for, or the TypeError saying what to pass instead."""
    entry = FOREIGN_ARGUMENTS.get(name)
    listed = ", ".join(_described(graph, arg) for arg in takes)
    if entry is None:
        raise TypeError(f"{graph.name} takes no argument {name!r}; it takes {listed}")
    whose = f"{entry.source}'" if entry.source.endswith("s") else f"{entry.source}'s"
    p = _input(graph, entry)
    if p is not None and not entry.fix:
        return p.arg
    if p is not None:
        raise TypeError(f"{name}: {whose} {entry.what} is {p.arg} here; {entry.fix.format(arg=p.arg)}")
    if entry.node:
        raise TypeError(f"{name}: {whose} {entry.what}, which {graph.name} does not take; it takes {listed}")
    raise TypeError(f"{name}: {whose} {entry.what}; {entry.fix}")


def _input(graph: ArchGraph, entry: ForeignArgument) -> InputParams | None:
    """The model's input the entry stands for, or None when the model has no such input."""
    if entry.side == "target":
        role = "decoder" if graph.kind == "encoder_decoder" else ""
    else:
        role = "decoder" if graph.kind == "decoder" else "encoder"
    node = f"{role}.{entry.node}"
    if not (role and entry.node and node in graph.placeholders()):
        return None
    p: InputParams = graph[node]["p"]
    if (entry.reads == "ids" and p.dtype != "long") or (entry.reads == "images" and p.local != "images"):
        return None
    return p


def _described(graph: ArchGraph, arg: str) -> str:
    """``x (image 32x32)``: an argument with what it is, where the graph says."""
    what = next((graph[n]["p"].what for n in graph.placeholders() if graph[n]["p"].arg == arg), "")
    return f"{arg} ({what})" if what else arg
