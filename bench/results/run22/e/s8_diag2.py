import torch
from kernels.fp8 import quant as Q
dev = "cuda" if torch.cuda.is_available() else "cpu"
def b(x): return x.view(torch.uint8)
for shape in ((2, 192, 200), (1, 256, 128)):
    torch.manual_seed(0)
    w = torch.randn(shape, device=dev) * 0.05
    E, N, K = shape
    for rnd in (False, True):
        q = torch.empty(shape, device=dev, dtype=torch.float8_e4m3fn); s = torch.empty(E, -(-N // 128), -(-K // 128), device=dev)
        Q.quantize_weight_into(w, q, s, round_to_bf16=rnd)
        src = w.to(torch.bfloat16) if rnd else w
        rq, rs = Q.quantize_weight_ref(src)
        kq, ks = Q.quantize_weight(src.contiguous())
        print(shape, "rnd", rnd, "vs ref q", (b(q) != b(rq)).sum().item(), "s", (s != rs).sum().item(), "| plain kernel vs ref", (b(kq) != b(rq)).sum().item(), (ks != rs).sum().item(), flush=True)
