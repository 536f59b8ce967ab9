"""The T5-like encoder-decoder layout: ``shared`` (the token table both stacks copy), blocks
``{encoder,decoder}.block.{i}.layer.{j}`` of ``SelfAttention.{q,k,v,o}`` (the first layer's
``relative_attention_bias`` shared by its stack), the decoder's ``EncDecAttention``, ``DenseReluDense.{wi,wo}``
(``wi_0``, ``wi_1`` where gated), RMSNorms ``layer_norm`` and ``final_layer_norm``, no biases, then
``lm_head``, or ``classification_head`` (``T5ForSequenceClassification``, whose backbone is ``transformer.``). T5
(Raffel et al. 2020: unscaled attention, a bucketed relative bias, a tied head fed ``d_model**-0.5`` times the
decoder's output) is its first table; mT5 changes a few entries of :data:`T5`.

The dropout (``dropout_rate``) is inert: T5 drops out after the embeddings, on the attention weights, inside and
after each sublayer and after the last norm, and the last has no spec key. The two stacks compute what HF's
compute in eval; specvit trains them without dropout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.seq2seq import Seq2Seq, both, classification, start_id
from specvit.interop.table import BARE, D, F, Head, Name, Only, count, register
from specvit.ops.mlp import GATED

__all__ = ["T5"]

_GATES = {"gelu_new": "geglu_tanh", "gelu_pytorch_tanh": "geglu_tanh", "gelu": "geglu", "silu": "swiglu",
          "swish": "swiglu"}  # fmt: skip
"""The activation of a gated MLP's gate (``act(wi_0) * wi_1``) -> specvit's gated activation."""


def _mlp(default: str) -> D:
    """The MLP's activation. T5's config class derives ``is_gated_act`` and ``dense_act_fn`` (the activation
    ``ACT2FN`` names) from ``feed_forward_proj`` (``gated-gelu`` is the tanh GELU, ``gelu_new``), and the model
    reads those two: where a config.json gives them, they win.

    Args:
        default: the class's default ``feed_forward_proj``.
    """

    def read(c: Config, spec: Mapping[str, Any]) -> str:
        proj = c.get("feed_forward_proj", default, str)
        parts = proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise c.refuse(
                "feed_forward_proj", proj, "expected gated-{act} or {act}", "use relu or gated-gelu"
            )
        implied = (len(parts) == 2, "gelu_new" if proj == "gated-gelu" else parts[-1])
        gated, act = c.get("is_gated_act", implied[0]), c.get("dense_act_fn", implied[1], str)
        table = _GATES if gated else ACTIVATIONS
        # blame the field that chose it: feed_forward_proj, or one a config.json overrode
        if act not in table:
            field, value = ("feed_forward_proj", proj) if (gated, act) == implied else ("dense_act_fn", act)
            if (gated, act) != implied and act == implied[1]:
                field, value = "is_gated_act", gated
            kind = "gated MLP (act(wi_0) * wi_1)" if gated else "MLP"
            raise c.refuse(
                field, value, f"specvit has no {kind} of activation {act}", f"use {', '.join(table)}"
            )
        return table[act]

    return D(read, ("feed_forward_proj", "is_gated_act", "dense_act_fn"))


def _decoder_depth(c: Config, spec: Mapping[str, Any]) -> int:
    """``num_decoder_layers``, the encoder's depth where a config leaves it out."""
    depth = c.get("num_decoder_layers", None, int)
    return spec["encoder.depth"] if depth is None else depth


def _tied(c: Config) -> tuple[bool, bool]:
    """Whether the head is tied to the embedding, and whether its input is scaled by ``d_model**-0.5``.

    transformers 5 ties T5's head in every config (``tie_word_embeddings`` reads true) and keeps what a config
    asked in ``scale_decoder_outputs``: a checkpoint whose head is its own (T5 v1.1) is loaded untied and
    unscaled. A config of transformers 4 says ``tie_word_embeddings`` alone."""
    tied = bool(c.get("tie_word_embeddings", True))
    scaled = bool(c.get("scale_decoder_outputs", tied))
    return tied and scaled, scaled


def _scale(c: Config, spec: Mapping[str, Any]) -> float | None:
    width = spec["decoder.width"]
    return float(width) ** -0.5 if _tied(c)[1] and width > 0 else None  # a width < 1 is refused by the spec


_DECODER = "decoder.block.{i}.layer."
_CROSS = "decoder.blocks.{i}.cross_attn."


