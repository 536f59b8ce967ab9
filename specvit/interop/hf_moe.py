"""Mixtures of experts of the Llama-like decoder layout, each a table of what it changes: Qwen2-MoE (a
shared expert behind a sigmoid gate), Qwen3-MoE (QK-norms) and OLMoE (QK-norms over all heads).

The experts are stacked as Mixtral's (``mlp.experts.gate_up_proj``, ``down_proj``, the router
``mlp.gate``). Qwen's dense layers (``mlp_only_layers``, and the layers ``decoder_sparse_step`` skips) are
overrides of one MLP, ``intermediate_size`` wide, whose weights keep Llama's names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specvit.interop.hf_decoders import MIXTRAL, QWEN3
from specvit.interop.hf_decoders3 import first_of
from specvit.interop.hf_layers import layer_types, overrides
from specvit.interop.hf_llama import LLAMA, head_dim, sliding
from specvit.interop.registry import Config, listable
from specvit.interop.table import D, F, Name, Only, count, register

__all__ = ["qwen_moe"]

_LAYER = "layers.{i}."
_LAYERS = r"(?:model\.)?layers\.\d+\."
_EXPERTS: dict[str, Name] = {
    "decoder.blocks.{i}.router": _LAYER + "mlp.gate",
    "decoder.blocks.{i}.mlp.fc1": _LAYER + "mlp.experts.gate_up_proj",
    "decoder.blocks.{i}.mlp.fc2": _LAYER + "mlp.experts.down_proj",
    # a dense layer's MLP, under Llama's names
    "decoder.blocks.{i}.mlp.fc1.weight": (_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"),
    "decoder.blocks.{i}.mlp.fc2.weight": _LAYER + "mlp.down_proj.weight",
}
_ROUTER = ("router_aux_loss_coef", "output_router_logits")  # the training loop weighs the router's loss


def _experts(c: Config, default: int) -> int:
    return first_of(("num_experts", "num_local_experts"), default).read(c, {})


def _dense(c: Config, depth: int, experts: int) -> list[int]:
    """Qwen's dense layers: those of ``mlp_only_layers``, and those ``decoder_sparse_step`` passes over."""
    only = c.get("mlp_only_layers", kind=list) or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise c.refuse("mlp_only_layers", only, "expected layer indexes", "give a list of integers")
    step = c.size("decoder_sparse_step", 1)
    sparse = _experts(c, experts) > 0
    return [i for i in range(depth) if i in only or not (sparse and (i + 1) % step == 0)]


