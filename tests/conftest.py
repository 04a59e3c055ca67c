"""Test tiers, as pytest markers (registered in pyproject.toml):

- ``unit``: pure torch / pure Python, seconds in all: config, data, parsers, small models.
- ``kernels``: Triton kernels, on CPU through Triton's interpreter (slow per call: small shapes).
- ``integration``: several processes (the gloo pool of tests/multiprocess.py), the trainer end to
  end, inductor compiles.
- ``gpu``: needs CUDA; skipped without it (the GPU machine runs ``pytest -m gpu``).

Every test gets exactly one of the first three: a tier marker on the test itself wins, else its
module's tier from ``MODULE_TIERS`` below (so modules need no marker of their own); a test with
neither stops the collection with an error naming its module, so a new file is given a tier
deliberately rather than running in the wrong one. ``gpu`` is added
on top to any test whose ``skipif`` skips exactly when CUDA is missing, for a reason naming the GPU. Select with
``pytest -m unit``, ``-m "not integration"``, ``-m "kernels or unit"``, ...; the full run
(``pytest tests``) prints the time spent per tier at the end.

Shared helpers live in tests/utils.py; the shared fixture is below.
"""

import os
import sys
import time
from collections import defaultdict

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's CPU interpreter. The variable must be set
# before triton is first imported (importing torch does not import it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TIERS = ("unit", "kernels", "integration")

# Each module's default tier; tests that differ from it carry their own marker.
MODULE_TIERS = {
    "test_adamw": "kernels",
    "test_attention_bench": "unit",
    "test_checkpoint": "integration",
    "test_comm_volume": "unit",
    "test_compare": "unit",
    "test_compile_overlap": "integration",
    "test_config": "unit",
    "test_data": "unit",
    "test_distributed": "integration",
    "test_float8_linear": "kernels",
    "test_expert_copies": "kernels",
    "test_fp8": "kernels",
    "test_fp8_parity": "kernels",
    "test_grouped_mm_fp8": "kernels",
    "test_hf": "unit",
    "test_hopper_gemm": "kernels",
    "test_layout": "unit",
    "test_linear_copies": "kernels",
    "test_loss": "unit",
    "test_mega_moe": "kernels",
    "test_mega_moe_fp8": "kernels",
    "test_model": "unit",
    "test_moe_backends": "kernels",
    "test_precision": "unit",
    "test_profiling": "integration",
    "test_signals": "integration",
    "test_simulate_world": "integration",
    "test_step_breakdown": "unit",
    "test_train": "integration",
}

# Tests of modules owned elsewhere whose tier differs from their module's (by node id prefix).
TEST_TIERS = {
    "test_float8_linear.py::test_fsdp2_trains_like_one_process": "integration",
    "test_float8_linear.py::test_train_main_with_fp8_linears_and_experts": "integration",
    "test_float8_linear.py::test_trainer_": "integration",
    "test_mega_moe_fp8.py::test_trains_end_to_end": "integration",
    "test_expert_copies.py::test_bf16_copies_train": "integration",
}


def _is_gpu_only(item) -> bool:
    """A ``skipif`` that skips exactly when there is no CUDA device, for a reason naming the GPU."""
    no_cuda = not torch.cuda.is_available()
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", "")).lower()
        conditions = [*mark.args, *([mark.kwargs["condition"]] if "condition" in mark.kwargs else [])]
        if any(w in reason for w in ("cuda", "gpu", "h200", "sm_")) and conditions and all(
                isinstance(c, bool) and c == no_cuda for c in conditions):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    untiered: dict[str, str] = {}  # module -> its file, for the error
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            name = item.nodeid.split("/")[-1]
            module = item.module.__name__.rsplit(".", 1)[-1]
            tier = next((t for prefix, t in TEST_TIERS.items() if name.startswith(prefix)), None)
            tier = tier or MODULE_TIERS.get(module)
            if tier is None:
                untiered[module] = item.nodeid.split("::")[0]
                continue
            item.add_marker(getattr(pytest.mark, tier))
        if _is_gpu_only(item):
            item.add_marker(pytest.mark.gpu)
    if untiered:
        raise pytest.UsageError("\n".join(
            f"{path} has no test tier: add \"{module}\": \"unit\" (or \"kernels\", \"integration\") to MODULE_TIERS "
            f"in tests/conftest.py, or mark each of its tests with @pytest.mark.unit / kernels / integration "
            f"(docs/testing.md)" for module, path in sorted(untiered.items())))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean dynamo state: blocks of many widths compiled in one process
    otherwise add up against dynamo's per-code-object recompile limit, and a fullgraph compile then
    fails depending on test order (inductor's on-disk cache still serves the kernels)."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


@pytest.fixture
def narrow_debug_model(monkeypatch):
    """The debug flavor at half its width with a quarter of its experts (dim 128, 4 heads, 2 experts),
    for trainer tests whose MoE kernels run in the interpreter, where the cost is per program."""
    import dataclasses

    from models.qwen3.args import FLAVORS

    monkeypatch.setitem(FLAVORS, "debug", dataclasses.replace(FLAVORS["debug"], dim=128, n_heads=4, num_experts=2))


_TIER_SECONDS: dict[str, float] = defaultdict(float)
_TIER_COUNTS: dict[str, int] = defaultdict(int)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.perf_counter()
    yield
    tier = next((t for t in TIERS if item.get_closest_marker(t)), "unit")
    _TIER_SECONDS[tier] += time.perf_counter() - start
    _TIER_COUNTS[tier] += 1


def pytest_terminal_summary(terminalreporter):
    if _TIER_COUNTS:
        parts = [f"{t} {_TIER_COUNTS[t]} tests {_TIER_SECONDS[t]:.0f}s" for t in TIERS if _TIER_COUNTS[t]]
        terminalreporter.write_line("tiers: " + ", ".join(parts))


def pytest_sessionfinish(session, exitstatus):
    from tests.multiprocess import close_pools

    close_pools()
