"""The warp-specialized Gluon FP8 GEMMs (kernels/fp8/hopper_wgrad.py, hopper_grouped.py, hopper_gate_up.py
on the engine of kernels/fp8/gluon_base.py, and the dense benchmark kernel bench/hopper_dense_gemm.py) and
the engine choice.

- Everywhere (CPU included): each kernel (as ``bench.sass_report --only gluon`` builds it) compiles
  for sm_90a with Triton's own ptxas, its SASS uses the FP8 warpgroup MMA (QGMMA) and keeps nothing
  in local memory inside a K loop. Gluon kernels have no CPU interpreter, so this is what CI can check.
- On a Hopper GPU: the product against a float64 reference on fresh random inputs at awkward shapes
  (rows and columns not multiples of the 128 tile, K not a multiple of 128, one K block, rows with
  100x larger scales), fp8-level agreement with the unquantized product.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from bench import hopper_dense_gemm as H  # noqa: E402
from bench import sass_report  # noqa: E402
from bench.hopper_gemm import make_grouped_inputs, make_inputs, make_wgrad_inputs  # noqa: E402
from kernels.fp8 import gluon_base  # noqa: E402
from kernels.fp8 import hopper_gate_up as GU  # noqa: E402
from kernels.fp8 import hopper_grouped as G  # noqa: E402
from kernels.fp8 import hopper_wgrad as W  # noqa: E402
from kernels.fp8.engine import resolve_engine  # noqa: E402
from kernels.fp8.grouped_gemm import fp8_grouped_gemm, fp8_grouped_gemm_ref, fp8_wgrad, fp8_wgrad_ref  # noqa: E402
from tests.bounds import assert_experts_close, assert_rows_close  # noqa: E402
from tests.utils import random_seed  # noqa: E402

IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# The names of bench.sass_report.gluon()'s kernels (built there without being compiled).
GLUON_KERNELS = ["gemm_st4", "gemm_st5", "wgrad_st4_fp32", "wgrad_st4_bf16", "grouped_down", "grouped_dx",
                 "grouped_da", "gate_up"]


def _compile_all(folder: str) -> None:
    """Compile every kernel of ``bench.sass_report.gluon()`` and write its cubin, PTX and
    shared-memory size into ``folder/<name>/``."""
    builds = sass_report.gluon()
    with open(os.path.join(folder, "names"), "w") as f:
        f.write(" ".join(builds))
    for name, build in builds.items():
        kernel = sass_report.compile_sm90(build)
        os.makedirs(os.path.join(folder, name))
        with open(os.path.join(folder, name, "k.cubin"), "wb") as f:
            f.write(kernel.asm["cubin"])
        with open(os.path.join(folder, name, "k.ptx"), "w") as f:
            f.write(kernel.asm["ptx"])
        with open(os.path.join(folder, name, "shared"), "w") as f:
            f.write(str(kernel.metadata.shared))


# Bounds of the GEMMs against float64, per output row, or per expert and per row and column of each
# expert's weight gradient (tests/bounds.py): 3-5x what the output rounding (bf16, 2^-9) or the FP8
# MMA's accumulation (fp32 out) gives, far below the O(1) a missing or misplaced row gives (a
# missing token: docs/testing.md, "Bounds that catch a dropped slot").
BF16_ROWS, FP32_ROWS = 1e-2, 1e-3
WGRAD_BOUNDS = {torch.bfloat16: (6e-3, 8e-3), torch.float32: (1e-3, 2e-3)}  # (expert, rows and columns)

# The gate/up epilogue's IEEE division (A / its row scale, bit-exact with the references) keeps one
# register in local memory around its slow path: a store and two loads per consumer warpgroup, per
# tile.
EPILOGUE_SPILLS = {"gate_up": 6}


def _local_memory_in_loops(sass: str) -> list[str]:
    """Local loads/stores between an mbarrier wait and the next arrive: inside a partition's K loop,
    where a spill would cost every K block."""
    inside, found = False, []
    for line in sass.splitlines():
        if "SYNCS.PHASECHK" in line:
            inside = True
        elif "SYNCS.ARRIVE" in line:
            inside = False
        elif inside and re.search(r"\b(LDL|STL)\b", line):
            found.append(line.split(";")[0].strip())
    return found


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every kernel compiled for sm_90, in one fresh process: once the Triton interpreter has run
    kernels in this one (the CPU suite's other tests), Gluon's code generator fails on kernels it
    compiles in a new cache."""
    folder = tmp_path_factory.mktemp("sm90")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Without the interpreter: under TRITON_INTERPRET=1 triton.language's own jitted helpers (the
    # combine functions of gl.max and gl.sum) are interpreted functions, which no compiler takes.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", "import sys; from tests.test_hopper_gemm import _compile_all; "
                    "_compile_all(sys.argv[1])", str(folder)], cwd=root, env=env, check=True)
    return folder


