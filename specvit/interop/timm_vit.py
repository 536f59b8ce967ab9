"""timm's ``VisionTransformer`` (ViT, DeiT, DeiT-III, ViT with registers, SigLIP-style avg pooling)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import Entry, Layout, cat, check_blocks, one, patches, same, unbatched
from specvit.interop.timm import Reader, TimmFamily, timm_family
from specvit.interop.timm_stem import STEM_MODULES, stem_entries, stem_input
from specvit.spec.schema import ImageInput, Spec

__all__ = [
    "image_input",
    "mlp_spec",
    "vit_block",
    "vit_blocks",
    "vit_head",
    "vit_layout",
    "vit_spec",
    "vit_stack",
]


def image_input(r: Reader) -> dict[str, Any]:
    """The ``input:`` of a timm ``PatchEmbed`` at ``patch_embed`` (fixed size, conv projection), or of a
    hybrid's ``HybridEmbed`` (its CNN backbone as the stem)."""
    if type(r.at("patch_embed")).__name__ == "HybridEmbed":
        return stem_input(r)
    for flag, why in (
        ("dynamic_img_pad", "specvit pads nothing"),
        ("dynamic_img_size", "specvit's position table has a fixed size"),
    ):
        if getattr(r.model, flag, False) or getattr(r.at("patch_embed"), flag, False):
            raise r.refuse(flag, True, why, f"build it with {flag}=False")
    r.absent("patch_embed.norm", "a norm between the patch projection and the positions has no spec")
    proj = r.at("patch_embed.proj")
    size, patch = tuple(r.at("patch_embed.img_size")), tuple(proj.kernel_size)
    if tuple(proj.stride) != patch:
        raise r.refuse("patch_embed.proj.stride", proj.stride, "overlapping patches", "stride = patch size")
    return {
        "kind": "image",
        "size": size[0] if size[0] == size[1] else list(size),
        "patch": patch[0] if patch[0] == patch[1] else list(patch),
        "channels": proj.in_channels,
        "bias": proj.bias is not None,
    }


def mlp_spec(r: Reader, path: str) -> dict[str, Any]:
    """The spec ``mlp:`` of a timm ``Mlp``, ``SwiGLU`` or ``SwiGLUPacked`` at ``path``."""
    name = type(r.at(path)).__name__
    r.absent(f"{path}.norm", "a norm inside the MLP (scale_mlp_norm)")
    if name == "SwiGLU":  # split gate and value: fc1_g, fc1_x
        act = r.activation(f"{path}.act")
        if act != "silu":
            raise r.refuse(f"{path}.act", act, "specvit's split-gate MLP is SwiGLU (SiLU)", "use SiLU")
        return {
            "hidden": r.at(f"{path}.fc2").in_features,
            "activation": "swiglu",
            "bias": _bias(r, f"{path}.fc2"),
        }
    if name == "GluMlp":
        act = r.activation(f"{path}.act")
        if act != "silu" or r.at(f"{path}.chunk_dim") != -1 or getattr(r.at(path), "gate_last", False):
            raise r.refuse(
                path, "GluMlp", "specvit's packed gated MLP is SiLU, gate first", "use SwiGLUPacked"
            )
        return {
            "hidden": r.at(f"{path}.fc2").in_features,
            "activation": "swiglu",
            "bias": _bias(r, f"{path}.fc2"),
        }
    if name != "Mlp":
        raise r.refuse(path, name, "specvit reads Mlp, SwiGLU and SwiGLUPacked", "use one of them")
    if _bias(r, f"{path}.fc1") != _bias(r, f"{path}.fc2"):
        raise r.refuse(f"{path}.fc1.bias", "one of two", "specvit's MLP biases are both on or both off", "")
    return {
        "hidden": r.at(f"{path}.fc1").out_features,
        "activation": r.activation(f"{path}.act"),
        "bias": _bias(r, f"{path}.fc2"),
    }


def _bias(r: Reader, path: str) -> bool:
    return r.at(path).bias is not None


