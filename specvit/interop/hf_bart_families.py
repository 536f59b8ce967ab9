"""Families of the BART-like encoder-decoder layout (:data:`~specvit.interop.hf_bart.BART`), each a table of what
it changes: mBART, Pegasus, Marian and M2M100."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from specvit.interop.hf_bart import BART, LOGITS_BIAS, legacy, padding
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.seq2seq import ROLES, both, classification, generation
from specvit.interop.table import BARE, D, F, lm, register

__all__: list[str] = []

_PRE = {"block.norm.placement": "pre", "final_norm": True}
"""Pre-norm blocks and a norm after the last (``{encoder,decoder}.layer_norm``)."""
_SINUSOIDS = {"position.kind": "sincos", "position.layout": "concat", "embed_norm": False}
"""Fixed sinusoids, sines then cosines (HF keeps them as a frozen ``embed_positions`` table), from position 0;
no norm after the embeddings."""
_MAX_LEN = tuple(f"{role}.position.max_len" for role in ROLES)
_LEARNED = (*_MAX_LEN, *(f"{role}.position.offset" for role in ROLES))
"""The learned table's entries, which sinusoids have not."""
_ROWS = "extra_pos_embeddings"
"""Older configs' rows before a learned table's first (BART's 2); inert where positions are sinusoids."""

_CLASSIFIER = "ForSequenceClassification"
"""BART's and mBART's class alone: the other families of the layout have none."""


def _last(c: Config, spec: Mapping[str, Any]) -> str:
    """mBART's decoder reads the source shifted right behind its last token that is not ``pad_token_id`` (the
    language id): its ``shift_tokens_right`` takes no start id, and a null pad id makes HF's class raise."""
    if spec["decoder.input.padding_idx"] is None:
        raise c.refuse(
            "pad_token_id",
            None,
            "mBART's sequence classifier puts the source's last token that is not pad_token_id first",
            "give the pad token's id",
        )
    return "last"


MBART = register(
    BART.but(
        "MBart",
        ("mbart",),
        both(_PRE),
        only=legacy(before=True, final=True, embedding=True, sinusoids=False),
        classes={_CLASSIFIER: classification(D(_last, ("pad_token_id",), lambda value, get: {}), eos=2)},
    )
)

PEGASUS = register(
    BART.but(
        "Pegasus",
        ("pegasus",),
        both(_PRE | _SINUSOIDS | {"input.padding_idx": padding(0)}),
        drop=(*_LEARNED, _ROWS, _CLASSIFIER),
        only=legacy(before=True, final=True, embedding=False, sinusoids=True),
        inert=(_ROWS,),
    )
)


def _decoder_vocab(c: Config, spec: Mapping[str, Any]) -> int:
    """The decoder's vocabulary: ``decoder_vocab_size`` where the stacks do not share a table, else the
    encoder's (a shared table of other sizes is refused)."""
    vocab = spec["encoder.input.vocab"]
    own = c.get("decoder_vocab_size", None, int)
    own = vocab if own is None else own
    if c.get("share_encoder_decoder_embeddings", True) and own != vocab:
        raise c.refuse(
            "decoder_vocab_size",
            own,
            f"the stacks share one table of vocab_size {vocab} rows, which HF's decoder table of another size "
            "replaces only where it ties the embeddings",
            f"use {vocab}, or share_encoder_decoder_embeddings: false",
        )
    return own


def _shared(c: Config, spec: Mapping[str, Any]) -> bool:
    """One token table for both stacks: Marian shares it where ``share_encoder_decoder_embeddings`` and
    ``tie_word_embeddings`` both say so (the class ties the stacks' copies only then)."""
    return bool(c.get("share_encoder_decoder_embeddings", True) and c.get("tie_word_embeddings", True))


def _write_shared(value: bool, get: Callable[[str], Any]) -> dict[str, Any]:
    return {"share_encoder_decoder_embeddings": bool(value)}


def _write_vocab(value: int, get: Callable[[str], Any]) -> dict[str, Any]:
    return {"decoder_vocab_size": value}


_SHARING = ("share_encoder_decoder_embeddings", "tie_word_embeddings")

_MARIAN = BART.but(
    "Marian",
    ("marian",),
    {
        **both(_SINUSOIDS | {"input.vocab": F("vocab_size", 58101), "input.padding_idx": padding(58100)}),
        "decoder.input.vocab": D(_decoder_vocab, ("decoder_vocab_size", *_SHARING), _write_vocab),
        "shared_embeddings": D(_shared, _SHARING, _write_shared),
    },
    drop=(*_LEARNED, _ROWS),
    only=legacy(before=False, final=False, embedding=False, sinusoids=True),
    inert=(_ROWS,),
)
MARIAN = register(
    replace(  # MarianMTModel: the LM head (of the decoder's vocabulary) and final_logits_bias
        _MARIAN,
        classes={"Model": BARE, "MTModel": generation(lm(tied=True), LOGITS_BIAS)},
        default="MTModel",
    )
)


def _first_position(c: Config, spec: Mapping[str, Any]) -> int:
    """M2M100 numbers the tokens from ``pad_token_id + 1`` (fairseq's ``make_positions``)."""
    pad = padding(1).read(c, spec)
    if pad is None:
        raise c.refuse(
            "pad_token_id",
            None,
            "M2M100 numbers positions from pad_token_id + 1, so it needs a pad token",
            "give the pad token's id",
        )
    return int(pad) + 1


M2M100 = register(
    BART.but(
        "M2M100",
        ("m2m_100",),
        both(
            _PRE
            | _SINUSOIDS
            | {
                "input.vocab": F("vocab_size", 128112),
                "input.scale": F("scale_embedding", True),
                "position.frequencies": "tensor2tensor",  # base^(-i / (d/2 - 1)), fairseq's
                "position.offset": D(_first_position, ("pad_token_id",)),
                "block.mlp.activation": F("activation_function", "relu", map=ACTIVATIONS),
                "dropout.attention": F("attention_dropout", 0.1),
            }
        ),
        drop=(
            *_MAX_LEN,
            *(o.name for o in BART.only if o.name != "is_decoder"),
            _CLASSIFIER,
        ),  # no legacy fields
        classes={"ForConditionalGeneration": lm(tied=True)},  # no final_logits_bias
    )
)
"""M2M100's positions (``create_position_ids_from_input_ids``) number only the tokens that are not the pad id: the
two agree where the padding trails the text and is masked (as tokenizers pad); a pad id inside the text, or left
padding, moves HF's positions and not specvit's."""
