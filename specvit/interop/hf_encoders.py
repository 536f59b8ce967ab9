"""Families of the BERT-like encoder layout (:data:`~specvit.interop.hf_bert.BERT`), each a table of what it
changes: RoBERTa, XLM-RoBERTa, CamemBERT, Data2VecText, ELECTRA, ALBERT and DistilBERT."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.hf_bert import (
    BERT,
    TANH,
    dropout,
    encoder_family,
    masked_lm,
    padding,
    sequence,
    task_classes,
)
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.table import D, F, Name, Only, Table, count, pooled, register

__all__: list[str] = []


def _first_row(c: Config) -> int:
    """RoBERTa's first position is row ``pad_token_id + 1``: the rows before it are the spec's offset."""
    pad = padding(1).read(c, {})
    if pad is None:
        raise c.refuse(
            "pad_token_id",
            None,
            "RoBERTa numbers positions from pad_token_id + 1, so it needs a pad token",
            "give the pad token's id",
        )
    return int(pad) + 1


def _positions(c: Config, spec: Mapping[str, Any]) -> int:
    """The positions a RoBERTa table holds after its offset rows."""
    return int(c.get("max_position_embeddings", 512)) - _first_row(c)


def _write_first_row(offset: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
    return {} if offset is None else {"pad_token_id": offset - 1}


def _write_rows(rows: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
    offset = get("encoder.position.offset")
    return {} if rows is None or offset is None else {"max_position_embeddings": rows + offset}


_ROBERTA = {
    "encoder.input.vocab": F("vocab_size", 30522),
    "encoder.input.padding_idx": padding(1),
    "encoder.position.offset": D(lambda c, spec: _first_row(c), ("pad_token_id",), _write_first_row),
    "encoder.position.max_len": D(_positions, ("max_position_embeddings",), _write_rows),
}
"""RoBERTa's positions: token i reads row ``pad_token_id + 1 + i``; the table's rows are
``max_position_embeddings``. HF's ``create_position_ids_from_input_ids`` numbers only the tokens that are not
the pad id, so the two agree where the padding trails the text and is masked (right padding, as tokenizers
pad by default); a left-padded batch, or a pad id inside the text, moves HF's positions and not specvit's."""


_RO_CLASSES = task_classes(
    masked_lm("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder", "gelu", bias="lm_head.bias"),
    sequence("classifier.dense", "classifier.out_proj"),  # on <s>, with tanh
)
"""RoBERTa's heads: ``lm_head`` (dense, exact GELU whatever ``hidden_act`` says, LayerNorm, tied decoder) and
the classification head (dense, tanh, ``out_proj``)."""


def _roberta(name: str, model_types: tuple[str, ...], backbone: str, **spec: Any) -> Table:
    return register(encoder_family(BERT, name, model_types, backbone, _ROBERTA | spec, classes=_RO_CLASSES))


ROBERTA = _roberta("Roberta", ("roberta",), "roberta.", **{"encoder.input.vocab": F("vocab_size", 50265)})
XLM_ROBERTA = _roberta("XLMRoberta", ("xlm-roberta",), "roberta.")
CAMEMBERT = _roberta("Camembert", ("camembert",), "roberta.")
DATA2VEC_TEXT = _roberta("Data2VecText", ("data2vec-text",), "data2vec_text.")


def _embed_width(c: Config, spec: Mapping[str, Any]) -> int | None:
    """The embeddings' width where it is not the blocks' (a linear layer then maps it to them)."""
    width = c.get("embedding_size", 128)
    return None if width == spec["encoder.width"] else width


def _write_embed_width(width: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
    return {"embedding_size": get("encoder.width") if width is None else width}


EMBED_WIDTH = D(_embed_width, ("embedding_size",), _write_embed_width)
"""ELECTRA's ``embedding_size``: specvit's ``embed_width`` where it is not ``hidden_size``."""


ELECTRA = register(
    encoder_family(
        BERT,
        "Electra",
        ("electra",),
        "electra.",
        {
            "encoder.width": F("hidden_size", 256),
            "encoder.embed_width": EMBED_WIDTH,
            "encoder.block.heads": count("num_attention_heads", 4),
            "encoder.block.mlp.hidden": F("intermediate_size", 1024),
        },
        inert=(
            "summary_type",
            "summary_use_proj",
            "summary_activation",
            "summary_last_dropout",
        ),  # MultipleChoice
        names={"encoder.embed_proj": "embeddings_project"},
        pooled=None,  # ElectraModel has no pooler
        classes=task_classes(
            masked_lm(  # the generator's: exact GELU, to the embeddings' width, the tied decoder's own bias
                "generator_predictions.dense",
                "generator_predictions.LayerNorm",
                "generator_lm_head",
                "gelu",
                width=EMBED_WIDTH,
            ),
            sequence("classifier.dense", "classifier.out_proj", "gelu"),
        ),
    )
)

_ALBERT = "encoder.albert_layer_groups.{i}.albert_layers.0."
_BLOCK = "encoder.blocks.{i}."


def _albert_width(c: Config, spec: Mapping[str, Any]) -> int:
    """ALBERT's embeddings' width: its linear layer to the blocks is there even at the blocks' width, and
    specvit's ``embed_proj`` only where the widths differ."""
    width = c.get("embedding_size", 128)
    if width == spec["encoder.width"]:
        raise c.refuse(
            "embedding_size",
            width,
            "ALBERT maps its embeddings to the blocks by a linear layer even at equal widths, and specvit's "
            "embed_proj exists only where embed_width differs from the width",
            "give an embedding_size other than hidden_size (ALBERT's checkpoints use 128)",
        )
    return width


