"""Launch each FP8 kernel of interest a few times at the 30B shape, for ncu (-k regex, launch-skip)."""
import torch
from kernels.fp8 import grouped_gemm as G
from kernels.fp8 import quant as Q
from kernels.mega_moe.routing import sort_by_expert, tile_table
from bench.fp8_gemm_variants import _xk

dev, T, top_k, E, D, F = "cuda", 16384, 8, 128, 2048, 768
Nr = T * top_k
ids = (torch.arange(T, device=dev)[:, None] * top_k + torch.arange(top_k, device=dev)) % E
slots, offs = sort_by_expert(ids, E)
x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
w1, w3 = ((torch.randn(E, F, D, device=dev) * 0.02).to(torch.bfloat16) for _ in range(2))
w2 = (torch.randn(E, D, F, device=dev) * 0.02).to(torch.bfloat16)
xq, xs = Q.quantize_rowwise(x)
(w1q, w1s), (w3q, w3s), (w2q, w2s) = Q.quantize_weight(w1), Q.quantize_weight(w3), Q.quantize_weight(w2)
for lag in (False, True):
    for _ in range(2):
        _, _, (aq, as_) = G.fp8_gate_up_swiglu(xq, xs, w1q, w1s, w3q, w3s, slots, offs, top_k, quantize_a=True,
                                               store_a=False, lag_promotion=lag)
for lag in (False, True):
    for _ in range(2):
        G.fp8_grouped_gemm(aq, as_, w2q, w2s, offs, lag_promotion=lag)
bm = 128
tiles = tile_table(offs, Nr, bm)
nt = tiles.shape[1]
out = torch.empty(Nr, D, device=dev, dtype=torch.bfloat16)
for mode in (1, 2):
    for _ in range(2):
        _xk[(nt * (D // 128),)](aq, as_, w2q, w2s, out, offs, tiles, nt, D, F, None, None, BLOCK_M=bm, BLOCK_N=128,
                                MODE=mode, TMA=False, WS=False, num_warps=8, num_stages=3)
torch.cuda.synchronize()
print("done")
