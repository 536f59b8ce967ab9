"""The BART-like encoder-decoder layout: ``model.shared`` (the token table both stacks copy),
``model.{encoder,decoder}.embed_positions``, ``layernorm_embedding``, blocks ``layers.{i}.self_attn.{q,k,v,out}_proj``,
``self_attn_layer_norm``, the decoder's ``encoder_attn`` and ``encoder_attn_layer_norm``, ``fc1``, ``fc2``,
``final_layer_norm``, a stack's last ``layer_norm``, then ``lm_head`` and ``final_logits_bias`` (a buffer HF adds
to the logits, read as the head's bias), or ``classification_head.{dense,out_proj}`` (``*ForSequenceClassification``:
the decoder reads the source shifted right, and the head its token at the source's last eos). BART (Lewis et al.
2020: post-norm, learned positions two rows in, a norm after the embeddings) is its first table; the families of
``hf_bart_families.py`` (mBART, Pegasus, Marian, M2M100) change a few entries of :data:`BART`.

The dropout after each sublayer (``dropout``) is read into specvit's ``dropout.embedding``, ``projection`` and
``mlp``, which also drops after the MLP's activation (BART's ``activation_dropout``, inert here): the same model
in eval, one dropout more in training. LayerDrop (``encoder_layerdrop``, ``decoder_layerdrop``: whole layers
skipped at random in training) has no spec key and is inert: specvit trains every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.layout import batched, flat
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.seq2seq import Seq2Seq, both, classification, generation, start_id
from specvit.interop.table import BARE, D, F, Only, Renamed, count, lm, register

__all__ = ["BART", "GENERATE", "legacy", "padding"]


def padding(default: int | None) -> D:
    """The token table's padding row (``nn.Embedding(padding_idx)``: no gradient to it): ``pad_token_id``, none
    where it is null (HF builds no table whose padding row is outside it; nor does specvit).

    Args:
        default: the HF class's default ``pad_token_id``.
    """

    def read(c: Config, spec: Mapping[str, Any]) -> int | None:
        return c.get("pad_token_id", None if "pad_token_id" in c.values else default, int)

    def write(value: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
        return {} if value is None else {"pad_token_id": value}

    return D(read, ("pad_token_id",), write)


def legacy(before: bool, final: bool, embedding: bool, sinusoids: bool) -> tuple[Only, ...]:
    """The fields of older (fairseq-converted) configs of the layout, read by no transformers class today: the
    family's own values, any other describing another family's model (the class would compute its own).

    Args:
        before: ``normalize_before``, pre-norm blocks.
        final: ``add_final_layer_norm``, a norm after the last block.
        embedding: ``normalize_embedding``, a norm after the embeddings.
        sinusoids: ``static_position_embeddings``, sinusoidal positions.
    """
    other = "another value describes another family of the layout, which this class does not compute"
    return (
        Only("normalize_before", before, (before,), f"pre-norm blocks: {other}"),
        Only("add_final_layer_norm", final, (final,), f"a norm after the last block: {other}"),
        Only("normalize_embedding", embedding, (embedding,), f"a norm after the embeddings: {other}"),
        Only("static_position_embeddings", sinusoids, (sinusoids,), f"sinusoidal positions: {other}"),
        Only("add_bias_logits", False, (False,), "a learned logits bias is not the final_logits_bias buffer"),
    )


GENERATE = ("decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id")
"""Token ids of HF's ``generate`` (specvit's takes them as arguments): they choose no logit."""

_ENC, _DEC = "encoder.layers.{i}.", "decoder.layers.{i}."


def _block(role: str, layer: str) -> dict[str, Any]:
    """A stack's names in the layout: the embeddings, the self-attention and MLP sublayers, the last norm."""
    block = f"{role}.blocks.{{i}}."
    return {
        f"{role}.tok_embed": f"{role}.embed_tokens",
        f"{role}.pos_embed.weight": Renamed(f"{role}.embed_positions.weight", batched),
        f"{role}.embed_norm": f"{role}.layernorm_embedding",
        block + "norm1": layer + "self_attn_layer_norm",
        block + "attn.qkv": tuple(layer + f"self_attn.{n}_proj" for n in "qkv"),
        block + "attn.proj": layer + "self_attn.out_proj",
        block + "mlp.fc1": layer + "fc1",
        block + "mlp.fc2": layer + "fc2",
        block + ("norm2" if role == "encoder" else "norm3"): layer + "final_layer_norm",
        f"{role}.norm": f"{role}.layer_norm",
    }