def test_every_gluon_kernel_is_checked(compiled):
    assert (compiled / "names").read_text().split() == GLUON_KERNELS


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "cuobjdump")), reason="triton ships no cuobjdump here")
@pytest.mark.parametrize("kernel", GLUON_KERNELS)
def test_compiles_for_sm90_without_loop_spills(compiled, kernel):
    folder = compiled / kernel
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", str(folder / "k.cubin")], capture_output=True,
                          text=True, check=True).stdout
    assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass, "no FP8 warpgroup MMA in the SASS"
    assert not _local_memory_in_loops(sass), f"registers spill to local memory in a K loop: {_local_memory_in_loops(sass)}"
    spills = len(re.findall(r"\b(LDL|STL)\b", sass))
    assert spills <= EPILOGUE_SPILLS.get(kernel, 0), f"{spills} local loads/stores: registers spill"
    shared = int((folder / "shared").read_text())
    assert shared <= 227 * 1024, f"{shared} bytes of shared memory"
    ptx = (folder / "k.ptx").read_text()
    assert "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx


@pytest.mark.gpu
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
    # Row by row (tests/bounds.py): a missing or misplaced row moves its own row by O(1).
    assert_rows_close(out, ref, BF16_ROWS, "out", f"seed {seed}")
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item(),
                               msg=lambda d: f"seed {seed}: {d}")


@pytest.mark.gpu
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


