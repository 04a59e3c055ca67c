"""The warp-specialized Gluon FP8 GEMM (kernels/fp8/hopper_gemm.py).

- Everywhere (CPU included): the kernel compiles for sm_90a with Triton's own ptxas, its SASS uses
  the FP8 warpgroup MMA (QGMMA) and spills nothing to local memory. Gluon kernels have no CPU
  interpreter, so this is what CI can check.
- On a Hopper GPU: the product against a float64 reference on fresh random inputs at awkward shapes
  (rows and columns not multiples of the 128 tile, K not a multiple of 128, one K block, rows with
  100x larger scales), fp8-level agreement with the unquantized product, and the no-scale probe.
"""

import os
import re
import subprocess

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from bench.hopper_gemm import make_inputs  # noqa: E402
from kernels.fp8 import hopper_gemm as H  # noqa: E402
from tests.utils import random_seed  # noqa: E402

FP8 = torch.float8_e4m3fn
IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _compile_sm90(stages: int, scaled: bool):
    """Compile the kernel for sm_90a without a GPU (host tensors stand in for the descriptors' bases)."""
    fn = H._fp8_gemm_kernel
    M = N = K = 1024
    args = dict(a_desc=H._descriptor(torch.empty(M, K, dtype=FP8), [128, 128], gl.float8e4nv),
                b_desc=H._descriptor(torch.empty(N, K, dtype=FP8), [128, 128], gl.float8e4nv),
                c_desc=H._descriptor(torch.empty(M, N, dtype=torch.bfloat16), [64, 128], gl.bfloat16),
                as_ptr=torch.empty(8, M), bs_ptr=torch.empty(8, 8), M=M, N=N, K=K)
    consts = dict(STAGES=stages, GROUP_M=8, SCALED=scaled)
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in consts else mangle_type(args[n]) for n in names}
    constexprs = {(names.index(n), ): v for n, v in consts.items()}
    attrs = {(names.index(n), ): [["tt.divisibility", 16]] for n in ("as_ptr", "bs_ptr", "M", "N", "K")}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": H.MAXNREG})


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "cuobjdump")), reason="triton ships no cuobjdump here")
@pytest.mark.parametrize("stages,scaled", [(4, True), (5, True), (4, False)])
def test_compiles_for_sm90_without_spills(tmp_path, stages, scaled):
    kernel = _compile_sm90(stages, scaled)
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass, "no FP8 warpgroup MMA in the SASS"
    assert not re.search(r"\b(LDL|STL)\b", sass), "registers spill to local memory"
    assert kernel.metadata.shared <= 227 * 1024, f"{kernel.metadata.shared} bytes of shared memory"
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx


@pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("M,N,K", [(300, 384, 640), (129, 136, 208), (1, 128, 128), (1024, 1536, 2048),
                                   (777, 2048, 768)])
@pytest.mark.parametrize("stages", [4, 5])
def test_matches_float64(M, N, K, stages):
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    a_q, a_s, b_q, b_s = make_inputs(M, N, K, generator=gen)
    out = H.fp8_gemm(a_q, a_s.t().contiguous(), b_q, b_s, stages=stages)
    ref = H.fp8_gemm_ref(a_q, a_s, b_q, b_s)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    # bf16 output rounding (2^-9) dominates: the fp32 promotion of each 128-wide block is exact enough.
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 4e-3, f"seed {seed}: relative error {err:.2e}"
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item(),
                               msg=lambda d: f"seed {seed}: {d}")


@pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_unscaled_probe_is_the_plain_product():
    gen = torch.Generator().manual_seed(random_seed())
    a_q, a_s, b_q, b_s = make_inputs(256, 256, 512, generator=gen)
    out = H.fp8_gemm(a_q, a_s.t().contiguous(), b_q, b_s, scaled=False)
    ref = a_q.double() @ b_q.double().T
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4e-3


@pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_rejects_what_it_cannot_run():
    gen = torch.Generator().manual_seed(0)
    a_q, a_s, b_q, b_s = make_inputs(128, 128, 256, generator=gen)
    with pytest.raises(ValueError, match="K"):
        H.fp8_gemm(a_q[:, :200], a_s.t().contiguous(), b_q[:, :200], b_s)  # rows not 16-byte aligned
    with pytest.raises(ValueError, match="a_s_t"):
        H.fp8_gemm(a_q, a_s.contiguous(), b_q, b_s)
    with pytest.raises(ValueError, match="e4m3"):
        H.fp8_gemm(a_q.float(), a_s.t().contiguous(), b_q, b_s)
