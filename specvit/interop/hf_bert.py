"""The BERT-like encoder layout: ``embeddings.{word,position,token_type}_embeddings`` and
``embeddings.LayerNorm``, then post-norm blocks ``encoder.layer.{i}.attention.self.{query,key,value}``,
``attention.output.{dense,LayerNorm}``, ``intermediate.dense``, ``output.{dense,LayerNorm}``, under a backbone
named per family (``bert.``, ``roberta.``, ``electra.``). BERT is its first table; the families of
``hf_encoders.py`` change a few entries of :data:`BERT`.

The task classes are heads written in generic head ops: the base model (without HF's pooler, as
``add_pooling_layer=False`` builds it; with it, as ``BertModel(config)`` does, :attr:`Table.pooled`: a
``classifier`` head on the first token with ``ops`` its dense layer and tanh and ``tokens: true``, returning
``last_hidden_state`` and ``pooler_output``); the classes with one linear layer on every token (token classification,
extractive question answering), an ``lm`` head of ``len(id2label)`` outputs; the masked LM, an ``lm`` head
whose ``ops`` are a dense layer, an activation and the blocks' norm before the decoder (tied to the word
embeddings, with a bias); and the sequence classifier, a ``classifier`` on the first token whose ``ops`` are
the pooler's dense layer and tanh (RoBERTa's classification head: the same on ``<s>``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from specvit.interop.layout import batched
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.table import (
    BARE,
    D,
    F,
    Head,
    Name,
    Only,
    Renamed,
    Table,
    count,
    labels,
    per_token,
    pooled,
    register,
)

__all__ = [
    "BERT",
    "QA",
    "TOKENS",
    "dropout",
    "encoder_family",
    "head_ops",
    "labels",
    "masked_lm",
    "padding",
    "per_token",
    "sequence",
    "task_classes",
]


TOKENS = per_token("classifier")
"""``*ForTokenClassification``: dropout (nothing in eval) and a linear classifier on every token."""
QA = per_token("qa_outputs", labels(2))
"""``*ForQuestionAnswering``: a linear layer to (start, end) logits on every token; specvit returns the two
as the last axis of one (B, N, 2) tensor."""


TANH = {"kind": "act", "fn": "tanh"}


def head_ops(*items: Mapping[str, Any]) -> D:
    """A head's ``ops:`` list, its items' values constants or read from the config (:class:`F`, :class:`D`).

    Args:
        items: the layers, ``{"kind": "act", "fn": F("hidden_act", "gelu", map=ACTIVATIONS)}``.
    """
    entries = [v for item in items for v in item.values() if isinstance(v, (F, D))]

    def read(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
        def value(v: Any) -> Any:
            return v.read(c) if isinstance(v, F) else v.read(c, spec) if isinstance(v, D) else v

        return [{k: value(v) for k, v in item.items()} for item in items]

    def write(ops: Any, get: Callable[[str], Any]) -> dict[str, Any]:
        config: dict[str, Any] = {}
        for item, op in zip(items, ops if isinstance(ops, list) else [], strict=False):
            for k, v in item.items():
                if isinstance(v, F):
                    config |= v.write(op.get(k))
                elif isinstance(v, D) and v.inverse is not None:
                    config |= v.inverse(op.get(k), get)
        return config

    return D(read, tuple(f for v in entries for f in v.fields), write)


def masked_lm(
    dense: str, norm: str, decoder: str, act: Any, *, bias: str | None = None, width: D | None = None
) -> Head:
    """``*ForMaskedLM``: a dense layer, an activation and the blocks' norm on every token, then the decoder to
    the vocabulary with a bias, its weight the word embeddings' unless ``tie_word_embeddings`` is false.

    Args:
        dense: HF's dense layer, outside the backbone.
        norm: HF's norm.
        decoder: HF's decoder.
        act: the activation: a name, or :class:`F` of its field.
        bias: the HF parameter the decoder's bias is when tied (BERT's ``cls.predictions.bias``).
        width: the dense layer's width where it is not the blocks' (the embeddings': ELECTRA, ALBERT).
    """
    linear: dict[str, Any] = {"kind": "linear"} | ({"width": width} if width is not None else {})
    spec = {
        "head.kind": "lm",
        "head.tied": F("tie_word_embeddings", True),
        "head.bias": True,
        "head.ops": head_ops(linear, {"kind": "act", "fn": act}, {"kind": "norm"}),
    }
    tied = {f"{decoder}.bias": bias} if bias else {}
    return Head(spec, {"head.ops.0": dense, "head.ops.2": norm, "head.fc": decoder}, tied)


def sequence(dense: str, fc: str, act: str = "tanh") -> Head:
    """``*ForSequenceClassification``: a dense layer and an activation on the first token (BERT's pooler),
    then a linear classifier of ``len(id2label)`` outputs.

    Args:
        dense: HF's dense layer, outside the backbone (``bert.pooler.dense``, ``classifier.dense``).
        fc: HF's classifier.
        act: the activation between them.
    """
    spec = {
        "head.kind": "classifier",
        "head.pool": "first",
        "head.classes": labels(),
        "head.ops": [{"kind": "linear"}, {"kind": "act", "fn": act}],
    }
    return Head(spec, {"head.ops.0": dense, "head.fc": fc})


def task_classes(lm: Head, seq: Head) -> dict[str, Head]:
    """The task classes of a BERT-like family: the base model, the token classifier and question answering (one
    linear layer on every token, the same in every family), and the family's own masked LM and sequence
    classifier.

    Args:
        lm: its ``*ForMaskedLM`` head (:func:`masked_lm`).
        seq: its ``*ForSequenceClassification`` head (:func:`sequence`).
    """
    return {
        "Model": BARE,
        "ForTokenClassification": TOKENS,
        "ForQuestionAnswering": QA,
        "ForMaskedLM": lm,
        "ForSequenceClassification": seq,
    }


def padding(default: int | None) -> D:
    """The token embedding's ``padding_idx``: the config's ``pad_token_id`` (no row when it is null).

    Args:
        default: the HF class's default ``pad_token_id``.
    """

    def read(c: Config, spec: Mapping[str, Any]) -> int | None:
        if "pad_token_id" in c.values and c.values["pad_token_id"] is None:
            return None
        return c.get("pad_token_id", default, int)

    def write(value: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
        return {"pad_token_id": value}

    return D(read, ("pad_token_id",), write)


def dropout(hidden: str, attention: str, default: float, *, projection: bool = True) -> dict[str, F | float]:
    """The stack's dropout rates (training only) from the config's two fields.

    Args:
        hidden: the field of the dropout after the embeddings, the attention's output projection and the MLP.
        attention: the field of the dropout on the attention weights.
        default: both fields' default in the HF class.
        projection: whether the family drops out after the attention's output projection (DistilBERT does not).
    """
    rate = F(hidden, default)
    return {
        "encoder.dropout.embedding": rate,
        "encoder.dropout.attention": F(attention, default),
        "encoder.dropout.projection": rate if projection else 0.0,
        "encoder.dropout.mlp": rate,
    }


def encoder_family(
    base: Table,
    name: str,
    model_types: tuple[str, ...],
    backbone: str,
    spec: Mapping[str, Any] | None = None,
    *,
    keys: str | None = None,
    **changes: Any,
) -> Table:
    """A family of an encoder layout: ``base.but(...)`` under the family's own backbone prefix.

    Args:
        base: the table it changes.
        name: the family's HF class prefix (``Roberta``).
        model_types: its config model types.
        backbone: the backbone's attribute in a task model, with the dot (``roberta.``).
        spec: spec entries added or replaced.
        keys: its key pattern; by default the base's with the backbone's prefix.
        changes: the other arguments of :meth:`Table.but` (``drop``, ``only``, ``inert``, ``names``, ``classes``).
    """
    pattern = keys or base.keys.replace(_escaped(base.backbone), _escaped(backbone), 1)
    table = base.but(name, model_types, spec, keys=pattern, **changes)
    return replace(table, backbone=backbone)


def _escaped(backbone: str) -> str:
    return backbone.replace(".", r"\.")


_LAYER = "encoder.layer.{i}."
_BLOCK = "encoder.blocks.{i}."

NAMES: dict[str, Name] = {
    "encoder.tok_embed": "embeddings.word_embeddings",
    "encoder.type_embed": "embeddings.token_type_embeddings",
    "encoder.pos_embed.weight": Renamed("embeddings.position_embeddings.weight", batched),
    "encoder.embed_norm": "embeddings.LayerNorm",
    _BLOCK + "attn.qkv": tuple(_LAYER + f"attention.self.{n}" for n in ("query", "key", "value")),
    _BLOCK + "attn.proj": _LAYER + "attention.output.dense",
    _BLOCK + "norm1": _LAYER + "attention.output.LayerNorm",
    _BLOCK + "mlp.fc1": _LAYER + "intermediate.dense",
    _BLOCK + "mlp.fc2": _LAYER + "output.dense",
    _BLOCK + "norm2": _LAYER + "output.LayerNorm",
}
"""specvit's modules in the BERT layout -> HF's, relative to the backbone."""

BERT = register(
    Table(
        name="Bert",
        model_types=("bert",),
        role="encoder",
        keys=r"(?:bert\.)?encoder\.layer\.\d+\.attention\.self\.query\.",  # not ALBERT's, nor DistilBERT's
        spec={
            "encoder.input.kind": "tokens",
            "encoder.input.vocab": F("vocab_size", 30522),
            "encoder.input.padding_idx": padding(0),
            "encoder.input.type_vocab": F("type_vocab_size", 2),
            "encoder.position.kind": "learned",
            "encoder.position.max_len": F("max_position_embeddings", 512),
            "encoder.width": F("hidden_size", 768),
            "encoder.depth": F("num_hidden_layers", 12),
            "encoder.embed_norm": True,
            "encoder.final_norm": False,
            "encoder.block.heads": count("num_attention_heads", 12),
            "encoder.block.norm.kind": "layernorm",
            "encoder.block.norm.placement": "post",
            "encoder.block.norm.eps": F("layer_norm_eps", 1e-12),
            "encoder.block.mlp.hidden": F("intermediate_size", 3072),
            "encoder.block.mlp.activation": F("hidden_act", "gelu", map=ACTIVATIONS),
            **dropout("hidden_dropout_prob", "attention_probs_dropout_prob", 0.1),
        },
        only=(
            Only("is_decoder", False, (False,), "a decoder's causal self-attention is not an encoder's"),
            Only(
                "add_cross_attention", False, (False,), "cross-attention layers have no place in an encoder"
            ),
            Only(
                "position_embedding_type",
                "absolute",
                ("absolute",),
                "relative key/query positions have no specvit position kind here",
            ),
        ),
        inert=(
            "classifier_dropout",  # dropout before a task head: training only
            "gradient_checkpointing",  # older config.json files: a memory switch of training
        ),
        names=NAMES,
        classes=task_classes(
            masked_lm(
                "cls.predictions.transform.dense",
                "cls.predictions.transform.LayerNorm",
                "cls.predictions.decoder",
                F("hidden_act", "gelu", map=ACTIVATIONS),
                bias="cls.predictions.bias",
            ),
            sequence("bert.pooler.dense", "classifier"),
        ),
        default="Model",
        ignore=(r"(?:\w+\.)?embeddings\.(?:position_ids|token_type_ids)",),  # index buffers, not weights
        backbone="bert.",
        pooled=pooled({"head.ops.0": "pooler.dense"}, pool="first", ops=[{"kind": "linear"}, TANH]),
    )
)
