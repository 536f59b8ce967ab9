"""Test-session settings shared by every test file."""

from __future__ import annotations

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` runs two workers on this project's two cores: one thread each, not two threads each
    # fighting over both cores (which made the training tests three times slower). No test depends on the
    # thread count: exactness tests compare in float64 and learning tests keep wide margins.
    torch.set_num_threads(1)
