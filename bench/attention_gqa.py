"""Which SDPA path is fastest for Qwen3 attention shapes on this GPU (forward + backward).

    python -m bench.attention_gqa

Compares ``enable_gqa=True`` against repeating K/V to all heads, under each SDPA backend, and
FlexAttention (``torch.compile``-d ``flex_attention`` with a causal block mask, GQA). :func:`flex_causal_attention` is checked against SDPA on CPU by
tests/test_attention_bench.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def flex_causal_attention(compiled: bool = True):
    """``attn(q, k, v) -> out``: causal GQA attention through FlexAttention, the block mask built
    once per (L, device) and reused (as a training step would)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    fn = torch.compile(flex_attention, fullgraph=True) if compiled else flex_attention
    masks = {}

    def attn(q, k, v):
        key = (q.shape[-2], q.device)
        if key not in masks:
            masks[key] = create_block_mask(causal, None, None, q.shape[-2], k.shape[-2], device=q.device)
        return fn(q, k, v, block_mask=masks[key], enable_gqa=q.shape[1] != k.shape[1])

    return attn


def main():
    B, L, H, KV, Hd = 1, 16384, 32, 4, 128
    q = torch.randn(B, H, L, Hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, L, Hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, L, Hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, H, L, Hd, device="cuda", dtype=torch.bfloat16)
    flops = 4 * B * H * L * L * Hd / 2 * 3.5  # causal: fwd 2 GEMMs, bwd 5 -> 3.5x fwd
    rows = []
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        for mode in ("enable_gqa", "repeat_kv"):
            def step():
                if mode == "enable_gqa":
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    kk, vv = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
                    out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
                out.backward(dout)
            try:
                with sdpa_kernel(backend):
                    ms = time_ms(step)
                rows.append((name, mode, f"{ms:.2f}", f"{flops / ms / 1e9:.0f}"))
            except RuntimeError as e:
                rows.append((name, mode, "unsupported", str(e).splitlines()[0][:60]))
    flex = flex_causal_attention()

    def flex_step():
        flex(q, k, v).backward(dout)

    try:
        ms = time_ms(flex_step)
        rows.append(("flex (compiled)", "enable_gqa", f"{ms:.2f}", f"{flops / ms / 1e9:.0f}"))
    except Exception as e:  # noqa: BLE001 - report any failure of the optional path as a row
        rows.append(("flex (compiled)", "enable_gqa", "failed", str(e).splitlines()[0][:60]))
    print(f"attention fwd+bwd B={B} L={L} H={H} KV={KV} head_dim={Hd}, torch {torch.__version__}")
    print("| backend | GQA | ms | TFLOP/s |\n| --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
