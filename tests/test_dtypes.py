"""Dtype names: every alias users type, and the errors for the rest."""

from __future__ import annotations

import pytest
import torch

import precision_annot as pa
from precision_annot import bf16, fp16, fp32, fp64
from precision_annot._src.dtypes import to_dtype


def test_reexported_dtypes_are_torch_dtypes() -> None:
    assert (pa.fp64, pa.fp32, pa.fp16, pa.bf16) == (
        torch.float64, torch.float32, torch.float16, torch.bfloat16
    )


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp32", fp32), ("float32", fp32), ("f32", fp32), ("torch.float32", fp32), ("FP32", fp32),
     ("bf16", bf16), ("bfloat16", bf16), ("torch.bfloat16", bf16), ("fp16", fp16),
     ("half", fp16), ("float16", fp16), ("double", fp64), ("fp64", fp64)],
)
def test_dtype_aliases(name: str, dtype: torch.dtype) -> None:
    assert to_dtype(name) == dtype


def test_unknown_dtype_name_quotes_it_and_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"'fp4'") as info:
        to_dtype("fp4")
    for valid in ("'fp32'", "'bf16'", "'half'"):
        assert valid in str(info.value)
