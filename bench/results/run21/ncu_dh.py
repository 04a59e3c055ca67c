"""The FP8 dh kernel (dA' + SwiGLU backward + quantized dH) at the 30B shape, for ncu; also timed
with store_sa off and at num_stages 2 (is its epilogue or its loop the cost?)."""
import torch
import triton
from kernels.fp8 import grouped_gemm as G
from kernels.fp8 import quant as Q
from kernels.mega_moe.routing import sort_by_expert
from kernels.mega_moe_fp8 import backward as B

dev, T, top_k, E, D, F = "cuda", 16384, 8, 128, 2048, 768
Nr = T * top_k
ids = (torch.arange(T, device=dev)[:, None] * top_k + torch.arange(top_k, device=dev)) % E
slots, offs = sort_by_expert(ids, E)
w2 = (torch.randn(E, D, F, device=dev) * 0.02).to(torch.bfloat16)
w2q, w2s = Q.quantize_weight(w2)
w2t_q, w2t_s = B._transposed(w2q), w2s.mT.contiguous()
h = torch.randn(Nr, 2 * F, device=dev, dtype=torch.bfloat16)
dy = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
dyq, dys = Q.quantize_rowwise(dy)
s_TK = torch.rand(T, top_k, device=dev)
import sys
if "--time" in sys.argv:
    for sa in (True, False):
        for bm, w, st in ((64, 8, 3), (64, 8, 2), (32, 4, 2), (64, 4, 2)):
            f = lambda: B.dh_swiglu(dyq, dys, w2t_q, w2t_s, h, s_TK, slots, offs, store_sa=sa, block_m=bm, num_warps=w, num_stages=st)
            try:
                ms = triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
                print(f"dh store_sa={sa} bm{bm} w{w} s{st}: {ms:.3f} ms")
            except Exception as e:
                print(f"dh store_sa={sa} bm{bm} w{w} s{st}: failed {type(e).__name__} {str(e)[:80]}")
else:
    for _ in range(2):
        B.dh_swiglu(dyq, dys, w2t_q, w2t_s, h, s_TK, slots, offs)
    torch.cuda.synchronize()
