"""timm's ``Beit`` (BEiT, Bao et al. 2021; BEiT v2, Peng et al. 2022).

A pre-norm ViT with a class token whose attention adds BEiT's learned 2D relative position bias (a table
per layer, or one shared by all layers: ``position: relative2d``), learned absolute positions or none, a
q and v bias without a k bias (``qkv_bias: [true, false, true]``), layer scale (``gamma_1``/``gamma_2``)
and either the class token or the mean of the patches with ``fc_norm`` (``head.norm``) as its pooling.

timm's initialisation (the head scaled by ``head_init_scale``, each block's output projections divided by
sqrt(2 * (layer + 1))) is not part of the architecture: the spec's ``init`` convention is specvit's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Layout, one
from specvit.interop.timm import Reader, TimmFamily, timm_family
from specvit.interop.timm_vit import image_input, mlp_spec, vit_blocks
from specvit.spec.schema import Spec

__all__ = ["beit_block", "beit_layout"]


def beit_block(r: Reader, path: str) -> dict[str, Any]:
    """The spec ``block:`` of one timm ``beit.Block`` (its relative bias table is the stack's position).

    Args:
        r: the model's reader.
        path: the block's path (``blocks.3``).
    """
    attn = f"{path}.attn"
    heads = r.at(f"{attn}.num_heads")
    head_dim = r.at(f"{attn}.qkv").out_features // (3 * heads)
    qkv_bias: Any = False
    if r.at(f"{attn}.q_bias") is not None:  # k_bias is a zero buffer: BEiT has no key bias
        qkv_bias = [True, False, True]
    norm = r.norm(f"{path}.norm1")
    if r.norm(f"{path}.norm2") != norm:
        raise r.refuse(f"{path}.norm2", r.norm(f"{path}.norm2"), "norm2 differs from norm1", "")
    block: dict[str, Any] = {
        "heads": heads,
        "head_dim": head_dim,
        "norm": {**norm, "placement": "pre"},
        "mlp": mlp_spec(r, f"{path}.mlp"),
        "qkv_bias": qkv_bias,
        "proj_bias": r.at(f"{attn}.proj").bias is not None,
        "attention_scale": r.scale(attn, head_dim),
    }
    if r.at(f"{path}.gamma_1") is not None:
        block["layer_scale"] = float(r.at(f"{path}.init_values"))
    return block


def _positions(r: Reader) -> Any:
    """``position:``: learned absolute positions (over the class token too) and/or the relative bias."""
    m = r.model
    own = r.same(
        [f"blocks.{i}" for i in range(len(m.blocks))],
        lambda b: r.at(f"{b}.attn.relative_position_bias_table") is not None,
        "relative position bias (use_rel_pos_bias)",
    )
    if own and m.rel_pos_bias is not None:
        raise r.refuse(
            "rel_pos_bias",
            "RelativePositionBias",
            "a shared table added to the layers' own (use_rel_pos_bias and use_shared_rel_pos_bias); "
            "specvit's relative2d is one or the other",
            "build it with use_rel_pos_bias or use_shared_rel_pos_bias, not both",
        )
    positions: list[Any] = []
    if m.pos_embed is not None:
        positions.append({"kind": "learned", "include_prefix": True})
    if own or m.rel_pos_bias is not None:
        positions.append({"kind": "relative2d", "shared": m.rel_pos_bias is not None})
    if not positions:
        return "none"
    return positions[0] if len(positions) == 1 else positions


def _head(r: Reader, block: dict[str, Any]) -> tuple[Any, bool]:
    """``head:`` and ``final_norm``: Beit's ``norm`` before pooling, or ``fc_norm`` after it."""
    m = r.model
    fc_norm = type(m.fc_norm).__name__ != "Identity"
    final_norm = type(m.norm).__name__ != "Identity"
    own = {k: v for k, v in block["norm"].items() if k != "placement"}
    for which in ("norm", "fc_norm"):
        if type(getattr(m, which)).__name__ != "Identity" and r.norm(which) != own:
            raise r.refuse(which, r.norm(which), "specvit's norms outside blocks are the blocks' norm", "")
    if m.num_classes == 0 and not m.global_pool:
        if fc_norm:
            raise r.refuse("fc_norm", r.norm("fc_norm"), "a norm of features that are not pooled", "")
        return "none", final_norm
    pool = {"token": "cls", "avg": "mean"}.get(m.global_pool)
    if pool is None:
        raise r.refuse("global_pool", m.global_pool, "a classifier needs pooling", "use 'token' or 'avg'")
    head = {
        "kind": "classifier",
        **r.classifier(),
        "pool": pool,
        "norm": fc_norm,
        "dropout": r.dropout("head_drop"),
    }
    return head, final_norm


def _beit(r: Reader) -> dict[str, Any]:
    m = r.model
    blocks = [f"blocks.{i}" for i in range(len(m.blocks))]
    block = r.same(blocks, lambda b: beit_block(r, b), "block")
    head, final_norm = _head(r, block)
    return {
        "specvit": 1,
        "name": "timm_beit",
        "description": "timm Beit, imported by specvit.from_timm.",
        "model": "encoder",
        "encoder": {
            "input": image_input(r),
            "prefix": {"cls": True},
            "position": _positions(r),
            "width": m.embed_dim,
            "depth": len(blocks),
            "block": block,
            "dropout": {
                "embedding": r.dropout("pos_drop"),
                "attention": r.dropout("blocks.0.attn.attn_drop"),
                "projection": r.dropout("blocks.0.attn.proj_drop"),
                "mlp": r.dropout("blocks.0.mlp.drop1"),
            },
            "drop_path": r.drop_path(blocks),
            "final_norm": final_norm,
        },
        "head": head,
    }


def beit_layout(spec: Spec, keys: Sequence[str]) -> Layout:
    """timm ``Beit`` keys: ``q_bias``/``v_bias`` beside a bias-free ``qkv``, ``gamma_1``/``gamma_2``, the
    per-block ``attn.relative_position_bias_table`` or the shared ``rel_pos_bias``, ``fc_norm``."""
    name = "timm Beit"
    _, fc1 = vit_blocks(spec, keys, name)
    block, layer = "encoder.blocks.{i}.", "blocks.{i}."
    table = {
        "encoder.patch_embed.proj.{p}": one("patch_embed.proj.{p}"),
        "encoder.prefix.cls_token": one("cls_token"),
        "encoder.pos_embed.weight": one("pos_embed"),
        "encoder.rel_bias.{p}": one("rel_pos_bias.{p}"),
        block + "rel_bias.{p}": one(layer + "attn.{p}"),  # the layer's own table lives in timm's attn
        block + "attn.{p}": one(layer + "attn.{p}"),  # q_bias, v_bias
        block + "mlp.fc1.{p}": fc1,
        block + "ls1.gamma": one(layer + "gamma_1"),
        block + "ls2.gamma": one(layer + "gamma_2"),
        "encoder.norm.{p}": one("norm.{p}"),
        "head.norm.{p}": one("fc_norm.{p}"),
        "head.fc.{p}": one("head.{p}"),
    }
    for part in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc2"):
        table[block + part + ".{p}"] = one(layer + part + ".{p}")  # timm names these as specvit does
    return Layout(name, table)


timm_family(
    TimmFamily(
        classes=("Beit",),
        modules=frozenset(
            {"PatchEmbed", "Block", "Attention", "Mlp", "SwiGLU", "RelativePositionBias"}
            | {"GELU", "GELUTanh", "QuickGELU", "SiLU", "ReLU"}
        ),
        # keys only a Beit has: the q/v bias, layer scale gammas, or a relative bias table outside a Swin stage
        keys=r"(blocks\.\d+\.(attn\.q_bias|gamma_1|attn\.relative_position_bias_table)|rel_pos_bias\.)",
        spec=_beit,
        layout=beit_layout,
    )
)