def qwen_moe(dense: int, expert: int, experts: int, top_k: int, shared: int | None) -> dict[str, D]:
    """The MLP entries of Qwen's MoE decoders: experts ``moe_intermediate_size`` wide where any layer has
    them (with Qwen2-MoE's shared expert behind its gate), and overrides of one MLP, ``intermediate_size``
    wide, in the dense layers.

    Args:
        dense: the class's default ``intermediate_size``.
        expert: its default ``moe_intermediate_size``.
        experts: its default number of experts.
        top_k: its default ``num_experts_per_tok``.
        shared: its default ``shared_expert_intermediate_size``, None for a family without a shared expert.
    """

    def all_dense(c: Config, spec: Mapping[str, Any]) -> bool:
        depth = spec["decoder.depth"]
        return listable(depth) and len(_dense(c, depth, experts)) == depth

    def moe(c: Config, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        if all_dense(c, spec):
            return None
        out = {
            "experts": _experts(c, experts),
            "top_k": c.size("num_experts_per_tok", top_k),
            "normalize": c.get("norm_topk_prob", False),
        }
        if shared is not None:
            out |= {"shared_hidden": c.get("shared_expert_intermediate_size", shared), "shared_gate": True}
        return out

    def hidden(c: Config, spec: Mapping[str, Any]) -> int:
        return (
            c.get("intermediate_size", dense)
            if all_dense(c, spec)
            else c.get("moe_intermediate_size", expert)
        )

    def layers(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        depth = spec["decoder.depth"]
        if not listable(depth) or all_dense(c, spec):
            return None
        indexes = _dense(c, depth, experts)
        block = {"mlp": {"moe": None, "hidden": c.get("intermediate_size", dense)}}
        return [{"layers": indexes, "block": block}] if indexes else None

    def write_moe(value: dict[str, Any] | None, get: Callable[[str], Any]) -> dict[str, Any]:
        if value is None:  # no layer has experts
            return {"num_experts": 0}
        out = {"num_experts": value["experts"], "num_experts_per_tok": value["top_k"]}
        out["norm_topk_prob"] = value["normalize"]
        return out | (
            {"shared_expert_intermediate_size": value["shared_hidden"]} if shared is not None else {}
        )

    def write_hidden(value: int, get: Callable[[str], Any]) -> dict[str, Any]:
        return {
            "intermediate_size" if get("decoder.block.mlp.moe") is None else "moe_intermediate_size": value
        }

    def write_layers(value: list[dict[str, Any]] | None, get: Callable[[str], Any]) -> dict[str, Any]:
        dense = [o for o in value or [] if "moe" in o["block"].get("mlp", {})]
        if not dense:
            return {"mlp_only_layers": []}
        return {
            "mlp_only_layers": dense[0]["layers"],
            "intermediate_size": dense[0]["block"]["mlp"]["hidden"],
        }

    placed = ("mlp_only_layers", "decoder_sparse_step", "num_experts", "num_local_experts")
    counts = (
        "num_experts_per_tok",
        "norm_topk_prob",
        *(("shared_expert_intermediate_size",) if shared else ()),
    )
    return {
        "decoder.block.mlp.moe": D(moe, placed + counts, write_moe),
        "decoder.block.mlp.hidden": D(
            hidden, ("intermediate_size", "moe_intermediate_size", *placed), write_hidden
        ),
        "decoder.overrides": D(layers, ("intermediate_size", *placed), write_layers),
    }


def _qwen2_moe_slides(c: Config, i: int) -> bool:
    """Qwen2-MoE's default layer types: every other layer below ``max_window_layers``."""
    return bool((i + 1) % 2) and i < c.get("max_window_layers", 28)


def _qwen2_moe_types(c: Config, spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Layer types are read by the windows' entries; a sliding layer without ``use_sliding_window`` is refused
    (transformers then builds a window of 0 keys)."""
    depth = spec["decoder.depth"]
    if listable(depth) and not c.get("use_sliding_window", False):
        types = layer_types(c, depth, lambda c, i: False)
        if "sliding_attention" in types:
            raise c.refuse(
                "layer_types", types, "sliding layers without use_sliding_window", "use full_attention"
            )
    return None


_QWEN2_WINDOWS = sliding(
    4096, _qwen2_moe_slides, switch=("use_sliding_window", False), fields=("max_window_layers",)
)
_QWEN2_MLP = qwen_moe(5632, 1408, 60, 4, 5632)

QWEN2_MOE = register(
    LLAMA.but(
        "Qwen2Moe",
        ("qwen2_moe",),
        {
            "decoder.input.vocab": F("vocab_size", 151936),
            "decoder.width": F("hidden_size", 2048),
            "decoder.depth": F("num_hidden_layers", 24),
            "decoder.block.heads": count("num_attention_heads", 16),
            "decoder.block.kv_heads": F("num_key_value_heads", 16),
            "decoder.block.qkv_bias": F("qkv_bias", True),
            "decoder.block.proj_bias": False,
            "decoder.block.mlp.bias": False,
            **_QWEN2_WINDOWS,
            **_QWEN2_MLP,
            "decoder.overrides": overrides(
                _qwen2_moe_types, _QWEN2_WINDOWS["decoder.overrides"], _QWEN2_MLP["decoder.overrides"]
            ),
        },
        drop=("pretraining_tp", "decoder.block.head_dim"),
        inert=_ROUTER,
        keys=_LAYERS + r"mlp\.shared_expert_gate\.",
        names={
            **_EXPERTS,
            "decoder.blocks.{i}.mlp.shared.fc1": (
                _LAYER + "mlp.shared_expert.gate_proj",
                _LAYER + "mlp.shared_expert.up_proj",
            ),
            "decoder.blocks.{i}.mlp.shared.fc2": _LAYER + "mlp.shared_expert.down_proj",
            "decoder.blocks.{i}.mlp.shared_gate": _LAYER + "mlp.shared_expert_gate",
        },
    )
)


def _qwen3_window(c: Config, spec: Mapping[str, Any]) -> int | None:
    """Qwen3-MoE's window, in every layer, with ``use_sliding_window``."""
    return c.get("sliding_window", 4096, int) if c.get("use_sliding_window", False) else None


QWEN3_MOE = register(
    QWEN3.but(
        "Qwen3Moe",
        ("qwen3_moe",),
        {
            "decoder.width": F("hidden_size", 2048),
            "decoder.depth": F("num_hidden_layers", 24),
            "decoder.block.heads": count("num_attention_heads", 32),
            "decoder.block.kv_heads": F("num_key_value_heads", 4),
            "decoder.block.head_dim": head_dim(),
            **qwen_moe(6144, 768, 128, 8, None),
            "decoder.block.sliding_window": D(_qwen3_window, ("sliding_window", "use_sliding_window")),
        },
        inert=_ROUTER,
        keys=_LAYERS + r"self_attn\.q_norm\.",
        names=_EXPERTS,
    )
)

OLMOE = register(
    MIXTRAL.but(
        "Olmoe",
        ("olmoe",),
        {
            "decoder.input.vocab": F("vocab_size", 50304),
            "decoder.position": LLAMA.spec["decoder.position"],
            "decoder.width": F("hidden_size", 2048),
            "decoder.depth": F("num_hidden_layers", 16),
            "decoder.block.heads": count("num_attention_heads", 16),
            "decoder.block.kv_heads": F("num_key_value_heads", 16),
            "decoder.block.qk_norm": "all",  # one RMSNorm over all heads' queries (keys)
            "decoder.block.mlp.hidden": F("intermediate_size", 2048),
            "decoder.block.mlp.moe.experts": F("num_experts", 64),
            "decoder.block.mlp.moe.top_k": F("num_experts_per_tok", 8),
            "decoder.block.mlp.moe.normalize": F("norm_topk_prob", False),
            "decoder.block.qkv_bias": F("attention_bias", False),
            "decoder.block.proj_bias": F("attention_bias", False),
        },
        drop=(
            "router_jitter_noise",
            "decoder.block.sliding_window",
            "decoder.block.head_dim",
            "ForSequenceClassification",
            "ForTokenClassification",
        ),
        only=(Only("clip_qkv", None, (None,), "clipping q, k and v has no spec key"),),
        keys=_LAYERS + r"self_attn\.q_norm\.",
    )
)
