"""An independent, functional reference of the Swin Transformer forward pass (Liu et al., 2021).

"Swin Transformer: Hierarchical Vision Transformer using Shifted Windows", https://arxiv.org/abs/2103.14030.
Written from the paper's algorithm as plain torch functions over a state dict named as timm's
``SwinTransformer`` names it (timm >= 0.9), so that tests can check specvit's Swin without timm and without
sharing any of specvit's code (attention is an explicit ``softmax(q k^T * scale + bias + mask) @ v``, no SDPA).

Conventions (those of timm's ``timm/models/swin_transformer.py``, which the fixture's logits come from):

- patch embedding: a ``patch_size`` x ``patch_size`` convolution with stride ``patch_size``, then
  LayerNorm (``patch_embed.proj``, ``patch_embed.norm``); features stay NHWC inside the stages;
- stage ``s`` >= 1 starts with patch merging (``layers.{s}.downsample``): the 2x2 neighbours are
  concatenated on channels in the order ``x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], x[1::2, 1::2]``
  (row offset fastest), then LayerNorm(4C) and a bias-free Linear 4C -> 2C;
- blocks alternate W-MSA (even index) and SW-MSA (odd index, shift ``window_size // 2``); when a stage's
  resolution is <= the window size, the window becomes the whole resolution and the shift is 0;
- the shifted windows are masked with -100.0 between tokens from different regions of the rolled map;
- the relative position bias of heads ``h`` between tokens ``i``, ``j`` of a window is
  ``table[(dy + Wh - 1) * (2 * Ww - 1) + (dx + Ww - 1), h]`` with ``(dy, dx) = pos_i - pos_j``;
- head: final LayerNorm, global average pool over H and W, then ``head.fc``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "relative_position_index",
    "shifted_window_mask",
    "swin_forward",
    "swin_num_params",
    "window_partition",
    "window_reverse",
]

MASK_VALUE = -100.0


def window_partition(x: Tensor, window: int) -> Tensor:
    """Split a feature map into non-overlapping square windows.

    Args:
        x: ``(B, H, W, C)``, ``H`` and ``W`` multiples of ``window``.
        window: the side of a window.

    Returns:
        ``(B * nH * nW, window * window, C)``, windows in row-major order within each image, tokens in
        row-major order within each window.
    """
    b, h, w, c = x.shape
    x = x.reshape(b, h // window, window, w // window, window, c)  # B, nH, wh, nW, ww, C
    x = x.permute(0, 1, 3, 2, 4, 5)  # B, nH, nW, wh, ww, C
    return x.reshape(b * (h // window) * (w // window), window * window, c)  # B*nH*nW, wh*ww, C


def window_reverse(windows: Tensor, window: int, h: int, w: int) -> Tensor:
    """Inverse of :func:`window_partition`.

    Args:
        windows: ``(B * nH * nW, window * window, C)``.
        window: the side of a window.
        h: height of the feature map.
        w: width of the feature map.

    Returns:
        ``(B, H, W, C)``.
    """
    c = windows.shape[-1]
    x = windows.reshape(-1, h // window, w // window, window, window, c)  # B, nH, nW, wh, ww, C
    x = x.permute(0, 1, 3, 2, 4, 5)  # B, nH, wh, nW, ww, C
    return x.reshape(-1, h, w, c)  # B, H, W, C


def relative_position_index(window: int) -> Tensor:
    """Index into the relative position bias table for every pair of tokens in a window.

    Args:
        window: the side of a window.

    Returns:
        ``(window**2, window**2)`` int64: entry ``[i, j]`` is ``(dy + window - 1) * (2 * window - 1) +
        (dx + window - 1)`` where ``(dy, dx)`` is the (row, column) position of token ``i`` minus that of
        token ``j``, tokens in row-major order.
    """
    pos = torch.arange(window * window)
    rows, cols = pos // window, pos % window  # (N,), (N,)
    dy = rows[:, None] - rows[None, :]  # N, N, in [-(window - 1), window - 1]
    dx = cols[:, None] - cols[None, :]  # N, N
    return (dy + window - 1) * (2 * window - 1) + (dx + window - 1)


def shifted_window_mask(h: int, w: int, window: int, shift: int) -> Tensor:
    """Additive attention mask of the shifted windows.

    After the cyclic shift by ``-shift`` on both axes, a window at the bottom or right edge holds tokens
    that were not neighbours in the image. The rolled map is cut into up to 3 x 3 regions (rows
    ``[0, h - window)``, ``[h - window, h - shift)``, ``[h - shift, h)``, and the same for columns); tokens
    of a window may only attend to tokens of the same region.

    Args:
        h: height of the feature map.
        w: width of the feature map.
        window: the side of a window.
        shift: the cyclic shift (> 0).

    Returns:
        ``(nH * nW, window**2, window**2)`` float32: 0 within a region, ``-100.0`` across regions.
    """
    row_region = torch.zeros(h, dtype=torch.long)
    row_region[h - window : h - shift] = 1
    row_region[h - shift :] = 2
    col_region = torch.zeros(w, dtype=torch.long)
    col_region[w - window : w - shift] = 1
    col_region[w - shift :] = 2
    region = row_region[:, None] * 3 + col_region[None, :]  # H, W
    region_windows = window_partition(region[None, :, :, None], window)[..., 0]  # nH*nW, N
    different = region_windows[:, :, None] != region_windows[:, None, :]  # nH*nW, N, N
    return torch.where(different, MASK_VALUE, 0.0).to(torch.float32)


def _stage_window_shift(resolution: int, window_size: int) -> tuple[int, int]:
    """Window side and shift of a stage's shifted blocks: no partition nor shift if the map fits a window."""
    if resolution <= window_size:
        return resolution, 0
    return window_size, window_size // 2


