"""`PrecisionPlan`: JSON that is not a plan is refused with the entry and the key named."""

from __future__ import annotations

import json
from typing import Any

import pytest
from torch import nn

from precision_annot import PrecisionPlan, precision, resolve


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
