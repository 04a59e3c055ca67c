import subprocess, os, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.mega_moe_fp8.backward import _dh_values, _store_quantized_half, _store_cols_quantized, _zero_cols
from kernels.mega_moe.common import tile_rows
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")

@triton.jit
def k(da_ptr, h_ptr, s_ptr, dhq_ptr, dhs_ptr, dht_ptr, dhts_ptr, sat_ptr, sats_ptr, ds_part_ptr, sorted_slot_ptr,
      offsets_ptr, table_ptr, num_tiles, N, F, LDQ, POW2: tl.constexpr, SOFT: tl.constexpr, VAR: tl.constexpr):
    pid = tl.program_id(0)
    FB = tl.cdiv(F, 128)
    pid_t = pid // FB
    pid_n = pid % FB
    offs_n = pid_n * 128 + tl.arange(0, 128)
    nmask = offs_n < F
    n64 = offs_n.to(tl.int64)
    expert, rows, rmask, _ = tile_rows(table_ptr, offsets_ptr, num_tiles, pid_t, 128)
    if VAR == 1:
        if expert < 0:
            _zero_cols(n64, nmask, pid_t, dht_ptr, dhts_ptr, LDQ, num_tiles)
            return
    slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
    rows64 = rows.to(tl.int64)
    smask = rmask[:, None] & nmask[None, :]
    acc = tl.load(da_ptr + rows64[:, None] * F + offs_n[None, :], mask=smask, other=0.0)
    dgate, dup, sa, ds_part = _dh_values(acc, rmask, slot, smask, rows64, offs_n, s_ptr, h_ptr, F, SOFT)
    FP = FB * 128
    if VAR != 2:
        _store_quantized_half(dgate, nmask, rows64, rmask, offs_n, 0, pid_n, dhq_ptr, dhs_ptr, FP, FB, POW2, SOFT)
        _store_quantized_half(dup, nmask, rows64, rmask, offs_n, FP, FB + pid_n, dhq_ptr, dhs_ptr, FP, FB, POW2, SOFT)
    tl.store(ds_part_ptr + pid_n * N + slot, ds_part, mask=rmask)
    if VAR != 3:
        _store_cols_quantized(dgate, smask, n64, nmask, pid_t, dht_ptr, dhts_ptr, LDQ, num_tiles, POW2, SOFT)
        _store_cols_quantized(dup, smask, n64 + F, nmask, pid_t, dht_ptr, dhts_ptr, LDQ, num_tiles, POW2, SOFT)
        _store_cols_quantized(sa, smask, n64, nmask, pid_t, sat_ptr, sats_ptr, LDQ, num_tiles, POW2, SOFT)

P = "*fp32"
sig = {"da_ptr": P, "h_ptr": "*bf16", "s_ptr": P, "dhq_ptr": "*u8", "dhs_ptr": P, "dht_ptr": "*u8", "dhts_ptr": P,
       "sat_ptr": "*u8", "sats_ptr": P, "ds_part_ptr": P, "sorted_slot_ptr": "*i32", "offsets_ptr": "*i32",
       "table_ptr": "*i32", "num_tiles": "i32", "N": "i32", "F": "i32", "LDQ": "i32", "POW2": "constexpr", "SOFT": "constexpr", "VAR": "constexpr"}
for var, label in ((0, "no surplus branch"), (1, "surplus branch"), (2, "no row quant"), (3, "no col quant")):
    for w in (8, 16):
        c = triton.compile(ASTSource(fn=k, signature=sig, constexprs={"POW2": False, "SOFT": False, "VAR": var}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": w})
        f = tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False); f.write(c.asm["ptx"]); f.close()
        txt = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True).stderr
        print(label, w, [l.strip()[:90] for l in txt.splitlines() if "Used" in l or "spill" in l], flush=True)