def _window_attention(
    state: dict[str, Tensor], prefix: str, x: Tensor, num_heads: int, window: int, shift: int
) -> Tensor:
    """(S)W-MSA of one block on an already normalised map.

    Args:
        state: the state dict.
        prefix: ``layers.{s}.blocks.{i}.attn.``.
        x: ``(B, H, W, C)``.
        num_heads: number of heads.
        window: window side.
        shift: cyclic shift, 0 for W-MSA.

    Returns:
        ``(B, H, W, C)``.
    """
    b, h, w, c = x.shape
    if h % window or w % window:
        raise ValueError(f"feature map {h}x{w} is not a multiple of the window {window}")
    head_dim = c // num_heads
    n = window * window

    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    windows = window_partition(x, window)  # B*nW, N, C
    bw = windows.shape[0]

    qkv = F.linear(windows, state[prefix + "qkv.weight"], state.get(prefix + "qkv.bias"))  # B*nW, N, 3C
    qkv = qkv.reshape(bw, n, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)  # 3, B*nW, nh, N, hd
    q, k, v = qkv[0], qkv[1], qkv[2]  # each B*nW, nh, N, hd

    scores = (q * head_dim**-0.5) @ k.transpose(-2, -1)  # B*nW, nh, N, N

    table = state[prefix + "relative_position_bias_table"]  # (2w-1)^2, nh
    if table.shape != ((2 * window - 1) ** 2, num_heads):
        raise ValueError(f"{prefix}relative_position_bias_table has shape {tuple(table.shape)}")
    index = relative_position_index(window).to(table.device)  # N, N
    stored_index = state.get(prefix + "relative_position_index")
    if stored_index is not None and not torch.equal(stored_index.to(index), index):
        raise ValueError(f"{prefix}relative_position_index differs from the reference's")
    bias = table[index.reshape(-1)].reshape(n, n, num_heads).permute(2, 0, 1)  # nh, N, N
    scores = scores + bias[None]

    if shift:
        mask = shifted_window_mask(h, w, window, shift).to(scores)  # nW, N, N
        stored_mask = state.get(prefix.removesuffix("attn.") + "attn_mask")
        if stored_mask is not None and not torch.equal(stored_mask.to(mask), mask):
            raise ValueError(f"{prefix}attn_mask differs from the reference's")
        nw = mask.shape[0]
        scores = scores.reshape(b, nw, num_heads, n, n) + mask[None, :, None]  # B, nW, nh, N, N
        scores = scores.reshape(bw, num_heads, n, n)  # B*nW, nh, N, N

    attn = torch.softmax(scores, dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(bw, n, c)  # B*nW, N, C (heads concatenated)
    out = F.linear(out, state[prefix + "proj.weight"], state[prefix + "proj.bias"])

    out = window_reverse(out, window, h, w)  # B, H, W, C
    if shift:
        out = torch.roll(out, shifts=(shift, shift), dims=(1, 2))
    return out


def _block(
    state: dict[str, Tensor], prefix: str, x: Tensor, num_heads: int, window: int, shift: int, eps: float
) -> Tensor:
    """One Swin block: ``x + (S)W-MSA(LN(x))`` then ``x + MLP(LN(x))``, on ``(B, H, W, C)``."""
    c = x.shape[-1]
    y = F.layer_norm(x, (c,), state[prefix + "norm1.weight"], state[prefix + "norm1.bias"], eps)
    x = x + _window_attention(state, prefix + "attn.", y, num_heads, window, shift)
    y = F.layer_norm(x, (c,), state[prefix + "norm2.weight"], state[prefix + "norm2.bias"], eps)
    y = F.linear(y, state[prefix + "mlp.fc1.weight"], state[prefix + "mlp.fc1.bias"])
    y = F.gelu(y)  # exact (erf) GELU, torch.nn.GELU's default
    y = F.linear(y, state[prefix + "mlp.fc2.weight"], state[prefix + "mlp.fc2.bias"])
    return x + y


def _patch_merging(state: dict[str, Tensor], prefix: str, x: Tensor, eps: float) -> Tensor:
    """Patch merging: ``(B, H, W, C)`` -> ``(B, H/2, W/2, 2C)``."""
    _, h, w, c = x.shape
    if h % 2 or w % 2:
        raise ValueError(f"patch merging needs an even feature map, got {h}x{w}")
    x = torch.cat(
        [x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1
    )  # B, H/2, W/2, 4C
    x = F.layer_norm(x, (4 * c,), state[prefix + "norm.weight"], state[prefix + "norm.bias"], eps)
    return F.linear(x, state[prefix + "reduction.weight"])  # B, H/2, W/2, 2C


def swin_forward(
    state: dict[str, Tensor],
    x: Tensor,
    *,
    embed_dim: int,
    depths: Sequence[int],
    num_heads: Sequence[int],
    window_size: int = 7,
    patch_size: int = 4,
    mlp_ratio: float = 4.0,
    eps: float = 1e-5,
) -> Tensor:
    """Logits of a Swin Transformer classifier.

    Args:
        state: parameters named as timm's ``SwinTransformer.state_dict()`` (timm >= 0.9, downsample at
            the start of stages 1..); buffers ``relative_position_index`` / ``attn_mask``, when present,
            are checked against the reference's own.
        x: images ``(B, 3, H, W)``.
        embed_dim: channels of stage 0 (doubled at each later stage).
        depths: blocks per stage.
        num_heads: heads per stage.
        window_size: window side (before clipping to a stage's resolution).
        patch_size: side of the patches of the stem.
        mlp_ratio: MLP hidden width over the block width (checked against ``mlp.fc1.weight``).
        eps: LayerNorm epsilon.

    Returns:
        ``(B, num_classes)``.
    """
    if len(depths) != len(num_heads):
        raise ValueError("depths and num_heads must have the same length")

    # stem: non-overlapping patches, linear projection, LayerNorm
    x = F.conv2d(x, state["patch_embed.proj.weight"], state["patch_embed.proj.bias"], stride=patch_size)
    x = x.permute(0, 2, 3, 1)  # B, H/p, W/p, E (NHWC from here on)
    x = F.layer_norm(x, (embed_dim,), state["patch_embed.norm.weight"], state["patch_embed.norm.bias"], eps)

    for s, (depth, heads) in enumerate(zip(depths, num_heads, strict=True)):
        if s > 0:
            x = _patch_merging(state, f"layers.{s}.downsample.", x, eps)
        dim = embed_dim * 2**s
        if x.shape[-1] != dim:
            raise ValueError(f"stage {s} has {x.shape[-1]} channels, expected {dim}")
        h, w = x.shape[1], x.shape[2]
        if h != w:
            raise ValueError("the reference handles square feature maps only")
        window, shift = _stage_window_shift(h, window_size)
        for i in range(depth):
            prefix = f"layers.{s}.blocks.{i}."
            hidden = state[prefix + "mlp.fc1.weight"].shape[0]
            if hidden != int(dim * mlp_ratio):
                raise ValueError(f"{prefix}mlp.fc1 has {hidden} outputs, expected {int(dim * mlp_ratio)}")
            x = _block(state, prefix, x, heads, window, shift if i % 2 == 1 else 0, eps)

    x = F.layer_norm(x, (x.shape[-1],), state["norm.weight"], state["norm.bias"], eps)  # B, h, w, Cf
    x = x.mean(dim=(1, 2))  # B, Cf
    return F.linear(x, state["head.fc.weight"], state["head.fc.bias"])  # B, num_classes


def swin_num_params(
    *,
    embed_dim: int,
    depths: Sequence[int],
    num_heads: Sequence[int],
    num_classes: int = 1000,
    img_size: int = 224,
    window_size: int = 7,
    patch_size: int = 4,
    in_chans: int = 3,
    mlp_ratio: float = 4.0,
) -> int:
    """Number of parameters (not buffers) of timm's ``SwinTransformer`` with this configuration.

    The relative position bias table of a stage is ``(2w - 1)^2 x heads`` with ``w`` the window side after
    clipping to the stage's resolution.
    """
    e = embed_dim
    total = in_chans * patch_size * patch_size * e + e + 2 * e  # patch_embed.proj + patch_embed.norm
    resolution = img_size // patch_size
    for s, (depth, heads) in enumerate(zip(depths, num_heads, strict=True)):
        c = e * 2**s
        if s > 0:
            total += 2 * (2 * c) + (2 * c) * c  # downsample.norm (4C_in = 2C) + reduction (2C -> C)
            resolution //= 2
        window, _ = _stage_window_shift(resolution, window_size)
        hidden = int(c * mlp_ratio)
        per_block = (
            2 * c  # norm1
            + 3 * c * c
            + 3 * c  # attn.qkv
            + (2 * window - 1) ** 2 * heads  # attn.relative_position_bias_table
            + c * c
            + c  # attn.proj
            + 2 * c  # norm2
            + c * hidden
            + hidden  # mlp.fc1
            + hidden * c
            + c  # mlp.fc2
        )
        total += depth * per_block
    features = e * 2 ** (len(depths) - 1)
    total += 2 * features  # norm
    total += features * num_classes + num_classes  # head.fc
    return total