def vit_block(r: Reader, path: str) -> dict[str, Any]:
    """The spec ``block:`` of one timm pre-norm ``Block`` (``Attention``, ``Mlp``, ``LayerScale``)."""
    if type(r.at(path)).__name__ != "Block":
        raise r.refuse(path, type(r.at(path)).__name__, "specvit reads timm's pre-norm Block", "use Block")
    attn = f"{path}.attn"
    heads, head_dim = r.at(f"{attn}.num_heads"), r.at(f"{attn}.head_dim")
    r.absent(f"{attn}.norm", "a norm before the attention projection (scale_attn_norm)")
    qk_norm = type(r.at(f"{attn}.q_norm")).__name__ != "Identity"
    block: dict[str, Any] = {
        "heads": heads,
        "head_dim": head_dim,
        "norm": {**r.norm(f"{path}.norm1"), "placement": "pre"},
        "mlp": mlp_spec(r, f"{path}.mlp"),
        "qkv_bias": _bias(r, f"{attn}.qkv"),
        "proj_bias": _bias(r, f"{attn}.proj"),
        "qk_norm": qk_norm,
        "attention_scale": r.scale(attn, head_dim),
    }
    if qk_norm and r.norm(f"{attn}.q_norm")["kind"] != block["norm"]["kind"]:
        raise r.refuse(
            f"{attn}.q_norm", type(r.at(f"{attn}.q_norm")).__name__, "a QK-norm of another kind", ""
        )
    if r.norm(f"{path}.norm2") != r.norm(f"{path}.norm1"):
        raise r.refuse(f"{path}.norm2", r.norm(f"{path}.norm2"), "norm2 differs from norm1", "")
    ls = r.at(f"{path}.ls1")
    if type(ls).__name__ == "LayerScale":
        block["layer_scale"] = float(ls.init_values)
    return block


def vit_spec(r: Reader) -> dict[str, Any]:
    """The spec fields of a timm ``VisionTransformer``."""
    m = r.model
    r.only("global_pool", ["token", "avg", "map", ""], "specvit pools by the class token, mean or a probe")
    r.only("pool_include_prefix", [False], "specvit's mean pool leaves the prefix tokens out")
    blocks = [f"blocks.{i}" for i in range(len(m.blocks))]
    block = r.same(blocks, lambda b: vit_block(r, b), "block")
    registers = m.num_reg_tokens
    prefix = {"cls": m.cls_token is not None, "registers": registers}
    position: Any = "none"
    if m.pos_embed is not None:
        position = {"kind": "learned", "include_prefix": not m.no_embed_class}
    return {
        "specvit": 1,
        "name": "timm_vision_transformer",
        "description": "timm VisionTransformer, imported by specvit.from_timm.",
        "model": "encoder",
        "encoder": {
            "input": image_input(r),
            "prefix": prefix,
            "position": position,
            **vit_stack(r, blocks, block, "pos_drop"),
        },
        "head": vit_head(r, block),
    }


def vit_stack(r: Reader, blocks: list[str], block: dict[str, Any], pos_drop: str) -> dict[str, Any]:
    """The fields of a timm ViT-like encoder past its input, prefix and positions: width, depth, the
    block, dropouts (the embedding's at ``pos_drop``), stochastic depth and the norms around the blocks."""
    m = r.model
    return {
        "width": m.embed_dim,
        "depth": len(blocks),
        "block": block,
        "dropout": {
            "embedding": r.dropout(pos_drop),
            "attention": r.dropout("blocks.0.attn.attn_drop"),
            "projection": r.dropout("blocks.0.attn.proj_drop"),
            "mlp": r.dropout("blocks.0.mlp.drop1"),
        },
        "drop_path": r.drop_path(blocks),
        "embed_norm": type(m.norm_pre).__name__ != "Identity",
        "final_norm": type(m.norm).__name__ != "Identity",
    }


def vit_head(r: Reader, block: dict[str, Any]) -> Any:
    """The ``head:`` of a timm ViT-like model (``global_pool``, ``fc_norm``, ``head_drop``, ``head``,
    ``attn_pool``), after checking that its norms outside the blocks are the blocks' norm."""
    m = r.model
    fc_norm = type(m.fc_norm).__name__ != "Identity"
    for which in ("norm", "fc_norm", "norm_pre"):
        if type(getattr(m, which)).__name__ != "Identity" and r.norm(which) != _norm_only(block):
            raise r.refuse(which, r.norm(which), "specvit's norms outside blocks are the blocks' norm", "")
    head: Any = "none"
    if m.global_pool:  # pooled, then classified unless num_classes=0 (the pooled features)
        pool = {"token": "cls", "avg": "mean", "map": "attention"}[m.global_pool]
        head = {
            "kind": "classifier",
            **r.classifier(),
            "pool": pool,
            **({"probe": probe_spec(r, block)} if pool == "attention" else {}),
            "norm": fc_norm,
            "dropout": r.dropout("head_drop"),
        }
    elif m.num_classes > 0:
        raise r.refuse("global_pool", m.global_pool, "a classifier needs pooling", "use 'token' or 'avg'")
    elif fc_norm:
        raise r.refuse("fc_norm", r.norm("fc_norm"), "a norm of features that are not pooled", "")
    return head


