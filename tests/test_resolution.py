"""`resolve`: the precedence of the levels, inheritance, containers, tied parameters."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot import (
    Policy,
    PrecisionPlan,
    annotate,
    bf16,
    fp16,
    fp32,
    fp64,
    precision,
    precision_scope,
    resolve,
)

LEVELS = ["instance", "class", "scope", "inherited", "default"]


def _build(levels: set[str]) -> tuple[nn.Module, nn.Module]:
    """A parent with one child; `levels` says which levels set compute, each to its own dtype."""
    dtypes = {"instance": fp64, "class": fp16, "scope": bf16, "inherited": fp32}

    class Leaf(nn.Linear):
        pass

    if "class" in levels:
        precision(compute=dtypes["class"])(Leaf)
    if "scope" in levels:
        with precision_scope(compute=dtypes["scope"]):
            leaf = Leaf(2, 2)
    else:
        leaf = Leaf(2, 2)
    if "instance" in levels:
        precision(compute=dtypes["instance"])(leaf)
    root = nn.Sequential(leaf)
    if "inherited" in levels:
        precision(compute=dtypes["inherited"])(root)
    return root, leaf


@pytest.mark.parametrize(("higher", "lower"), list(itertools.combinations(range(len(LEVELS)), 2)))
def test_precedence_table(higher: int, lower: int) -> None:
    levels = {LEVELS[higher], LEVELS[lower]} - {"default"}
    root, _ = _build(levels)
    has_default = "default" in (LEVELS[higher], LEVELS[lower])
    default = Policy(compute=torch.float32) if has_default else None
    entry = resolve(root, default)["0"]
    winner = LEVELS[higher]
    expected = {"instance": fp64, "class": fp16, "scope": bf16, "inherited": fp32,
                "default": fp32}[winner]
    assert entry.policy.compute == expected
    # a default reaches the child through the root, so the child sees it as inherited
    assert entry.sources["compute"] == ("inherited" if winner == "default" else winner)


def test_default_fills_root_fields_only_where_nothing_is_set() -> None:
    root = precision(compute=fp32)(nn.Sequential(nn.Linear(2, 2)))
    plan = resolve(root, default="bf16-mixed")
    assert plan[""].policy == Policy(compute=fp32, storage=fp32, comm=fp32)
    assert plan[""].sources == {"compute": "instance", "storage": "default", "comm": "default",
                                "output": None, "master": None, "grad": None, "optim": None}


def test_output_is_not_inherited() -> None:
    model = precision(compute=bf16, output=fp32)(nn.Sequential(nn.Linear(2, 2)))
    plan = resolve(model)
    assert plan[""].policy.output == fp32
    assert plan["0"].policy.output is None
    assert plan.boundaries == ("",)


def test_resolve_and_apply_reject_non_modules() -> None:
    with pytest.raises(TypeError, match="resolve expects an nn.Module"):
        resolve([nn.Linear(2, 2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="default"):
        resolve(nn.Linear(2, 2), default=3)  # type: ignore[arg-type]


def test_tied_parameters_with_conflicting_storage_name_both_modules() -> None:
    emb, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": precision(bf16)(emb), "head": precision(fp32)(head)})
    with pytest.raises(ValueError, match=r"'emb'.*'head'"):
        resolve(model)
    precision(bf16)(head)
    assert resolve(model)["head"].policy.storage == bf16


def test_tied_weights_with_one_owner_unset_and_the_other_bf16_are_an_error() -> None:
    emb, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": precision(storage=bf16)(head)})
    with pytest.raises(ValueError, match=r"shared by modules 'emb' \(storage=fp32, unset.*'head'"):
        resolve(model)


def test_a_containers_output_is_carried_by_its_children() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    annotate(model, {"1": "output=fp32"})
    plan = resolve(model, default="bf16")
    assert plan["1.0"].policy.output == fp32 and plan["1.1"].policy.output == fp32
    assert plan["1.0"].sources["output"] == "inherited"
    assert plan["0"].policy.output is None  # a parent that runs does not pass output on


def test_a_module_shared_by_two_parents_that_disagree_names_both_paths() -> None:
    """0.2 resolved it under its first parent only: it ran bf16 inside the fp32 island."""
    shared = nn.Linear(4, 4)
    model = nn.Sequential(precision(fp32)(nn.Sequential(shared)), nn.Sequential(shared))
    with pytest.raises(ValueError, match=r"Module '0.0' is also reached as '1.0'.*"
                                         r"compute=fp32.*under '0'.*compute=bf16.*under '1'.*"
                                         r"annotate the module itself"):
        resolve(model, default="bf16")
    precision(fp32)(shared)  # its own annotation: both paths agree on its policy ...
    with pytest.raises(ValueError, match=r"not a boundary under '0'.*"
                                         r"hands its output back in bf16 under '1'.*output="):
        resolve(model, default="bf16")  # ... but not on what its callers get back
    precision(output=bf16)(shared)
    plan = resolve(model, default="bf16")
    assert "1.0" not in plan and plan["0.0"].policy.output == bf16
    assert resolve(nn.Sequential(nn.Sequential(shared), nn.Sequential(shared)), "bf16")


def test_a_tied_weight_has_one_comm_dtype() -> None:
    """Issue 18: the DDP hook reduced a tied weight in bf16 and DeepSpeed in fp32."""
    emb, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": precision(comm=bf16)(head)})
    with pytest.raises(ValueError, match=r"shared by modules 'emb' \(comm=fp32\) and 'head' "
                                         r"\(comm=bf16\).*same comm"):
        resolve(model, default="bf16-mixed")
    precision(comm=bf16)(emb)
    assert resolve(model, default="bf16-mixed")["head"].policy.comm == bf16


def test_a_default_that_sets_nothing_is_said() -> None:
    with precision_scope("bf16-mixed"):
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.warns(UserWarning, match=r"default='compute=fp16,storage=fp16,comm=fp16' sets "
                                         r"nothing.*compute=bf16 \(scope\)") as caught:
        resolve(model, default="fp16")
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve(model, default="output=fp32")  # sets output: it has an effect
        resolve(model)


def test_function_regions_the_forward_calls_are_in_the_plan() -> None:
    """0.2 did not see them: needs_loss_scaling stayed False for an fp16 region."""
    model = RegionUser()
    plan = resolve(model, default="bf16-mixed")
    assert plan[""].regions == {"half_softmax": Policy(compute=fp16),
                                "RegionUser.fp32_scores": Policy(compute=fp32, storage=fp32,
                                                                 comm=fp32)}
    assert plan.needs_loss_scaling and not resolve(nn.Linear(2, 2), "bf16").needs_loss_scaling
    assert "half_softmax()" in str(plan) and PrecisionPlan.from_json(plan.to_json()) == plan


@precision(compute=fp16)
def half_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


class RegionUser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @precision(fp32)
    def fp32_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x @ x.transpose(-1, -2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return half_softmax(self.fp32_scores(self.lin(x)))


def test_keep_dtype_on_a_container_is_said_to_keep_nothing_when_resolved() -> None:
    blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    pa.precision("fp32", keep_dtype=("cache",))(blocks)
    model = nn.Sequential()
    model.blocks = blocks
    with pytest.warns(UserWarning, match=r"keep_dtype=\('cache',\) on 'blocks' is ignored: "
                                         r"ModuleList has no forward of its own") as caught:
        plan = pa.resolve(model, default="bf16")
    assert caught[0].filename == __file__  # pointed at the caller's line
    assert plan["blocks"].keep_dtype == ("cache",) and plan["blocks"].container
    plain = nn.Sequential(nn.Linear(4, 4))
    pa.precision("fp32", keep_dtype=("x",))(plain[0])  # a module that runs: kept, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pa.resolve(plain, default="bf16")
