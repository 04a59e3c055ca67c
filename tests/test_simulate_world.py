"""A simulated world (``[parallelism] simulate_world_size``, parallelisms/simulate.py): one process
acts as rank 0 of N with collectives looped back. Each collective's rule, the expert-parallel
exchange it implies, the trainer at N = 2, 4 and 8 (FSDP, FSDP + EP, HSDP + EP, compiled), the
per-rank parameter memory, and the refusals."""

import collections
import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from components.config import ConfigError
from parallelisms.simulate import init_simulated_world
from tests.utils import logged_steps, make_trainer, run_losses, trainer_args
from train import main

SIM = "--parallelism.simulate_world_size"
EP = "--parallelism.expert_parallel_degree"
# Three steps of the 1-layer debug model, 2 x 32 tokens per rank and step, every step logged.
TINY = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.steps", "3", "--training.device", "cpu"]


@pytest.fixture
def world():
    """Starts a loopback world of N ranks (``world(N)``); destroys whatever group is left after the test."""
    yield init_simulated_world
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# The collectives
# --------------------------------------------------------------------------------------------------

@pytest.mark.unit
def test_all_gather_repeats_the_local_shard(world):
    world(4)
    x = torch.arange(6.0).view(3, 2)
    out = torch.full((12, 2), float("nan"))
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, x.repeat(4, 1))
    outs = [torch.empty_like(x) for _ in range(4)]
    dist.all_gather(outs, x)
    assert all(torch.equal(o, x) for o in outs)
    assert torch.equal(funcol.all_gather_tensor(x, 0, dist.group.WORLD), x.repeat(4, 1))
    # The expert shards' gather (along dim 1) and its backward, a reduce-scatter of the gradient.
    w = x.clone().requires_grad_()
    full = funcol.all_gather_tensor_autograd(w, 1, dist.group.WORLD)
    assert torch.equal(full, x.repeat(1, 4))
    grad = torch.arange(24.0).view(3, 8)
    full.backward(grad)
    assert torch.equal(w.grad, 4 * grad[:, :2])  # SUM: every rank sent this rank's gradient


@pytest.mark.unit
def test_reduce_scatter_is_this_ranks_chunk_reduced_over_identical_ranks(world):
    world(4)
    x = torch.arange(8.0)
    for op, factor in ((dist.ReduceOp.SUM, 4), (dist.ReduceOp.AVG, 1), (dist.ReduceOp.MAX, 1)):
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, x.clone(), op=op)
        assert torch.equal(out, factor * x[:2]), op
    assert torch.equal(funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD), 4 * x[:2])
    assert torch.equal(funcol.reduce_scatter_tensor(x, "avg", 0, dist.group.WORLD), x[:2])
    out = torch.empty(2)
    dist.reduce_scatter(out, list(x.chunk(4)))
    assert torch.equal(out, 4 * x[:2])


@pytest.mark.unit
def test_fsdp_gradient_divide_factor_is_applied_after_the_sum(world):
    """A gradient divide factor (upstream TorchTitan sets one under expert parallelism) makes FSDP2
    pass PREMUL_SUM(1 / factor), whose factor torch 2.11 hides from Python: the simulated world has
    FSDP2 sum and then divide instead, with the same gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    world(4)
    ops = collectives._get_gradient_divide_factors(dist.group.WORLD, None, torch.float32, "cpu", 8.0)
    assert ops[1:] == (8.0, dist.ReduceOp.SUM, dist.ReduceOp.SUM)
    lin = torch.nn.Linear(8, 4, bias=False)
    fully_shard(lin, mesh=init_device_mesh("cpu", (4,)))
    lin.set_gradient_divide_factor(8.0)
    x = torch.randn(3, 8)
    lin(x).sum().backward()
    # Four identical ranks summed, divided by 8: half of this rank's row of the gradient.
    assert torch.allclose(lin.weight.grad.to_local(), 0.5 * x.sum(0, keepdim=True))


@pytest.mark.unit
def test_loopback_copies_are_timed_until_taken(world):
    """The copies that stand in for collectives are timed (host clock on CPU), summed over the
    groups, and reset when taken; outside a simulated world there are none."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallelisms.simulate import loopback_copy_seconds

    assert loopback_copy_seconds() == 0.0
    world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    x = torch.randn(1 << 20)
    dist.all_to_all_single(torch.empty_like(x), x, group=mesh.get_group("a"))
    dist.all_gather_into_tensor(torch.empty(4 << 20), x)
    first = loopback_copy_seconds()
    assert first > 0
    assert loopback_copy_seconds() == 0.0
    dist.barrier()  # moves nothing
    assert loopback_copy_seconds() == 0.0