def _names() -> dict[str, Name]:
    """specvit's modules in the T5 layout -> HF's: the MLP is the encoder's second layer, the decoder's third."""
    names: dict[str, Name] = {}
    for role, ff in (("encoder", 1), ("decoder", 2)):
        layer, block = f"{role}.block.{{i}}.layer.", f"{role}.blocks.{{i}}."
        names |= {
            f"{role}.tok_embed": f"{role}.embed_tokens",
            f"{role}.rel_bias.embedding": f"{role}.block.0.layer.0.SelfAttention.relative_attention_bias",
            block + "norm1": layer + "0.layer_norm",
            block + "attn.qkv": tuple(layer + f"0.SelfAttention.{n}" for n in "qkv"),
            block + "attn.proj": layer + "0.SelfAttention.o",
            block + f"norm{ff + 1}": layer + f"{ff}.layer_norm",
            block + "mlp.fc1": layer + f"{ff}.DenseReluDense.wi",
            block + "mlp.fc2": layer + f"{ff}.DenseReluDense.wo",
            f"{role}.norm": f"{role}.final_layer_norm",
        }
    return names | {
        "decoder.blocks.{i}.norm2": _DECODER + "1.layer_norm",
        _CROSS + "q": _DECODER + "1.EncDecAttention.q",
        _CROSS + "kv": (_DECODER + "1.EncDecAttention.k", _DECODER + "1.EncDecAttention.v"),
        _CROSS + "proj": _DECODER + "1.EncDecAttention.o",
    }


def _gated(spec: Any, keys: Sequence[str]) -> Mapping[str, Name]:
    """A gated MLP's input projection: the gate (``wi_0``), then the value (``wi_1``)."""
    if spec.encoder.block.mlp.activation not in GATED:
        return {}
    out: dict[str, Name] = {}
    for role, ff in (("encoder", 1), ("decoder", 2)):
        wi = f"{role}.block.{{i}}.layer.{ff}.DenseReluDense.wi"
        out[f"{role}.blocks.{{i}}.mlp.fc1"] = (wi + "_0", wi + "_1")
    return out


T5 = register(
    Seq2Seq(
        name="T5",
        model_types=("t5",),
        role="encoder_decoder",
        keys=r"(?:transformer\.)?encoder\.block\.\d+\.layer\.0\.SelfAttention\.",
        spec={
            **both(
                {
                    "input.kind": "tokens",
                    "input.vocab": F("vocab_size", 32128),
                    "position.kind": "relative",
                    "position.buckets": F("relative_attention_num_buckets", 32),
                    "position.max_distance": F("relative_attention_max_distance", 128),
                    "width": F("d_model", 512),
                }
            ),
            "encoder.depth": F("num_layers", 6),
            "decoder.depth": D(_decoder_depth, ("num_decoder_layers",)),
            **both(
                {
                    "block.heads": count("num_heads", 8),
                    "block.head_dim": F("d_kv", 64),
                    "block.norm.kind": "rmsnorm",
                    "block.norm.eps": F("layer_norm_epsilon", 1e-6),
                    "block.mlp.hidden": F("d_ff", 2048),
                    "block.mlp.activation": _mlp("relu"),
                    "block.mlp.bias": False,
                    "block.qkv_bias": False,
                    "block.proj_bias": False,
                    "block.attention_scale": 1.0,  # q·k unscaled
                }
            ),
            "encoder.block.layers": ["self_attention", "mlp"],
            "decoder.block.layers": ["masked_self_attention", "cross_attention", "mlp"],
            "shared_embeddings": True,
        },
        only=(
            Only("is_decoder", False, (False,), "a decoder-only T5 stack is not this table's"),
            Only(
                "is_encoder_decoder",
                True,
                (True,),
                "transformers' T5 decoder then keeps no cross-attention cache of its own and computes "
                "another model",
            ),
        ),
        inert=(
            "dropout_rate",  # training only (see the module's docstring)
            "initializer_factor",
            "decoder_start_token_id",  # a token id of HF's generate; the sequence classifier reads it
        ),
        names=_names(),
        classes={
            "Model": BARE,
            "ForConditionalGeneration": Head(
                {
                    "head.kind": "lm",
                    "head.tied": D(
                        lambda c, spec: _tied(c)[0], ("tie_word_embeddings", "scale_decoder_outputs")
                    ),
                    "head.scale": D(_scale, ("tie_word_embeddings", "scale_decoder_outputs")),
                },
                {"head.fc": "lm_head"},
            ),
            "ForSequenceClassification": classification(start_id(None, 0, writes_pad=True), eos=1),
        },
        default="ForConditionalGeneration",
        # older checkpoints' bias table in the first cross-attention, which no T5 class reads
        ignore=(
            r"(?:transformer\.)?decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",
        ),
        backbone="transformer.",  # the sequence classifier's; the other classes have none
        chosen=_gated,
    )
)

MT5 = register(
    T5.but(
        "MT5",
        ("mt5",),
        {
            **both({"input.vocab": F("vocab_size", 250112), "block.mlp.hidden": F("d_ff", 1024)}),
            "encoder.depth": F("num_layers", 8),
            **both(
                {
                    "block.heads": count("num_heads", 6),
                    "block.mlp.activation": _mlp("gated-gelu"),
                }
            ),
        },
        # MT5ForConditionalGeneration never scales the decoder's output, and its head is its own: the class
        # ties it to the embedding when built from a config (tie_word_embeddings reads true in every config),
        # and published checkpoints hold a head of their own, which from_pretrained keeps.
        classes={
            "ForConditionalGeneration": Head({"head.kind": "lm", "head.tied": False}, {"head.fc": "lm_head"}),
            "ForSequenceClassification": classification(start_id(0, 0, writes_pad=True), eos=1),
        },
        inert=("tie_word_embeddings",),
    )
)
