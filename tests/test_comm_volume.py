"""bench/comm_volume.py: the bytes of every collective on a layout small enough to count by hand,
the totals, the link split, and the layouts the trainer would refuse."""

from __future__ import annotations

import json

import pytest

from bench import comm_volume as CV
from components.config import ConfigError

# The debug flavor: D 256, 4 layers, 8 heads and 2 KV heads of 32, vocab 2048, F 128, E 8, top-2.
# 4 ranks on 2 nodes of 2: FSDP 4, EP 2 (ranks 0-1, one node), expert shards 2 (ranks 0 and 2,
# one per node), 8 tokens per rank.
TINY = CV.Layout("debug", world=4, ep=2, seq_len=8, batch=1, gpus_per_node=2)
NV, IB = 450e9, 50e9


def _rows(report):
    return {(c.name, c.when): c for c in report.collectives}


def test_tiny_layout_bytes_by_hand():
    r = CV.comm_volume(TINY)
    rows = _rows(r)
    # C = min(ceil(2.0 x T 8 x K 2 / ep 2), T 8 x min(K 2, E/ep 4)) = min(16, 16) = 16 rows per peer.
    assert r.derived["capacity_rows_per_peer"] == 16
    # A bf16 row of D: 512 B; the one peer gets 16 rows = 8192 B of a 2 x 8192 = 16384 B buffer, on NVLink.
    # Forward and recomputation: 2 x 4 layers = 8 calls; backward: dispatch and combine gradients, 2 x 4.
    for name, when in (("EP dispatch: token rows (bf16)", "fwd + recompute"),
                       ("EP combine: expert output rows (bf16)", "fwd + recompute"),
                       ("EP gradients of combine and dispatch (bf16)", "bwd")):
        c = rows[name, when]
        assert (c.calls, c.tensor_bytes, c.sent_bytes, c.nvlink_bytes, c.ib_bytes) == (8, 16384, 8192, 8192, 0)
    # One int64 id per row: 16 x 8 = 128 B to the peer, forward and recomputation only.
    ids = rows["EP dispatch: expert ids (int64)", "fwd + recompute"]
    assert (ids.calls, ids.tensor_bytes, ids.sent_bytes) == (8, 256, 128)
    # Each of w1, w3, w2 of this rank's E/ep = 4 experts: 4 x 128 x 256 x 2 B = 262144 B, gathered over 2
    # ranks on 2 nodes: half sent, all through the NIC. 3 weights x 4 layers x 2 passes = 24 gathers,
    # 12 bf16 reduce-scatters.
    ag = rows["expert weights all-gather (bf16, w1 w3 w2)", "fwd + recompute"]
    rs = rows["expert gradients reduce-scatter (bf16)", "bwd"]
    assert (ag.calls, ag.tensor_bytes, ag.sent_bytes, ag.ib_bytes) == (24, 262144, 131072, 131072)
    assert (rs.calls, rs.tensor_bytes, rs.sent_bytes, rs.ib_bytes) == (12, 262144, 131072, 131072)
    # A block's dense parameters: norms 256 + 256, wq 256 x 256 = 65536, wk and wv 64 x 256 = 16384 each,
    # wo 65536, q/k norms 32 + 32, router gate 8 x 256 = 2048: 166464 (every dim 0 divides by 4).
    assert r.derived["block_fsdp_numel"] == 166464
    # bf16: 332928 B, 3/4 sent = 249696; over 2 nodes with 2 ranks each, half of it through the NIC.
    fwd = rows["FSDP block params all-gather (bf16)", "fwd"]
    bwd = rows["FSDP block params all-gather (bf16)", "bwd"]
    assert (fwd.calls, fwd.tensor_bytes, fwd.sent_bytes, fwd.ib_bytes, fwd.nvlink_bytes) == (
        4, 332928, 249696, 124848, 124848)
    assert (bwd.calls, bwd.sent_bytes) == (3, 249696)  # the last block is not resharded
    grads = rows["FSDP block grads reduce-scatter (float32)", "bwd"]
    assert (grads.calls, grads.tensor_bytes, grads.sent_bytes) == (4, 665856, 499392)
    # Embedding 2048 x 256 = 524288: gathered in forward and backward, reduced in float32.
    emb = rows["FSDP tok_embeddings all-gather (bf16)", "fwd + bwd"]
    assert (emb.calls, emb.tensor_bytes, emb.sent_bytes) == (2, 1048576, 786432)
    assert rows["FSDP tok_embeddings grads reduce-scatter (float32)", "bwd"].sent_bytes == 1572864
    # Norm 256 + output 2048 x 256: 524544, gathered once (kept for backward).
    out = rows["FSDP norm + output all-gather (bf16)", "fwd"]
    assert (out.calls, out.tensor_bytes, out.sent_bytes) == (1, 1049088, 786816)
    assert rows["FSDP norm + output grads reduce-scatter (float32)", "bwd"].sent_bytes == 1573632
    assert len(r.collectives) == 13
    # 3 x 65536 + 1024 (EP) + 24 x 131072 + 12 x 131072 (experts) + 7 x 249696 + 4 x 499392 (blocks)
    # + 2 x 786432 + 1572864 (embedding) + 786816 + 1573632 (norm + output)
    assert r.totals()["sent_bytes"] == 197632 + 4718592 + 3745440 + 3145728 + 2360448 == 14167840