@pytest.mark.unit
def test_all_reduce_sums_n_copies_and_keeps_avg_max_min(world):
    world(8)
    for op, factor in ((dist.ReduceOp.SUM, 8), (dist.ReduceOp.AVG, 1), (dist.ReduceOp.MAX, 1), (dist.ReduceOp.MIN, 1)):
        t = torch.tensor([1.5, -2.0])
        dist.all_reduce(t, op=op)
        assert torch.equal(t, factor * torch.tensor([1.5, -2.0])), op
    flag = torch.tensor([15], dtype=torch.int32)  # the signals' agreement: MAX of one int
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    assert flag.item() == 15
    assert torch.equal(funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD), torch.full((3,), 8.0))


@pytest.mark.unit
def test_all_to_all_loops_back_symmetric_exchanges_only(world):
    world(4)
    x = torch.arange(16.0).view(8, 2)
    assert torch.equal(funcol.all_to_all_single(x, None, None, dist.group.WORLD), x)
    assert torch.equal(funcol.all_to_all_single(x, [1, 3, 2, 2], [1, 3, 2, 2], dist.group.WORLD), x)
    outs = [torch.empty(2, 2) for _ in range(4)]
    dist.all_to_all(outs, list(x.chunk(4)))
    assert all(torch.equal(o, c) for o, c in zip(outs, x.chunk(4)))
    with pytest.raises(NotImplementedError, match="not a symmetric exchange"):
        dist.all_to_all_single(torch.empty(8, 2), x, [2, 2, 2, 2], [1, 3, 2, 2])


@pytest.mark.unit
def test_broadcast_and_barrier_are_local_and_point_to_point_is_refused(world):
    world(2)
    t = torch.tensor([3.0])
    dist.broadcast(t, src=0)
    assert t.item() == 3.0
    dist.barrier()
    box = [{"rank": 0}]
    dist.broadcast_object_list(box, src=0)
    assert box == [{"rank": 0}]
    gathered = [None, None]
    dist.all_gather_object(gathered, "mine")
    assert gathered == ["mine", "mine"]
    with pytest.raises(Exception, match="peer does not exist"):
        dist.send(t, dst=1)


@pytest.mark.unit
def test_ep_exchange_computes_each_slot_once_with_valid_local_ids(world):
    """Under loopback, the rows sent to rank r come back to this rank's experts with local ids in
    [0, E/ep): each (token, k) slot is computed exactly once, by the local expert of the same local
    index as its own (global id mod E/ep), and its output returns to its own row."""
    from kernels.moe import BackendArgs, get_moe_backend
    from parallelisms.expert_parallel import ExpertParallel
    from parallelisms.parallel_dims import ParallelDims

    world(4)
    E, ep, T, K, D, F = 8, 4, 16, 2, 8, 6
    mesh = ParallelDims(dp_replicate=1, dp_shard=4, ep=ep, world_size=4).mesh
    layer = ExpertParallel(mesh, E, capacity_factor=ep, param_dtype=torch.float32)  # no slot is dropped
    gen = torch.Generator().manual_seed(0)
    x_TD = torch.randn(T, D, generator=gen)
    ids_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights_TK = torch.rand(T, K, generator=gen)
    n_local = E // ep
    w1, w3 = torch.randn(n_local, F, D, generator=gen), torch.randn(n_local, F, D, generator=gen)
    w2 = torch.randn(n_local, D, F, generator=gen)

    recv_x, recv_expert, layout = layer._dispatch(x_TD, ids_TK, False)
    assert recv_x.shape[0] == ep * layer.capacity(T, K)  # one rank's receive buffer
    real = recv_expert >= 0
    assert int(real.sum()) == T * K and int(recv_expert.max()) < n_local
    rows = layout.send_row_N  # where each slot (in expert order) sits
    tokens = layout.sorted_slots_N // K
    assert torch.equal(recv_x[rows], x_TD[tokens])
    assert torch.equal(recv_expert[rows], layout.sorted_ids_N % n_local)

    backend = get_moe_backend("torch")
    y_TD, dropped_E = layer(backend, BackendArgs(), x_TD, ids_TK, weights_TK, w1, w3, w2)
    assert dropped_E.sum() == 0
    want = backend(x_TD, ids_TK % n_local, weights_TK, w1, w3, w2)
    torch.testing.assert_close(y_TD, want, rtol=1e-5, atol=1e-5)


