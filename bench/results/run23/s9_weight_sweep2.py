"""Session 9 call D: the one-pass weight quantization (fp32 masters, bf16 rounding, both layouts):
warps x which tile is transposed; bytes checked identical across variants and qt == q.mT.
Prints the best as 'BEST warps trans_from'."""
import torch, triton
from kernels.fp8 import quant as Q

def ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

total = {}
for name, (D, F) in {"30B": (2048, 768), "235B": (4096, 1536)}.items():
    E = 128
    for wname, (N, K) in {"w1": (F, D), "w2": (D, F)}.items():
        w = torch.randn(E, N, K, device="cuda") * 0.02
        q = torch.empty(E, N, K, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(E, N // 128, K // 128, device="cuda")
        qt = torch.empty(E, K, N, device="cuda", dtype=torch.float8_e4m3fn)
        st = torch.empty(E, K // 128, N // 128, device="cuda")
        ref = None
        for warps in (8, 16, 32):
            for tf in (0, 1, 2):
                try:
                    t = ms(lambda: Q.quantize_weight_into(w, q, s, qt, st, round_bf16=True, num_warps=warps, trans_from=tf))
                except Exception as exc:
                    print(f"{name} {wname} warps {warps} trans_from {tf} failed {type(exc).__name__}"); continue
                got = (q.view(torch.uint8).clone(), qt.view(torch.uint8).clone(), s.clone(), st.clone())
                ref = ref or got
                ok = all(torch.equal(a, b) for a, b in zip(ref, got)) and torch.equal(got[1], got[0].mT) and torch.equal(got[3], got[2].mT)
                total[(warps, tf)] = total.get((warps, tf), 0.0) + t
                print(f"{name} {wname} fp32->e4m3+T warps {warps:2d} trans_from {tf} {t:7.3f} ms {w.numel() * 6 / t / 1e6:6.0f} GB/s {'ok' if ok else 'WRONG BYTES'}", flush=True)
                if not ok:
                    total[(warps, tf)] = float("inf")
best = min(total, key=total.get)
print("totals:", {k: round(v, 3) for k, v in total.items()})
print("BEST", *best)
