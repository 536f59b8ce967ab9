"""One attention core whose parts are data (:class:`Attention`), on top of ``F.scaled_dot_product_attention``.

The parts, each a constructor argument (see :class:`Attention`): the projections (a packed ``qkv``, split
``q``/``k``/``v``, ``q`` and ``kv`` from a memory, or SAGAN's 1x1 convs over a map), the head layout
(GQA/MQA, any head and value widths), QK-norm, rotary tables and DETR's positions, cosine attention, keys
and values from the grid shrunk by a strided conv and a norm (PVT's spatial reduction, :mod:`specvit.nn.reduce`), the
output projection (or none) and an output gate, which tokens query (CaiT), global tokens beside a sliding
window (Longformer, :mod:`specvit.nn.global_tokens`), and a partition of the token grid into (shifted,
padded) windows around plain attention (:mod:`specvit.nn.partition`). The **scores**, in this order:
``q·k`` times ``scale``; talking heads mix them across heads (CaiT); additive biases (a ``bias`` input such
as ALiBi or T5's buckets; a relative table of the layer's own: Swin's, Swin-V2's continuous one, MViTv2's
decomposed one; DeBERTa's disentangled scores); soft-capping (Gemma 2); the masks (causal, a sliding window,
padding, global tokens; keys a row cannot see get no weight); the softmax; talking heads mix the weights
again; ConViT's gate mixes them with positional weights of the grid.

SDPA's fused kernels run whenever no part needs the scores themselves (talking heads, soft-capping); the math
path computes the same thing otherwise.

Masks: ``mask`` / ``memory_mask`` are boolean with True = padding (ignored key), the torch
``nn.MultiheadAttention`` convention. A query row that ends up with no visible key (e.g. every key of
that sample is padding) outputs zeros from the attention (so the module returns ``proj(0) = proj.bias``)
instead of NaN, independently of the SDPA backend; its gradients are finite too.

Caches: one :class:`KVCache` per model; each attention layer reads and writes its own entry by its
``layer_idx``, as HF's ``Cache`` objects do.

Every forward takes the tokens positionally and everything else by keyword (``mask``, ``rope``, ``bias``,
``pos``, ``cache``, ``rel_embed``, ``rel_index``, ``global_mask``; with a memory also ``memory``, ``memory_mask``, ``memory_pos``, ``memory_rope``).

Dim legend: B batch, N tokens, D width, H heads, Hkv kv heads, hd head dim (vd of values), M memory tokens,
G windows per sample (1 without a partition), L tokens per window (N without one), Nq query tokens.
T is the number of keys a self-attention query sees (N, or cached + N with a KV cache); Dm memory width.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from specvit.nn.attend import (
    Parts,
    QkNorm,
    QkNormScope,
    QkvBias,
    attend,
    attend_math,
    check_parts,
    head_norm,
    normed_rotated,
    output_parts,
    packed_projection,
    project_positioned,
    resolve_heads,
    split_heads,
    split_parts,
    split_rotated,
    three_biases,
    visible_mask,
)
from specvit.nn.cache import KVCache
from specvit.nn.functional import to_map, to_tokens
from specvit.nn.global_tokens import GlobalTokens, global_attention, global_keys, global_parts, global_rows
from specvit.nn.linear import Linear
from specvit.nn.partition import window_merge, window_split
from specvit.nn.reduce import reduce_tokens, spatial_reduction
from specvit.nn.relative import disentangled_scores
from specvit.nn.scores import (
    cosine_qk,
    cpb_coords,
    decomposed_bias,
    grid_offsets,
    table_bias,
)

__all__ = ["Attention", "CrossAttention", "KVCache", "QkNorm", "RelativeBias", "SelfAttention"]

RelativeBias = Literal["table", "cpb", "decomposed"]
"""A relative position bias a layer owns: Swin's learned table over its windows, Swin-V2's continuous
position bias MLP, or MViTv2's decomposed tables (ViTDet, SAM)."""


