"""bench/step_breakdown.py on a hand-written trace in the profiler's Chrome format."""

import json

import pytest

from bench import step_breakdown as SB


def _op(name, ts, dur, ext, tid=1, dims=None):
    args = {"External id": ext}
    if dims is not None:
        args["Input Dims"] = dims
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _launch(ts, corr, ext, tid=1):
    args = {"correlation": corr} if ext is None else {"correlation": corr, "External id": ext}
    return {"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": ts, "dur": 1, "tid": tid, "args": args}


def _kernel(name, ts, dur, corr, ext, cat="kernel"):
    args = {"correlation": corr} if ext is None else {"correlation": corr, "External id": ext}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7, "args": args}


def _trace():
    ev = [
        # A compiled region launching an inductor RMSNorm and a cast kernel (no op of their own).
        _op("CompiledFunction", 0, 100, 1),
        _launch(1, 101, 1), _kernel("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 10, 5, 101, 1),
        _launch(2, 102, 1), _kernel("triton_poi_fused__to_copy_3", 15, 2, 102, 1),
        # Attention through its aten op: cuDNN kernel.
        _op("aten::_scaled_dot_product_cudnn_attention", 3, 5, 2),
        _launch(4, 103, 2), _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 20, 30, 103, 2),
        # The MoE custom op launching a Triton kernel and an inner aten::mm (cuBLAS).
        _op("mega_moe::forward", 10, 20, 3),
        _launch(11, 104, 3), _kernel("_gate_up_swiglu_kernel", 50, 40, 104, 3),
        _op("aten::mm", 12, 3, 4, dims=[[1024, 2048], [2048, 768]]),
        _launch(13, 105, 4), _kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 90, 10, 105, 4),
        # A Triton launch with no op of its own: found by its launch time inside the MoE op.
        _launch(14.5, 110, None), _kernel("triton_poi_fused_mul_7", 160, 3, 110, None),
        # Dense GEMM, and the output head's GEMM (a vocab-sized dim).
        _op("aten::mm", 31, 3, 5, dims=[[16384, 2048], [2048, 2048]]),
        _launch(32, 106, 5), _kernel("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_NTT", 100, 8, 106, 5),
        _op("aten::mm", 35, 3, 6, dims=[[16384, 2048], [2048, 151936]]),
        _launch(36, 107, 6), _kernel("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_NTT", 108, 20, 107, 6),
        # The optimizer; a memcpy; an unknown kernel.
        _op("Optimizer.step#AdamW.step", 40, 10, 7),
        _launch(41, 108, 7), _kernel("void at::native::multi_tensor_apply_kernel<...>", 130, 10, 108, 7),
        _kernel("Memcpy HtoD (Pageable -> Device)", 145, 5, 0, 0, cat="gpu_memcpy"),
        _op("aten::weird", 60, 2, 9),
        _launch(61, 109, 9), _kernel("some_kernel_nobody_knows", 155, 5, 109, 9),
    ]
    return {"traceEvents": ev}


def test_breakdown_classifies_and_accounts_every_microsecond():
    report = SB.breakdown(_trace(), steps=1)
    parts = report["parts_ms"]
    want = {"norm": 5, "cast": 2, "attention": 30, "moe": 53, "gemm": 8, "lm_head": 20, "optimizer": 10,
            "memory": 5, "other": 5, "comm": 0}
    assert parts == pytest.approx({k: v / 1e3 for k, v in want.items()})
    # Kernels span 10..163 us with gaps at 17-20, 128-130, 140-145, 150-155.
    assert report["wall_ms"] == pytest.approx(0.153)
    assert report["busy_ms"] == pytest.approx(0.138)
    assert report["idle_ms"] == pytest.approx(0.015)
    assert report["top_kernels"][0]["name"] == "_gate_up_swiglu_kernel"
    assert sum(k["ms"] for k in report["top_kernels"]) == pytest.approx(sum(parts.values()))
    md = SB.markdown(report)
    assert "| moe | 0.05 |" in md and "| idle |" in md
    # The gaps by their neighbours, largest first, summing to the idle time.
    gaps = report["idle_gaps"]
    assert sum(g["ms"] for g in gaps) == pytest.approx(report["idle_ms"])
    assert [round(g["ms"] * 1e3) for g in gaps] == [5, 5, 3, 2]
    assert (gaps[2]["after"], gaps[2]["before"]) == ("cast: triton_poi_fused__to_copy_3",
                                                    "attention: cudnn_generated_fort_native_sdpa_sm90_flash_fprop")
    assert {gaps[0]["after"], gaps[1]["after"]} == {"optimizer: void at::native::multi_tensor_apply_kernel<...>",
                                                    "memory: Memcpy HtoD (Pageable -> Device)"}
    assert "Idle gaps by the kernels around them" in md


