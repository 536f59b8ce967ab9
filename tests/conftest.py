"""Test-session settings shared by every test file."""

from __future__ import annotations

import os

import torch

from specvit.interop.compat import torchvision_ops

# timm (and many transformers classes) import torchvision, whose C++ ops do not load on the CPU-only torch
# wheel: specvit's hook defines the two op schemas its import needs (`import specvit` installs it too).
torchvision_ops()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` runs two workers on this project's two cores: one thread each, not two threads each
    # fighting over both cores (which made the training tests three times slower). No test depends on the
    # thread count: exactness tests compare in float64 and learning tests keep wide margins.
    torch.set_num_threads(1)