def test_times_at_link_rates_and_totals_sum_the_parts():
    r = CV.comm_volume(TINY)
    rows, t = _rows(r), r.totals()
    # NIC-bound ring over 2 nodes of 2: rails put half the bytes on the NIC, one NIC all of them.
    fwd = rows["FSDP block params all-gather (bf16)", "fwd"]
    assert r.seconds(fwd) == pytest.approx(4 * 124848 / IB)
    assert r.one_nic_seconds(fwd) == pytest.approx(4 * 249696 / IB)
    assert r.seconds(rows["EP dispatch: token rows (bf16)", "fwd + recompute"]) == pytest.approx(8 * 8192 / NV)
    for c in r.collectives:
        assert c.nvlink_bytes + c.ib_bytes == c.sent_bytes
    assert t["sent_bytes"] == sum(c.calls * c.sent_bytes for c in r.collectives)
    assert t["ib_bytes"] + t["nvlink_bytes"] == t["sent_bytes"]
    assert t["seconds"] == pytest.approx(sum(r.seconds(c) for c in r.collectives))
    assert t["seconds"] == pytest.approx(sum(t["by_group_seconds"].values()))
    assert t["one_nic_seconds"] >= t["seconds"]
    half = CV.comm_volume(TINY, efficiency=0.5)
    assert half.totals()["seconds"] == pytest.approx(2 * t["seconds"])


def test_padding_no_ep_no_ac_and_fp8():
    # FSDP2 pads dim 0 to a multiple of the group: (5, 3) over 4 ranks is gathered as (8, 3).
    assert CV.ring_tensor_numel((5, 3), 4) == 24
    # 64 ranks: q_norm and k_norm (32) pad to 64, the gate's 8 rows to 64: 166464 + 2 x 32 + 56 x 256.
    wide = CV.comm_volume(CV.Layout("debug", world=64, ep=8, seq_len=8))
    assert wide.derived["block_fsdp_numel"] == 166464 + 64 + 14336
    # Without EP the experts (3 x 8 x 128 x 256) are FSDP's and there is no all-to-all.
    no_ep = CV.comm_volume(CV.Layout("debug", world=2, ep=1, seq_len=8))
    assert no_ep.derived["block_fsdp_numel"] == 166464 + 786432
    assert not [c for c in no_ep.collectives if c.kind == "all_to_all"]
    # Without activation checkpointing nothing is recomputed.
    no_ac = _rows(CV.comm_volume(CV.Layout("debug", world=4, ep=2, seq_len=8, gpus_per_node=2, full_ac=False)))
    assert no_ac["EP dispatch: token rows (bf16)", "fwd"].calls == 4
    assert no_ac["expert weights all-gather (bf16, w1 w3 w2)", "fwd"].calls == 12
    # The capacity is the trainer's: ceil(0.5 x 8 x 2 / 2) = 4, and a large factor stops at T x min(K, E/ep).
    assert CV.comm_volume(CV.Layout("debug", 4, 2, seq_len=8, capacity_factor=0.5)).derived[
        "capacity_rows_per_peer"] == 4
    assert CV.comm_volume(CV.Layout("debug", 4, 2, seq_len=8, capacity_factor=100)).derived[
        "capacity_rows_per_peer"] == 16
    fp8 = CV.comm_volume(CV.Layout("debug", world=4, ep=2, seq_len=8, gpus_per_node=2, fp8=True))
    assert fp8.totals()["sent_bytes"] == CV.comm_volume(TINY).totals()["sent_bytes"]
    assert any("FP8" in n for n in fp8.notes)


@pytest.mark.parametrize("layout, match", [
    (CV.Layout("debug", world=4, ep=3), "does not divide the 8 experts"),
    (CV.Layout("debug", world=6, ep=4), "does not divide the data-parallel shard degree 6"),
    (CV.Layout("debug", world=12, ep=4), "not a whole number of 8-GPU nodes"),
    (CV.Layout("debug", world=24, ep=8), "not divisible by the 3 ranks"),
    (CV.Layout("debug", world=4, ep=2, seq_len=0), "seq_len"),
    (CV.Layout("debug", world=4, ep=2, reduce_dtype="float16"), "reduce_dtype"),
])
def test_bad_layouts_raise(layout, match):
    with pytest.raises(ValueError, match=match):
        CV.comm_volume(layout)
    assert issubclass(ConfigError, ValueError)


def test_cli_markdown_and_json(capsys, tmp_path):
    argv = ["--flavor", "debug", "--world", "4", "--ep", "2", "--seq-len", "8", "--gpus-per-node", "2"]
    CV.main(argv + ["--json"])
    payload = json.loads(capsys.readouterr().out)
    assert payload["totals"]["sent_bytes"] == 14167840
    assert payload["derived"]["capacity_rows_per_peer"] == 16
    assert set(payload["links"]["sources"]) == {"nvlink", "nvlink_mlperf", "ib", "ring"}
    CV.main(argv + ["--json", str(tmp_path / "out.json")])
    text = capsys.readouterr().out
    assert "| **total** |" in text and "EP dispatch: token rows (bf16)" in text
    assert json.loads((tmp_path / "out.json").read_text())["totals"]["sent_bytes"] == 14167840
    reports = CV.main(["--preset", "all"])
    capsys.readouterr()
    assert [(r.layout.world, r.derived["n_layers"]) for r in reports] == [(8, 48), (32, 48), (128, 94)]
