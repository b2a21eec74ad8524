"""`Policy`: parsing, round-trips, presets, merge, and the rules about one policy."""

from __future__ import annotations

import itertools

import pytest
import torch

import precision_annot as pa
from precision_annot import Policy, bf16, fp16, fp32, fp64
from precision_annot._src.policy import as_policy

DTYPES = [None, fp64, fp32, fp16, bf16]


@pytest.mark.parametrize("bad", [torch.int64, torch.bool, torch.int8, torch.complex64])
@pytest.mark.parametrize("field", ["compute", "storage"])
def test_non_floating_dtypes_are_rejected(bad: torch.dtype, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Policy(**{field: bad})
    with pytest.raises(ValueError, match=field):
        pa.precision(**{field: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("fields", list(itertools.product(DTYPES, repeat=4)))
def test_parse_str_round_trip_over_every_combination(
    fields: tuple[torch.dtype | None, ...],
) -> None:
    p = Policy(*fields)
    assert Policy.parse(str(p)) == p


def test_parse_keys_and_short_keys() -> None:
    assert Policy.parse("compute=bf16,storage=fp32") == Policy(compute=bf16, storage=fp32)
    assert Policy.parse("c=bf16, s=f32, r=bf16, o=float32") == Policy(bf16, fp32, bf16, fp32)


def test_bare_dtype_sets_compute_storage_comm() -> None:
    assert Policy.parse("fp32") == Policy(compute=fp32, storage=fp32, comm=fp32)
    assert as_policy(bf16) == Policy(compute=bf16, storage=bf16, comm=bf16)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [("32-true", Policy(fp32, fp32, fp32)), ("16-true", Policy(fp16, fp16, fp16)),
     ("bf16-true", Policy(bf16, bf16, bf16)), ("16-mixed", Policy(fp16, fp32, fp32)),
     ("bf16-mixed", Policy(bf16, fp32, fp32)), ("64-true", Policy(fp64, fp64, fp64))],
)
def test_lightning_presets(preset: str, expected: Policy) -> None:
    assert Policy.parse(preset) == expected
    assert as_policy(preset) == expected


def test_merge_is_field_by_field_and_the_other_wins() -> None:
    a = Policy(compute=bf16, storage=fp32)
    b = Policy(compute=fp32, output=fp16)
    assert a.merge(b) == Policy(compute=fp32, storage=fp32, output=fp16)
    assert b.merge(Policy()) == b


def test_policy_is_frozen() -> None:
    with pytest.raises(AttributeError):
        Policy().compute = fp32  # type: ignore[misc]


def test_policy_accepts_names_and_normalizes() -> None:
    assert Policy(compute="half") == Policy(compute=fp16)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "match"),
    [("compute=bf16,compute=fp32", "given twice"),
     ("c=bf16,c=fp32", "given twice"),
     ("speed=bf16", "Unknown policy key 'speed'"),
     ("compute=", "not key=dtype"),
     ("compute=fp9", "'fp9'"),
     ("bf16,fp32", "key=dtype"),
     ("mixed", "Unknown policy 'mixed'")],
)
def test_bad_policy_strings(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Policy.parse(text)


@pytest.mark.parametrize("spec", [3, 1.5, [fp32], {"compute": fp32}])
def test_spec_of_wrong_type(spec: object) -> None:
    with pytest.raises(TypeError, match="Policy, a torch.dtype, a dtype name"):
        as_policy(spec)
    with pytest.raises(TypeError, match="Received"):
        pa.precision(spec)  # type: ignore[arg-type]


def test_a_dtype_or_preset_then_fields() -> None:
    assert Policy.parse("fp32,output=fp32") == Policy(compute=fp32, storage=fp32, comm=fp32,
                                                      output=fp32)
    assert Policy.parse("bf16-mixed,comm=bf16") == Policy(compute=bf16, storage=fp32, comm=bf16)
    fp8 = Policy.parse("bf16-mixed,compute=fp8")
    assert (fp8.gemm, fp8.compute, fp8.storage) == ("fp8", bf16, fp32)
    with pytest.raises(ValueError, match="Unknown policy 'fp9'"):
        Policy.parse("fp9,output=fp32")