class Attention(nn.Module):
    """Multi-head attention whose parts are data: see the module docstring for each part and its order.

    Args:
        dim: token width D.
        num_heads: number of query heads H.
        num_kv_heads: number of key/value heads Hkv (divides H); None = H (plain MHA), 1 = MQA.
        head_dim: per-head width hd of queries and keys; None = D // H.
        v_head_dim: per-head width vd of the values; None = hd (SAGAN: queries and keys C/8, values C).
        memory_dim: the keys and values come from a memory of this width (cross-attention: projections
            ``q`` and a packed ``kv``); None = from the tokens themselves.
        projection: ``packed`` (one ``qkv``; ``q`` and ``kv`` with a memory), ``split`` (``q``, ``k``, ``v``:
            CaiT) or ``conv`` (1x1 convs ``query``, ``key``, ``value`` over a (B, D, H, W) map: SAGAN).
        qkv_bias: biases of q, k and v: one for all, or (q, k, v) (packed with some: ``q_bias`` ... apart).
        proj: an output projection H * vd -> D; without one (SAGAN) the heads are D wide together.
        proj_bias: bias of the output projection.
        output_gate: the output times a learned scalar ``gamma`` that starts at 0 (SAGAN).
        qk_norm: ``layernorm`` or ``rmsnorm`` over hd applied to queries and keys, or None.
        qk_norm_bias: the QK LayerNorms have a bias.
        qk_norm_affine: the QK norms have a learned weight.
        qk_norm_unit_offset: the QK norms scale by ``1 + w`` (Gemma 3).
        qk_norm_scope: ``head``: each head normalised over its hd channels; ``all``: the H (or Hkv) heads
            of a token over their H * hd channels at once (OLMo 2).
        qk_norm_after_rope: the QK norms normalise the rotated queries and keys (HunYuan), not the unrotated.
        norm_eps: epsilon of the QK norms.
        scale: factor of q·k; None = 1/sqrt(hd) (T5 uses 1).
        cosine: cosine attention (Swin-V2): cos(q, k) times a learned per-head ``logit_scale``,
            exp(min(logit_scale, log 100)), instead of q·k times ``scale``.
        talking_heads: the logits and the weights are mixed across heads by learned H x H maps ``proj_l``
            (before the softmax) and ``proj_w`` (after it) (CaiT).
        relative: the layer's own relative bias: ``table`` (Swin's ``relative_position_bias_table``), ``cpb``
            (Swin-V2's MLP ``cpb_mlp``), ``decomposed`` (MViTv2's ``rel_pos_h``, ``rel_pos_w``), or None.
        cpb_hidden: the hidden width of the ``cpb`` MLP.
        pretrained: the window side the ``cpb`` MLP's coordinates are normalised by, 0 for the window.
        softcap: soft-capping of the logits, ``softcap * tanh(logits / softcap)`` (Gemma 2), or None.
        disentangled: DeBERTa's scores ``q_i · pos_k[r(i, j)] + k_j · pos_q[r(i, j)]`` of the ``rel_embed``
            table through this layer's q and k projections, r the ``rel_index`` rows.
        gated: ConViT's gate: the weights mixed with ``softmax(pos_proj([dx, dy, dx² + dy²]))`` of each offset
            on the ``grid`` by a per-head ``sigmoid(gating_param)``, then renormalised.
        causal: query i only sees keys at positions <= its own.
        window: query i only sees keys less than ``window`` positions away (a sliding window), or None.
        queries: only the first ``queries`` tokens query (CaiT's class attention: 1); None = every token.
        global_tokens: tokens seen by and seeing every token beside a window (Longformer): ``"mask"``, those
            the ``global_mask`` input marks; K, the first K; None = none.
        global_projection: the global tokens' rows again through their own projections ``qkv_global``.
        grid: the (gh, gw) token grid, for ``grid_window`` and decomposed relative positions.
        grid_window: attend within M x M windows of the grid (padded to a multiple of M when M does not
            divide it, as ViTDet's), or None.
        shift: cyclic shift of the grid before windowing (M/2 in every second Swin block), with a region mask.
        reduction: keys and values from the ``grid`` reduced r x r by the conv ``sr`` (kernel = stride = r)
            and the LayerNorm ``norm`` (of eps ``norm_eps``), through ``q`` and ``kv`` (PVT); None = none.
        attn_drop: dropout on the attention probabilities (training only).
        proj_drop: dropout after the output projection.
        layer_idx: this layer's entry in a :class:`KVCache`.
        device: parameter device.
        dtype: parameter dtype.
    """

    proj: nn.Module  # made by output_parts: the output projection or Identity, its dropout, the gate's scalar
    proj_drop: nn.Module
    gamma: Tensor  # with output_gate only

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        memory_dim: int | None = None,
        projection: Literal["packed", "split", "conv"] = "packed",
        qkv_bias: QkvBias = True,
        proj: bool = True,
        proj_bias: bool = True,
        output_gate: bool = False,
        qk_norm: QkNorm | None = None,
        qk_norm_bias: bool = True,
        qk_norm_affine: bool = True,
        qk_norm_unit_offset: bool = False,
        qk_norm_scope: QkNormScope = "head",
        qk_norm_after_rope: bool = False,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        cosine: bool = False,
        talking_heads: bool = False,
        relative: RelativeBias | None = None,
        cpb_hidden: int = 512,
        pretrained: int = 0,
        softcap: float | None = None,
        disentangled: bool = False,
        gated: bool = False,
        causal: bool = False,
        window: int | None = None,
        queries: int | None = None,
        global_tokens: GlobalTokens | None = None,
        global_projection: bool = False,
        grid: tuple[int, int] | None = None,
        grid_window: int | None = None,
        shift: int = 0,
        reduction: int | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = resolve_heads(dim, num_heads, num_kv_heads, head_dim)
        self.v_head_dim, self.output_gate = v_head_dim or self.head_dim, output_gate
        gqa, tiles = self.num_kv_heads != num_heads, (grid, grid_window, shift)
        check_parts(memory_dim, projection, relative, *tiles, queries, causal, gated, disentangled, gqa,
                    global_tokens, global_projection, reduction)  # fmt: skip
        self.global_tokens, self.global_projection = global_tokens, global_projection
        self.reduction = reduction
        self.cross = memory_dim is not None or reduction is not None  # a reduction attends to a copy of x
        self.projection, self.queries = projection, queries
        self.causal, self.window, self.layer_idx, self.attn_drop = causal, window, layer_idx, attn_drop
        self.scale = 1.0 if cosine else scale  # cosine attention folds its learned scale into the queries
        if disentangled and scale is None:  # DeBERTa scales its three terms by 1/sqrt(3 hd)
            self.scale = (3 * self.head_dim) ** -0.5
        self.cosine, self.talking_heads, self.softcap = cosine, talking_heads, softcap
        self.relative, self.pretrained = relative, pretrained
        self.gated, self.disentangled = gated, disentangled
        self.grid, self.grid_window, self.shift = grid, grid_window, shift
        hd, h = self.head_dim, num_heads
        self._projections(dim, memory_dim, qkv_bias, qk_norm, device, dtype)
        if global_projection:  # Longformer's query_global, key_global and value_global, packed
            self.qkv_global = packed_projection(self, dim, global_parts(self.parts), device, dtype)
        qk = {"bias": qk_norm_bias, "affine": qk_norm_affine, "unit_offset": qk_norm_unit_offset}
        self.qk_norm_after_rope = qk_norm_after_rope
        self.q_norm = head_norm(qk_norm, h, hd, norm_eps, qk_norm_scope, device, dtype, **qk)
        self.k_norm = head_norm(qk_norm, self.num_kv_heads, hd, norm_eps, qk_norm_scope, device, dtype, **qk)
        self._score_parameters(cpb_hidden, device, dtype)
        output_parts(self, h * self.v_head_dim, dim, (proj, proj_bias, output_gate), proj_drop, device, dtype)
        if reduction is not None:
            self.sr, self.norm = spatial_reduction(dim, reduction, norm_eps, device, dtype)

    def _score_parameters(
        self, cpb_hidden: int, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> None:
        """The parameters of the score parts: cosine attention's logit scale, Swin's table, Swin-V2's bias MLP or
        MViTv2's decomposed tables, talking heads' maps, ConViT's positional projection and gates."""
        h = self.num_heads
        if self.cosine:
            self.logit_scale = nn.Parameter(
                torch.full((h, 1, 1), math.log(10.0), device=device, dtype=dtype)
            )  # (H, 1, 1)
        if self.relative == "cpb":
            self.cpb_mlp = nn.Sequential(
                nn.Linear(2, cpb_hidden, device=device, dtype=dtype),
                nn.ReLU(inplace=True),
                nn.Linear(cpb_hidden, h, bias=False, device=device, dtype=dtype),
            )
        elif self.relative == "table":
            m = self.grid_window or 0
            self.relative_position_bias_table = nn.Parameter(
                torch.zeros((2 * m - 1) ** 2, h, device=device, dtype=dtype)
            )
        elif self.relative == "decomposed":
            (qh, qw), hd = self._extent, self.head_dim
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * qh - 1, hd, device=device, dtype=dtype))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * qw - 1, hd, device=device, dtype=dtype))
        if self.talking_heads:
            self.proj_l = nn.Linear(h, h, device=device, dtype=dtype)  # mixes the logits across heads
            self.proj_w = nn.Linear(h, h, device=device, dtype=dtype)  # mixes the probabilities across heads
        if self.gated:
            self.pos_proj = nn.Linear(3, h, device=device, dtype=dtype)  # an offset's score in each head
            self.gating_param = nn.Parameter(torch.ones(h, device=device, dtype=dtype))

    def _projections(
        self,
        dim: int,
        memory_dim: int | None,
        qkv_bias: QkvBias,
        qk_norm: QkNorm | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        """The q/k/v projections: ``qkv``; ``q`` and ``kv`` with a memory; ``q``, ``k``, ``v`` (split); or
        the 1x1 convs ``query``, ``key``, ``value`` (conv: SAGAN's, their weights (out, D, 1, 1)); and
        ``rope_together``: one RoPE call may rotate q and k (one ``qkv``, all heads one width, no QK-norm;
        tables of no heads: RoPE-Mixed's hold one per query head)."""
        hd, h, hkv, vd = self.head_dim, self.num_heads, self.num_kv_heads, self.v_head_dim
        self.rope_together = False
        self.native_rope: Any = None  # a native split_rotated, set while specvit generates (nn/decoding.py)
        bq, bk, bv = three_biases(qkv_bias)
        if self.projection == "conv":  # a map's 1x1 convs: SAGAN's f, g, h (g queries, f keys)
            self.query = nn.Conv2d(dim, h * hd, 1, bias=bq, device=device, dtype=dtype)
            self.key = nn.Conv2d(dim, hkv * hd, 1, bias=bk, device=device, dtype=dtype)
            self.value = nn.Conv2d(dim, hkv * vd, 1, bias=bv, device=device, dtype=dtype)
        elif self.projection == "split":
            self.q = Linear(dim, h * hd, bias=bq, device=device, dtype=dtype)
            self.k = Linear(dim, hkv * hd, bias=bk, device=device, dtype=dtype)
            self.v = Linear(dim, hkv * vd, bias=bv, device=device, dtype=dtype)
        elif self.cross:
            self.q = Linear(dim, h * hd, bias=bq, device=device, dtype=dtype)
            self.parts: Parts = (("k", hkv * hd, bk), ("v", hkv * vd, bv))
            self.kv = packed_projection(self, memory_dim or dim, self.parts, device, dtype)
        else:
            self.parts = (("q", h * hd, bq), ("k", hkv * hd, bk), ("v", hkv * vd, bv))
            self.rope_together = self.queries is None and vd == hd and qk_norm is None
            self.qkv = packed_projection(self, dim, self.parts, device, dtype)

    @property
    def _extent(self) -> tuple[int, int]:
        """What one query attends over on the grid: its window, or the whole grid."""
        if self.grid_window is not None:
            return (self.grid_window, self.grid_window)
        assert self.grid is not None
        return self.grid

    def _qkv(
        self, x: Tensor, pos: Tensor | None, rope: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, [G,] H, Nq, hd), keys (hd) and values (B, [G,] Hkv, L, vd) of the tokens x:
        (B, [G,] L, D), or of a (B, D, H, W) map (conv); with ``rope`` (if ``rope_together``) q and k rotated."""
        h, hkv, hd, vd = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        if self.projection == "conv":  # each 1x1 conv over the map, its H * W positions as tokens
            q, k, v = (to_tokens(conv(x)) for conv in (self.query, self.key, self.value))  # (B, N, out)
            return split_heads(q, hd), split_heads(k, hd), split_heads(v, vd)
        if self.projection == "split":
            q = self.q(x if self.queries is None else x[..., : self.queries, :])
            return split_heads(q, hd), split_heads(self.k(x), hd), split_heads(self.v(x), vd)
        rows = (h + hkv) * hd  # the q and k rows read x + pos
        qkv = project_positioned(self, x, pos, self.qkv, self.parts, rows)  # (B, N, (H + 2Hkv) * hd)
        if rope is not None:
            return (self.native_rope or split_rotated)(qkv, (h, hkv), hd, rope)
        q, k, v = split_parts(qkv, ((h, hd), (hkv, hd), (hkv, vd)))  # (B, [G,] H or Hkv, L, hd); values vd
        return (q if self.queries is None else q[..., : self.queries, :]), k, v

    def _memory(
        self,
        memory: Tensor | None,
        memory_pos: Tensor | None,
        memory_rope: tuple[Tensor, Tensor] | None,
        cache: KVCache | None,
    ) -> tuple[Tensor, Tensor]:
        """The memory's (B, Hkv, M, hd) keys (QK-normed, rotated) and values (vd); with a cache, computed once.
        With a spatial reduction the memory is the tokens, and their grid reduced is what the keys and values read."""
        if cache is not None and self.layer_idx in cache.memory:
            return cache.memory[self.layer_idx]
        assert memory is not None
        if self.reduction is not None:
            memory = reduce_tokens(memory, self.grid, self.sr, self.norm)  # (B, N, D) -> (B, M, D)
        hkv, hd, vd = self.num_kv_heads, self.head_dim, self.v_head_dim
        kv = project_positioned(self, memory, memory_pos, self.kv, self.parts, hkv * hd)  # (B, M, Hkv(hd+vd))
        k, v = split_parts(kv, ((hkv, hd), (hkv, vd)))  # (B, Hkv, M, hd), (B, Hkv, M, vd)
        k = normed_rotated(k, self.k_norm, memory_rope, self.qk_norm_after_rope)
        if cache is not None:
            cache.memory[self.layer_idx] = (k, v)
        return k, v

    def _relative_bias(self, q: Tensor) -> Tensor:
        """The layer's own relative position bias for queries q: (B, G*H, L, hd) -> broadcastable to the
        (B, G*H, L, L) scores (plus the region mask of shifted windows)."""
        h, (qh, qw), groups = self.num_heads, self._extent, q.shape[1] // self.num_heads
        length = qh * qw
        if self.relative == "decomposed":
            per_window = q.reshape(-1, h, length, self.head_dim)  # (B*G, H, L, hd)
            bias = decomposed_bias(per_window, self.rel_pos_h, self.rel_pos_w, (qh, qw))  # (B*G, H, L, L)
            return bias.view(q.shape[0], -1, length, length)  # (B, G*H, L, L)
        if self.relative == "cpb":
            table = self.cpb_mlp(cpb_coords(qh, self.pretrained, q.device).to(q.dtype))  # ((2M-1)^2, H)
        else:
            table = self.relative_position_bias_table
        return table_bias(table, qh, groups, self.relative == "cpb", self.grid, self.shift)  # (1, G*H, L, L)

    def _output(self, out: Tensor, b: int, shape: torch.Size) -> Tensor:
        """The heads' outputs (B, G*H, Nq, vd) through the output projection, the windows merged, times the
        gate: (B, Nq, D), or with conv projections a map of the input's ``shape`` (B, D, H, W)."""
        h, vd = self.num_heads, self.v_head_dim
        if self.grid_window is not None:
            assert self.grid is not None  # check_parts: windows need the grid
            out = out.unflatten(1, (-1, h)).transpose(2, 3).flatten(3)  # (B, G, L, H*vd)
            out = window_merge(self.proj_drop(self.proj(out)), self.grid, self.grid_window, self.shift)
        else:
            out = out.transpose(1, 2).reshape(b, out.shape[2], h * vd)  # (B, Nq, H*vd)
            out = self.proj_drop(self.proj(out))  # (B, Nq, D)
        if self.output_gate:  # SAGAN: gamma * o (the block adds x)
            out = self.gamma * out
        return to_map(out, (shape[2], shape[3])) if self.projection == "conv" else out  # (B, Nq, D), or a map

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, is_causal: bool, bias: Tensor | None
    ) -> Tensor:
        """q (B, G*H, Nq, hd) over k, v (B, G*Hkv, T, hd): SDPA, or the math path if a part needs the scores."""
        dropout_p = self.attn_drop if self.training else 0.0
        if self.talking_heads or self.softcap is not None or self.gated:
            mix = (self.proj_l, self.proj_w) if self.talking_heads else None
            scale, cap, gate = self.scale, self.softcap, self._gate(q)
            return attend_math(q, k, v, visible, is_causal, dropout_p, bias, scale, cap, mix, gate)
        return attend(q, k, v, visible, is_causal, dropout_p, bias, self.scale)  # (B, G*H, Nq, hd)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        bias: Tensor | None = None,
        pos: Tensor | None = None,
        cache: KVCache | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        memory_pos: Tensor | None = None,
        memory_rope: tuple[Tensor, Tensor] | None = None,
        rel_embed: Tensor | None = None,
        rel_index: Tensor | None = None,
        global_mask: Tensor | None = None,
    ) -> Tensor:
        """Attend x to itself (and to the cached tokens), or to the memory: (B, Nq, D) for the Nq queries.

        Args:
            x: (B, N, D) tokens, or a (B, D, H, W) map (conv projections).
            mask: (B, T) bool, True = padding key; T = cached + N with a cache. Queries are not masked.
            rope: ``(cos, sin)`` tables for the N new tokens (absolute positions cached .. cached + N - 1).
            bias: additive attention bias broadcastable to (B, H, N, T) (ALiBi, relative positions).
            pos: (B or 1, N, D) positions added to the input of the queries and keys only (DETR).
            cache: the model's KV cache; this layer's new keys/values are appended to its entry (a memory's
                are computed once). A causal layer lets query i (absolute position cached + i) see keys
                j <= cached + i, a non-causal one lets the new tokens see every cached and new key.
            memory: (B, M, Dm) memory tokens (with ``memory_dim``); not read once cached.
            memory_mask: (B, M) bool, True = padding memory token.
            memory_pos: (B or 1, M, Dm) positions added to the keys' input, not the values' (DETR).
            memory_rope: ``(cos, sin)`` tables of the M memory tokens: RoPE rotates the keys (CroCo).
            rel_embed: (2P, D) DeBERTa's relative table (with ``disentangled``).
            rel_index: (N, N) long, its row for each query and key.
            global_mask: (B, N) bool, True = a global token (with ``global_tokens="mask"``).
        """
        (b, n, _), hd = to_tokens(x).shape if self.projection == "conv" else x.shape, self.head_dim
        if self.grid_window is not None:
            assert self.grid is not None  # check_parts: windows need the grid
            x = window_split(x, self.grid, self.grid_window, self.shift)  # (B, G, L, D)
        together = rope is not None and self.rope_together and rope[0].dim() == 2  # one call, (N, r) tables
        if self.cross:
            q = split_heads(self.q(x if pos is None else x + pos), hd)  # (B, H, N, hd)
            k, v = self._memory(x if self.reduction else memory, memory_pos, memory_rope, cache)
        else:  # (B, [G,] H, Nq, hd), (B, [G,] Hkv, L, hd), (B, [G,] Hkv, L, hd)
            q, k, v = self._qkv(x, pos, rope if together else None)
        if not together:
            q = normed_rotated(q, self.q_norm, rope, self.qk_norm_after_rope)
            k = k if self.cross else normed_rotated(k, self.k_norm, rope, self.qk_norm_after_rope)
        if self.cosine:
            q, k = cosine_qk(q, k, self.logit_scale)
        if self.grid_window is not None:  # windows and heads as one 4D attention, which every SDPA takes
            q, k, v = q.flatten(1, 2), k.flatten(1, 2), v.flatten(1, 2)  # (B, G*H, L, hd)
        past, first = 0, 0  # query i sits at absolute position past + i, key j at first + j
        if cache is not None and not self.cross:
            past, first, k, v = self._append(cache, k, v, n)  # keys and values (B, Hkv, T, hd)
        t = k.shape[2]
        if bias is not None and bias.shape[-1] != t:
            bias = bias[..., -t:]  # the keys still held: (B or 1, H, N or 1, T)
        if self.relative is not None:
            own = self._relative_bias(q)  # (1 or B, G*H, L, L)
            bias = own if bias is None else bias + own
        if self.disentangled:
            own = disentangled_scores(self, q, k, rel_embed, rel_index)  # (B, H, N, N)
            bias = own if bias is None else bias + own
        visible, is_causal = None, False  # visible: broadcastable to (B, 1, N, T), True = may attend
        if self.causal or self.window is not None or mask is not None or memory_mask is not None:
            sizes, masks = (b, n, t, past, first), (mask, memory_mask)
            visible, is_causal = visible_mask(
                self.causal, self.window, sizes, masks, cache, bias is None, q.device
            )
        if self.global_tokens is not None:  # Longformer: every token sees the global tokens, they see all
            rows = global_rows(self.global_tokens, global_mask, n, x.device)  # (B or 1, N)
            visible = global_keys(visible, rows, mask, not self.global_projection)
        out = self._attend(q, k, v, visible, is_causal, bias)  # (B, G*H, Nq, hd)
        if self.global_projection:  # the global rows again through their own q, k, v
            out = global_attention(self, x, out, rows, mask, pos, rope, bias)  # (B, H, N, hd)
        if cache is not None and self.causal:
            cache.bound(self.layer_idx, self.window)
        return self._output(out, b, x.shape)  # (B, Nq, D), or a (B, D, H, W) map

    def _append(self, cache: KVCache, k: Tensor, v: Tensor, n: int) -> tuple[int, int, Tensor, Tensor]:
        """The new keys and values appended to this layer's cache entry: the absolute positions of the first
        new query and of the first key held, and the keys and values held (B, Hkv, T, hd)."""
        past = cache.length(self.layer_idx)
        k, v = cache.append(self.layer_idx, k, v)  # (B, Hkv, T, hd)
        return past, past + n - k.shape[2], k, v

    def _gate(self, q: Tensor) -> tuple[Tensor, Tensor] | None:
        """ConViT's positional weights (1, H, N, N) over the grid's offsets and the per-head gates (H, 1, 1),
        or None without gated positions."""
        if not self.gated:
            return None
        assert self.grid is not None  # check_parts: gated positions need the grid
        offsets = grid_offsets(self.grid, q.device).to(q.dtype)  # (N, N, 3)
        positional = self.pos_proj(offsets).permute(2, 0, 1).softmax(dim=-1)  # (H, N, N)
        return positional[None], torch.sigmoid(self.gating_param).view(-1, 1, 1)

    def extra_repr(self) -> str:
        parts = [f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"]
        parts += [f"v_head_dim={self.v_head_dim}"] * (self.v_head_dim != self.head_dim)
        parts += ["memory=True"] * (self.cross and self.reduction is None)
        parts.append(f"causal={self.causal}, window={self.window}, attn_drop={self.attn_drop}")
        named = ("queries", "global_tokens", "grid", "grid_window", "relative", "softcap", "reduction")
        parts += [f"{n}={getattr(self, n)}" for n in named if getattr(self, n) is not None]
        flags = ("cosine", "talking_heads", "disentangled", "gated", "output_gate")
        parts += [n for n in flags if getattr(self, n)]
        return ", ".join(parts + [f"shift={self.shift}"] * bool(self.shift))


SelfAttention = Attention
"""The core with its defaults is multi-head self-attention (the name models and tests have used)."""


class CrossAttention(Attention):
    """The core attending from the tokens to a memory of width ``memory_dim`` (None = D); keyword
    arguments as :class:`Attention`'s."""

    def __init__(self, dim: int, num_heads: int, *, memory_dim: int | None = None, **kwargs: Any) -> None:
        super().__init__(dim, num_heads, memory_dim=dim if memory_dim is None else memory_dim, **kwargs)
