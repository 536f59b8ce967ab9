"""BART (``BartForConditionalGeneration``; Lewis et al. 2020): post-norm LayerNorm blocks with biases, learned
positions offset by 2 rows, a norm after the embeddings, shared token embeddings and a tied LM head.

``final_logits_bias`` is a buffer of zeros in HF, added to the logits. The spec from a config has no head
bias and the conversion refuses a nonzero ``final_logits_bias``; a spec with ``head.bias: true`` takes it as
the head's bias instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from specvit.interop.layout import Entry, Layout, batched, cat, check_blocks, one, prefix
from specvit.interop.registry import Config, Family, activation, family

__all__: list[str] = []


# Fields of older (fairseq-converted) BART configs that transformers no longer reads; any value but BART's
# own would describe another model (mBART's pre-norm, a final norm, a logits bias, sinusoidal positions).
_LEGACY = {
    "normalize_before": (False, "pre-norm blocks are mBART's; BART's blocks are post-norm"),
    "add_final_layer_norm": (False, "a norm after the last block is mBART's, not BART's"),
    "normalize_embedding": (True, "BART normalises the embeddings (layernorm_embedding)"),
    "add_bias_logits": (False, "a learned logits bias is not BART's final_logits_bias buffer"),
    "static_position_embeddings": (False, "sinusoidal positions are not BART's learned table"),
    "extra_pos_embeddings": (2, "BART's position table starts 2 rows in"),
}


def _spec(c: Config) -> dict[str, Any]:
    for key, (value, why) in _LEGACY.items():
        c.only(key, value, [value], why)
    width, eps = c.get("d_model", 1024), 1e-5
    tied = bool(c.get("tie_word_embeddings", True))
    tokens: dict[str, Any] = {"kind": "tokens", "vocab": c.get("vocab_size", 50265)}
    pad = c.get("pad_token_id", 1)
    if isinstance(pad, int) and 0 <= pad < tokens["vocab"]:
        tokens["padding_idx"] = pad  # nn.Embedding(padding_idx=pad): no gradient to that row
    if c.get("scale_embedding", False):
        tokens["scale"] = True
    act = activation(c, key="activation_function", default="gelu")

    def stack(depth: int, heads: int, ffn: int, layers: list[str]) -> dict[str, Any]:
        return {
            "input": tokens,
            "position": {
                "kind": "learned",
                "max_len": c.get("max_position_embeddings", 1024),
                "offset": 2,
            },
            "width": width,
            "depth": depth,
            "embed_norm": True,
            "final_norm": False,
            "block": {
                "heads": heads,
                "layers": layers,
                "norm": {"placement": "post", "eps": eps},
                "mlp": {"hidden": ffn, "activation": act},
            },
        }

    return {
        "specvit": 1,
        "name": "bart_from_hf",
        "description": "BART (BartForConditionalGeneration; Lewis et al. 2020), imported from its transformers config.",
        "model": "encoder_decoder",
        "encoder": stack(
            c.get("encoder_layers", 12),
            c.get("encoder_attention_heads", 16),
            c.get("encoder_ffn_dim", 4096),
            ["self_attention", "mlp"],
        ),
        "decoder": stack(
            c.get("decoder_layers", 12),
            c.get("decoder_attention_heads", 16),
            c.get("decoder_ffn_dim", 4096),
            ["masked_self_attention", "cross_attention", "mlp"],
        ),
        "head": {"kind": "lm", "tied": tied},
        "shared_embeddings": tied,
    }


def _logits_bias(ts: Sequence[Tensor]) -> Tensor:
    return ts[0].reshape(-1)  # final_logits_bias (1, vocab) -> the head's bias (vocab,)


def _layout(spec: Any, keys: Sequence[str]) -> Layout:
    name = "HF BartForConditionalGeneration"
    check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "post")
    check_blocks(spec, "decoder", name, [("masked_self_attention", "cross_attention", "mlp")], "post")
    pre = prefix(keys, "model.")
    table: dict[str, Entry] = {}
    for role in ("encoder", "decoder"):
        layer, block = f"{pre}{role}.layers.{{i}}.", f"{role}.blocks.{{i}}."
        qkv = tuple(layer + f"self_attn.{n}_proj" + ".{p}" for n in "qkv")
        table |= {
            f"{role}.pos_embed.weight": one(f"{pre}{role}.embed_positions.weight", batched),
            f"{role}.embed_norm.{{p}}": one(f"{pre}{role}.layernorm_embedding.{{p}}"),
            block + "attn.qkv.{p}": (qkv, cat),
            block + "attn.proj.{p}": one(layer + "self_attn.out_proj.{p}"),
            block + "norm1.{p}": one(layer + "self_attn_layer_norm.{p}"),
            block + "mlp.fc1.{p}": one(layer + "fc1.{p}"),
            block + "mlp.fc2.{p}": one(layer + "fc2.{p}"),
        }
    layer, block = pre + "decoder.layers.{i}.", "decoder.blocks.{i}."
    table |= {
        "encoder.blocks.{i}.norm2.{p}": one(pre + "encoder.layers.{i}.final_layer_norm.{p}"),
        block + "cross_attn.q.{p}": one(layer + "encoder_attn.q_proj.{p}"),
        block + "cross_attn.kv.{p}": (
            (layer + "encoder_attn.k_proj.{p}", layer + "encoder_attn.v_proj.{p}"),
            cat,
        ),
        block + "cross_attn.proj.{p}": one(layer + "encoder_attn.out_proj.{p}"),
        block + "norm2.{p}": one(layer + "encoder_attn_layer_norm.{p}"),
        block + "norm3.{p}": one(layer + "final_layer_norm.{p}"),
    }
    tied: dict[str, str] = {}
    ignore: list[str] = []
    if spec.shared_embeddings:
        table["encoder.tok_embed.weight"] = one(pre + "shared.weight")
        for role in ("encoder", "decoder"):
            tied[f"{pre}{role}.embed_tokens.weight"] = pre + "shared.weight"
    else:  # untied: each stack reads its own table; `shared` takes no part in the computation
        for role in ("encoder", "decoder"):
            table[f"{role}.tok_embed.weight"] = one(f"{pre}{role}.embed_tokens.weight")
        ignore.append(pre.replace(".", r"\.") + r"shared\.weight")
    if spec.head.tied:  # the head shares the decoder's table
        tied["lm_head.weight"] = pre + (
            "shared.weight" if spec.shared_embeddings else "decoder.embed_tokens.weight"
        )
    else:
        table["head.fc.weight"] = one("lm_head.weight")
    if spec.head.bias:
        table["head.fc.bias"] = one("final_logits_bias", _logits_bias)
    zeros = (
        {} if spec.head.bias else {"final_logits_bias": "write head.bias: true to take it as the head's bias"}
    )
    return Layout(name, table, ignore=tuple(ignore), tied=tied, zeros=zeros)


family(
    Family(
        "BartForConditionalGeneration",
        ("bart",),
        r"(?:model\.)?encoder\.layernorm_embedding\.",
        _spec,
        _layout,
    )
)
