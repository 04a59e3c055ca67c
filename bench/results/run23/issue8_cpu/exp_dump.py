import os, sys, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.utils import run_and_get_code
import torch._inductor.config as ic
sys.path.insert(0, "/work/main")
from parallelisms.compile import COMM_REORDER_PASSES
from tests.test_distributed import free_port

@torch.library.custom_op("exp::expert", mutates_args=())
def expert(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) * (ids.view(-1, 1) >= 0)
@expert.register_fake
def _(x, ids, w):
    return x.new_empty(x.shape[0], w.shape[1])

def _bwd(ctx, g):
    x, ids, w = ctx.saved_tensors
    with torch.enable_grad():
        xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = torch.relu(xx @ ww) * (ids.view(-1, 1) >= 0)
        gx, gw = torch.autograd.grad(y, (xx, ww), g)
    return gx, None, gw
def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
expert.register_autograd(_bwd, setup_context=_setup)

def dispatch(x, ids, g):
    order = torch.argsort(ids, stable=True)
    send = x[order]
    rx = funcol.all_to_all_single_autograd(send, None, None, g)
    rid = funcol.all_to_all_single(ids[order], None, None, g)
    return rx, rid, order

def layer(x, ids, w, g, P):
    xs, idss = x.chunk(P), ids.chunk(P)
    sent = [dispatch(a, b, g) for a, b in zip(xs, idss)]
    backs = [funcol.all_to_all_single_autograd(expert(rx, rid, w), None, None, g) for rx, rid, _ in sent]
    return torch.cat([yb[torch.argsort(o)] for yb, (_, _, o) in zip(backs, sent)])

os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(free_port())
dist.init_process_group("gloo", rank=0, world_size=1)
g = dist.group.WORLD
x, ids, w = torch.randn(64, 16, requires_grad=True), torch.randint(0, 4, (64,)), torch.randn(16, 16, requires_grad=True)
def dump(snodes):
    from torch._inductor.comms import contains_collective, contains_wait
    for sn in snodes:
        kind = "COLL" if contains_collective(sn) else "WAIT" if contains_wait(sn) else "    "
        deps = [(type(d).__name__, d.name) for d in sn.unmet_dependencies]
        print(kind, sn.get_name(), sorted(sn.get_buffer_names()), deps)
    return snodes
passes = [dump]
ic.reorder_for_compute_comm_overlap = True
ic.reorder_for_compute_comm_overlap_passes = passes
fn = torch.compile(lambda a, b, c: layer(a, b, c, g, 2), fullgraph=True)
out, (code, *_) = run_and_get_code(fn, x, ids, w)
torch.testing.assert_close(out, layer(x, ids, w, g, 2))
import re
for ln in code.split("def call(")[1].splitlines():
    s = ln.strip()
    if re.search(r"all_to_all_single\.default|wait_tensor|exp\.expert|cpp_fused|argsort|sort\.", s) and not s.startswith("#") and "assert" not in s:
        print("   ", s[:150])
dist.destroy_process_group()
