"""ModernBERT's encoder (``ModernBertModel``) as a table: pre-norm blocks ``layers.{i}.attn.Wqkv`` / ``attn.Wo``
and a GeGLU ``mlp.Wi`` / ``mlp.Wo``, LayerNorms without biases, RoPE of one theta in the global layers and
another in the local ones, which attend within ``local_attention // 2`` tokens on either side.

It is not the BERT layout, and states with the language's own constructs: the local layers are overrides
(``sliding_window``, and a ``rope`` base of their own), and the first layer, whose ``attn_norm`` is an
identity, is a block graph without the first norm. Its task classes all put a prediction head (dense,
activation, LayerNorm) before their linear layer: the head's ``ops``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.hf_bert import head_ops, labels, padding
from specvit.interop.hf_llama import GATED
from specvit.interop.registry import ACTIVATIONS, Config, listable
from specvit.interop.table import BARE, D, F, Head, Only, Table, count, register

__all__ = ["MODERNBERT"]

_LAYER_TYPES = ("full_attention", "sliding_attention")
_THETA = {
    "full_attention": ("global_rope_theta", 160_000.0),
    "sliding_attention": ("local_rope_theta", 10_000.0),
}
"""Each layer type's theta: its ``rope_parameters`` entry, or the field older config.json files hold."""

FIRST = [
    {"name": "attn", "op": "self_attention", "inputs": ["x"]},
    {"name": "res1", "op": "add", "inputs": ["x", "attn"]},
    {"name": "norm2", "op": "norm", "inputs": ["res1"]},
    {"name": "mlp", "op": "mlp", "inputs": ["norm2"]},
    {"name": "res2", "op": "add", "inputs": ["res1", "mlp"]},
]
"""ModernBERT's first block: a pre-norm block whose attention reads the embeddings without a norm (they are
normed already)."""


def _theta(c: Config, layer_type: str) -> float:
    """The RoPE theta of one layer type; scaled RoPE, or any parameter but the theta, is refused."""
    params = c.sub("rope_parameters").sub(layer_type)
    for key, value in params.values.items():
        if (key, value) == ("rope_type", "default") or key == "rope_theta":
            continue
        raise params.refuse(
            key, value, "specvit's rope here is plain RoPE of a theta", "use rope_type default"
        )
    legacy, default = _THETA[layer_type]
    return float(params.get("rope_theta", c.get(legacy, default)))