def _mega_on_cpu() -> None:
    """The exchange tests hold CPU tensors: the mega kernels run on them in Triton's interpreter only."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the mega kernels run CPU tensors only in Triton's interpreter, which a CUDA machine's "
                    "tests do not select (tests/test_mega_moe*.py run them on the GPU)")


def _exchange_case(world, factor: float, dtype: torch.dtype, D: int, F: int, skewed: bool = True):
    """A 4-rank EP-4 exchange of E = 8 experts with fresh inputs: (layer, ids_TK, leaves, grad_TD,
    seed), leaves = [x, routing weights, w1, w3, w2] of this rank's E/ep experts. ``skewed``: expert
    E - 1 gets no token and expert 1 is hot (at factor 0.5 its destination overflows)."""
    from parallelisms.expert_parallel import ExpertParallel
    from parallelisms.parallel_dims import ParallelDims

    world(4)
    E, ep, T, K = 8, 4, 24, 3
    mesh = ParallelDims(dp_replicate=1, dp_shard=4, ep=ep, world_size=4).mesh
    layer = ExpertParallel(mesh, E, capacity_factor=factor, param_dtype=dtype)
    gen = torch.Generator()
    seed = gen.seed()
    ids_TK = torch.stack([torch.randperm(E - 1 if skewed else E, generator=gen)[:K] for _ in range(T)])
    if skewed:
        ids_TK[: T // 2, 0] = 1
    n_local = E // ep

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=dtype) * scale

    leaves = [randn(T, D), torch.rand(T, K, generator=gen, dtype=dtype), randn(n_local, F, D, scale=D**-0.5),
              randn(n_local, F, D, scale=D**-0.5), randn(n_local, D, F, scale=F**-0.5)]
    return layer, ids_TK, leaves, randn(T, D), seed


def _kept_slots(layer, x_TD, ids_TK) -> torch.Tensor:
    """(T, K) bool: the slots that fit the receive buffers (the rest are dropped)."""
    return layer._dispatch(x_TD, ids_TK, False)[2].slot_row_TK < layer.ep * layer.capacity(*ids_TK.shape)


@pytest.mark.parametrize("factor", [4.0, 0.5], ids=["no_drop", "drops"])
def test_ep_exchange_leaves_empty_rows_undefined_for_mega(world, monkeypatch, factor):
    """With a backend that reads only routed rows (the mega kernels, in Triton's interpreter here) the
    send buffer and the gradient of the returned rows are left undefined where empty -- NaN in this
    test -- and the mega kernels leave their outputs' empty rows unwritten: y and every gradient still
    equal the one-process torch backend's, with dropped slots at factor 0.5."""
    _mega_on_cpu()
    from kernels.moe import BackendArgs, get_moe_backend
    from parallelisms import expert_parallel as EP

    poisoned = []

    def nan_rows(num_rows, like):
        poisoned.append(num_rows)
        return like.new_full((num_rows, like.shape[-1]), float("nan"))

    monkeypatch.setattr(EP, "_undefined_rows", nan_rows)
    layer, ids_TK, leaves, grad_TD, seed = _exchange_case(world, factor, torch.float32, D=32, F=48)
    mega = get_moe_backend("mega")
    assert mega.routed_rows_only and not get_moe_backend("torch").routed_rows_only

    got = [t.clone().requires_grad_() for t in leaves]
    y_TD, dropped_E = layer(mega, BackendArgs(), got[0], ids_TK, *got[1:])
    y_TD.backward(grad_TD)
    R = layer.ep * layer.capacity(*ids_TK.shape)
    assert poisoned == [R + 1, R + 1], poisoned  # the send buffer, then the returned rows' gradient
    keep_TK = _kept_slots(layer, leaves[0], ids_TK)
    assert (int(dropped_E.sum()) > 0) == (factor < 1)

    want = [t.double().requires_grad_() for t in leaves]
    y_want = get_moe_backend("torch")(want[0], ids_TK % leaves[2].shape[0], want[1] * keep_TK, *want[2:])
    y_want.backward(grad_TD.double())
    torch.testing.assert_close(y_TD.double(), y_want, rtol=1e-4, atol=1e-4, msg=f"y (seed {seed})")
    for name, g, w in zip(["x", "weights", "w1", "w3", "w2"], got, want):
        torch.testing.assert_close(g.grad.double(), w.grad, rtol=1e-4, atol=1e-4, msg=f"{name} (seed {seed})")


@pytest.mark.parametrize("backend", ["torch", "mega"])
def test_ep_exchange_compiled_in_float32_has_the_eager_gradients(world, backend):
    """The exchange compiled whole (fullgraph) in float32, where the combine's output needs no cast:
    the loss and all five gradients equal eager's. (torch 2.11 compiled the combine with zero
    gradients while its forward ended in a no-op cast.) mega: the path that leaves empty rows undefined."""
    if backend == "mega":
        _mega_on_cpu()
    from kernels.moe import BackendArgs, get_moe_backend

    layer, ids_TK, leaves, _, seed = _exchange_case(world, 2.0, torch.float32, D=32, F=48, skewed=False)
    fn = get_moe_backend(backend)

    def loss(x, w, w1, w3, w2):
        y_TD, _ = layer(fn, BackendArgs(), x, ids_TK, w, w1, w3, w2)
        return y_TD.square().sum()

    results = []
    for f in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        got = [t.clone().requires_grad_() for t in leaves]
        out = f(*got)
        results.append([out, *torch.autograd.grad(out, got)])
    for name, a, b in zip(["loss", "x", "weights", "w1", "w3", "w2"], *results):
        assert b.abs().max() > 0, f"{name}: compiled gradient is zero (seed {seed})"
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"{name} (seed {seed})")


