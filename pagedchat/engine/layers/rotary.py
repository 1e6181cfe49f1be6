"""Rotary position embedding: a table of cos and signed sin per position, made once from the model's own
rotary module, and the rotation of q and k by it."""

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by its rows' rotary tables [T, D]: transformers' rotary, as
    rotate_half(x) * sin == roll(x, D / 2) * (sin with its first half negated), exactly."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed[:, None]