def _position(c: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The stack's RoPE: the global layers' theta (the local layers override it)."""
    return {"kind": "rope", "base": _theta(c, "full_attention")}


def _layer_types(c: Config, depth: int) -> list[str]:
    """``layer_types``, or as ModernBertConfig makes them of ``global_attn_every_n_layers`` (global first)."""
    if not listable(depth):  # the spec refuses the depth; nothing is made per layer of it
        return []
    types = c.get("layer_types", kind=list)
    if types is None:
        every = c.size("global_attn_every_n_layers", 3)
        types = ["sliding_attention" if i % every else "full_attention" for i in range(depth)]
    if len(types) != depth or not all(t in _LAYER_TYPES for t in types):
        raise c.refuse(
            "layer_types",
            types,
            f"expected full_attention or sliding_attention for each of the {depth} layers",
            "give one type per layer",
        )
    return types


def _overrides(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The first block as a graph without its attention's norm, and the local layers: a window of
    ``local_attention // 2`` tokens either side (HF's distance <= w is specvit's < w + 1) and their theta."""
    types = _layer_types(c, spec["encoder.depth"])
    local = [i for i, t in enumerate(types) if t == "sliding_attention"]
    overrides: list[dict[str, Any]] = [{"layers": [0], "block": {"graph": FIRST}}]
    if local:
        window = c.size("local_attention", 128) // 2 + 1
        block = {"sliding_window": window, "rope": {"base": _theta(c, "sliding_attention")}}
        overrides.append({"layers": local, "block": block})
    return overrides


def _write_overrides(overrides: list[dict[str, Any]], get: Callable[[str], Any]) -> dict[str, Any]:
    """The layer types, the local layers' window and both thetas: the overrides :func:`_overrides` reads."""
    depth, local = get("encoder.depth"), next((o for o in overrides if o["layers"] != [0]), None)
    window = local["block"]["sliding_window"] if local else None
    thetas = {
        "full_attention": get("encoder.position.base"),
        "sliding_attention": local["block"]["rope"]["base"] if local else _THETA["sliding_attention"][1],
    }
    types = [
        "sliding_attention" if local and i in local["layers"] else "full_attention" for i in range(depth)
    ]
    config: dict[str, Any] = {
        "layer_types": types,
        "rope_parameters": {t: {"rope_type": "default", "rope_theta": v} for t, v in thetas.items()},
    }
    return config | ({"local_attention": 2 * (window - 1)} if window else {})


_OVERRIDES = (
    "layer_types",
    "global_attn_every_n_layers",
    "local_attention",
    "rope_parameters",
    "local_rope_theta",
)
"""The fields the overrides read."""
_LAYER = "layers.{i}."
_BLOCK = "encoder.blocks.{i}."

_OPS = head_ops(
    {"kind": "linear", "bias": F("classifier_bias", False)},
    {"kind": "act", "fn": F("classifier_activation", "gelu", map=ACTIVATIONS)},
    {"kind": "norm"},  # norm_eps and norm_bias, as the blocks'
)
"""``ModernBertPredictionHead``, before every task class's linear layer."""


def _task(fc: str, **spec: Any) -> Head:
    """A task class: the prediction head, then its linear layer ``fc`` (spec entries by the key under head.)."""
    entries = {f"head.{k}": v for k, v in spec.items()} | {"head.ops": _OPS}
    return Head(entries, {"head.ops.0": "head.dense", "head.ops.2": "head.norm", "head.fc": fc})


def _tokens(outputs: D) -> Head:
    """A linear layer on every token after the prediction head."""
    return _task("classifier", kind="lm", vocab=outputs, bias=True, tied=False)


MODERNBERT = register(
    Table(
        name="ModernBert",
        model_types=("modernbert",),
        role="encoder",
        keys=r"(?:model\.)?layers\.\d+\.attn\.Wqkv\.",
        spec={
            "encoder.input.kind": "tokens",
            "encoder.input.vocab": F("vocab_size", 50368),
            "encoder.input.padding_idx": padding(50283),
            "encoder.position": D(_position, ("rope_parameters", "global_rope_theta", "local_rope_theta")),
            "encoder.width": F("hidden_size", 768),
            "encoder.depth": F("num_hidden_layers", 22),
            "encoder.embed_norm": True,
            "encoder.final_norm": True,
            "encoder.block.heads": count("num_attention_heads", 12),
            "encoder.block.norm.kind": "layernorm",
            "encoder.block.norm.placement": "pre",
            "encoder.block.norm.eps": F("norm_eps", 1e-5),
            "encoder.block.norm.bias": F("norm_bias", False),
            "encoder.block.mlp.hidden": F("intermediate_size", 1152),
            "encoder.block.mlp.activation": F("hidden_activation", "gelu", map=GATED),
            "encoder.block.mlp.bias": F("mlp_bias", False),
            "encoder.block.qkv_bias": F("attention_bias", False),
            "encoder.block.proj_bias": F("attention_bias", False),
            "encoder.overrides": D(_overrides, _OVERRIDES, _write_overrides),
            "encoder.dropout.embedding": F("embedding_dropout", 0.0),
            "encoder.dropout.attention": F("attention_dropout", 0.0),
            "encoder.dropout.projection": F("attention_dropout", 0.0),  # ModernBERT's out_drop
            "encoder.dropout.mlp": F("mlp_dropout", 0.0),
        },
        only=(Only("rope_scaling", None, (None,), "scaled RoPE has no specvit position kind"),),
        inert=(
            "cls_token_id",
            "sep_token_id",
            "initializer_cutoff_factor",
            "deterministic_flash_attn",  # flash attention's kernel choice
            "reference_compile",  # torch.compile of older transformers' layers
            "gradient_checkpointing",
            "sparse_prediction",  # the masked LM's loss on the masked tokens only
            "sparse_pred_ignore_index",
            "repad_logits_with_grad",
            "classifier_dropout",  # training only
            "layer_norm_eps",  # older config.json files: ModernBERT reads norm_eps
            "position_embedding_type",  # older config.json files: ModernBERT's positions are RoPE
        ),
        names={
            "encoder.tok_embed": "embeddings.tok_embeddings",
            "encoder.embed_norm": "embeddings.norm",
            _BLOCK + "norm1": _LAYER + "attn_norm",
            _BLOCK + "attn.qkv": _LAYER + "attn.Wqkv",  # [q; k; v], as specvit packs them
            _BLOCK + "attn.proj": _LAYER + "attn.Wo",
            _BLOCK + "norm2": _LAYER + "mlp_norm",
            _BLOCK + "mlp.fc1": _LAYER + "mlp.Wi",  # [input; gate]: act(input) * gate, specvit's geglu
            _BLOCK + "mlp.fc2": _LAYER + "mlp.Wo",
            "encoder.norm": "final_norm",
        },
        classes={
            "Model": BARE,
            "ForTokenClassification": _tokens(labels()),
            "ForQuestionAnswering": _tokens(labels(2)),
            "ForMaskedLM": _task(
                "decoder", kind="lm", tied=F("tie_word_embeddings", True), bias=F("decoder_bias", True)
            ),
            "ForSequenceClassification": _task(
                "classifier",
                kind="classifier",
                pool=F("classifier_pooling", "cls", map={"cls": "first", "mean": "mean"}),
                classes=labels(),
            ),
        },
        default="Model",
        ignore=(r"(?:model\.)?rotary_emb\.\w+",),  # RoPE tables older checkpoints carry
    )
)
