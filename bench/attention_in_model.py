"""Which SDPA kernel the trainer's attention actually runs, and how fast (forward + backward).

    python -m bench.attention_in_model

``[model] attention_backend = "cudnn"`` was no faster than the default in the whole step although
cuDNN was 1.7x flash in isolation on contiguous (B, H, L, hd) inputs. This times SDPA at the Qwen3-30B-A3B attention shape on q/k/v laid out as
the model makes them ((B, L, H, hd) transposed: not contiguous) and contiguous, eager and under
``torch.compile(fullgraph=True)``, with each backend preference, plus the model's own
``Attention`` module, and names the attention kernels the profiler sees in each case.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from bench.timing import time_ms
from models.qwen3.args import get_model_args
from models.qwen3.model import ATTENTION_BACKENDS, Attention, rope_cos_sin

ORDERS = {
    "auto": None,
    "cudnn": ATTENTION_BACKENDS["cudnn"],
    "flash": ATTENTION_BACKENDS["flash"],
}


def attention_kernels(fn) -> str:
    """Names of the GPU kernels of one call of ``fn`` that look like attention."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    keys = ("flash", "cudnn", "fmha", "attention", "attn", "sdpa", "cutlass")
    names = sorted({e.key for e in prof.key_averages() if any(k in e.key.lower() for k in keys)})
    return "; ".join(n[:70] for n in names) or "(none matched)"


def main() -> None:
    args = get_model_args("qwen3_30b_a3b")
    B, L, H, KV, hd = 1, 16384, args.n_heads, args.n_kv_heads, args.head_dim
    dev, bf16 = "cuda", torch.bfloat16
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  L {L} H {H} KV {KV} hd {hd}", flush=True)
    rows = []
    q0 = torch.randn(B, L, H, hd, device=dev, dtype=bf16)
    k0 = torch.randn(B, L, KV, hd, device=dev, dtype=bf16)
    v0 = torch.randn(B, L, KV, hd, device=dev, dtype=bf16)
    dout = torch.randn(B, H, L, hd, device=dev, dtype=bf16)
    for layout in ("transposed", "contiguous"):
        for name, order in ORDERS.items():
            for compiled in (False, True):
                def sdpa(q, k, v, order=order):
                    if order is None:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    with sdpa_kernel(order, set_priority=True):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

                fn = torch.compile(sdpa, fullgraph=True) if compiled else sdpa
                leaves = [t.clone().requires_grad_() for t in (q0, k0, v0)]

                def step(fn=fn, leaves=leaves, layout=layout):
                    q, k, v = (t.transpose(1, 2) for t in leaves)
                    if layout == "contiguous":
                        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
                    torch.autograd.grad(fn(q, k, v), leaves, dout)

                try:
                    ms = time_ms(step, 10)
                    rows.append(f"{layout:10s} {name:6s} {'compiled' if compiled else 'eager':8s} {ms:8.2f} ms  "
                                f"{attention_kernels(step)}")
                except Exception as exc:
                    rows.append(f"{layout:10s} {name:6s} {'compiled' if compiled else 'eager':8s} failed: {exc!s:.80}")
                print(rows[-1], flush=True)
                torch._dynamo.reset()
    # The model's own module, compiled as the trainer compiles blocks.
    x = torch.randn(B, L, args.dim, device=dev, dtype=bf16, requires_grad=True)
    cos, sin = rope_cos_sin(hd, L, args.rope_theta, device=dev)  # fp32, as the model keeps them
    for name in ORDERS:
        attn = Attention(args, name).to(dev, bf16)
        fn = torch.compile(attn, fullgraph=True)

        def step(fn=fn):
            fn(x, cos, sin).sum().backward()

        try:
            ms = time_ms(step, 10)
            rows.append(f"{'module':10s} {name:6s} compiled {ms:8.2f} ms  {attention_kernels(step)}")
        except Exception as exc:
            rows.append(f"{'module':10s} {name:6s} compiled failed: {exc!s:.80}")
        print(rows[-1], flush=True)
        torch._dynamo.reset()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
