"""The attention op: one node kind for every attention, its parts data (:class:`AttentionParams`).

Every attention node builds the attention core (:class:`specvit.nn.attention.Attention`) from the parts its
params turn on: projections (packed, split, keys and values from a memory), the head layout, QK-norm,
cosine attention, talking heads, relative tables of the layer's own, soft-capping, masks (causal, a
sliding window), which tokens query, global tokens beside a sliding window (Longformer), a partition of
the token grid into (shifted, padded) windows, values of their own head width, the output projection or
none, and an output gate. SAGAN's layer is the core with 1x1-conv projections over a (B, C, H, W) map
(``projection="conv"``), values C wide, no output projection and the gate. A node is recorded under the
name of its configuration (:func:`configuration`: ``self_attention``, ``cross_attention``,
``class_attention``, ``window_attention``, ``sagan_attention`` ...), which every registry name maps back to
this one op; the sublayers that lower to it are in :mod:`specvit.ops.attention` (SAGAN's in
:mod:`specvit.ops.sagan`).

The op reads its side inputs by port (``mask``, ``rope``, ``bias``, ``pos``, ``cache``, ``global_mask``; with a
memory also ``memory``, ``memory_mask``, ``memory_pos``, ``memory_rope``): whatever the stack has is wired.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from specvit.ops.base import Dims, Filler, Op, Params, Shape, linear_flops, op, visible_pairs
from specvit.ops.norm import norm_params

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ATTENTION_MODULE", "SIDE_PORTS", "AttentionParams", "configuration", "core_args"]

SIDE_PORTS = (
    "mask",
    "rope",
    "bias",
    "pos",
    "cache",
    "rel_embed",
    "rel_index",
    "memory",
    "memory_mask",
    "memory_pos",
    "memory_rope",
    "global_mask",
)
"""The side values an attention node reads, by the name the stack holds them under."""

Relative = Literal["table", "cpb", "decomposed"]

ATTENTION_MODULE = "specvit.nn.attention:Attention"
"""The module every attention op builds."""

_CORE_PARTS: dict[str, Any] = {
    "memory_dim": None,
    "projection": "packed",
    "cosine": False,
    "talking_heads": False,
    "relative": None,
    "softcap": None,
    "disentangled": False,
    "gated": False,
    "causal": False,
    "window": None,
    "queries": None,
    "global_tokens": None,
    "global_projection": False,
    "grid": None,
    "grid_window": None,
    "v_head_dim": None,
    "proj": True,
    "output_gate": False,
    "reduction": None,
}


def core_args(**args: Any) -> dict[str, Any]:
    """Constructor arguments of the attention core (``specvit.nn.attention:Attention``) with every part
    stated, the ones not in ``args`` off: an ejected layer folds the parts its model never uses."""
    return {**_CORE_PARTS, **args}


@dataclass(frozen=True)
class AttentionParams(Params):
    """The parts of one attention layer.

    Args:
        dim: token width.
        heads: query heads.
        kv_heads: key/value heads (fewer for GQA, 1 for MQA).
        head_dim: width per head of the queries and keys.
        v_head_dim: width per head of the values, or None for ``head_dim`` (SAGAN: C, queries and keys C/8).
        qkv_bias: biases in the q, k and v projections.
        proj: an output projection H * v_head_dim -> dim; without one the heads are ``dim`` wide (SAGAN).
        proj_bias: bias in the output projection.
        output_gate: the output times a learned scalar ``gamma`` that starts at 0 (SAGAN).
        qk_norm: ``layernorm`` or ``rmsnorm`` on queries and keys, or None.
        qk_norm_bias: the QK LayerNorms have a bias.
        qk_norm_affine: the QK norms have a learned weight.
        qk_norm_unit_offset: the QK norms scale by ``1 + w``.
        qk_norm_scope: ``head`` (each head over head_dim) or ``all`` (a token's heads at once, OLMo 2).
        qk_norm_late: the QK norms after RoPE, on the rotated queries and keys (HunYuan).
        eps: epsilon of the QK norms.
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
        causal: a query sees only keys at or before its own position.
        scale: factor of q·k, or None for 1/sqrt(head_dim).
        window: the keys a query sees: on a token ``grid``, the window x window tile it sits in (Swin,
            ViTDet); in a sequence, the ``window`` positions up to its own (a sliding window); None for all.
        softcap: the logits soft-capped to ``softcap * tanh(logits / softcap)`` before the masks, or None.
        memory_dim: keys and values come from a memory of this width (cross-attention), or None.
        projection: ``packed`` (one qkv linear), ``split`` (q, k and v linears) or ``conv`` (SAGAN's 1x1 convs
            ``query``, ``key``, ``value`` over a (B, dim, H, W) map, which the layer returns as a map).
        queries: only the first ``queries`` tokens query (CaiT's class attention), or None for all.
        talking_heads: the logits and the weights are mixed across heads (CaiT).
        grid: the (rows, cols) token grid, for windows and grid-relative tables, or None.
        shift: the cyclic shift of the grid before windowing (Swin's every second block).
        relative: the layer's own relative bias: ``table`` (Swin), ``cpb`` (Swin-V2's MLP), ``decomposed``
            (MViTv2's, ViTDet), or None.
        cosine: cosine attention with a learned per-head logit scale (Swin-V2).
        gated: ConViT's gated positional attention over the whole ``grid``.
        disentangled: DeBERTa's content-to-position and position-to-content scores of the stack's relative
            table (the ``rel_embed`` and ``rel_index`` ports).
        cpb_hidden: hidden width of the ``cpb`` MLP.
        pretrained: the window side the ``cpb`` MLP's coordinates are normalised by, 0 for ``window``.
        global_tokens: tokens every token attends to beside its sliding window and that attend to every token
            (Longformer): ``mask``, those the ``global_mask`` port marks per sample; K, the first K; or None.
        global_projection: the global tokens' rows are computed again with q, k, v projections of their own.
        reduction: the keys and values read the ``grid`` reduced r x r by a strided conv and a LayerNorm
            (PVT's spatial reduction), or None.
        layer: the layer's index in a KV cache.
    """

    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: tuple[bool, bool, bool] = (True, True, True)
    proj_bias: bool = True
    qk_norm: str | None = None
    qk_norm_bias: bool = True
    qk_norm_affine: bool = True
    qk_norm_unit_offset: bool = False
    qk_norm_scope: str = "head"
    qk_norm_late: bool = False
    eps: float = 1e-6
    attn_drop: float = 0.0
    proj_drop: float = 0.0
    causal: bool = False
    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    memory_dim: int | None = None
    projection: Literal["packed", "split", "conv"] = "packed"
    queries: int | None = None
    talking_heads: bool = False
    grid: tuple[int, int] | None = None
    shift: int = 0
    relative: Relative | None = None
    cosine: bool = False
    gated: bool = False
    disentangled: bool = False
    cpb_hidden: int = 0
    pretrained: int = 0
    global_tokens: str | int | None = None
    global_projection: bool = False
    layer: int = field(default=0, metadata={"varies": True, "setting": False})
    v_head_dim: int | None = None
    proj: bool = True
    output_gate: bool = False
    reduction: int | None = None

    @property
    def inner(self) -> int:
        """The width of the heads together, H * hd."""
        return self.heads * self.head_dim

    @property
    def v_width(self) -> int:
        """The width of one head's values, vd."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def v_inner(self) -> int:
        """The width of the heads' outputs together, H * vd."""
        return self.heads * self.v_width

    @property
    def qk_channels(self) -> int:
        """The channels of the queries (SAGAN's C / 8): H * hd."""
        return self.inner

    @property
    def tiles(self) -> bool:
        """The grid is cut into window x window tiles."""
        return self.grid is not None and self.window is not None

    @property
    def padded(self) -> tuple[int, int]:
        """The grid padded to a multiple of the window (the grid itself without windows)."""
        assert self.grid is not None
        (gh, gw), m = self.grid, self.window
        return (gh + (-gh) % m, gw + (-gw) % m) if m is not None else (gh, gw)

    @property
    def extent(self) -> tuple[int, int]:
        """What one query attends over on the grid: its tile, or the whole grid."""
        assert self.grid is not None
        return (self.window, self.window) if self.window is not None else self.grid

    @property
    def qk_params(self) -> int:
        if not self.qk_norm:
            return 0
        q, k = (self.heads, self.kv_heads) if self.qk_norm_scope == "all" else (1, 1)
        hd, bias, affine = self.head_dim, self.qk_norm_bias, self.qk_norm_affine
        return norm_params(self.qk_norm, q * hd, bias, affine) + norm_params(
            self.qk_norm, k * hd, bias, affine
        )

    @property
    def own_params(self) -> int:
        """Parameters beside the projections and QK-norms: talking-heads maps, the logit scale, tables."""
        h, n = self.heads, 2 * (self.heads**2 + self.heads) * self.talking_heads + self.heads * self.cosine
        n += 5 * h * self.gated  # ConViT: pos_proj 3 -> H with a bias, one gate per head
        n += self.output_gate  # SAGAN's gamma
        n += (self.dim * self.reduction**2 + 3) * self.dim if self.reduction else 0  # PVT: conv, LayerNorm
        if self.relative == "table":
            assert self.window is not None
            n += (2 * self.window - 1) ** 2 * h
        elif self.relative == "cpb":
            n += 3 * self.cpb_hidden + self.cpb_hidden * h  # 2 -> hidden (with bias) -> H
        elif self.relative == "decomposed":
            qh, qw = self.extent
            n += (2 * qh - 1 + 2 * qw - 1) * self.head_dim
        return n

    def bias_rows(self, kv_rows: int, v_rows: int) -> int:
        """The q/k/v bias parameters: ``heads * head_dim`` for q, ``kv_rows`` for k and ``v_rows`` for v."""
        bq, bk, bv = self.qkv_bias
        return self.inner * bq + kv_rows * bk + v_rows * bv


def configuration(p: AttentionParams) -> str:
    """The name a node with these parts is recorded and drawn under."""
    if p.memory_dim is not None:
        return "cross_attention"
    if p.projection == "conv":
        return "sagan_attention"
    if p.queries is not None:
        return "class_attention"
    if p.talking_heads:
        return "talking_heads_attention"
    if p.relative in ("table", "cpb"):
        return "window_attention"
    return "grid_attention" if p.grid is not None else "self_attention"


def _masked(p: AttentionParams) -> bool:
    """A self-attention over a sequence whose static mask (causal, a sliding window) hides pairs a dense
    kernel computes; with global tokens, which pairs are used is data, and all are counted."""
    plain = p.memory_dim is None and p.grid is None and p.queries is None and p.projection != "conv"
    return plain and p.global_tokens is None and (p.causal or p.window is not None)


def _flags(p: AttentionParams) -> list[str]:
    flags = []
    if p.qk_norm:
        flags.append(
            f"qk {p.qk_norm}"
            + " over all heads" * (p.qk_norm_scope == "all")
            + " after RoPE" * p.qk_norm_late
        )
    if p.attn_drop or p.proj_drop:
        flags.append(f"dropout {p.attn_drop:g}/{p.proj_drop:g}")
    if p.window is not None and not p.tiles:
        flags.append(f"sliding window {p.window}")
    if p.scale is not None:
        flags.append(f"scale {p.scale:g}")
    if p.softcap is not None:
        flags.append(f"softcap {p.softcap:g}")
    if len(set(p.qkv_bias)) > 1:
        flags.append("bias " + "".join(c for c, b in zip("qkv", p.qkv_bias, strict=True) if b))
    return flags


def _where(p: AttentionParams) -> str:
    """Which keys each query sees, in a few words."""
    if p.memory_dim is not None:
        return f"memory dim {p.memory_dim}"
    if p.queries is not None:
        return "class token queries all tokens" if p.queries == 1 else f"first {p.queries} tokens query all"
    if p.projection == "conv":
        return "softmax over the map's positions"
    if p.grid is None:
        return "causal" if p.causal else "not causal"
    (gh, gw), (hp, wp) = p.grid, p.padded
    if p.window is None:
        return f"global · whole {gh}x{gw} grid"
    shifted = f"shifted by {p.shift}" if p.shift else "not shifted"
    pad = f" · grid {gh}x{gw} padded to {hp}x{wp}" if (hp, wp) != (gh, gw) else ""
    return f"{p.window}x{p.window} windows · {shifted}{pad}"


def _relative_line(p: AttentionParams) -> str:
    if p.relative == "table":
        m = 2 * (p.window or 0) - 1
        return f"relative bias · table {m}x{m}x{p.heads}"
    if p.relative == "cpb":
        m = p.window or 1
        normalised = f"coords / {p.pretrained - 1}" if p.pretrained else f"coords / {max(m - 1, 1)}"
        return f"CPB MLP 2→{p.cpb_hidden}→{p.heads} · 16·sigmoid · {normalised}"
    (qh, qw), hd = p.extent, p.head_dim
    return f"decomposed rel. pos · h {2 * qh - 1}x{hd} · w {2 * qw - 1}x{hd}"


@op
class Attention(Op):
    kind = "self_attention"
    names = (
        "cross_attention",
        "class_attention",
        "talking_heads_attention",
        "window_attention",
        "grid_attention",
        "sagan_attention",
    )
    params_type = AttentionParams
    category = "attention"
    module = ATTENTION_MODULE
    ports = ("x", *SIDE_PORTS)

    def requires(self, p: AttentionParams) -> tuple[str, ...]:
        if p.global_tokens == "mask":
            return ("x", "global_mask")
        return ("x", "memory") if p.memory_dim is not None else ("x",)

    def shape(self, p: AttentionParams, inputs: Mapping[str, Shape], dims: Dims) -> Shape:
        if p.projection == "conv":  # a map in, a map out
            if len(inputs["x"]) != 4 or inputs["x"][1] != p.dim:
                raise ValueError(f"expects a (B, {p.dim}, H, W) feature map, got {inputs['x']}")
            return inputs["x"]
        b, n, d = inputs["x"]
        if d != p.dim:
            raise ValueError(f"expects width {p.dim}, got {d}")
        return (b, n, d) if p.queries is None else (b, p.queries, d)

    def params(self, p: AttentionParams) -> int:
        kv_rows, v_rows, src = p.kv_heads * p.head_dim, p.kv_heads * p.v_width, p.memory_dim or p.dim
        projections = (
            p.dim * p.inner + src * (kv_rows + v_rows) + (p.v_inner * p.dim + p.dim * p.proj_bias) * p.proj
        )
        if p.global_projection:  # qkv_global: the packed q, k, v projection again (Longformer)
            projections += p.dim * (p.inner + kv_rows + v_rows) + p.bias_rows(kv_rows, v_rows)
        return projections + p.bias_rows(kv_rows, v_rows) + p.qk_params + p.own_params

    def flops(self, p: AttentionParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        x = inputs["x"]
        b, n = (x[0], x[2] * x[3]) if p.projection == "conv" else (x[0], x[1])  # a map's H * W positions
        kv_rows, v_rows = p.kv_heads * p.head_dim, p.kv_heads * p.v_width
        rows = b * math.prod(p.padded) if p.tiles else b * n  # the tokens the projections see
        keys = p.window**2 if p.tiles and p.window else n  # per query
        queries = rows if p.queries is None else b * p.queries
        if p.memory_dim is not None:
            keys = inputs["memory"][1]
            qkv = linear_flops(rows, p.dim, p.inner) + linear_flops(b * keys, p.memory_dim, kv_rows + v_rows)
        elif p.reduction and p.grid is not None:  # q over every token; the conv and kv over the reduced ones
            keys = math.prod(g // p.reduction for g in p.grid)
            qkv = linear_flops(rows, p.dim, p.inner) + linear_flops(b * keys, p.dim, kv_rows + v_rows)
            qkv += 2 * b * keys * p.dim * p.dim * p.reduction**2
        elif p.projection != "packed":  # split linears or 1x1 convs, which count as linears
            qkv = linear_flops(queries, p.dim, p.inner) + linear_flops(rows, p.dim, kv_rows + v_rows)
        else:
            qkv = linear_flops(rows, p.dim, p.inner + kv_rows + v_rows)
        out = qkv + 2 * queries * keys * (p.inner + p.v_inner)  # q·k, attn @ v
        out += linear_flops(queries, p.v_inner, p.dim) * p.proj
        if p.talking_heads:
            out += 2 * linear_flops(b * n * n, p.heads, p.heads)
        if p.global_projection:  # every row again through qkv_global, attending over every token
            out += linear_flops(b * n, p.dim, p.inner + 2 * kv_rows) + 4 * b * n * n * p.inner
        if p.gated:
            out += linear_flops(n * n, 3, p.heads)  # the positional scores, once per forward
        if p.disentangled:  # the table through the q and k projections, then its two products
            rows = inputs["rel_embed"][0]
            out += linear_flops(rows, p.dim, 2 * p.inner) + 2 * linear_flops(b * n, p.inner, rows)
        if p.relative == "decomposed":
            out += 2 * rows * p.inner * sum(p.extent)  # the two einsums
        elif p.relative == "cpb":
            offsets = (2 * (p.window or 0) - 1) ** 2
            out += linear_flops(offsets, 2, p.cpb_hidden) + linear_flops(offsets, p.cpb_hidden, p.heads)
        return out

    def useful_flops(self, p: AttentionParams, inputs: Mapping[str, tuple[int, ...]]) -> int:
        """:meth:`flops` less the q·k and attention·v products of the pairs a causal mask or a sliding window
        hides (:func:`~specvit.ops.base.visible_pairs`); a partition's windows compute only their own pairs."""
        dense = self.flops(p, inputs)
        if not _masked(p):
            return dense
        b, n = inputs["x"][0], inputs["x"][1]
        return dense - 2 * b * (n * n - visible_pairs(n, p.causal, p.window)) * (p.inner + p.v_inner)

    def note(self, p: AttentionParams) -> str | None:
        if not _masked(p):
            return None
        mask = f"{'causal ' * p.causal}attention" + f" in a sliding window of {p.window}" * bool(p.window)
        kept = "query-key pairs in the window" if p.window else "S(S+1)/2 query-key pairs the mask keeps"
        return f"{mask}: useful counts only the {kept}; the total all S x S, as a dense kernel does"

    def ctor(self, p: AttentionParams) -> dict[str, Any]:
        qk: dict[str, Any] = {}
        if p.qk_norm:  # the QK-norm's settings, those beside kind, bias and eps only where not the default
            qk = {"qk_norm": p.qk_norm, "qk_norm_bias": p.qk_norm_bias, "norm_eps": p.eps}
            qk |= {} if p.qk_norm_affine else {"qk_norm_affine": False}
            qk |= {"qk_norm_unit_offset": True} if p.qk_norm_unit_offset else {}
            qk |= {"qk_norm_scope": "all"} if p.qk_norm_scope == "all" else {}
            qk |= {"qk_norm_after_rope": True} if p.qk_norm_late else {}
        qk |= {"norm_eps": p.eps} if p.reduction else {}  # the reduction's norm
        cpb = {"cpb_hidden": p.cpb_hidden, "pretrained": p.pretrained} if p.relative == "cpb" else {}
        return core_args(
            dim=p.dim,
            num_heads=p.heads,
            num_kv_heads=p.kv_heads,
            head_dim=p.head_dim,
            memory_dim=p.memory_dim,
            projection=p.projection,
            qkv_bias=p.qkv_bias if len(set(p.qkv_bias)) > 1 else p.qkv_bias[0],
            proj_bias=p.proj_bias,
            **qk,
            scale=p.scale,
            cosine=p.cosine,
            talking_heads=p.talking_heads,
            relative=p.relative,
            **cpb,
            softcap=p.softcap,
            disentangled=p.disentangled,
            gated=p.gated,
            causal=p.causal,
            window=None if p.tiles else p.window,
            queries=p.queries,
            global_tokens=p.global_tokens,
            global_projection=p.global_projection,
            grid=p.grid,
            grid_window=p.window if p.tiles else None,
            **({"shift": p.shift} if p.shift else {}),
            reduction=p.reduction,
            attn_drop=p.attn_drop,
            proj_drop=p.proj_drop,
            layer_idx=p.layer,
            v_head_dim=p.v_head_dim,
            proj=p.proj,
            output_gate=p.output_gate,
        )

    def init(self, module: nn.Module, p: AttentionParams, fill: Filler) -> None:
        from torch.nn.init import trunc_normal_

        fill.children(module)  # layers by type (the bias MLP's too, as timm's init does)
        separate = ("q_bias", "k_bias", "v_bias", "q_global_bias", "k_global_bias", "v_global_bias")
        for name in separate:  # the separate biases of a packed projection
            if hasattr(module, name):
                fill.zeros(getattr(module, name))
        if p.cosine:
            fill(module.logit_scale, lambda t: t.fill_(math.log(10.0)))  # Swin-V2: scale 10 at init
        if p.gated:
            fill.ones(module.gating_param)  # ConViT: each head starts at sigmoid(1) positional
        if p.output_gate:
            fill.zeros(module.gamma)  # SAGAN: the layer starts at zero, its block as the identity
        for table in ("relative_position_bias_table", "rel_pos_h", "rel_pos_w"):
            if hasattr(module, table):
                fill(getattr(module, table), lambda t: trunc_normal_(t, std=0.02))

    def label(self, p: AttentionParams) -> tuple[str, ...]:
        heads = f"heads {p.heads} · kv_heads {p.kv_heads} · head_dim {p.head_dim}"
        heads += f" · v_head_dim {p.v_width}" if p.v_width != p.head_dim else ""
        talking = ["talking heads (mixed before and after softmax)"] if p.talking_heads else []
        lines = [heads, " · ".join([_where(p), *talking, *_flags(p)])]
        if p.relative is not None:
            lines.append(_relative_line(p))
        if p.cosine:
            lines.append("cosine attention · logit scale ≤ 100")
        if p.reduction and p.grid is not None:
            (gh, gw), r = p.grid, p.reduction
            lines.append(
                f"keys, values of the grid reduced · {r}x{r} conv, stride {r} · {gh // r}x{gw // r} · norm"
            )
        if p.gated:
            lines.append("gated positions · softmax(q·k) and softmax of offsets, gated per head")
        if p.global_tokens is not None:
            which = "the global mask's" if p.global_tokens == "mask" else f"the first {p.global_tokens}"
            own = " · their rows by q, k, v of their own" if p.global_projection else ""
            lines.append(f"global tokens ({which}) see and are seen by every token{own}")
        if p.disentangled:
            lines.append("disentangled · content→position and position→content scores · scale 1/√(3·hd)")
        if p.projection == "conv":
            lines.append(f"1x1 convs · q/k {p.dim}→{p.inner} · v {p.dim}→{p.kv_heads * p.v_width}")
        output = ["no output projection"] * (not p.proj) + ["output × gamma (init 0)"] * p.output_gate
        if output:
            lines.append(" · ".join(output))
        return tuple(lines)