def test_steps_divide_and_cli(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    assert SB.main([str(path), "--steps", "2", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "step wall 0.1 ms" in out
    assert json.loads((tmp_path / "r.json").read_text())["parts_ms"]["moe"] == pytest.approx(0.0265)
    with pytest.raises(SystemExit):
        SB.main([str(tmp_path / "missing.json"), "--steps", "1"])


def test_cpu_only_trace_is_refused(tmp_path, capsys):
    cpu_only = {"traceEvents": [_op("aten::mm", 0, 1, 1)]}
    with pytest.raises(ValueError, match="no GPU kernels"):
        SB.breakdown(cpu_only, steps=1)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(cpu_only))
    assert SB.main([str(path), "--steps", "1"]) == 2
    assert "profile a CUDA run" in capsys.readouterr().err


def test_copies_inside_a_collective_are_communication():
    """A simulated world's collectives are copies (a memcpy and a copy kernel) launched inside the
    collective's op: they count as communication; a memcpy outside any collective stays memory."""
    ev = [_op("_c10d_functional::all_to_all_single", 0, 10, 1),
          _launch(1, 201, 1), _kernel("Memcpy DtoD (Device -> Device)", 10, 6, 201, 1, cat="gpu_memcpy"),
          _op("c10d::allgather_", 3, 5, 2),
          _launch(4, 202, 2), _kernel("void at::native::elementwise_kernel<copy>", 20, 4, 202, 2),
          _op("aten::copy_", 30, 2, 3),
          _launch(31, 203, 3), _kernel("Memcpy DtoD (Device -> Device)", 30, 3, 203, 3, cat="gpu_memcpy")]
    report = SB.breakdown({"traceEvents": ev}, steps=1)
    assert report["parts_ms"]["comm"] == pytest.approx(0.010)
    assert report["parts_ms"]["memory"] == pytest.approx(0.003)
    assert report["comm_exposed_ms"] == pytest.approx(0.010)


def test_exposed_communication():
    """Two streams: an all-to-all 0-10 us overlapped by a GEMM 5-20 us, then one 20-30 us alone."""
    ev = [_kernel("ncclDevKernel_SendRecv", 0, 10, 1, 1), _kernel("nvjet_gemm", 5, 15, 2, 2),
          _kernel("ncclDevKernel_AllToAll", 20, 10, 3, 3)]
    report = SB.breakdown({"traceEvents": ev}, steps=1)
    assert report["comm_ms"] == pytest.approx(0.020)
    assert report["comm_exposed_ms"] == pytest.approx(0.015)  # 0-5 and 20-30
    assert report["busy_ms"] == pytest.approx(0.030) and report["idle_ms"] == pytest.approx(0.0)
    assert "exposed 0.0 ms" in SB.markdown(report)


def test_host_work_during_long_gaps():
    """A 3 ms gap whose next kernel was launched late: the host time until that launch is charged to
    the ops that ran inside the op enclosing the whole gap; a gap the launch did not wait for
    charges nothing; short gaps are not looked at."""
    ev = [
        _op("aten::mm", 0, 5, 1), _launch(1, 201, 1), _kernel("nvjet_tst_a", 10, 100, 201, 1),
        # The optimizer step: the GPU idles from 110 to 3110 while the host runs two ops in it.
        _op("Optimizer.step#AdamW.step", 100, 4000, 2),
        _op("aten::_foreach_norm", 100, 1000, 3), _op("aten::_fused_adamw_", 1200, 1900, 4),
        _launch(3100, 202, 4), _kernel("void at::native::multi_tensor_apply_kernel<a>", 3110, 50, 202, 4),
        # A 2 ms gap the kernel's launch did not wait for (launched long before): nothing charged.
        _op("aten::add", 3150, 5, 5), _launch(3151, 203, 5), _kernel("void add_kernel", 5160, 10, 203, 5),
        # A short gap (0.5 ms): not looked at.
        _op("aten::mul", 5600, 5, 6), _launch(5601, 204, 6), _kernel("void mul_kernel", 5670, 10, 204, 6),
    ]
    report = SB.breakdown({"traceEvents": ev}, steps=1)
    host = {(h["within"], h["op"]): h["ms"] for h in report["long_gap_host"]}
    assert host == pytest.approx({("Optimizer.step#AdamW.step", "aten::_foreach_norm"): 0.99,
                                  ("Optimizer.step#AdamW.step", "aten::_fused_adamw_"): 1.9,
                                  ("Optimizer.step#AdamW.step", "(no op)"): 0.1})
    md = SB.markdown(report)
    assert "gaps of 1 ms or more" in md and "`aten::_fused_adamw_` | 1.900 |" in md
