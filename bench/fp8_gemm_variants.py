"""Where the block-scaled FP8 grouped GEMM's K loop spends its time: one kernel in variants.

    python -m bench.fp8_gemm_variants          # on the H200: table of ms, TFLOP/s, error
    TRITON_INTERPRET=1 python -m bench.fp8_gemm_variants --cpu   # modes 0, 1, 3-5 checked on CPU

One grouped GEMM over expert-sorted rows (no gather), balanced routing, T 16384 top-8 E 128, at the
30B down shape (K 768, N 2048) and a gate/up-like one (K 2048, N 1536), in variants:
MODE 0: acc + dot(a, b) * sa[:, None] * sb[None, :]   (2 muls + 1 add)
MODE 1: acc + dot(a, b) * (sa * sb)[:, None]          (sb a scalar when BN == 128: one FMA)
MODE 2: acc = dot(a, b, acc)                          (no scales: Triton's FP8 ceiling here)
MODE 3: MODE 1 lagged by one block
MODE 4/5: MODE 1 with the scales loaded one / two blocks ahead
TMA: A and B through host tensor descriptors; WS: tl.range(warp_specialize=True).
Also bf16 operands in MODE 2, torch._scaled_mm rowwise and a bf16 matmul, dense, at the same sizes.
kernels/fp8/grouped_gemm.py runs MODE 4's loop, through TMA where A's rows are not gathered.
"""
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.fp8 import grouped_gemm as G
from kernels.fp8 import blockwise as Q
from kernels.fp8.grouped_gemm import _m_tile
from kernels.common.routing import sort_by_expert, tile_table


