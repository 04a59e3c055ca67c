import sys, torch
import kernels.fp8_rowwise as R
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()
T, K, N = 4096, 2048, 512
g = torch.Generator().manual_seed(0)
x = torch.randn(T, K, generator=g); w = torch.randn(N, K, generator=g) / K**0.5; dy = torch.randn(T, N, generator=g)
x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
ref = x64 @ w64.t(); ref.backward(dy.double())
for impl in ("custom_op", "function"):
    for how in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset(); R.IMPLEMENTATION = impl
        def f(a, b):
            with torch.autocast(dev, dtype=torch.bfloat16):
                return R.fp8_linear(a, b, torch.bfloat16)
        fn = f if how == "eager" else torch.compile(f, backend=how, fullgraph=True)
        a = x.to(dev, torch.bfloat16).detach().clone().requires_grad_(); b = w.to(dev).detach().clone().requires_grad_()
        y = fn(a, b); y.backward(dy.to(dev, torch.bfloat16))
        print(f"{impl:9s} {how:9s}: y {rel(y.cpu(), ref.detach()):.4f} dx {rel(a.grad.cpu(), x64.grad):.4f} dw {rel(b.grad.cpu(), w64.grad):.4f}", flush=True)