NAMES = {
    **_block("encoder", _ENC),
    **_block("decoder", _DEC),
    "decoder.blocks.{i}.norm2": _DEC + "encoder_attn_layer_norm",
    "decoder.blocks.{i}.cross_attn.q": _DEC + "encoder_attn.q_proj",
    "decoder.blocks.{i}.cross_attn.kv": (_DEC + "encoder_attn.k_proj", _DEC + "encoder_attn.v_proj"),
    "decoder.blocks.{i}.cross_attn.proj": _DEC + "encoder_attn.out_proj",
}
"""specvit's modules in the BART layout -> HF's, relative to the backbone (``model.``)."""

LOGITS_BIAS = Renamed("final_logits_bias", flat)
"""HF's (1, vocab) buffer added to the logits, as the LM head's bias."""

BART = register(
    Seq2Seq(
        name="Bart",
        model_types=("bart",),
        role="encoder_decoder",
        keys=r"(?:model\.)?encoder\.layers\.\d+\.self_attn_layer_norm\.",
        spec={
            **both(
                {
                    "input.kind": "tokens",
                    "input.vocab": F("vocab_size", 50265),
                    "input.padding_idx": padding(1),
                    "input.scale": F("scale_embedding", False),  # the embedding times sqrt(d_model)
                    "position.kind": "learned",
                    "position.max_len": F("max_position_embeddings", 1024),
                    "position.offset": 2,  # BartLearnedPositionalEmbedding starts two rows in
                    "width": F("d_model", 1024),
                    "embed_norm": True,
                    "final_norm": False,
                    "block.norm.placement": "post",
                    "block.norm.eps": 1e-5,  # nn.LayerNorm's default
                    "block.mlp.activation": F("activation_function", "gelu", map=ACTIVATIONS),
                    "dropout.embedding": F("dropout", 0.1),
                    "dropout.attention": F("attention_dropout", 0.0),
                    "dropout.projection": F("dropout", 0.1),
                    "dropout.mlp": F("dropout", 0.1),
                }
            ),
            "encoder.depth": F("encoder_layers", 12),
            "encoder.block.layers": ["self_attention", "mlp"],
            "encoder.block.heads": count("encoder_attention_heads", 16),
            "encoder.block.mlp.hidden": F("encoder_ffn_dim", 4096),
            "decoder.depth": F("decoder_layers", 12),
            "decoder.block.layers": ["masked_self_attention", "cross_attention", "mlp"],
            "decoder.block.heads": count("decoder_attention_heads", 16),
            "decoder.block.mlp.hidden": F("decoder_ffn_dim", 4096),
            "shared_embeddings": F("tie_word_embeddings", True),  # both stacks read `shared`
        },
        only=(
            Only("is_decoder", False, (False,), "a decoder-only model (BartForCausalLM) is not this table's"),
            *legacy(before=False, final=False, embedding=True, sinusoids=False),
            Only("extra_pos_embeddings", 2, (2,), "the position table starts 2 rows in"),
        ),
        inert=(
            *GENERATE,
            "activation_dropout",  # training only; specvit's dropout.mlp drops there at dropout's rate
            "encoder_layerdrop",  # training only: LayerDrop has no spec key
            "decoder_layerdrop",
            "init_std",
        ),
        names=NAMES,
        classes={
            "Model": BARE,
            "ForConditionalGeneration": generation(lm(tied=True), LOGITS_BIAS),
            "ForSequenceClassification": classification(start_id(2, 1), eos=2),
        },
        default="ForConditionalGeneration",
        frozen="{role}.embed_positions.weight",
    )
)