@pytest.mark.unit
@pytest.mark.parametrize("factor", [4.0, 0.5], ids=["no_drop", "drops"])
def test_ep_exchange_gradients_equal_autograd_through_one_process(world, factor):
    """The dispatch's and combine's hand-written backwards (gathers, float32 sums) against autograd
    through the one-process MoE in float64: gradients of x, the routing weights and the experts,
    fresh inputs each run, with empty rows in every buffer, an expert no token routes to, and at
    factor 0.5 dropped slots (whose weights get no gradient)."""
    from kernels.moe import BackendArgs, get_moe_backend

    layer, ids_TK, leaves, grad_TD, seed = _exchange_case(world, factor, torch.float64, D=8, F=6)
    backend = get_moe_backend("torch")

    got = [t.clone().requires_grad_() for t in leaves]
    y_TD, dropped_E = layer(backend, BackendArgs(), got[0], ids_TK, *got[1:])
    y_TD.backward(grad_TD)
    keep_TK = _kept_slots(layer, leaves[0], ids_TK)
    assert int(dropped_E.sum()) == int((~keep_TK).sum()) and (int(dropped_E.sum()) > 0) == (factor < 1)

    want = [t.clone().requires_grad_() for t in leaves]
    y_want = backend(want[0], ids_TK % leaves[2].shape[0], want[1] * keep_TK, *want[2:])
    y_want.backward(grad_TD)
    torch.testing.assert_close(y_TD, y_want, rtol=1e-12, atol=1e-12, msg=f"y (seed {seed})")
    for name, g, w in zip(["x", "weights", "w1", "w3", "w2"], got, want):
        torch.testing.assert_close(g.grad, w.grad, rtol=1e-12, atol=1e-12, msg=f"{name} (seed {seed})")


