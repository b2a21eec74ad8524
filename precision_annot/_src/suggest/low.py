"""The low policy `suggest` runs in (fp16, bf16 or an fp8 recipe) and, for fp8, the Linear
layers too small to gain from it."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from precision_annot._src.dtypes import FP8_RECIPES, LOW_PRECISION, dtype_name, fp32
from precision_annot._src.float8 import Gemm
from precision_annot._src.float8_checks import too_small
from precision_annot._src.policy import Policy, SpecLike, as_policy
from precision_annot._src.suggest.constants import ISLAND


def low_policies(low: SpecLike) -> tuple[Policy, Policy]:
    """The policy outside the islands and the islands' own."""
    if isinstance(low, str) and low.strip().lower().split("/")[0] in FP8_RECIPES:
        recipe = low.strip().lower()
        policy = Policy(compute=recipe if "/" in recipe else f"{recipe}/bf16",  # type: ignore[arg-type]
                        storage=fp32, comm=fp32)
        assert policy.compute is not None
        return policy, Policy(compute=policy.compute, storage=fp32, comm=fp32)
    policy = as_policy(low, argument="low")
    if policy.compute not in LOW_PRECISION:
        raise ValueError(
            "suggest(low=...) names the low-precision policy to run in: its compute must be "
            f"fp16 or bf16, or an fp8 recipe. Received: low={low!r} "
            f"(compute={dtype_name(policy.compute)}). Valid: 'bf16', 'fp16', 'bf16-mixed', "
            f"'16-mixed', {', '.join(repr(r) for r in FP8_RECIPES)}.")
    if policy.storage is None:
        policy = dataclasses.replace(policy, storage=policy.compute)
    return policy, ISLAND


def speed_islands(model: nn.Module, policy: Policy) -> list[str]:
    """With fp8 `low`: the Linear layers whose GEMMs are too small for fp8 to gain, and every
    module that is not a Linear under fp8 (its ops run in the high compute anyway)."""
    assert policy.fp8 is not None
    gemm = Gemm(policy.fp8)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
            and too_small(gemm, m.out_features, m.in_features)]


def warn_no_fp8_gain(low: SpecLike, speed: list[str], low_dtype: torch.dtype) -> None:
    warnings.warn(
        f"suggest: low={low!r} but no Linear layer here gains from fp8: "
        + (f"all {len(speed)} are too small (torchao's thresholds, see check's "
           f"fp8-small-gemm), so the plan keeps them in {dtype_name(low_dtype)} and runs no "
           "GEMM in fp8." if speed else "the model has none, so nothing would run in fp8.")
        + " low='bf16-mixed' gives the same plan without fp8 in its name.",
        UserWarning, stacklevel=3)
