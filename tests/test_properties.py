"""Property-based: random module trees, annotated at every level, run exactly as planned.

Each example builds a tree of Linear, LayerNorm, BatchNorm, rotary-style and kwargs-taking
modules inside `nn.ModuleList` / `nn.ModuleDict` containers and `nn.Sequential`s, with tied
weights, annotates it by class, instance, rule, scope and default with all four fields, and
checks that `audit` finds no divergence, that gradients land in storage, that `remove`
restores the model, and that the plan's JSON re-applies identically to a fresh copy.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from precision_annot import (
    Policy,
    PrecisionPlan,
    annotate,
    apply,
    audit,
    bf16,
    fp16,
    fp32,
    precision,
    precision_scope,
    remove,
    resolve,
)
from precision_annot._src.boundary import Boundary, CastingDict
from precision_annot._src.runtime import installed_boundaries

D = 4
DTYPES = [None, fp32, bf16, fp16]
LEAVES = ["linear", "layernorm", "batchnorm", "rotary", "kwargs"]


class Rotary(nn.Module):
    """A non-persistent table built in fp32 and a persistent scale that follows storage."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(D) / D), persistent=False)
        self.register_buffer("scale", torch.full((D,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + torch.cos(self.inv_freq).to(x.dtype)


class Keyed(nn.Module):
    """Takes a keyword tensor and returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.lin(x) + x * scale, "aux": x.sum()}


class Node(nn.Module):
    """Calls its children in order; its own code keeps computing in the dtype it was given."""

    def __init__(self, children: list[nn.Module], holder: str) -> None:
        super().__init__()
        self.holder = holder
        if holder == "list":
            self.items: nn.Module = nn.ModuleList(children)
        elif holder == "dict":
            self.items = nn.ModuleDict({f"m{i}": c for i, c in enumerate(children)})
        else:
            for i, c in enumerate(children):
                self.add_module(f"c{i}", c)

    def _children_in_order(self) -> list[nn.Module]:
        if self.holder == "list":
            return list(self.items)  # type: ignore[arg-type]
        if self.holder == "dict":
            return list(self.items.values())  # type: ignore[operator]
        return list(self.children())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self._children_in_order():
            y = child(x, scale=torch.ones_like(x)) if isinstance(child, Keyed) else child(x)
            y = y["out"] if isinstance(y, dict) else y
            x = y if y.dtype == x.dtype else y.to(x.dtype)
        return x


@dataclasses.dataclass
class Spec:
    kind: str  # a leaf kind, "node" or "seq"
    children: list[Spec] = dataclasses.field(default_factory=list)
    holder: str = "attrs"
    instance: Policy | None = None
    scope: Policy | None = None
    tie: bool = False  # a Linear that shares the previous Linear's weight


policies = st.builds(Policy, compute=st.sampled_from(DTYPES), storage=st.sampled_from(DTYPES),
                     comm=st.sampled_from(DTYPES))
with_output = st.builds(Policy, compute=st.sampled_from(DTYPES),
                        storage=st.sampled_from(DTYPES), comm=st.sampled_from(DTYPES),
                        output=st.sampled_from(DTYPES))
maybe = st.one_of(st.none(), policies)


def leaf(kinds: list[str]) -> st.SearchStrategy[Spec]:
    return st.builds(Spec, kind=st.sampled_from(kinds), instance=st.one_of(st.none(), with_output),
                     tie=st.booleans())


def trees() -> st.SearchStrategy[Spec]:
    seq = st.recursive(
        leaf(["linear", "layernorm", "batchnorm", "rotary"]),
        lambda inner: st.builds(Spec, kind=st.just("seq"),
                                children=st.lists(inner, min_size=1, max_size=3),
                                instance=maybe, scope=maybe),
        max_leaves=4,
    )
    return st.recursive(
        st.one_of(leaf(LEAVES), seq),
        lambda inner: st.builds(Spec, kind=st.just("node"),
                                children=st.lists(inner, min_size=1, max_size=3),
                                holder=st.sampled_from(["attrs", "list", "dict"]),
                                instance=st.one_of(st.none(), with_output), scope=maybe),
        max_leaves=7,
    )


class Built:
    def __init__(self, classes: dict[str, type[nn.Module]]) -> None:
        self.classes = classes
        self.last_linear: nn.Linear | None = None

    def build(self, spec: Spec) -> nn.Module:
        if spec.scope is not None:
            with precision_scope(spec.scope):
                module = self._build(spec)
        else:
            module = self._build(spec)
        if spec.instance is not None:
            precision(spec.instance)(module)
        return module

    def _build(self, spec: Spec) -> nn.Module:
        if spec.kind == "node":
            return Node([self.build(c) for c in spec.children], spec.holder)
        if spec.kind == "seq":
            # Sequential passes each output straight on: no `output` field inside it
            return nn.Sequential(*[self.build(dataclasses.replace(c, instance=_no_output(
                c.instance))) for c in spec.children])
        module = self.classes[spec.kind]()
        if spec.kind == "linear":
            assert isinstance(module, nn.Linear)
            if spec.tie and self.last_linear is not None:
                module.weight = self.last_linear.weight
            self.last_linear = module
        return module


def _no_output(policy: Policy | None) -> Policy | None:
    return None if policy is None else dataclasses.replace(policy, output=None)


def classes(tags: dict[str, Policy | None]) -> dict[str, type[nn.Module]]:
    """Fresh classes per example, so class tags do not leak between examples."""
    bases: dict[str, Any] = {
        "linear": (nn.Linear, lambda self: nn.Linear.__init__(self, D, D)),
        "layernorm": (nn.LayerNorm, lambda self: nn.LayerNorm.__init__(self, D)),
        "batchnorm": (nn.BatchNorm1d, lambda self: nn.BatchNorm1d.__init__(self, D)),
        "rotary": (Rotary, Rotary.__init__),
        "kwargs": (Keyed, Keyed.__init__),
    }
    out: dict[str, type[nn.Module]] = {}
    for kind, (base, init) in bases.items():
        cls = type(f"Gen{base.__name__}", (base,), {"__init__": init,
                                                     "__module__": __name__})
        if tags.get(kind) is not None:
            precision(tags[kind])(cls)
        out[kind] = cls
    return out


rules = st.lists(st.tuples(st.sampled_from(["class:layernorm", "class:linear", "glob:*.0",
                                            "glob:*items*", "predicate:batchnorm"]),
                           policies), max_size=3)


def _selector(text: str, cls: dict[str, type[nn.Module]]) -> Any:
    kind, _, value = text.partition(":")
    if kind == "class":
        return cls[value]
    if kind == "glob":
        return value
    target = cls[value]
    return lambda name, m: isinstance(m, target)


def dtypes_of(model: nn.Module) -> dict[str, torch.dtype]:
    out = {f"p:{n}": p.dtype for n, p in model.named_parameters()}
    out.update({f"b:{n}": b.dtype for n, b in model.named_buffers()})
    return out


#: one example: a tree, class tags on its leaves, rules, and the root's default
EXAMPLES = {
    "tree": trees(),
    "tags": st.fixed_dictionaries({k: maybe for k in LEAVES}),
    "rules": rules,
    "default": st.builds(Policy, compute=st.sampled_from([fp32, bf16, fp16]),
                         storage=st.sampled_from(DTYPES), comm=st.sampled_from(DTYPES)),
}


@settings(max_examples=250, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(**EXAMPLES)
def test_random_trees_run_exactly_as_planned(tree: Spec, tags: dict[str, Policy | None],
                                             rules: list[tuple[str, Policy]],
                                             default: Policy) -> None:
    torch.manual_seed(0)
    cls = classes(tags)
    model = Built(cls).build(Spec("node", [tree], holder="attrs"))
    annotate(model, [(_selector(s, cls), p) for s, p in rules], strict=False)
    try:
        plan = resolve(model, default=default)
    except ValueError as e:
        assert "is shared by modules" in str(e)  # a tied weight planned in two dtypes
        assume(False)
    pristine = copy.deepcopy(model)
    before, text = dtypes_of(model), repr(model)
    dtype_before = {id(p): p.dtype for p in model.parameters()}

    apply(model, plan)
    x = torch.randn(3, D, requires_grad=True)
    with audit(model) as report:
        out = model(x)
        out.float().sum().backward()
    assert report.divergences == [], "\n" + str(report)

    # gradients land in storage
    for name, entry in plan.items():
        module = model.get_submodule(name)
        for pname, p in module.named_parameters(recurse=False):
            if p.grad is not None:
                planned = entry.policy.storage or dtype_before[id(p)]
                assert p.dtype == p.grad.dtype == planned, (name, pname)

    # the JSON round trip re-applies identically to a fresh copy
    fresh = copy.deepcopy(pristine)
    apply(fresh, PrecisionPlan.from_json(plan.to_json()))
    assert dtypes_of(fresh) == dtypes_of(model)
    assert installed_boundaries(fresh) == installed_boundaries(model)
    again = copy.deepcopy(pristine)
    apply(again, plan)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), again(x), rtol=0, atol=0)

    # remove restores the model
    remove(model)
    assert dtypes_of(model) == before
    assert repr(model) == text and installed_boundaries(model) == []
    for m in model.modules():
        assert not isinstance(m.__dict__.get("forward"), Boundary)
        assert not isinstance(m._parameters, CastingDict)
        assert not isinstance(m._buffers, CastingDict)
        assert "_precision_annot_state" not in m.__dict__


@pytest.mark.slow
@settings(max_examples=3000, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(**EXAMPLES)
def test_random_trees_many_more_examples(tree: Spec, tags: dict[str, Policy | None],
                                         rules: list[tuple[str, Policy]],
                                         default: Policy) -> None:
    test_random_trees_run_exactly_as_planned.hypothesis.inner_test(  # type: ignore[attr-defined]
        tree, tags, rules, default)
