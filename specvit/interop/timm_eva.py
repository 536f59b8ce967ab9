"""timm's ``Eva`` (EVA, EVA-02): learned positions plus EVA's 2D RoPE on the patch tokens, q and v biases
only, SwiGLU with its inner norm, layer scale ``gamma_1``/``gamma_2``, mean pooling with ``fc_norm``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specvit.interop.layout import BlockSlice, Entry, Layout, cat, one, patches, same
from specvit.interop.timm import Reader, TimmFamily, timm_family
from specvit.interop.timm_vit import image_input, vit_blocks, vit_stack
from specvit.spec.schema import Spec

__all__ = ["eva_block", "eva_layout"]


def _bias(r: Reader, path: str) -> bool:
    return r.at(path).bias is not None


def _same_norm(r: Reader, path: str, block: dict[str, Any], what: str) -> None:
    """The norm at ``path`` must be the block's own (timm builds it with the same ``norm_layer``)."""
    if r.norm(path) != {k: v for k, v in block["norm"].items() if k != "placement"}:
        raise r.refuse(path, r.norm(path), f"specvit's {what} is of the block's norm kind and eps", "")


def _mlp(r: Reader, path: str, block: dict[str, Any]) -> dict[str, Any]:
    """``mlp:`` of an EVA block: ``Mlp``, packed ``GluMlp`` or split ``SwiGLU``, each with an optional
    norm on the hidden activations (``scale_mlp``)."""
    name = type(r.at(path)).__name__
    if name in ("SwiGLU", "GluMlp"):
        act = r.activation(f"{path}.act")
        packed_ok = name == "SwiGLU" or (
            r.at(f"{path}.chunk_dim") == -1 and not getattr(r.at(path), "gate_last", False)
        )
        if act != "silu" or not packed_ok:
            raise r.refuse(path, name, "specvit's gated MLP is SiLU(gate) * value, gate first", "")
        fc1 = f"{path}.fc1_g" if name == "SwiGLU" else f"{path}.fc1"
        mlp = {"hidden": r.at(f"{path}.fc2").in_features, "activation": "swiglu"}
    elif name == "Mlp":
        fc1 = f"{path}.fc1"
        mlp = {"hidden": r.at(fc1).out_features, "activation": r.activation(f"{path}.act")}
    else:
        raise r.refuse(path, name, "specvit reads Mlp, GluMlp and SwiGLU", "use one of them")
    if _bias(r, fc1) != _bias(r, f"{path}.fc2"):
        raise r.refuse(f"{fc1}.bias", "one of two", "specvit's MLP biases are both on or both off", "")
    inner = type(r.at(f"{path}.norm")).__name__ != "Identity"
    if inner:
        _same_norm(r, f"{path}.norm", block, "MLP's inner norm")
    return {**mlp, "bias": _bias(r, f"{path}.fc2"), "norm": inner}


def _qkv_bias(r: Reader, attn: str) -> Any:
    """EvaAttention's q and v biases (no k bias), or AttentionRope's biases on all three."""
    rope = type(r.at(attn)).__name__ == "AttentionRope"
    if r.at(f"{attn}.qkv") is not None:  # fused: EVA's q_bias and v_bias parameters, k_bias a zero buffer
        biased = _bias(r, f"{attn}.qkv") if rope else r.at(f"{attn}.q_bias") is not None
    else:
        biased = _bias(r, f"{attn}.q_proj")
        if (_bias(r, f"{attn}.k_proj") != (biased and rope)) or _bias(r, f"{attn}.v_proj") != biased:
            why = "AttentionRope biases q, k and v alike" if rope else "EVA's k projection has no bias"
            raise r.refuse(f"{attn}.k_proj.bias", _bias(r, f"{attn}.k_proj"), why, "")
    if not biased:
        return False
    return True if rope else [True, False, True]


def _kv_heads(r: Reader, attn: str) -> dict[str, Any]:
    """AttentionRope's grouped keys and values (``num_kv_heads``), each shared by consecutive query heads."""
    kv = getattr(r.at(attn), "num_kv_heads", None)
    return {} if kv in (None, r.at(f"{attn}.num_heads")) else {"kv_heads": kv}


