"""The ``gpu`` marker of tests/conftest.py: it skips a test without CUDA, and a test skipped for want
of a GPU without carrying it fails, since ``pytest -m gpu`` on the GPU machine would never select it."""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

from tests.utils import ROOT

SAMPLE = """
import pytest

pytestmark = pytest.mark.unit


def test_skips_itself_for_cuda():
    pytest.skip("needs CUDA")


@pytest.mark.skipif(True, reason="needs an sm_90 (Hopper) GPU")
def test_skipif_names_a_gpu():
    pass


def test_skips_for_another_reason():
    pytest.skip("the optional package is missing")


@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs an sm_90 (Hopper) GPU")
def test_marked_needs_hopper():
    pass


@pytest.mark.gpu
def test_marked():
    pass


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_case_marked(device):
    pass
"""


def test_unmarked_gpu_skips_fail_and_the_marker_skips(tmp_path):
    """Run without CUDA (hidden from the child process if this machine has a GPU), with this suite's
    conftest as a plugin, on a sample module."""
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(SAMPLE))
    report = tmp_path / "report.xml"
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                          "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), f"--junitxml={report}",
                          "-q", str(tmp_path / "test_sample.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 1, res.stdout + res.stderr  # tests failed (not a usage or collection error)
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        result = next(iter(case), None)
        outcomes[case.get("name")] = (result.tag, result.get("message", "")) if result is not None else ("passed", "")
    # Skipped for want of a GPU without the marker: failed (in setup for a skipif: an error).
    for name, tag in (("test_skips_itself_for_cuda", "failure"), ("test_skipif_names_a_gpu", "error")):
        assert outcomes[name][0] == tag and "is not marked gpu" in outcomes[name][1], (name, outcomes[name])
    assert outcomes["test_skips_for_another_reason"] == ("skipped", "the optional package is missing")
    assert outcomes["test_marked"] == ("skipped", "needs a CUDA GPU (marked gpu)")
    assert outcomes["test_marked_needs_hopper"][0] == "skipped"
    assert outcomes["test_one_case_marked[cpu]"] == ("passed", "")
    assert outcomes["test_one_case_marked[cuda]"] == ("skipped", "needs a CUDA GPU (marked gpu)")
    assert len(outcomes) == 7, outcomes
