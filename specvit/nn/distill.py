"""DeiT's distilled head output (Touvron et al., 2021): the class-token and distillation-token logits.

Dim legend: B batch, C classes.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["DistilledLogits"]


class DistilledLogits(nn.Module):
    """The output of a head with two classifiers, one on the class token and one on the distillation token.

    In eval, and in training unless ``distilled_training`` is set, the average ``(x + dist) / 2`` (timm's
    ``VisionTransformerDistilled``); in training with ``distilled_training = True``, the pair ``(x, dist)``,
    the class logits for the label loss and the distillation logits for the teacher's.

    Attributes:
        distilled_training: return both logits in training mode (timm's flag of the same name).
    """

    def __init__(self) -> None:
        super().__init__()
        self.distilled_training = False

    def forward(self, x: Tensor, *, dist: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """x: (B, C) class-token logits; dist: (B, C) distillation-token logits."""
        if self.distilled_training and self.training:
            return x, dist  # ((B, C), (B, C))
        return (x + dist) / 2  # (B, C)

    def extra_repr(self) -> str:
        return f"distilled_training={self.distilled_training}"