def eva_block(r: Reader, path: str) -> dict[str, Any]:
    """The spec ``block:`` of one timm ``EvaBlock`` (pre-norm, ``EvaAttention`` or ``AttentionRope``)."""
    attn = f"{path}.attn"  # other block and attention classes are refused by the family's module list
    r.absent(f"{attn}.norm", "a norm before the attention's output projection (scale_attn_inner)")
    if r.at(f"{attn}.gate") is not None:
        raise r.refuse(f"{attn}.gate", "Linear", "gated attention has no spec", "gated_attn=False")
    heads, head_dim = r.at(f"{attn}.num_heads"), r.at(f"{attn}.head_dim")
    qk_norm = type(r.at(f"{attn}.q_norm")).__name__ != "Identity"
    block: dict[str, Any] = {
        "heads": heads,
        "head_dim": head_dim,
        **_kv_heads(r, attn),
        "norm": {**r.norm(f"{path}.norm1"), "placement": "pre"},
        "qkv_bias": _qkv_bias(r, attn),
        "proj_bias": _bias(r, f"{attn}.proj"),
        "qk_norm": qk_norm,
        "attention_scale": r.scale(attn, head_dim),
    }
    if head_dim * heads == r.model.embed_dim:
        block["head_dim"] = None  # width / heads, as a spec writes it
    block["mlp"] = _mlp(r, f"{path}.mlp", block)
    _same_norm(r, f"{path}.norm2", block, "second norm")
    if qk_norm:
        _same_norm(r, f"{attn}.q_norm", block, "QK-norm")
    gamma_1, gamma_2 = r.at(f"{path}.gamma_1"), r.at(f"{path}.gamma_2")
    if (gamma_1 is None) != (gamma_2 is None):
        raise r.refuse(f"{path}.gamma_2", None, "specvit scales both branches or neither", "")
    if gamma_1 is not None:
        block["layer_scale"] = float(r.at(f"{path}.init_values"))
    return block


def _rope(r: Reader, grid: tuple[int, int]) -> dict[str, Any]:
    """``rope2d`` of timm's ``RotaryEmbeddingCat`` as EVA builds it (``rope_type='cat'``), or of its
    ``RotaryEmbeddingMixed`` (``rope_type='mixed'``: learned frequencies, one set per block)."""
    rope = r.at("rope")
    mixed = type(rope).__name__ == "RotaryEmbeddingMixed"
    checks: list[tuple[str, Any, str]] = [
        ("rope.aug_active", [False], "coordinate augmentation changes the positions in training"),
        ("rope.feat_shape", [list(grid), grid], "specvit's rotary table is the patch grid's"),
    ]
    if not mixed:
        checks += [
            ("rope.in_pixels", [False], "specvit's 2D RoPE is over patch indexes"),
            ("rope.grid_type", ["index"], "specvit's 2D RoPE is over patch indexes"),
            ("rope.grid_offset", [0.0], "specvit's patch coordinates start at 0"),
            (
                "rope.dim",
                [r.at("blocks.0.attn.head_dim")],
                "the rotary width is not the attention's head dim",
            ),
        ]
    for path, allowed, why in checks:
        r.only(path, allowed, why)
    r.only("rope.grid_indexing", ["ij", "xy"], "specvit's grid axes are ij or xy")
    half = bool(getattr(rope, "rotate_half", False))
    for i in range(len(r.model.blocks)):
        attn = f"blocks.{i}.attn"
        r.only(f"{attn}.rotate_half", [half], "the attention and its table disagree")
        r.only(f"{attn}.num_prefix_tokens", [r.model.num_prefix_tokens], "all prefix tokens stay unrotated")
    ref = None if mixed else rope.ref_feat_shape
    return {
        "kind": "rope2d",
        "base": float(rope.temperature),
        "layout": "half" if half else "interleaved",
        "ref_grid": None if ref is None else [int(ref[0]), int(ref[1])],
        "axes": rope.grid_indexing,
        "frequencies": "learned" if mixed else "fixed",
    }


def _head(r: Reader) -> Any:
    m = r.model
    r.only("global_pool", ["token", "avg"], "specvit pools by the class token or the mean")
    if m.attn_pool is not None:
        raise r.refuse("attn_pool", type(m.attn_pool).__name__, "attention pooling has no spec", "")
    return {
        "kind": "classifier",
        **r.classifier(),
        "pool": {"token": "cls", "avg": "mean"}[m.global_pool],
        "norm": type(m.fc_norm).__name__ != "Identity",
        "dropout": r.dropout("head_drop"),
    }


