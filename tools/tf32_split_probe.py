#!/usr/bin/env python3
"""What fusec's f32 GEMMs rest on (kernels/gemm/split_tf32.cuh), measured
with PyTorch on a GPU: cuBLAS's f32 product against one TF32 product over
K tripled, its operands split into (hi, lo, hi) and (hi, hi, lo) with hi
rounded to TF32, and against one TF32 product of the raw operands: time
and largest error over the largest value of an f64 product. "lo-only"
leaves hi to the GEMM's own conversion of a raw f32 (lo = x - x
truncated), which is only right if cuBLAS truncates.

    python3 tools/tf32_split_probe.py
"""
import torch, time
torch.manual_seed(0)
dev = "cuda"
def hi_of(x):
    b = x.view(torch.int32)
    r = ((b + 0x1000) & ~0x1fff)
    return r.view(torch.float32)
def bench(f, n=20):
    for _ in range(3): f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3
for (m, n, k) in [(2048, 4096, 1024), (2048, 1024, 4096), (2048, 3072, 1024), (1024, 4096, 2048), (4096, 1024, 2048), (16384, 4096, 1024)]:
    a = torch.randn(m, k, device=dev); b = torch.randn(k, n, device=dev)
    ref = (a.double() @ b.double())
    scale = ref.abs().max().item()
    torch.backends.cuda.matmul.allow_tf32 = False
    t32 = bench(lambda: a @ b); e32 = ((a @ b).double() - ref).abs().max().item() / scale
    torch.backends.cuda.matmul.allow_tf32 = True
    ah = hi_of(a); al = a - ah; bh = hi_of(b); bl = b - bh
    A = torch.cat([ah, al, ah], 1).contiguous(); B = torch.cat([bh, bh, bl], 0).contiguous()
    t3 = bench(lambda: A @ B); e3 = ((A @ B).double() - ref).abs().max().item() / scale
    def split():
        ah = hi_of(a); al = a - ah; bh = hi_of(b); bl = b - bh
        return torch.cat([ah, al, ah], 1), torch.cat([bh, bh, bl], 0)
    ts = bench(split)
    # lo only, relying on the GEMM's own conversion of a raw f32
    A2 = torch.cat([a, a - (a.view(torch.int32) & ~0x1fff).view(torch.float32), a], 1)
    B2 = torch.cat([b, b, b - (b.view(torch.int32) & ~0x1fff).view(torch.float32)], 0)
    e3t = ((A2 @ B2).double() - ref).abs().max().item() / scale
    t1 = bench(lambda: a @ b); e1 = ((a @ b).double() - ref).abs().max().item() / scale
    fl = 2 * m * n * k / 1e9
    print(f"m={m} n={n} k={k}: fp32 {t32:.3f} ms ({fl/t32:.0f} TF/s) err {e32:.2e} | 3xTF32 K'=3K {t3:.3f} ms ({fl/t3:.0f} eff TF/s) err {e3:.2e} (lo-only/trunc {e3t:.2e}) | torch split {ts:.3f} ms | 1xTF32 {t1:.3f} ms err {e1:.2e}")
