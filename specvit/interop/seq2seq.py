"""Encoder-decoder layouts as tables: a :class:`Seq2Seq` is a :class:`~specvit.interop.table.Table` of two
stacks (``role`` ``encoder_decoder``), whose entries are dotted keys under ``encoder.`` and ``decoder.``
(:func:`both` writes an entry the two stacks share once).

Its layout adds what the two stacks share to the names the table gives: one token table (``shared``), of which
both stacks' ``embed_tokens`` are copies and to which an LM head may be tied; a head's bias that the spec leaves
out (BART's ``final_logits_bias``) must then be zero; a frozen sinusoid table that HF keeps as a parameter
(Marian's ``embed_positions``) must hold the sinusoids the spec computes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specvit.interop.layout import Layout, Misfit, same
from specvit.interop.registry import Config
from specvit.interop.table import LABELS, D, F, Head, Name, Renamed, name_table
from specvit.interop.variants import Variant

__all__ = ["ROLES", "Seq2Seq", "both", "classification", "generation", "start_id"]

ROLES = ("encoder", "decoder")

_STRUCTURE = ("block.layers", "block.norm.placement", "embed_norm", "final_norm", "position.kind")
"""Spec keys whose value a layout's names presume: a spec of other values is another family's (a Misfit)."""


def both(entries: Mapping[str, Any]) -> dict[str, Any]:
    """The same entries in the encoder and the decoder: ``both({"width": F("d_model", 1024)})``.

    Args:
        entries: spec keys under a stack (``block.norm.eps``) -> an F, a D or a constant.
    """
    return {f"{role}.{key}": value for role in ROLES for key, value in entries.items()}


def _sources(name: Name) -> tuple[str, ...]:
    theirs = name.sources if isinstance(name, Renamed) else name
    return (theirs,) if isinstance(theirs, str) else theirs


def _sinusoids(position: Any, shape: tuple[int, ...]) -> Tensor:
    """The (rows, width) table of a ``sincos`` position as HF stores it, from the spec's first position."""
    from specvit.nn.position import sincos_table

    if len(shape) != 2:
        return torch.empty(0)
    rows, width = shape
    positions = torch.arange(position.offset, position.offset + rows)
    return sincos_table(positions, width, position.base, position.layout, position.frequencies)


@dataclass(frozen=True)
class Seq2Seq(Variant):
    """An encoder-decoder family of a shared layout (see :class:`~specvit.interop.table.Table` for the fields).

    Args:
        shared: the HF module of the token table both stacks share, relative to the backbone.
        frozen: the HF parameter of a stack's frozen sinusoid table (``{role}.embed_positions.weight``), checked
            against the spec's ``sincos`` positions where a state dict holds it; None where HF keeps none.
    """

    shared: str = "shared"
    frozen: str | None = None

    def layout(self, spec: Any, keys: Sequence[str]) -> Layout:
        """The weights' names of an encoder-decoder spec (see :meth:`Table.layout`).

        Args:
            spec: the spec whose weights are named.
            keys: the state dict's keys.

        Raises:
            Misfit: the spec's stacks are not this family's (norm placement, positions, sublayers).
        """
        self._fits(spec)
        names = {**self.names, **(self.chosen(spec, keys) if self.chosen else {})}
        pre = self.backbone if self.backbone and any(k.startswith(self.backbone) for k in keys) else ""
        outside = dict(self._head(spec, keys).names)
        zeros: dict[str, str] = {}
        bias = outside.get("head.fc.bias")
        if bias is not None and not getattr(spec.head, "bias", False):  # a head without one: HF's must be 0
            del outside["head.fc.bias"]
            zeros = dict.fromkeys(_sources(bias), "write head.bias: true to take it as the head's bias")
        table = name_table(names, pre, outside)
        shared, ignore = f"{pre}{self.shared}.weight", list(self.ignore)
        tied: dict[str, str] = {}
        if spec.shared_embeddings:
            table["encoder.tok_embed.weight"] = ((shared,), same)
            tied = {f"{pre}{names[f'{role}.tok_embed']}.weight": shared for role in ROLES}
        else:  # each stack reads its own table; the class may keep `shared` all the same (BART untied)
            ignore.append(re.escape(shared))
        if getattr(spec.head, "tied", False) and "head.fc" in outside:
            owner = shared if spec.shared_embeddings else f"{pre}{names['decoder.tok_embed']}.weight"
            tied |= {f"{head}.weight": owner for head in _sources(outside["head.fc"])}
        fixed: dict[str, Any] = {}
        for role in ROLES if self.frozen else ():
            for position in spec.stacks[role].positions[:1]:
                if position.kind == "sincos":
                    fixed[pre + str(self.frozen).format(role=role)] = functools.partial(_sinusoids, position)
        shown = " / ".join(dict.fromkeys(f"HF {self.name}{c}" for c in (self.default, "Model")))
        return Layout(shown, table, ignore=tuple(ignore), tied=tied, zeros=zeros, fixed=fixed)

    def _fits(self, spec: Any) -> None:
        """Raise :class:`Misfit` where a spec key the table states as a constant has another value."""
        if spec.model != "encoder_decoder":
            raise Misfit(f"HF {self.name} is an encoder-decoder, but spec {spec.name!r} is a {spec.model}")
        for role in ROLES:
            stack = spec.stacks[role]
            ours = {
                "block.layers": list(stack.block.layers),
                "block.norm.placement": stack.block.norm.placement,
                "embed_norm": stack.embed_norm,
                "final_norm": stack.final_norm,
                "position.kind": [p.kind for p in stack.positions],
            }
            for key in _STRUCTURE:
                want = self.spec.get(f"{role}.{key}")
                if want is None or isinstance(want, (F, D)):
                    continue
                want = [want] if key == "position.kind" else want
                if ours[key] != want:
                    raise Misfit(
                        f"HF {self.name} has {role}.{key} {want}, but spec {spec.name!r} has {ours[key]}"
                    )


