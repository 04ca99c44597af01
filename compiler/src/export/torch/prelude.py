
import argparse
import json
import math
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- fusec's builtins that are not one PyTorch call ----


def rms_norm(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, theta):
    """Rotary embedding of [..., T, H, D] heads, "rotate half" pairs (i, i + D/2)."""
    T, D = x.shape[-3], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D // 2, dtype=torch.float64, device=x.device) * 2 / D)
    angle = torch.arange(T, dtype=torch.float64, device=x.device)[:, None] * inv_freq
    cos = angle.cos()[:, None, :].to(x.dtype)
    sin = angle.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def attention(q, k, v, lengths=None, causal=False, scale=None, dropout=0.0, training=False):
    """Attention over heads laid out [B, T, H, D], as fusec lays them out (SDPA wants [B, H, T, D]);
    keys at or past lengths[b] (i32 [B]) are padding, as a key-padding mask; dropout on the
    probabilities while training."""
    mask = None
    if lengths is not None:
        T, S = q.shape[-3], k.shape[-3]
        keys = torch.arange(S, device=q.device)
        mask = (keys[None, :] < lengths.long()[:, None])[:, None, None, :]
        if causal:
            mask = mask & torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    y = F.scaled_dot_product_attention(
        q.transpose(-3, -2),
        k.transpose(-3, -2),
        v.transpose(-3, -2),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=q.shape[-2] != k.shape[-2],
        dropout_p=dropout if training else 0.0,
    )
    return y.transpose(-3, -2)


def causal_mask(scores, fill=float("-inf")):
    """Entries above the diagonal of the last two axes set to `fill`."""
    T, S = scores.shape[-2], scores.shape[-1]
    above = torch.ones(T, S, dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(above, fill)


def conv2d_nhwc(x, weight, stride, padding):
    """Convolution of [B, H, W, Cin] by a [KH, KW, Cin, Cout] kernel, giving [B, Ho, Wo, Cout]."""
    y = F.conv2d(x.permute(0, 3, 1, 2), weight.permute(3, 2, 0, 1), stride=stride, padding=padding)
    return y.permute(0, 2, 3, 1)


# ---- the model file's blocks, one class per distinct block instance ----
