"""`unwrap`: the one place wrappers around a model are seen through."""

from __future__ import annotations

import torch
from torch import nn

from precision_annot._src.wrappers import unwrap


def test_compile_and_data_parallel_are_seen_through_nested_or_not() -> None:
    model = nn.Linear(2, 2)
    assert unwrap(model) is model
    assert unwrap(torch.compile(model)) is model
    assert unwrap(nn.DataParallel(model)) is model
    assert unwrap(torch.compile(nn.DataParallel(model))) is model


def test_a_module_named_like_a_wrapper_without_its_attribute_is_itself() -> None:
    class DataParallel(nn.Module):  # a user's class that happens to share the name
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(2, 2)

    odd = DataParallel()
    assert unwrap(odd) is odd