# Expert row counts: balanced, an expert with no rows, every row on one expert, counts that are not
# multiples of the 128-row tile, a single row.
WGRAD_ROUTINGS = {"uneven": [300, 0, 129, 1024, 5, 128], "one_expert": [0, 0, 1000, 0], "single_row": [1, 0],
                  "balanced": [512] * 8}


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("routing", list(WGRAD_ROUTINGS))
@pytest.mark.parametrize("M,NCOL", [(256, 384), (768, 2048), (128, 136)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_matches_float64(routing, M, NCOL, out_dtype):
    if out_dtype == torch.bfloat16 and NCOL % 8:
        pytest.skip("bf16 rows of 136 columns are not 16-byte aligned")
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    at_q, at_s, bt_q, bt_s, offs = make_wgrad_inputs(WGRAD_ROUTINGS[routing], M, NCOL, generator=gen)
    out = W.fp8_wgrad_ws(at_q, at_s, bt_q, bt_s, offs, out_dtype)
    ref = fp8_wgrad_ref(at_q, at_s, bt_q, bt_s, offs)
    assert out.shape == ref.shape and out.dtype == out_dtype
    counts = offs.diff().tolist()
    for e, n in enumerate(counts):
        if n == 0:
            assert (out[e] == 0).all(), f"seed {seed}: expert {e} has no rows but a nonzero gradient"
    # Inside a 128-token block Hopper's FP8 MMA keeps ~14 mantissa bits; bf16 output rounds to 2^-9.
    # Per expert and per row and column of each expert's matrix (tests/bounds.py): a token missing
    # from an expert's sum, or a zeroed row or column, moves its expert, row or column.
    expert, lines = WGRAD_BOUNDS[out_dtype]
    assert_experts_close(out, ref, expert, lines, "dW", f"seed {seed}")
    # The Triton kernel computes the same sums: both engines agree closely.
    tri = fp8_wgrad(at_q, at_s, bt_q, bt_s, offs, out_dtype)
    assert_experts_close(out, tri, expert, lines, "dW against the Triton engine", f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_wgrad_rejects_what_it_cannot_run():
    at_q, at_s, bt_q, bt_s, offs = make_wgrad_inputs([200, 10], 192, 256, generator=torch.Generator().manual_seed(0))
    assert not W.wgrad_supported(192, 256, torch.float32)
    with pytest.raises(ValueError, match="multiple of 128"):
        W.fp8_wgrad_ws(at_q, at_s, bt_q, bt_s, offs)
    with pytest.raises(ValueError, match="at_s"):
        W.fp8_wgrad_ws(at_q[:128], at_s[:64], bt_q, bt_s, offs)


# Expert row counts of the M-grouped tests (as WGRAD_ROUTINGS), and rows past every expert.
GROUPED_ROUTINGS = {"uneven": ([300, 0, 129, 1024, 5, 128], 37), "one_expert": ([0, 0, 1000, 0], 0),
                    "single_row": ([1, 0], 3), "balanced": ([512] * 8, 0)}


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("routing", list(GROUPED_ROUTINGS))
@pytest.mark.parametrize("N,K", [(256, 384), (2048, 768), (136, 208), (768, 2048)])
@pytest.mark.parametrize("mode", ["down", "dx", "da"])
def test_grouped_matches_float64(routing, N, K, mode):
    """The op's three uses: combine (scatter to slots, routing weights, bf16), scatter (bf16), plain
    rows (fp32), against float64 and the Triton kernel on the rows the op reads (rows past every
    expert are left unwritten, as by the Triton kernel); deterministic."""
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    counts, extra = GROUPED_ROUTINGS[routing]
    a_q, a_s, b_q, b_s, offs, slot, w = make_grouped_inputs(counts, N, K, extra, generator=gen)
    kw = dict(out_slot_N=slot if mode != "da" else None, slot_weights_N=w if mode == "down" else None)
    dtype = torch.float32 if mode == "da" else torch.bfloat16
    out = G.fp8_grouped_gemm_ws(a_q, a_s, b_q, b_s, offs, dtype, **kw)
    assert out.shape == (a_q.shape[0], N) and out.dtype == dtype
    ref = fp8_grouped_gemm_ref(a_q, a_s, b_q, b_s, offs, **kw)
    written = torch.zeros(a_q.shape[0], dtype=torch.bool, device=out.device)
    written[:int(offs[-1])] = True
    if kw["out_slot_N"] is not None:
        written = torch.zeros_like(written).index_copy(0, slot.long(), written)
    out2 = G.fp8_grouped_gemm_ws(a_q, a_s, b_q, b_s, offs, dtype, **kw)
    torch.testing.assert_close(out2[written], out[written], rtol=0, atol=0,
                               msg=lambda d: f"seed {seed}: not deterministic: {d}")
    # Row by row (tests/bounds.py): a row (a slot) dropped or written to the wrong slot moves by O(1).
    tol = BF16_ROWS if dtype == torch.bfloat16 else FP32_ROWS
    if written.any():
        o, r = out[written], ref[written]
        assert_rows_close(o, r, tol, "out", f"seed {seed}")
        tri = fp8_grouped_gemm(a_q, a_s, b_q, b_s, offs, out_dtype=dtype, **kw)[written]
        assert_rows_close(o, tri, tol, "out against the Triton engine", f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_grouped_rejects_what_it_cannot_run():
    a_q, a_s, b_q, b_s, offs, slot, w = make_grouped_inputs([200, 10], 256, 200, generator=torch.Generator().manual_seed(0))
    assert not G.grouped_supported(200)
    with pytest.raises(ValueError, match="multiple of 16"):
        G.fp8_grouped_gemm_ws(a_q, a_s, b_q, b_s, offs)
    a_q, a_s, b_q, b_s, offs, slot, w = make_grouped_inputs([200, 10], 256, 256, generator=torch.Generator().manual_seed(0))
    for tiles in (torch.zeros(2, 4, dtype=torch.int32, device="cuda"),  # wrong size
                  torch.zeros(2, 3, dtype=torch.int32, device="cuda")):  # right size, no tile count after it
        with pytest.raises(ValueError, match="tile_table"):
            G.fp8_grouped_gemm_ws(a_q, a_s, b_q, b_s, offs, tiles=tiles)
    with pytest.raises(ValueError, match="slot_weights_N needs out_slot_N"):
        G.fp8_grouped_gemm_ws(a_q, a_s, b_q, b_s, offs, slot_weights_N=w)


# (tokens, top-k, experts, D, F, routing): partial row tiles, an expert with no rows, every slot on one
# expert, EP's empty slots, a K that ends in a partial 128 block (208), the 30B widths.
GATE_UP_CASES = [(300, 8, 8, 256, 256, "random"), (129, 1, 4, 208, 128, "one_expert"),
                 (77, 2, 8, 2048, 768, "empty_expert"), (200, 4, 8, 256, 384, "empty_slots")]


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("case", GATE_UP_CASES, ids=lambda c: f"T{c[0]}k{c[1]}E{c[2]}D{c[3]}F{c[4]}-{c[5]}")
@pytest.mark.parametrize("pow2", [False, True])
def test_gate_up_matches_the_triton_kernel(case, pow2):
    """The Gluon gate/up over rows gathered into expert order against the Triton kernel (which
    gathers them itself) and float64: H and A's e4m3 bytes and scales, on the rows the op reads."""
    from kernels.fp8 import blockwise as Q
    from kernels.fp8.grouped_gemm import fp8_gate_up_swiglu, fp8_gate_up_swiglu_ref
    from kernels.common.routing import gather_sorted_rows, sort_by_expert, tile_table
    from tests.utils import make_routing

    seed = random_seed()
    T, K, E, D, F, kind = case
    ids, _ = make_routing(T, K, E, kind, device="cuda")
    slots, offs = sort_by_expert(ids, E)
    xq, xs = Q.quantize_1x128(torch.randn(T, D, device="cuda"), pow2)
    w1q, w1s = Q.quantize_weight(torch.randn(E, F, D, device="cuda") * 0.05, pow2)
    w3q, w3s = Q.quantize_weight(torch.randn(E, F, D, device="cuda") * 0.05, pow2)
    tiles = tile_table(offs, T * K, 128)
    a_in = gather_sorted_rows(xq.view(torch.uint8), slots, offs, K).view(xq.dtype)
    s_in = gather_sorted_rows(xs, slots, offs, K)
    h, (aq, a_s) = GU.fp8_gate_up_swiglu_ws(a_in, s_in, w1q, w1s, w3q, w3s, offs, tiles=tiles, pow2_scales=pow2)
    h_t, _, (aq_t, as_t) = fp8_gate_up_swiglu(xq, xs, w1q, w1s, w3q, w3s, slots, offs, K, quantize_a=True,
                                              store_a=False, pow2_scales=pow2, tiles=tiles, block_m=128)
    n = int(offs[-1])
    g, u, _ = fp8_gate_up_swiglu_ref(xq, xs, w1q, w1s, w3q, w3s, slots, offs, K)
    ref = torch.cat([g[:n], u[:n]], dim=1)
    if n:
        assert_rows_close(h[:n], ref, BF16_ROWS, "H against float64", f"seed {seed}")
    # The same MMAs and promotions in the same order: the engines agree bit for bit.
    assert torch.equal(h[:n], h_t[:n]), f"seed {seed}: H differs from the Triton kernel's"
    assert torch.equal(aq[:n].view(torch.uint8), aq_t[:n].view(torch.uint8)), f"seed {seed}: A's e4m3 bytes differ"
    assert torch.equal(a_s[:n], as_t[:n]), f"seed {seed}: A's scales differ"


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_gate_up_rejects_what_it_cannot_run():
    from kernels.fp8 import blockwise as Q

    E, F, D = 2, 192, 256
    aq, as_ = Q.quantize_1x128(torch.randn(64, D, device="cuda"))
    wq, ws = Q.quantize_weight(torch.randn(E, F, D, device="cuda"))
    offs = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    assert not GU.gate_up_supported(D, F, torch.bfloat16) and not GU.gate_up_supported(D, 256, torch.float32)
    with pytest.raises(ValueError, match="multiple of 128"):
        GU.fp8_gate_up_swiglu_ws(aq, as_, wq, ws, wq, ws, offs)
    wq, ws = Q.quantize_weight(torch.randn(E, 256, D, device="cuda"))
    with pytest.raises(ValueError, match="w1_q .* w3_q"):
        GU.fp8_gate_up_swiglu_ws(aq, as_, wq, ws, wq[:, :128].contiguous(), ws, offs)
    with pytest.raises(ValueError, match="tile_table"):
        GU.fp8_gate_up_swiglu_ws(aq, as_, wq, ws, wq, ws, offs, tiles=torch.zeros(2, 3, dtype=torch.int32, device="cuda"))


def test_checked_tile_table():
    """The Gluon launchers' tile table (CPU: no kernel runs): built when not given, and a caller's table
    of the wrong size, or without room for the tile count stored after it, refused."""
    from kernels.common.routing import max_tiles, tile_table

    offs = torch.tensor([0, 130, 130, 300], dtype=torch.int32)  # an empty expert, partial tiles
    Nr, n = 300, max_tiles(300, 3, gluon_base.GROUPED_BLOCK_M)
    built = gluon_base.checked_tile_table(None, offs, Nr, n)
    assert torch.equal(built, tile_table(offs, Nr, gluon_base.GROUPED_BLOCK_M))
    assert gluon_base.checked_tile_table(built, offs, Nr, n) is built
    with pytest.raises(ValueError, match="is not a table of 128-row tiles over 300 rows"):
        gluon_base.checked_tile_table(torch.zeros(2, n + 1, dtype=torch.int32), offs, Nr, n)
    with pytest.raises(ValueError, match="which also stores the tile count after it"):
        gluon_base.checked_tile_table(torch.zeros(2, n, dtype=torch.int32), offs, Nr, n)  # no count past the table


def test_engine_choice():
    with pytest.raises(ValueError, match="one of"):
        resolve_engine("cutlass", "cpu")
    assert resolve_engine("triton", "cpu") == "triton"
    assert resolve_engine("auto", "cpu") == "triton"
    with pytest.raises(RuntimeError, match="cannot run"):
        resolve_engine("gluon", "cpu")
    if IS_HOPPER and os.environ.get("TRITON_INTERPRET") != "1":
        assert resolve_engine("auto", "cuda") == "gluon"
