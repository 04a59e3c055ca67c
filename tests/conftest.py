"""Test tiers, as pytest markers (registered in pyproject.toml):

- ``unit``: pure torch / pure Python, seconds in all: config, data, parsers, small models.
- ``kernels``: Triton kernels, on CPU through Triton's interpreter (slow per call: small shapes).
- ``integration``: several processes (the gloo pool of tests/multiprocess.py), the trainer end to
  end, inductor compiles.
- ``gpu``: needs CUDA; the marker itself skips the test without it (the GPU machine runs
  ``pytest -m gpu``).

Every test gets exactly one of the first three: a tier marker on the test itself wins, else its
module's tier from ``MODULE_TIERS`` below (so modules need no marker of their own); a test with
neither stops the collection with an error naming its module, so a new file is given a tier
deliberately rather than running in the wrong one. ``gpu`` is given by hand, on top: on a test, a
module (``pytestmark``) or one case (``pytest.param(..., marks=pytest.mark.gpu)``); a test that
needs more than CUDA (a Hopper GPU) keeps its own ``skipif`` beside it. Without CUDA, a test that is
skipped for a reason naming CUDA or a GPU but lacks the marker fails instead
(:func:`unmarked_gpu_skip`): ``pytest -m gpu`` would never select it. Select with
``pytest -m unit``, ``-m "not integration"``, ``-m "kernels or unit"``, ...; the full run
(``pytest tests``) prints the time spent per tier at the end.

Shared helpers live in tests/utils.py; the shared fixture is below.
"""

import os
import re
import sys
import time
from collections import defaultdict

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's CPU interpreter. The variable must be set
# before triton is first imported (importing torch does not import it).
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
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
    "test_loss_curves": "unit",
    "test_gpu_marker": "unit",
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


# The reason every ``gpu`` test is skipped with on a machine without CUDA.
NO_CUDA_REASON = "needs a CUDA GPU (marked gpu)"
# A skip reason naming CUDA, a GPU or an sm_ architecture: the test was skipped for want of one.
GPU_REASON = re.compile(r"\b(cuda|gpu|sm_\d)", re.IGNORECASE)


def _skip_reason(report) -> str:
    """The reason of a skipped test's or module's report (pytest keeps it as "Skipped: <reason>")."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def unmarked_gpu_skip(report, marked: bool) -> str | None:
    """Why ``report`` (a test's or a module's) must fail: it was skipped for want of a GPU, on a
    machine without CUDA, and does not carry the ``gpu`` marker (``marked``), so the GPU machine's
    ``pytest -m gpu`` never selects it; None when nothing is wrong."""
    if HAS_CUDA or marked or not report.skipped or hasattr(report, "wasxfail"):
        return None
    reason = _skip_reason(report)
    if not GPU_REASON.search(reason):
        return None
    return (f"{report.nodeid} was skipped for want of a GPU ({reason!r}) but is not marked gpu, so "
            f"`pytest -m gpu` on a GPU machine never selects it: mark it @pytest.mark.gpu (one case of a "
            f"parametrization: pytest.param(..., marks=pytest.mark.gpu); a module: pytestmark = "
            f"pytest.mark.gpu), which also skips it without CUDA")


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
        if not HAS_CUDA and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=NO_CUDA_REASON))
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
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    failure = unmarked_gpu_skip(report, marked=item.get_closest_marker("gpu") is not None)
    if failure:
        report.outcome, report.longrepr = "failed", failure


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module that skips itself for want of a GPU hides its tests from `pytest -m gpu` the same way.
    report = (yield).get_result()
    failure = unmarked_gpu_skip(report, marked=False)
    if failure:
        report.outcome, report.longrepr = "failed", failure


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