# --------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------

def run_simulated(tmp_path, capsys, *extra: str) -> str:
    """``train.main`` in this process with ``extra`` over TINY; its output (it must succeed)."""
    rc = main(trainer_args(tmp_path, *TINY, *extra))
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert rc == 0, out
    assert not dist.is_initialized()  # main destroys its group: the next run starts afresh
    return out


@pytest.mark.parametrize("n, extra", [
    (2, []), (4, []), (8, []),  # FSDP over all N ranks
    (2, [EP, "2"]), (4, [EP, "4"]), (8, [EP, "2"]),  # FSDP + EP (8, ep 2: experts also sharded over 4)
    (8, [EP, "8", "--parallelism.expert_capacity_factor", "8"]),  # one expert per rank
    (4, ["--parallelism.data_parallel_replicate_degree", "2", EP, "2", "--training.global_batch_size", "16",
         "--training.mixed_precision_param", "bfloat16", "--moe.load_balance", "expert_bias"]),  # HSDP + EP
], ids=["fsdp2", "fsdp4", "fsdp8", "ep2of2", "ep4of4", "ep2of8", "ep8of8", "hsdp_ep"])
def test_debug_model_trains_in_a_simulated_world(tmp_path, capsys, n, extra):
    out = run_simulated(tmp_path, capsys, SIM, str(n), *extra)
    assert f"simulating rank 0 of {n} ranks in one process: collectives are looped back (no communication" in out
    assert f", world {n} = dp_replicate " in out
    steps = logged_steps(out)
    assert sorted(steps) == [1, 2, 3], out
    for s in steps.values():
        assert math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0, out
    assert 6.0 < steps[1]["loss"] < 9.0, steps[1]  # about ln(2048) = 7.6 at initialization
    marks = [line for line in out.splitlines() if line.startswith(("step:", "summary:"))]
    mark = re.compile(rf"\[simulated rank 0 of {n}: no communication; loopback copies (\S+)s, compute only "
                      r"(\S+)s, ([\d,]+) tokens/s per device\]$")
    assert len(marks) == 4 and all(mark.search(line) for line in marks), marks
    # The copies are part of the step: what is left is shorter, never negative. The debug model's copies
    # can all print as 0.000s; test_loopback_copies_are_timed_until_taken checks they are timed.
    for line in marks:
        copies, compute = (float(g) for g in mark.search(line).groups()[:2])
        step_time = float(re.search(r"step[_ ]time:? (\S+)s", line).group(1))
        assert 0 <= copies < step_time and compute == pytest.approx(step_time - copies, abs=2e-3), line


def test_compiled_blocks_train_in_a_simulated_world(tmp_path, capsys):
    """The compiled path at one size: functional collectives inside inductor's graphs go through the
    loopback group too. In bf16, as the reference configs train: compiled blocks then read the
    experts' DTensor weights through their bf16 compute copies, which took the global tensor for the
    local shard under dynamo and failed at the first step."""
    out = run_simulated(tmp_path, capsys, SIM, "4", EP, "2", "--compile.enable", "--compile.loss", "false",
                        "--training.steps", "2", "--training.mixed_precision_param", "bfloat16")
    steps = logged_steps(out)
    assert sorted(steps) == [1, 2] and all(math.isfinite(s["loss"]) for s in steps.values()), out


def test_compiled_blocks_of_two_widths_in_one_process(tmp_path, capsys, monkeypatch):
    """One process compiling FSDP-wrapped blocks of one width and then of another with other head
    counts (as the test suite does) trains both: dynamo reads FSDP modules' ints as symbolic once
    they change, and SDPA's enable_gqa takes a bool only. The fault is in dynamo's trace, so
    aot_eager shows it (it failed so with the bool computed per call) without inductor's CPU build."""
    import dataclasses

    from models.qwen3.args import FLAVORS

    debug = FLAVORS["debug"]
    for n_heads in (4, debug.n_heads):
        monkeypatch.setitem(FLAVORS, "debug", dataclasses.replace(debug, n_heads=n_heads))
        out = run_simulated(tmp_path / f"heads{n_heads}", capsys, SIM, "2", "--compile.enable",
                            "--compile.loss", "false", "--compile.backend", "aot_eager", "--training.steps", "1")
        assert all(math.isfinite(s["loss"]) for s in logged_steps(out).values()), out