def _eva(r: Reader) -> dict[str, Any]:
    m = r.model
    if m.patch_drop is not None:
        raise r.refuse("patch_drop", type(m.patch_drop).__name__, "patch dropout has no spec", "")
    blocks = [f"blocks.{i}" for i in range(len(m.blocks))]
    block = r.same(blocks, lambda b: eva_block(r, b), "block")
    for which in ("norm", "fc_norm", "norm_pre"):
        if type(getattr(m, which)).__name__ != "Identity":
            _same_norm(r, which, block, f"{which} (a norm outside the blocks)")
    inp = image_input(r)
    positions: list[Any] = []
    if m.pos_embed is not None:
        positions.append({"kind": "learned", "include_prefix": not m.no_embed_class})
    if m.rope is not None:
        positions.append(_rope(r, tuple(m.patch_embed.grid_size)))
    return {
        "specvit": 1,
        "name": "timm_eva",
        "description": "timm Eva (EVA / EVA-02), imported by specvit.from_timm.",
        "model": "encoder",
        "encoder": {
            "input": inp,
            "prefix": {
                "cls": m.cls_token is not None,
                "registers": 0 if m.reg_token is None else m.reg_token.shape[1],
            },
            "position": positions[0] if len(positions) == 1 else positions or "none",
            **vit_stack(r, blocks, block, "pos_drop"),
        },
        "head": _head(r),
    }


def eva_layout(spec: Spec, keys: Sequence[str]) -> Layout:
    """timm ``Eva`` keys: fused ``qkv`` with ``q_bias``/``v_bias`` or separate ``q_proj``/``k_proj``/
    ``v_proj``, ``gamma_1``/``gamma_2``, packed ``GluMlp`` or split ``SwiGLU`` with ``mlp.norm``."""
    name = "timm Eva"
    image, fc1 = vit_blocks(spec, keys, name)
    block, layer = "encoder.blocks.{i}.", "blocks.{i}.attn."
    separate = any(".attn.q_proj." in k for k in keys)
    if separate:
        qkv: Entry = ((layer + "q_proj.weight", layer + "k_proj.weight", layer + "v_proj.weight"), cat)
        qkv_bias: Entry = ((layer + "q_proj.bias", layer + "k_proj.bias", layer + "v_proj.bias"), cat)
        q_bias, v_bias = one(layer + "q_proj.bias"), one(layer + "v_proj.bias")
    else:
        qkv, q_bias, v_bias = one(layer + "qkv.weight"), one(layer + "q_bias"), one(layer + "v_bias")
        qkv_bias = one(layer + "qkv.bias")  # AttentionRope's, on q, k and v
    table: dict[str, Entry] = {
        "encoder.patch_embed.proj.{p}": one(
            "patch_embed.proj.{p}", patches if image.projection == "linear" else same
        ),
        "encoder.prefix.cls_token": one("cls_token"),
        "encoder.prefix.reg_token": one("reg_token"),
        "encoder.pos_embed.weight": one("pos_embed"),
        "encoder.embed_norm.{p}": one("norm_pre.{p}"),
        block + "attn.qkv.weight": qkv,
        block + "attn.qkv.bias": qkv_bias,
        block + "attn.q_bias": q_bias,
        block + "attn.v_bias": v_bias,
        block + "mlp.fc1.{p}": fc1,
        block + "ls1.gamma": one("blocks.{i}.gamma_1"),
        block + "ls2.gamma": one("blocks.{i}.gamma_2"),
        "encoder.norm.{p}": one("norm.{p}"),
        "head.norm.{p}": one("fc_norm.{p}"),
        "head.fc.{p}": one("head.{p}"),
        block + "rope.freqs": (("rope.freqs",), BlockSlice(1)),  # RoPE-Mixed: (2, depth, H, hd/2)
    }
    for part in ("norm1", "attn.q_norm", "attn.k_norm", "attn.proj", "norm2", "mlp.norm", "mlp.fc2"):
        table[block + part + ".{p}"] = one("blocks.{i}." + part + ".{p}")  # named as specvit names them
    return Layout(name, table, ignore=(r"blocks\.\d+\.attn\.k_bias", r"rope\.(?!freqs$).*"))


timm_family(
    TimmFamily(
        classes=("Eva",),
        modules=frozenset(
            {"PatchEmbed", "EvaBlock", "EvaAttention", "AttentionRope", "Mlp", "SwiGLU", "GluMlp", "RmsNorm"}
            | {"RotaryEmbeddingCat", "RotaryEmbeddingMixed", "GELU", "GELUTanh", "QuickGELU", "SiLU", "ReLU"}
        ),
        keys=r"blocks\.\d+\.(attn\.q_proj\.|attn\.q_bias$|gamma_1$|mlp\.norm\.)|rope\.freqs$",
        spec=_eva,
        layout=eva_layout,
    )
)
