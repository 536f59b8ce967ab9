"""Random masking of patch tokens and the masked-patch pixel loss (MAE, He et al. 2021).

The conventions are MAE's (and HF ``ViTMAEForPreTraining``'s): per sample, patches are shuffled by the
``argsort`` of uniform noise, the first ``keep`` of the shuffle stay visible, ``ids_restore`` (the
``argsort`` of the shuffle) puts them back in place, and the mask is 1 where a patch was removed.

Dim legend: B batch, N patches, L visible patches, D width, P pixels per patch (ph * pw * C).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = [
    "MaskTokens",
    "drop_prefix",
    "keep_tokens",
    "masked_patch_mse",
    "masked_patches",
    "patchify",
    "random_shuffle",
    "restore_ids",
]


def random_shuffle(x: Tensor, noise: Tensor | None = None) -> Tensor:
    """A random order of the patches per sample: the ``argsort`` of ``noise`` (drawn uniform if None).

    Args:
        x: (B, N, D) the patch tokens (for the sizes and device).
        noise: (B, N) the noise to sort, for reproducible masks; None draws ``torch.rand``.

    Returns:
        (B, N) long ``ids_shuffle``: the patches in the order they are kept.
    """
    if noise is None:
        noise = torch.rand(x.shape[0], x.shape[1], device=x.device)  # (B, N)
    return torch.argsort(noise, dim=1)


def restore_ids(ids_shuffle: Tensor) -> Tensor:
    """(B, N) ``ids_restore``: where each patch went in the shuffle, so ``gather`` undoes it."""
    return torch.argsort(ids_shuffle, dim=1)


def keep_tokens(x: Tensor, ids_shuffle: Tensor, keep: int) -> Tensor:
    """The visible tokens: the first ``keep`` of the shuffle, (B, N, D) -> (B, L, D) with L = keep."""
    ids_keep = ids_shuffle[:, :keep]  # (B, L)
    return torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, x.shape[2]))


def masked_patches(ids_restore: Tensor, keep: int) -> Tensor:
    """(B, N) float mask, 1 where a patch is removed: patch ``i`` is masked when its place in the
    shuffle, ``ids_restore[:, i]``, is past the first ``keep``."""
    return (ids_restore >= keep).float()


def patchify(images: Tensor, patch: tuple[int, int]) -> Tensor:
    """Images as per-patch pixel vectors, (B, C, H, W) -> (B, N, ph * pw * C), pixels in (row, col,
    channel) order within a patch (MAE's ``patchify``)."""
    b, c, h, w = images.shape
    ph, pw = patch
    x = images.reshape(b, c, h // ph, ph, w // pw, pw)  # (B, C, gh, ph, gw, pw)
    x = x.permute(0, 2, 4, 3, 5, 1)  # (B, gh, gw, ph, pw, C)
    return x.reshape(b, (h // ph) * (w // pw), ph * pw * c)


def masked_patch_mse(
    pred: Tensor, images: Tensor, mask: Tensor, patch: tuple[int, int], norm_pix: bool = False
) -> Tensor:
    """MAE's loss: the mean squared error of each patch's pixels, averaged over the masked patches only.

    Args:
        pred: (B, N, P) predicted pixels per patch.
        images: (B, C, H, W) the images the encoder read.
        mask: (B, N) 1 where a patch was removed.
        patch: (ph, pw) patch size.
        norm_pix: normalise each target patch by its mean and (unbiased) variance first (``norm_pix_loss``).

    Returns:
        The scalar loss.
    """
    target = patchify(images, patch)  # (B, N, P)
    if norm_pix:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    loss = ((pred - target) ** 2).mean(dim=-1)  # (B, N)
    return (loss * mask).sum() / mask.sum()


class MaskTokens(nn.Module):
    """Put a learned mask token in every removed patch's place and undo the shuffle (MAE's decoder input).

    Args:
        dim: width D of the tokens.
        prefix: leading tokens (the class token) that pass through in front.
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        dim: int,
        prefix: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.prefix = dim, prefix
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim, device=device, dtype=dtype))

    def forward(self, x: Tensor, *, ids_restore: Tensor) -> Tensor:
        """(B, prefix + L, D) visible tokens and (B, N) ``ids_restore`` -> (B, prefix + N, D) in patch order."""
        b, n = ids_restore.shape
        visible = x[:, self.prefix :]  # (B, L, D)
        masked = self.mask_token.expand(b, n - visible.shape[1], -1)  # (B, N - L, D)
        shuffled = torch.cat((visible, masked), dim=1)  # (B, N, D) in shuffle order
        index = ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[2])  # (B, N, D)
        tokens = torch.gather(shuffled, 1, index)  # (B, N, D) in patch order
        return torch.cat((x[:, : self.prefix], tokens), dim=1)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, prefix={self.prefix}"


def drop_prefix(x: Tensor, prefix: int) -> Tensor:
    """The tokens after the first ``prefix`` (the class token): (B, prefix + N, D) -> (B, N, D)."""
    return x[:, prefix:]
