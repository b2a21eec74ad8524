"""The suite's own rule for CPUs whose kernels have no fp8 GEMM (tests/conftest.py): a test
that fails with that kernel error is reported skipped, with the reason; any other failure of a
test stays a failure. This CPU runs fp8, so the inner run replaces torch's fp8 GEMM with one
that raises as such a kernel set does (mocked kernel)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

_REFUSING = '''
import torch

def _refused(*args, **kwargs):
    raise RuntimeError("could not create a primitive descriptor for a matmul primitive")

torch._scaled_mm = _refused
'''

_TESTS = '''
import torch
from torch import nn
from precision_annot import apply

def _fp8_model():
    model = nn.Sequential(nn.Linear(64, 64))
    return apply(model, default="compute=fp8,storage=fp32")

def test_an_fp8_gemm():
    _fp8_model()(torch.randn(64, 64)).sum().backward()

def test_another_failure():
    _fp8_model()
    assert 1 == 2
'''


@pytest.mark.slow  # a pytest run of its own: 15 s
def test_a_cpu_without_fp8_gemms_skips_only_what_needs_them_mocked_kernel(
        pytester: pytest.Pytester) -> None:
    pytest.importorskip("torchao")
    conftest = (Path(__file__).parent / "conftest.py").read_text()
    pytester.makeconftest(conftest.replace("from __future__ import annotations\n", "")
                          + _REFUSING)
    pytester.makepyfile(test_fp8=_TESTS)
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*this CPU's kernels cannot run fp8 GEMMs (RuntimeError: "
                                 "could not create a primitive descriptor*"])
