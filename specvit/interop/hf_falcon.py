"""Falcon (``FalconForCausalLM``) as a table: ``transformer.word_embeddings``, ``h.{i}.self_attention``
with q, k and v fused in ``query_key_value``, ``mlp.dense_h_to_4h`` / ``dense_4h_to_h``, LayerNorm, RoPE.

Three block layouts share the weights' names: sequential (``parallel_attn: false``: ``input_layernorm``,
``post_attention_layernorm``), parallel with one norm (Falcon-7B: ``input_layernorm`` feeds both branches,
specvit's two norms hold its weights) and parallel with two (``new_decoder_architecture``, Falcon-40B:
``ln_attn``, ``ln_mlp``). The fused projection groups its heads by key/value head: for each of the kv
groups its queries, then its key and value; multi-query (one group) and per-head (a group per head) are
its two ends. ALiBi (``alibi: true``) is refused: Falcon scales it by 1/sqrt(head_dim) with the scores,
which specvit's (BLOOM's) ALiBi is not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from specvit.interop.hf_decoders2 import full_rope
from specvit.interop.layout import Transform, Undoable
from specvit.interop.registry import ACTIVATIONS, Config
from specvit.interop.table import (
    BARE,
    SEQUENCE,
    D,
    F,
    Name,
    Only,
    Renamed,
    Table,
    count,
    lm,
    per_token,
    register,
)
from specvit.interop.variants import variant

__all__ = ["FALCON", "grouped_qkv"]


def grouped_qkv(heads: int, kv_heads: int) -> Transform:
    """A fused projection stored by key/value group ([q of the group's heads, k, v] for each group: Falcon)
    as specvit's [q; k; v] (every head's q, then every group's k, then v).

    Args:
        heads: the query heads.
        kv_heads: the key/value heads (the groups).
    """

    per = heads // kv_heads

    def take(t: Tensor) -> Tensor:
        rest = t.shape[1:]
        grouped = t.reshape(kv_heads, per + 2, -1, *rest)  # (G, per + 2, head_dim, ...)
        q, k, v = grouped[:, :per], grouped[:, per], grouped[:, per + 1]
        return torch.cat([x.reshape(-1, *rest) for x in (q, k, v)]).contiguous()

    def back(t: Tensor) -> Tensor:
        rest = t.shape[1:]
        by_head = t.reshape(heads + 2 * kv_heads, -1, *rest)  # (heads + 2 G, hd, ...)
        q, k, v = by_head.split([heads, kv_heads, kv_heads])
        groups = [q.reshape(kv_heads, per, *q.shape[1:]), k[:, None], v[:, None]]  # (G, n, hd, ...)
        return torch.cat(groups, dim=1).reshape(t.shape)  # (G * (per + 2) * hd, ...)

    return Undoable(take, back)


def _new(c: Config) -> bool:
    return bool(c.get("new_decoder_architecture", False))


def _kv_heads(c: Config, spec: Mapping[str, Any]) -> int | None:
    """The key/value heads: ``num_kv_heads`` in the new architecture, else one (``multi_query``) or all."""
    if _new(c):
        return c.get("num_kv_heads", None, int)
    return 1 if c.get("multi_query", True) else None


def _write_kv_heads(kv_heads: int | None, get: Callable[[str], Any]) -> dict[str, Any]:
    """One key/value head: multi-query; one a head: ``multi_query: false``; groups: the new architecture."""
    if kv_heads in (1, None):
        return {"multi_query": kv_heads == 1}
    return {"new_decoder_architecture": True, "num_kv_heads": kv_heads}


def _parallel(c: Config, spec: Mapping[str, Any]) -> bool:
    """Whether attention and MLP read the block's input in parallel; the combinations HF's Falcon builds
    norms for but reads others of (it raises) are refused."""
    parallel = bool(c.get("parallel_attn", True))
    norms = c.get("num_ln_in_parallel_attn", 2 if _new(c) else None, int)
    if _new(c) and not parallel:
        raise c.refuse(
            "parallel_attn",
            False,
            "the new decoder architecture reads ln_attn, which HF then does not build",
            "use true",
        )
    if parallel and not _new(c) and norms == 2:
        raise c.refuse(
            "num_ln_in_parallel_attn",
            2,
            "the old decoder architecture reads input_layernorm, which HF then does not build",
            "use 1 or null",
        )
    return parallel


def _mlp_hidden(c: Config, spec: Mapping[str, Any]) -> int:
    hidden = c.get("ffn_hidden_size", None, int)
    return hidden if hidden is not None else 4 * spec["decoder.width"]


_H = "h.{i}."


def _names(spec: Any, keys: Sequence[str]) -> Mapping[str, Name]:
    """The block's norms (by the keys: two where ``ln_attn`` is there, else one or a sequential pair) and
    the fused projection's groups (by the spec's heads)."""
    block = spec.decoder.block
    if any(".ln_attn." in k for k in keys):
        norms = {"norm1": _H + "ln_attn", "norm2": _H + "ln_mlp"}
    else:
        second = "input_layernorm" if block.parallel else "post_attention_layernorm"
        norms = {"norm1": _H + "input_layernorm", "norm2": _H + second}
    qkv = Renamed(
        _H + "self_attention.query_key_value", grouped_qkv(block.heads, block.kv_heads or block.heads)
    )
    return {**{f"decoder.blocks.{{i}}.{k}": v for k, v in norms.items()}, "decoder.blocks.{i}.attn.qkv": qkv}


def _zero(name: str, why: str) -> Only:
    return Only(name, 0.0, (0.0,), why)


FALCON = register(
    variant(
        Table(
            name="Falcon",
            model_types=("falcon",),
            role="decoder",
            keys=r"(?:transformer\.)?h\.\d+\.self_attention\.query_key_value\.",
            spec={
                "decoder.input.kind": "tokens",
                "decoder.input.vocab": F("vocab_size", 65024),
                "decoder.position": full_rope(10000.0),
                "decoder.width": F("hidden_size", 4544),
                "decoder.depth": F("num_hidden_layers", 32),
                "decoder.block.layers": ["masked_self_attention", "mlp"],
                "decoder.block.heads": count("num_attention_heads", 71),
                "decoder.block.kv_heads": D(
                    _kv_heads, ("num_kv_heads", "multi_query", "new_decoder_architecture"), _write_kv_heads
                ),
                "decoder.block.parallel": D(
                    _parallel,
                    ("parallel_attn", "num_ln_in_parallel_attn"),
                    lambda value, get: {"parallel_attn": value},
                ),
                "decoder.block.norm.eps": F("layer_norm_epsilon", 1e-5),
                "decoder.block.qkv_bias": F("bias", False),
                "decoder.block.proj_bias": F("bias", False),
                "decoder.block.mlp.hidden": D(
                    _mlp_hidden, ("ffn_hidden_size",), lambda value, get: {"ffn_hidden_size": value}
                ),
                "decoder.block.mlp.activation": F("activation", "gelu", map=ACTIVATIONS),
                "decoder.block.mlp.bias": F("bias", False),
            },
            only=(
                Only(
                    "alibi", False, (False,), "Falcon's ALiBi is scaled by 1/sqrt(head_dim), specvit's is not"
                ),
                Only(
                    "apply_residual_connection_post_layernorm",
                    False,
                    (False,),
                    "a residual from after the norm has no spec key",
                ),
                # HF's attention_dropout drops the attention's residual branch in sequential blocks, not
                # its weights; hidden_dropout drops the sum of both branches
                _zero(
                    "attention_dropout", "a dropout of the attention's residual branch alone has no spec key"
                ),
                _zero("hidden_dropout", "a dropout of the two branches' sum has no spec key"),
            ),
            names={
                "decoder.tok_embed": "word_embeddings",
                "decoder.blocks.{i}.attn.proj": _H + "self_attention.dense",
                "decoder.blocks.{i}.mlp.fc1": _H + "mlp.dense_h_to_4h",
                "decoder.blocks.{i}.mlp.fc2": _H + "mlp.dense_4h_to_h",
                "decoder.norm": "ln_f",
            },
            classes={
                "Model": BARE,
                "ForCausalLM": lm(tied=True),
                "ForSequenceClassification": SEQUENCE,
                "ForTokenClassification": per_token("classifier"),
            },
            backbone="transformer.",
        ),
        _names,
    )
)
