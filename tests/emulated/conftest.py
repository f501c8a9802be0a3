"""These tests run inside `mirage run --gpus-per-node 4` (see tests/test_emulated_suite.py)."""

import torch

assert torch.cuda.is_available(), "tests/emulated must run under mirage run"
