"""Session 8: which TRANS_MODE of _weight_kernel is right on the GPU, and its refresh time."""
import torch, triton
from kernels.fp8 import quant as Q
from kernels.mega_moe_fp8.weights import QuantizedExpertWeights as W
dev = "cuda" if torch.cuda.is_available() else "cpu"
def b(x): return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x
for mode in (0, 1, 2):
    Q.WEIGHT_TRANS_MODE = mode
    bad = []
    for (E, F, D) in ((2, 192, 200), (1, 256, 128), (3, 768, 512), (1, 130, 260)):
        for rnd in (False, True):
            torch.manual_seed(E * F + D)
            ws = [torch.randn(E, F, D, device=dev) * 0.05, torch.randn(E, F, D, device=dev) * 0.05, torch.randn(E, D, F, device=dev) * 0.05]
            bs = [w.to(torch.bfloat16) for w in ws]
            got = W.quantize(*(ws if rnd else bs), round_to_bf16=rnd)
            (q1, s1), (q3, s3), (q2, s2) = (Q.quantize_weight(x) for x in bs)
            FP = triton.cdiv(F, 128) * 128
            w13 = torch.zeros(E, D, 2 * FP, dtype=torch.uint8, device=dev)
            w13[:, :, :F], w13[:, :, FP:FP + F] = b(q1).mT, b(q3).mT
            want = dict(w1_q=q1, w1_s=s1, w3_q=q3, w3_s=s3, w2_q=q2, w2_s=s2, w2t_q=b(q2).mT.contiguous(), w2t_s=s2.mT.contiguous(), w13t_q=w13, w13t_s=torch.cat([s1.mT, s3.mT], 2))
            for k, v in want.items():
                g = b(getattr(got, k)); n = (g != b(v)).sum().item() if g.shape == v.shape else -1
                if n: bad.append(f"{E}x{F}x{D} rnd={rnd} {k}:{n}")
    ms = float("nan")
    if dev == "cuda":
        E, F, D = 128, 1536, 4096
        ms_ = [torch.randn(E, F, D, device=dev), torch.randn(E, F, D, device=dev), torch.randn(E, D, F, device=dev)]
        out = W.empty(E, F, D, dev)
        ms = triton.testing.do_bench(lambda: W.quantize(*ms_, round_to_bf16=True, out=out), warmup=5, rep=50, return_mode="median")
        del ms_, out
    print(f"mode {mode}: {'OK' if not bad else 'BAD ' + ' '.join(bad[:6])}  refresh 235B {ms:.3f} ms", flush=True)
