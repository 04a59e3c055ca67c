"""Session 9: the one-pass weight quantization's launch (num_warps) with and without the transposed store."""
import torch, triton
from kernels.fp8 import quant as Q
from kernels.mega_moe_fp8.weights import QuantizedExpertWeights

def ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

for name, (D, F) in {"30B": (2048, 768), "235B": (4096, 1536)}.items():
    E = 128
    w = torch.randn(E, F, D, device="cuda") * 0.02
    q = torch.empty(E, F, D, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(E, F // 128, D // 128, device="cuda")
    qt = torch.empty(E, D, F, device="cuda", dtype=torch.float8_e4m3fn)
    st = torch.empty(E, D // 128, F // 128, device="cuda")
    ref = None
    for warps in (4, 8, 16):
        for trans in (False, True):
            a = (qt, st) if trans else (None, None)
            t = ms(lambda: Q.quantize_weight_into(w, q, s, *a, round_bf16=True, num_warps=warps))
            nbytes = w.numel() * (4 + 1 + (1 if trans else 0))
            print(f"{name} w1 fp32->e4m3 warps {warps:2d} trans {trans!s:5s} {t:7.3f} ms {nbytes / t / 1e6:6.0f} GB/s", flush=True)
            if trans:
                got = (q.view(torch.uint8).clone(), qt.view(torch.uint8).clone())
                ref = ref or got
                assert all(torch.equal(x, y) for x, y in zip(ref, got)), "bytes differ across warps"
    assert torch.equal(ref[1], ref[0].mT), "transposed store != q.mT"