@pytest.mark.parametrize("keep,keep_layers,keep_moe_layers,sends",
                         [("none", 0, 0, 12), ("attention", 0, 0, 12), ("attention", 1, 0, 12),
                          ("attention_and_moe", 0, 1, 10)])
def test_compiled_step_runs_each_exchange_once(tmp_path, monkeypatch, keep, keep_layers, keep_moe_layers, sends):
    """A compiled EP step sends the token rows 6 times per layer, no more: dispatch and return in the
    forward, again in the recomputation, and their two backward all-to-alls (also with one block
    keeping attention and the other recomputed whole); a block that keeps the experts sends them 4
    times, skipping the recomputation's. torch 2.11 traced the exchange twice into the forward graph
    when the combine was an opaque op (8-9 per layer: an extra exchange and expert forward per layer
    on the GPU machine's torch)."""
    from parallelisms.simulate import LoopbackGroup

    rows_sent = []
    exchange = LoopbackGroup.all_to_all_single

    def counted(self, output, *args, **kwargs):
        if output.dim() == 2:  # the token rows (the expert ids travel as a vector)
            rows_sent.append(tuple(output.shape))
        return exchange(self, output, *args, **kwargs)

    monkeypatch.setattr(LoopbackGroup, "all_to_all_single", counted)
    monkeypatch.setattr(LoopbackGroup, "alltoall_base", counted)
    layers = 2
    trainer = make_trainer(tmp_path, *TINY, SIM, "4", EP, "2", "--model.n_layers", str(layers), "--compile.enable",
                           "--compile.backend", "aot_eager", "--compile.loss", "false",
                           "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full",
                           "--activation_checkpoint.keep", keep, "--activation_checkpoint.keep_layers", str(keep_layers),
                           "--activation_checkpoint.keep_moe_layers", str(keep_moe_layers))
    try:
        run_losses(trainer, 1)  # compiles (and may run collectives while tracing)
        rows_sent.clear()
        run_losses(trainer, 2)
    finally:
        dist.destroy_process_group()
    assert len(rows_sent) == sends * 2, rows_sent


