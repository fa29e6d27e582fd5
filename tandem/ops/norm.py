"""RMS norms of Qwen3.5.

- `rms_norm_1p`: zero-centred weight, `x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in fp32.
- `gated_rms_norm`: the GDN output norm, plain weight, applied per value head before the gate:
  `w * rms(o) * silu(z)`.
"""

import torch
import torch.nn.functional as F


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # weight multiplies in the model dtype, the gate in fp32 (as the reference implementation does)
    return ((weight * normed) * F.silu(z.float())).to(x.dtype)
