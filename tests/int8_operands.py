"""Random INT8 GEMM operands and the exact reference both INT8 GEMM kernels must equal bit for bit."""

import torch


def operands(m, n, k, *, bias_dtype=None, seed=0, device="cpu"):
    """Codes a (m, k) and w (n, k) in [-127, 127], scales a_scale (m, 1) and w_scale (n,), a bias (n,) or None."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    a_scale = torch.rand(m, 1, generator=g) * 1e-2 + 1e-4
    w_scale = torch.rand(n, generator=g) * 1e-2 + 1e-4
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    return tuple(None if t is None else t.to(device) for t in (a, a_scale, w, w_scale, bias))


def reference(a, a_scale, w, w_scale, bias, out_dtype):
    """Exact integer product (int64), then the kernels' epilogue: acc * a_scale * w_scale, + bias, in fp32."""
    acc = (a.cpu().long() @ w.cpu().long().t()).float()
    out = acc * a_scale.cpu().reshape(-1, 1) * w_scale.cpu().reshape(-1)
    if bias is not None:
        out = out + bias.cpu().float()
    return out.to(out_dtype)