def _saved_outside_regions(tmp_path, layers: int) -> collections.Counter:
    """Shapes of the tensors one forward saves for backward outside the recomputed regions (other than
    parameters and buffers): rank 0 of 4, EP 2, compiled, bf16, full AC keeping the attention core."""
    from torch.distributed.tensor import DTensor

    trainer = make_trainer(tmp_path / str(layers), *TINY, SIM, "4", EP, "2", "--model.n_layers", str(layers),
                           "--compile.enable", "--compile.backend", "aot_eager", "--compile.loss", "false",
                           "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full",
                           "--activation_checkpoint.keep", "attention")
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    held = {local(t).untyped_storage().data_ptr() for t in [*trainer.model.parameters(), *trainer.model.buffers()]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in held:
            saved[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    inputs = next(iter(trainer.dataloader))[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), trainer.amp:
        trainer.model(inputs)
    dist.destroy_process_group()
    return collections.Counter(saved.values())


def test_kept_attention_holds_no_exchange_buffers(tmp_path):
    """keep = "attention" under compile with EP: a block holds the attention core's tensors (q, k, v,
    output, log-sum-exp), its input and its gathered parameters, not the EP exchange's buffers, the
    gathered expert weights or the combine's float32 slot rows. (Without a per-op policy torch 2.11
    held those: collectives and the ops inside autograd Functions escaped the regions' tags.)"""
    from models.qwen3.args import FLAVORS

    one, two = _saved_outside_regions(tmp_path, 1), _saved_outside_regions(tmp_path, 2)
    per_layer = two - one
    a = FLAVORS["debug"]
    B, L = 2, 32  # TINY
    allowed = {(B, a.n_heads, L, a.head_dim), (B, a.n_kv_heads, L, a.head_dim), (B, a.n_heads, L), (B, L, a.dim),
               (L, a.head_dim),  # the rotary tables
               (a.n_heads * a.head_dim, a.dim), (a.n_kv_heads * a.head_dim, a.dim), (a.dim, a.n_heads * a.head_dim),
               (a.num_experts, a.dim), (a.dim,), (a.head_dim,)}
    assert per_layer and set(per_layer) <= allowed, sorted(set(per_layer) - allowed)


def test_parameters_take_one_ranks_share_of_memory(tmp_path, world):
    """At N = 8 with EP 2: every FSDP-sharded parameter keeps rank 0's ceil(n / 8) slice of its
    sharded dim, the experts this rank's E / ep experts split over the 4 ranks that share them, so
    the parameters held are 1/8 of the model's (up to uneven shards), and the routers stay whole
    in compute (each expert keeps a gate row of its own)."""
    trainer = make_trainer(tmp_path, *TINY, SIM, "8", EP, "2")
    local = total = 0
    for name, p in trainer.model.named_parameters():
        assert isinstance(p, DTensor), name
        shard_dims = [pl.dim for pl in p.placements if pl.is_shard()]
        if name.endswith(("w1", "w2", "w3")):
            assert p.to_local().shape[0] == p.shape[0] // 2 and p.to_local().shape[1] == p.shape[1] // 4, name
        else:
            (dim,) = shard_dims
            assert dim == (1 if name.endswith("router.gate.weight") else 0), name
            assert p.to_local().shape[dim] == math.ceil(p.shape[dim] / 8), name
        local += p.to_local().numel()
        total += p.numel()
    assert total / 8 <= local < 1.01 * total / 8, (local, total)


def test_initial_weights_load_as_rank_0s_shards(tmp_path, world):
    """``[checkpoint] initial_load_path`` works in a simulated world: this rank reads its shards of
    the whole weights (a DCP checkpoint of a one-process run here)."""
    source = make_trainer(tmp_path / "src", *TINY, "--training.seed", "3", "--checkpoint.enable")
    source.checkpoint.save(1)
    want = {k: v.clone() for k, v in source.model.state_dict().items()}
    trainer = make_trainer(tmp_path / "run", *TINY, SIM, "4", EP, "2", "--checkpoint.initial_load_path",
                           str(tmp_path / "src" / "checkpoint" / "step-1"), "--checkpoint.initial_load_format", "dcp")
    assert trainer.checkpoint.maybe_load() == 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for key, value in trainer.model.state_dict().items():
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        assert torch.equal(value.to_local(), want[key][tuple(slice(o, o + s) for o, s in zip(offset, shape))]), key


# --------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    ([SIM, "1"], r"simulate_world_size 1 simulates no other rank: use 0 \(off, one process\) or a world of at least 2"),
    ([SIM, "4", "--checkpoint.enable"], r"cannot save or resume a checkpoint.*set \[checkpoint\] enable = false"),
    ([SIM, "4", "--parallelism.data_parallel_shard_degree", "3"],
     r"= 3 must equal the world size \(4\) \(\[parallelism\] simulate_world_size\)"),
    ([SIM, "4", EP, "3"], r"expert_parallel_degree = 3 does not divide the 8 experts"),
    ([SIM, "2", EP, "4"], r"expert_parallel_degree = 4 is larger than the data-parallel shard degree 2"),
], ids=["one_rank", "checkpointing", "degrees", "ep_experts", "ep_world"])
def test_what_cannot_be_simulated_is_refused(tmp_path, world, extra, message):
    with pytest.raises(ConfigError, match=message):
        make_trainer(tmp_path, *TINY, *extra)


def test_refused_under_torchrun_or_an_existing_group(tmp_path, world, monkeypatch):
    with monkeypatch.context() as env:
        env.setenv("WORLD_SIZE", "4")
        with pytest.raises(ConfigError, match=r"launched as one of 4 ranks \(WORLD_SIZE=4.*run it with plain python"):
            make_trainer(tmp_path, *TINY, SIM, "4")
    world(2)
    with pytest.raises(ConfigError, match=r"already has a process group \(loopback, 2 ranks\)"):
        make_trainer(tmp_path, *TINY, SIM, "4")