@triton.jit
def _xk(a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, offsets_ptr, table_ptr, num_tiles, N, K, a_desc, b_desc,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    pid_m, pid_n, expert, rows, rmask, safe_rows = _m_tile(table_ptr, offsets_ptr, num_tiles, N, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    row0 = tl.load(table_ptr + num_tiles + pid_m)
    KB = K // 128
    NB = N // 128
    e64 = expert.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    a_ptrs = a_ptr + safe_rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + e64 * N * K + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    as_ptrs = as_ptr + safe_rows.to(tl.int64) * KB
    bsv_ptrs = bs_ptr + (e64 * NB + offs_n // 128) * KB
    bs0 = bs_ptr + (e64 * NB + pid_n * (BLOCK_N // 128)) * KB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    d_prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s_prev = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # MODE 4/5: scales prefetched one/two blocks ahead (loaded an iteration before their use)
    s_n1 = tl.load(as_ptrs) * tl.load(bs0)
    s_n2 = tl.load(as_ptrs + tl.minimum(1, KB - 1)) * tl.load(bs0 + tl.minimum(1, KB - 1))
    for kb in tl.range(0, KB, warp_specialize=WS):
        if TMA:
            a = a_desc.load([row0, kb * 128])
            b = b_desc.load([(e64 * N + pid_n * BLOCK_N).to(tl.int32), kb * 128]).T
        else:
            a = tl.load(a_ptrs + kb * 128)
            b = tl.load(b_ptrs + kb * 128)
        if MODE == 2:
            acc = tl.dot(a, b, acc)
        elif MODE == 0:
            sa = tl.load(as_ptrs + kb)
            sb = tl.load(bsv_ptrs + kb)
            acc = acc + tl.dot(a, b) * sa[:, None] * sb[None, :]
        elif MODE == 1:
            s = tl.load(as_ptrs + kb) * tl.load(bs0 + kb)
            acc = acc + tl.dot(a, b) * s[:, None]
        elif MODE == 4:
            kn = tl.minimum(kb + 1, KB - 1)
            s_next = tl.load(as_ptrs + kn) * tl.load(bs0 + kn)
            acc = acc + tl.dot(a, b) * s_n1[:, None]
            s_n1 = s_next
        elif MODE == 5:
            kn = tl.minimum(kb + 2, KB - 1)
            s_next = tl.load(as_ptrs + kn) * tl.load(bs0 + kn)
            acc = acc + tl.dot(a, b) * s_n1[:, None]
            s_n1 = s_n2
            s_n2 = s_next
        else:
            s = tl.load(as_ptrs + kb) * tl.load(bs0 + kb)
            d = tl.dot(a, b)
            acc = acc + d_prev * s_prev[:, None]
            d_prev = d
            s_prev = s
    if MODE == 3:
        acc = acc + d_prev * s_prev[:, None]
    smask = rmask[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=smask)


def ms(fn, reps=50):
    return triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median")


def run(T=16384, top_k=8, E=128, shapes=((768, 2048), (2048, 1536))):
    dev = "cuda"
    Nr = T * top_k
    ids = (torch.arange(T, device=dev)[:, None] * top_k + torch.arange(top_k, device=dev)) % E
    _, offs = sort_by_expert(ids, E)
    rows_out = []
    for K, N in shapes:
        a = torch.randn(Nr, K, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(E, N, K, device=dev) * 0.02).to(torch.bfloat16)
        aq, as_ = Q.quantize_1x128(a)
        wq, ws = Q.quantize_weight(w)
        ref = None
        flops = 2 * Nr * N * K
        # reference: dequantized fp32, on a sample of experts (all rows of experts 0, 5, 127)
        adq = Q.dequantize_rowwise_ref(aq, as_)
        wdq = Q.dequantize_weight_ref(wq, ws)
        check_e = (0, 5, E - 1)
        offs_h = offs.tolist()

        def err(out):
            num = den = 0.0
            for e in check_e:
                r0, r1 = offs_h[e], offs_h[e + 1]
                refe = adq[r0:r1].float() @ wdq[e].float().T
                num += (out[r0:r1].float() - refe).pow(2).sum().item()
                den += refe.pow(2).sum().item()
            return (num / den) ** 0.5

        def row(label, fn, check=True):
            try:
                out = fn()
                torch.cuda.synchronize()
                e = err(out) if check else float("nan")
                t = ms(fn)
                rows_out.append(f"K{K:5d} N{N:5d} {label:44s} {t:7.3f} ms {flops / t / 1e9:6.0f} TFLOP/s  err {e:.2e}")
            except Exception as exc:
                rows_out.append(f"K{K:5d} N{N:5d} {label:44s} failed: {type(exc).__name__}: {str(exc)[:120]}")
            print(rows_out[-1], flush=True)

        row("production fp8_grouped_gemm (defaults)", lambda: G.fp8_grouped_gemm(aq, as_, wq, ws, offs))
        row("production bm128 bn128 w8 s3", lambda: G.fp8_grouped_gemm(aq, as_, wq, ws, offs, tiles=tile_table(offs, Nr, 128), block_m=128, num_warps=8, num_stages=3))
        configs = [(64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4)]
        for bm, bn, nw, ns in configs:
            tiles = tile_table(offs, Nr, bm)
            nt = tiles.shape[1]
            ad = TensorDescriptor.from_tensor(aq, [bm, 128])
            bd = TensorDescriptor.from_tensor(wq.view(E * N, K), [bn, 128])
            for mode, tma, wsp in ((1, False, False), (2, False, False), (4, False, False), (5, False, False),
                                   (4, True, False), (5, True, False), (2, True, False), (4, True, True),
                                   (5, True, True)):
                if mode == 0 and tma:
                    continue
                out = torch.empty(Nr, N, device=dev, dtype=torch.bfloat16)

                def f(out=out, tiles=tiles, nt=nt, ad=ad, bd=bd, mode=mode, tma=tma, wsp=wsp, bm=bm, bn=bn, nw=nw, ns=ns):
                    _xk[(nt * (N // bn),)](aq, as_, wq, ws, out, offs, tiles, nt, N, K, ad, bd, BLOCK_M=bm, BLOCK_N=bn,
                                            MODE=mode, TMA=tma, WS=wsp, num_warps=nw, num_stages=ns)
                    return out
                row(f"x bm{bm} bn{bn} w{nw} s{ns} mode{mode}{' tma' if tma else ''}{' ws' if wsp else ''}", f,
                    check=mode != 2)
        # bf16 operands, no scales (the bf16 ceiling of this kernel)
        for bm, bn, nw, ns in ((128, 128, 8, 3), (64, 128, 4, 4)):
            tiles = tile_table(offs, Nr, bm)
            nt = tiles.shape[1]
            wb = w.contiguous()
            ad = TensorDescriptor.from_tensor(a, [bm, 64])
            out = torch.empty(Nr, N, device=dev, dtype=torch.bfloat16)
            row(f"bf16 bm{bm} bn{bn} w{nw} s{ns} mode2", lambda tiles=tiles, nt=nt, bm=bm, bn=bn, nw=nw, ns=ns, out=out:
                _xk[(nt * (N // bn),)](a, as_, wb, ws, out, offs, tiles, nt, N, K, ad, ad, BLOCK_M=bm, BLOCK_N=bn,
                                        MODE=2, TMA=False, WS=False, num_warps=nw, num_stages=ns) or out, check=False)
        # dense ceilings at the same total size
        bT = wq[0].T  # (K, N), column-major as _scaled_mm wants
        one_r = torch.ones(Nr, 1, device=dev)
        one_c = torch.ones(1, N, device=dev)
        row("torch._scaled_mm rowwise dense (Nr,K)x(K,N)", lambda: torch._scaled_mm(aq, bT, one_r, one_c, out_dtype=torch.bfloat16, use_fast_accum=True), check=False)
        row("torch bf16 dense matmul (Nr,K)x(K,N)", lambda: a @ w[0].T, check=False)
    print("\n".join(rows_out))


def cpu_check(seed: int = 0, device: str = "cpu") -> dict:
    """Modes 0, 1, 3-5 without TMA against the dequantized reference at a tiny size (K = 256: two K
    blocks), on CPU under TRITON_INTERPRET=1 or on the GPU; returns {(block_m, mode): relative error}."""
    torch.manual_seed(seed)
    E, top_k, T, K, N = 4, 2, 40, 256, 256
    ids = torch.randint(0, E, (T, top_k), device=device)
    _, offs = sort_by_expert(ids, E)
    Nr = T * top_k
    a = torch.randn(Nr, K, device=device)
    w = torch.randn(E, N, K, device=device) * 0.02
    aq, as_ = Q.quantize_1x128(a)
    wq, ws = Q.quantize_weight(w)
    adq, wdq = Q.dequantize_rowwise_ref(aq, as_), Q.dequantize_weight_ref(wq, ws)
    eid = torch.repeat_interleave(torch.arange(E, device=device), offs.diff().long())
    ref = torch.einsum("rk,rnk->rn", adq, wdq[eid])
    errors = {}
    for bm in (16, 32):
        tiles = tile_table(offs, Nr, bm)
        nt = tiles.shape[1]
        for mode in (0, 1, 3, 4, 5):
            out = torch.zeros(Nr, N, dtype=torch.bfloat16, device=device)
            _xk[(nt * (N // 128),)](aq, as_, wq, ws, out, offs, tiles, nt, N, K, None, None, BLOCK_M=bm,
                                     BLOCK_N=128, MODE=mode, TMA=False, WS=False)
            errors[(bm, mode)] = ((out.float() - ref).norm() / ref.norm()).item()
    return errors


if __name__ == "__main__":
    print(cpu_check()) if "--cpu" in sys.argv else run()
