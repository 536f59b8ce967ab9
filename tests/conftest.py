"""Test-session settings shared by every test file."""

from __future__ import annotations

import os

import torch

# timm imports torchvision, whose C++ ops do not load on the CPU-only torch wheel: define the two op
# schemas its Python side registers fake kernels for, so that `import timm` works and builds every model.
# timm is a reference only; nothing in specvit imports it.
_TORCHVISION = torch.library.Library("torchvision", "DEF")
_TORCHVISION.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_TORCHVISION.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` runs two workers on this project's two cores: one thread each, not two threads each
    # fighting over both cores (which made the training tests three times slower). No test depends on the
    # thread count: exactness tests compare in float64 and learning tests keep wide margins.
    torch.set_num_threads(1)