def _write_groups(groups: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
    return {"num_hidden_groups": get("encoder.depth") if groups is None else groups}


def _groups(c: Config, spec: Mapping[str, Any]) -> int | None:
    """ALBERT's layer groups: ``num_hidden_groups`` sets of block weights, runs of equally many consecutive
    layers sharing one; none when every layer has its own."""
    groups, depth = c.size("num_hidden_groups", 1), spec["encoder.depth"]
    if depth % groups:
        raise c.refuse(
            "num_hidden_groups",
            groups,
            f"the groups do not divide the {depth} layers, so HF's runs of layers sharing a group differ in "
            "length, and specvit's shared weight sets each take depth / blocks layers",
            f"use a divisor of num_hidden_layers ({depth})",
        )
    return None if groups == depth else groups


ALBERT_NAMES: dict[str, Name] = {
    "encoder.embed_proj": "encoder.embedding_hidden_mapping_in",
    _BLOCK + "attn.qkv": tuple(_ALBERT + f"attention.{n}" for n in ("query", "key", "value")),
    _BLOCK + "attn.proj": _ALBERT + "attention.dense",
    _BLOCK + "norm1": _ALBERT + "attention.LayerNorm",
    _BLOCK + "mlp.fc1": _ALBERT + "ffn",
    _BLOCK + "mlp.fc2": _ALBERT + "ffn_output",
    _BLOCK + "norm2": _ALBERT + "full_layer_layer_norm",
}
"""ALBERT's blocks: one per layer group (``{i}`` is the group), each of one layer."""

ALBERT = register(
    encoder_family(
        BERT,
        "Albert",
        ("albert",),
        "albert.",
        {
            "encoder.input.vocab": F("vocab_size", 30000),
            "encoder.width": F("hidden_size", 4096),
            "encoder.embed_width": D(
                _albert_width, ("embedding_size",), lambda value, get: {"embedding_size": value}
            ),
            "encoder.share.blocks": D(_groups, ("num_hidden_groups",), _write_groups),
            "encoder.block.heads": count("num_attention_heads", 64),
            "encoder.block.mlp.hidden": F("intermediate_size", 16384),
            "encoder.block.mlp.activation": F("hidden_act", "gelu_new", map=ACTIVATIONS),
            **dropout("hidden_dropout_prob", "attention_probs_dropout_prob", 0.0),
        },
        drop=("is_decoder", "add_cross_attention"),  # ALBERT has neither
        only=(
            Only(
                "inner_group_num", 1, (1,), "several layers within a group of shared weights have no spec key"
            ),
        ),
        inert=("classifier_dropout_prob",),
        names=ALBERT_NAMES,
        classes=task_classes(
            masked_lm(
                "predictions.dense",
                "predictions.LayerNorm",
                "predictions.decoder",
                F("hidden_act", "gelu_new", map=ACTIVATIONS),
                bias="predictions.bias",
                width=D(_albert_width, ("embedding_size",), lambda value, get: {"embedding_size": value}),
            ),
            sequence("albert.pooler", "classifier"),
        ),
        keys=r"(?:albert\.)?encoder\.albert_layer_groups\.",
        pooled=pooled({"head.ops.0": "pooler"}, pool="first", ops=[{"kind": "linear"}, TANH]),
    )
)

_DISTIL = "transformer.layer.{i}."

DISTILBERT = register(
    encoder_family(
        BERT,
        "DistilBert",
        ("distilbert",),
        "distilbert.",
        {
            "encoder.input.type_vocab": 0,  # no token types
            "encoder.width": F("dim", 768),
            "encoder.depth": F("n_layers", 6),
            "encoder.block.heads": count("n_heads", 12),
            "encoder.block.norm.eps": 1e-12,  # fixed in DistilBERT's LayerNorms
            "encoder.block.mlp.hidden": F("hidden_dim", 3072),
            "encoder.block.mlp.activation": F("activation", "gelu", map=ACTIVATIONS),
            **dropout("dropout", "attention_dropout", 0.1, projection=False),
        },
        drop=("is_decoder", "add_cross_attention", "position_embedding_type"),
        only=(
            Only(
                "sinusoidal_pos_embds",
                False,
                (False,),
                "a frozen sinusoidal table would be trained as a learned one",
            ),
        ),
        inert=("qa_dropout", "seq_classif_dropout"),
        names={
            "encoder.tok_embed": "embeddings.word_embeddings",
            "encoder.embed_norm": "embeddings.LayerNorm",
            _BLOCK + "attn.qkv": tuple(_DISTIL + f"attention.{n}_lin" for n in "qkv"),
            _BLOCK + "attn.proj": _DISTIL + "attention.out_lin",
            _BLOCK + "norm1": _DISTIL + "sa_layer_norm",
            _BLOCK + "mlp.fc1": _DISTIL + "ffn.lin1",
            _BLOCK + "mlp.fc2": _DISTIL + "ffn.lin2",
            _BLOCK + "norm2": _DISTIL + "output_layer_norm",
        },
        classes=task_classes(
            masked_lm(  # its norm's eps is 1e-12, as the blocks'
                "vocab_transform",
                "vocab_layer_norm",
                "vocab_projector",
                F("activation", "gelu", map=ACTIVATIONS),
            ),
            sequence("pre_classifier", "classifier", "relu"),
        ),
        keys=r"(?:distilbert\.)?transformer\.layer\.\d+\.attention\.q_lin\.",
        pooled=None,  # DistilBertModel has no pooler
    )
)