def generation(head: Head, bias: Name | None = None) -> Head:
    """``*ForConditionalGeneration``: an LM head on the decoder, and the buffer HF adds to its logits (BART's
    ``final_logits_bias``, (1, vocab)) as the head's bias.

    Args:
        head: the LM head (:func:`~specvit.interop.table.lm`).
        bias: the logits' bias buffer, as a :class:`Renamed` to the head's bias; None where there is none.
    """
    if bias is None:
        return head
    return Head({**head.spec, "head.bias": True}, {**head.names, "head.fc.bias": bias})


def _token(c: Config, key: str, default: int | None, why: str) -> int:
    """A token id the sequence classifier computes with: refused where null (HF's class raises there); the
    class's default where the config leaves the field out."""
    value = c.get(key, None if key in c.values else default, int)
    if value is None:
        raise c.refuse(key, None, f"{c.model_type}'s sequence classifier {why}", "give the token's id")
    return int(value)


def start_id(default: int | None, pad: int | None, writes_pad: bool = False) -> D:
    """The decoder's first id where it reads the source shifted right (``decoder_start_token_id``); HF's shift
    also needs a ``pad_token_id`` (it replaces the labels' -100 with it), so a null one is refused.

    Args:
        default: the config class's ``decoder_start_token_id``.
        pad: the config class's ``pad_token_id``.
        writes_pad: written back, give a ``pad_token_id`` too (the start id: a family whose spec holds no pad).
    """

    def read(c: Config, spec: Mapping[str, Any]) -> int:
        _token(c, "pad_token_id", pad, "shifts the source right, which HF does only with a pad_token_id")
        return _token(c, "decoder_start_token_id", default, "puts decoder_start_token_id before the source")

    def write(value: int, get: Any) -> dict[str, Any]:
        return {"decoder_start_token_id": value} | ({"pad_token_id": value} if writes_pad else {})

    return D(read, ("decoder_start_token_id", "pad_token_id"), write)


def classification(start: Any, eos: int, module: str = "classification_head") -> Head:
    """``*ForSequenceClassification`` of an encoder-decoder (BART's, T5's): the decoder reads the source shifted
    right (``start``: its ``decoder.input.shifted_source`` entry), and its token at the source's last
    ``eos_token_id`` goes through dropout, ``dense``, tanh, dropout and ``out_proj`` to ``num_labels`` logits
    (both dropouts ``classifier_dropout``).

    Args:
        start: the entry of the shift's start id (:func:`start_id`, or a D giving ``last``).
        eos: the config class's ``eos_token_id``.
        module: the head's HF module.
    """
    spec = {
        "decoder.input.shifted_source": start,
        "head.kind": "classifier",
        "head.pool": "last_eos",
        "head.eos_id": D(
            lambda c, spec: _token(
                c, "eos_token_id", eos, "pools the decoder's token at the last eos_token_id"
            ),
            ("eos_token_id",),
            lambda value, get: {"eos_token_id": value},
        ),
        "head.ops": D(
            _classifier_ops, ("classifier_dropout",), lambda ops, get: {"classifier_dropout": ops[0]["p"]}
        ),
        "head.dropout": F("classifier_dropout", 0.0),
        "head.classes": LABELS,
    }
    return Head(spec, {"head.ops.1": f"{module}.dense", "head.fc": f"{module}.out_proj"})


def _classifier_ops(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The classification head's layers before ``out_proj``: HF's dropout before ``dense``, then tanh."""
    p = c.get("classifier_dropout", 0.0, float)
    return [{"kind": "dropout", "p": p}, {"kind": "linear"}, {"kind": "act", "fn": "tanh"}]