def probe_spec(r: Reader, block: dict[str, Any]) -> dict[str, Any]:
    """The ``probe:`` of a timm ``AttentionPoolLatent`` (``global_pool='map'``): one latent, the blocks'
    norm and activation, biased q and kv, no QK-norm or positions of its own."""
    path = "attn_pool"
    r.only(f"{path}.latent_len", [1], "specvit's probe is one learned query")
    r.only(f"{path}.pool", ["token"], "specvit's probe pools to its one query")
    r.absent(f"{path}.pos_embed", "a position table of the pool's own")
    r.absent(f"{path}.q_norm", "a QK-norm in the pool")
    if not (_bias(r, f"{path}.q") and _bias(r, f"{path}.kv")):
        raise r.refuse(f"{path}.q.bias", None, "specvit's probe projections have biases", "")
    if r.norm(f"{path}.norm") != _norm_only(block):
        raise r.refuse(f"{path}.norm", r.norm(f"{path}.norm"), "the probe's norm is the blocks' norm", "")
    mlp = mlp_spec(r, f"{path}.mlp")
    if (mlp["activation"], mlp["bias"]) != (block["mlp"]["activation"], block["mlp"]["bias"]):
        raise r.refuse(f"{path}.mlp", mlp, "the probe's MLP has the blocks' activation and biases", "")
    return {"heads": r.at(f"{path}.num_heads"), "hidden": mlp["hidden"]}


def _norm_only(block: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in block["norm"].items() if k != "placement"}


def vit_blocks(spec: Spec, keys: Sequence[str], name: str) -> tuple[ImageInput, Entry]:
    """The checks every ViT-like timm layout shares, and where its blocks' ``mlp.fc1`` comes from.

    Args:
        spec: the target spec: an image encoder of pre-norm ``[self_attention, mlp]`` blocks, else ValueError.
        keys: the state dict's keys; split SwiGLU gate and value (``fc1_g``, ``fc1_x``) are concatenated.
        name: the source format, for messages.

    Returns:
        The spec's image input and the ``fc1`` entry.
    """
    stack = spec.stacks[spec.output_stack]
    if spec.model != "encoder" or not isinstance(stack.input, ImageInput):
        raise ValueError(
            f"source 'timm' converts {name.removeprefix('timm ')} state dicts (image encoders); spec "
            f"{spec.name!r} is a {spec.model} model reading {stack.input.kind}"
        )
    check_blocks(spec, "encoder", name, [("self_attention", "mlp")], "pre")
    if any(re.fullmatch(r"blocks\.\d+\.mlp\.fc1_g\.weight", k) for k in keys):  # SwiGLU: split gate/value
        return stack.input, (("blocks.{i}.mlp.fc1_g.{p}", "blocks.{i}.mlp.fc1_x.{p}"), cat)
    return stack.input, one("blocks.{i}.mlp.fc1.{p}")


def vit_layout(spec: Spec, keys: Sequence[str]) -> Layout:
    """timm ``VisionTransformer`` keys: class and register tokens, learned positions with or without the
    prefix, ``norm_pre``, layer scale, QK-norm, ``fc_norm``, packed or split gated MLPs."""
    name = "timm VisionTransformer"
    image, fc1 = vit_blocks(spec, keys, name)
    block, layer = "encoder.blocks.{i}.", "blocks.{i}."
    patch = patches if image.projection == "linear" else same
    table = {
        "encoder.patch_embed.proj.{p}": one("patch_embed.proj.{p}", patch),
        "encoder.prefix.cls_token": one("cls_token"),
        "encoder.prefix.reg_token": one("reg_token"),
        "encoder.pos_embed.weight": one("pos_embed"),
        "encoder.embed_norm.{p}": one("norm_pre.{p}"),
        block + "mlp.fc1.{p}": fc1,
        "encoder.norm.{p}": one("norm.{p}"),
        "head.norm.{p}": one("fc_norm.{p}"),
        "head.fc.{p}": one("head.{p}"),
        "head.pool.latent.weight": one("attn_pool.latent", unbatched),
        **(stem_entries(image, keys) if image.stem else {}),
    }
    for part in ("q", "kv", "proj", "norm", "mlp.fc1", "mlp.fc2"):  # the probe's, by timm's names
        table[f"head.pool.{'attn.' * (part in ('q', 'kv', 'proj'))}{part}.{{p}}"] = one(
            f"attn_pool.{part}.{{p}}"
        )
    for part in (
        "norm1",
        "attn.qkv",
        "attn.q_norm",
        "attn.k_norm",
        "attn.proj",
        "ls1",
        "norm2",
        "mlp.fc2",
        "ls2",
    ):
        table[block + part + ".{p}"] = one(layer + part + ".{p}")  # timm names these as specvit does
    return Layout(name, table)


VIT_MODULES = frozenset(
    {"Block", "Attention", "Mlp", "SwiGLU", "GluMlp", "LayerScale", "RmsNorm", "AttentionPoolLatent"}
    | {"GELU", "GELUTanh", "QuickGELU", "SiLU", "ReLU"}
)
"""The module classes of timm's ViT blocks and heads, whatever embeds the patches."""

timm_family(
    TimmFamily(
        classes=("VisionTransformer",),
        modules=VIT_MODULES | {"PatchEmbed"} | STEM_MODULES,
        keys=None,
        spec=vit_spec,
        layout=vit_layout,
    )
)
