"""`PrecisionPlan`: the table, queries, and JSON that round-trips or is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from precision_annot import (
    PrecisionPlan,
    annotate,
    apply,
    bf16,
    fp32,
    precision,
    precision_scope,
    resolve,
)
from precision_annot._src.runtime import installed_boundaries


def _model() -> nn.Module:
    with precision_scope("bf16-mixed"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    annotate(model, {nn.LayerNorm: "fp32", "2": "output=fp32"})
    return model


def test_plan_table_and_queries() -> None:
    plan = resolve(_model())
    text = str(plan)
    for column in ("module", "type", "compute", "storage", "comm", "output", "source", "params",
                   "bytes"):
        assert column in text.splitlines()[0]
    assert "LayerNorm" in text and "rule" in text and "scope" in text
    assert plan.boundaries == ("", "1", "2")
    assert not plan.needs_loss_scaling
    assert plan.param_bytes_by_dtype == {fp32: (20 + 8 + 10) * 4}
    assert resolve(nn.Linear(2, 2), default="16-mixed").needs_loss_scaling
    with pytest.raises(KeyError, match="Names: '', '0'"):
        plan["3"]


def test_param_bytes_follow_planned_storage() -> None:
    plan = resolve(nn.Sequential(nn.Linear(4, 4), precision(bf16)(nn.Linear(4, 4))))
    assert plan.param_bytes_by_dtype == {fp32: 80, bf16: 40}


def test_json_round_trip_and_reapply_to_a_fresh_instance() -> None:
    plan = resolve(_model())
    loaded = PrecisionPlan.from_json(plan.to_json())
    assert loaded == plan
    assert loaded.to_json() == plan.to_json()
    fresh = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))  # no annotations
    apply(fresh, loaded)
    assert fresh[1].weight.dtype == fp32
    out = fresh(torch.randn(3, 4))
    assert out.dtype == fp32
    assert installed_boundaries(fresh) == ["", "1", "2"]


def test_from_json_rejects_other_text() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        PrecisionPlan.from_json("{")
    with pytest.raises(ValueError, match="precision_annot.plan"):
        PrecisionPlan.from_json('{"modules": []}')


def _data() -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(2, 2), precision("fp32")(nn.LayerNorm(2)))
    return json.loads(resolve(model, default="bf16").to_json())  # type: ignore[no-any-return]


def _edit(index: int, key: str, value: Any) -> str:
    data = _data()
    if value is _DROP:
        del data["modules"][index][key]
    else:
        data["modules"][index][key] = value
    return json.dumps(data)


_DROP = object()


@pytest.mark.parametrize(
    ("index", "key", "value", "message"),
    [(1, "name", 3, r"modules\[1\]: 'name' must be a string"),
     (1, "type", _DROP, r"modules\[1\] \('0'\): 'type' must be of type str"),
     (1, "policy", "compute=fp9", r"modules\[1\] \('0'\): 'policy' is not a policy"),
     (1, "sources", {"compute": "magic"}, r"'sources' has compute='magic'"),
     (2, "boundary", "false", r"modules\[2\] \('1'\): 'boundary' must be of type bool"),
     (1, "params", -4, r"'params' must be a count >= 0"),
     (1, "param_bytes", "12", r"'param_bytes' must be of type int"),
     (1, "param_dtype_bytes", {"fp8": 4}, r"unknown dtype 'fp8'"),
     (1, "param_dtype_bytes", {"bf16": 10**12}, r"not the sum"),
     (1, "keep_dtype", [1.5], r"'keep_dtype' must list"),
     (0, "container", "no", r"'container' must be of type bool")],
)
def test_malformed_entries_raise_value_errors_naming_the_entry_and_key(
    index: int, key: str, value: Any, message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        PrecisionPlan.from_json(_edit(index, key, value))


def test_malformed_plans_as_a_whole() -> None:
    data = _data()
    for modules, message in [(None, "non-empty list"), ([], "non-empty list"),
                             (["x"], r"modules\[0\] must be an object"),
                             (data["modules"][1:], "comes before its parent|root entry"),
                             ([data["modules"][0]] * 2, "listed twice")]:
        with pytest.raises(ValueError, match=message):
            PrecisionPlan.from_json(json.dumps({**data, "modules": modules}))
    with pytest.raises(ValueError, match="'default' is not a policy"):
        PrecisionPlan.from_json(json.dumps({**data, "default": "fp9"}))


def test_a_valid_plan_still_round_trips() -> None:
    text = json.dumps(_data())
    assert PrecisionPlan.from_json(text).to_json() == json.dumps(_data(), indent=2)


def test_every_torch_dtype_round_trips_and_counts_keep_dtypes() -> None:
    """0.2 raised "Unknown dtype name 'int8'" in str(plan), from_json, DDP buckets and FSDP."""
    from precision_annot.adapters import ddp, fsdp

    quantized = nn.Linear(4, 4)
    for name, dtype in [("q", torch.int8), ("steps", torch.int64), ("f8", torch.float8_e4m3fn)]:
        quantized.register_parameter(name, nn.Parameter(torch.zeros(4, dtype=dtype),
                                                        requires_grad=False))
    plan = resolve(nn.Sequential(quantized), default="bf16-mixed")
    entry = plan["0"]
    assert entry.param_dtype_bytes == {fp32: 80 + 16, torch.int8: 4, torch.int64: 32}
    assert "int8 4 B" in str(plan) and "int64 32 B" in str(plan)
    assert PrecisionPlan.from_json(plan.to_json()) == plan
    assert ddp.buckets(plan)[0].dtype == fp32 and fsdp.collective_cost(plan).gathers == 1


def test_a_bad_count_names_its_key() -> None:
    data = _data()
    data["modules"][1]["numel"] = {"bf16": -1}
    with pytest.raises(ValueError, match=r"'numel'\['bf16'\] must be a count >= 0"):
        PrecisionPlan.from_json(json.dumps(data))
    data["modules"][1]["param_dtype_bytes"] = {"bf16": "12"}
    with pytest.raises(ValueError, match=r"'param_dtype_bytes'\['bf16'\] must be a count"):
        PrecisionPlan.from_json(json.dumps(data))
