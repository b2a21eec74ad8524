"""Casts over trees of values: exact in backward, and no copy where none is needed."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from precision_annot import (
    bf16,
    fp16,
    fp32,
)
from precision_annot._src.casting import cast_tree


@pytest.mark.parametrize("src", [fp32, bf16, fp16])
@pytest.mark.parametrize("dst", [fp32, bf16, fp16, torch.float64])
def test_boundary_cast_is_exact(src: torch.dtype, dst: torch.dtype) -> None:
    x = torch.randn(17, 3, dtype=src, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y = cast_tree(x, dst)
    y2 = x2.to(dst)
    assert_close(y, y2, rtol=0, atol=0)
    grad = torch.randn_like(y2)
    y.backward(grad)
    y2.backward(grad)
    assert x.grad is not None and x.grad.dtype == src
    assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_cast_to_same_dtype_returns_the_same_object() -> None:
    x = torch.randn(3)
    assert cast_tree(x, fp32) is x
    tree = {"a": x, "b": [x, torch.arange(3)]}
    assert cast_tree(tree, fp32) is tree
    ints = torch.arange(4)
    out = cast_tree({"x": x, "ids": ints, "n": 3, "s": "text"}, bf16)
    assert out["ids"] is ints and out["n"] == 3 and out["s"] == "text" and out["x"].dtype == bf16
