"""fp8 backends: one plan, said in each fp8 system's own dialect.

- `module_filter(plan)` and `float8_config(plan)`: torchao's `module_filter_fn` and
  `Float8LinearConfig` for `convert_to_float8_training` by hand.
- `ao_recipe_kwargs(plan)`: Accelerate's `AORecipeKwargs` (config and filter), for
  `Accelerator(mixed_precision="fp8", kwargs_handlers=[...])`.
- `megatron_args(plan, model)` and `te_settings(plan, model)`: the Megatron arguments
  (`fp8_recipe`, `first_last_layers_bf16`, `moe_router_dtype`) and the TransformerEngine recipe
  and `fp8_autocast(enabled=False)` regions that match the plan, with what they cannot say.

`apply` itself converts the planned Linear layers with torchao; these are for the systems that
convert models themselves. torchao and Accelerate are imported only when a function here needs
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from precision_annot._src.dtypes import dtype_name, fp32
from precision_annot._src.execution import fp8_gemms
from precision_annot._src.float8 import Gemm, config, plain_class
from precision_annot._src.float8_checks import accelerate_refusal, one_gemm
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.runtime import subject
from precision_annot.adapters.transformers import router_names

__all__ = ["BackendSettings", "ao_recipe_kwargs", "float8_config", "megatron_args",
           "module_filter", "te_settings"]


def _gemms(model_or_plan: nn.Module | PrecisionPlan) -> dict[str, Gemm]:
    given = subject(model_or_plan, "fp8")
    given.require_facts("fp8", "which layers are Linear")
    return fp8_gemms(given.plan)


def module_filter(model_or_plan: nn.Module | PrecisionPlan) -> Callable[[nn.Module, str], bool]:
    """torchao's `module_filter_fn` for the plan: True for exactly the Linear layers the plan
    runs in fp8 (by qualified name from the model's root), and False for a layer that is
    already converted, so that a model `apply` converted is not converted twice."""
    names = frozenset(_gemms(model_or_plan))

    def keep(module: nn.Module, fqn: str) -> bool:
        return fqn in names and type(module) is plain_class(module) and not hasattr(
            module, "linear_mm_config")

    return keep


def float8_config(model_or_plan: nn.Module | PrecisionPlan) -> Any:
    """torchao's `Float8LinearConfig` for the plan's one fp8 recipe (with FSDP2's fp8
    all-gather when its fp8 layers have comm=fp8)."""
    return config(one_gemm(_gemms(model_or_plan), "float8_config"))


def ao_recipe_kwargs(model_or_plan: nn.Module | PrecisionPlan) -> Any:
    """Accelerate's `AORecipeKwargs` for the plan: its one fp8 config, and a filter that
    converts exactly the planned Linear layers (Accelerate's default skips the first and last
    Linear, whatever they are).

    Example:
        >>> # accelerator = Accelerator(mixed_precision="fp8",
        >>> #                           kwargs_handlers=[fp8.ao_recipe_kwargs(model)])
    """
    from accelerate.utils import AORecipeKwargs

    refusal = accelerate_refusal(subject(model_or_plan, "ao_recipe_kwargs"))
    if refusal is not None:
        raise ValueError(refusal)
    gemm = one_gemm(_gemms(model_or_plan), "ao_recipe_kwargs")
    return AORecipeKwargs(config=config(gemm), module_filter_func=module_filter(model_or_plan))


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """What another fp8 system needs to run a plan.

    Attributes:
        backend: "megatron" or "transformer_engine".
        settings: its arguments, by name.
        unexpressed: what of the plan it cannot say, one line each; empty when exact.
    """

    backend: str
    settings: dict[str, Any]
    unexpressed: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return not self.unexpressed

    def __str__(self) -> str:
        lines = [f"{self.backend}:"] + [f"  {k} = {v!r}" for k, v in self.settings.items()]
        if self.unexpressed:
            lines.append("  cannot express:")
            lines.extend(f"    - {u}" for u in self.unexpressed)
        return "\n".join(lines)


_MEGATRON_RECIPES = {"fp8": "tensorwise", "mxfp8": "mxfp8"}
_TE_RECIPES = {"fp8": "Float8CurrentScaling()", "mxfp8": "MXFP8BlockScaling()"}


def _layers(named: dict[str, nn.Module]) -> tuple[str, list[str]]:
    """The transformer layers: the ModuleList of one repeated class holding the most Linear
    layers, as (its name, its children's names)."""
    best: tuple[int, str, list[str]] = (0, "", [])
    for name, module in named.items():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(c) for c in module}) != 1:
            continue
        linears = sum(isinstance(m, nn.Linear) for m in module.modules())
        if linears > best[0]:
            prefix = f"{name}." if name else ""
            best = (linears, name, [f"{prefix}{i}" for i in range(len(module))])
    return best[1], best[2]


def _linears_under(named: dict[str, nn.Module], prefix: str) -> list[str]:
    return [n for n, m in named.items() if isinstance(m, nn.Linear)
            and (n == prefix or n.startswith(prefix + "."))]


def megatron_args(model: nn.Module, plan: PrecisionPlan | None = None) -> BackendSettings:
    """The Megatron-Core arguments that run the plan's fp8: `fp8_recipe`,
    `first_last_layers_bf16` with `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16`,
    and `moe_router_dtype`. Megatron keeps embeddings, the output layer, norms and routers out
    of fp8 and converts whole transformer layers, so a plan that keeps part of a layer in high
    precision, or puts the LM head in fp8, is listed in `unexpressed`."""
    plan, named, gemms = _fp8_of(model, plan)
    unexpressed: list[str] = []
    recipe = _one_recipe(gemms, "one fp8 recipe per model", unexpressed)
    settings: dict[str, Any] = {"fp8": "e4m3" if gemms else None}
    if recipe is not None:
        settings["fp8_recipe"] = _MEGATRON_RECIPES.get(recipe, "blockwise")
        if recipe not in _MEGATRON_RECIPES:
            unexpressed.append(f"compute={recipe}: Megatron has no row-wise scaling; "
                               "'blockwise' (1x128 / 128x128 blocks) is the nearest")
    all_routers = router_names(named)
    state, in_layers = _megatron_layers(named, gemms, all_routers, unexpressed)
    settings.update(_first_last(state, bool(gemms), unexpressed))
    outside = [n for n in gemms if n not in in_layers]
    if outside:
        unexpressed.append(f"fp8 outside the transformer layers ({outside[:3]}); Megatron "
                           "keeps the embedding and output layer in high precision")
    if all_routers:
        settings["moe_router_dtype"] = _router_dtype(plan, all_routers, unexpressed)
    return BackendSettings("megatron", settings, tuple(unexpressed))


def _fp8_of(model: nn.Module, plan: PrecisionPlan | None
            ) -> tuple[PrecisionPlan, dict[str, nn.Module], dict[str, Gemm]]:
    """The plan (given, or the model's), the named modules, and the fp8 Linear layers."""
    given = subject(model, "fp8")
    plan = given.plan if plan is None else plan
    named = dict(given.model.named_modules()) if given.model is not None else {}
    return plan, named, fp8_gemms(plan, named)


def _one_recipe(gemms: dict[str, Gemm], rule: str, unexpressed: list[str]) -> str | None:
    """The plan's fp8 recipe; a backend that takes one (`rule`) is told of the others."""
    recipes = sorted({g.recipe for g in gemms.values()})
    if len(recipes) > 1:
        unexpressed.append(f"{rule}; the plan has {recipes}")
    return recipes[0] if recipes else None


def _megatron_layers(named: dict[str, nn.Module], gemms: dict[str, Gemm],
                     all_routers: list[str], unexpressed: list[str]
                     ) -> tuple[list[bool], set[str]]:
    """Per transformer layer, whether it runs fp8 (Megatron converts whole layers: a layer
    with part of its Linear layers out of fp8 is told of), and the Linear layers inside."""
    _, layers = _layers(named)
    in_layers = {n for layer in layers for n in _linears_under(named, layer)}
    state = []
    for layer in layers:
        linears = _linears_under(named, layer)
        fp8 = [n for n in linears if n in gemms]
        dense = [n for n in linears if n not in set(all_routers)]
        if fp8 and len(fp8) < len(dense):
            high = [n for n in dense if n not in gemms]
            unexpressed.append(f"layer {layer!r} keeps part of its Linear layers out of fp8 "
                               f"({high[:3]}); Megatron converts whole layers")
        state.append(bool(fp8))
    return state, in_layers


def _first_last(state: list[bool], fp8: bool, unexpressed: list[str]) -> dict[str, Any]:
    """Megatron's `first_last_layers_bf16` and its counts, from which layers run fp8; layers
    out of fp8 between fp8 ones, which it cannot say, are told of."""
    start = next((i for i, s in enumerate(state) if s), len(state))
    end = next((i for i, s in enumerate(reversed(state)) if s), len(state))
    if fp8 and not all(state[start:len(state) - end]):
        unexpressed.append("layers kept in high precision between fp8 layers; Megatron keeps "
                           "only the first and last layers out of fp8")
    if fp8 and (start or end):
        return {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": start,
                "num_layers_at_end_in_bf16": end}
    return {"first_last_layers_bf16": False}


def _router_dtype(plan: PrecisionPlan, routers: list[str], unexpressed: list[str]
                  ) -> str | None:
    """Megatron's `moe_router_dtype`: fp32 or fp64 when every router is planned so."""
    widest = {plan[n].policy.compute for n in routers}
    if widest == {fp32} or widest == {torch.float64}:
        return dtype_name(widest.pop())
    if len(widest) > 1:
        unexpressed.append("routers planned in several dtypes; Megatron takes one")
    return None


def te_settings(model: nn.Module, plan: PrecisionPlan | None = None) -> BackendSettings:
    """The TransformerEngine recipe for the plan's fp8, and the modules to run under
    `te.fp8_autocast(enabled=False)` inside the model's `fp8_autocast`: the outermost modules
    holding Linear layers, none of them fp8. (TE runs fp8 only in its own `te.Linear` layers:
    build those where the plan says fp8.)"""
    _, named, gemms = _fp8_of(model, plan)
    unexpressed: list[str] = []
    recipe = _one_recipe(gemms, "one recipe per fp8_autocast region", unexpressed)
    settings: dict[str, Any] = {"fp8_recipe": None if recipe is None else
                                _TE_RECIPES.get(recipe, "Float8BlockScaling()")}
    if recipe is not None and recipe not in _TE_RECIPES:
        unexpressed.append(f"compute={recipe}: TE has no row-wise scaling; "
                           "Float8BlockScaling() is the nearest")
    settings["fp8_autocast_disabled"] = _outermost_without_fp8(named, gemms)
    settings["te_linear"] = sorted(gemms)
    return BackendSettings("transformer_engine", settings, tuple(unexpressed))


def _outermost_without_fp8(named: dict[str, nn.Module], gemms: dict[str, Gemm]) -> list[str]:
    """The outermost modules holding Linear layers, none of them fp8."""
    linears = {n for n, m in named.items() if isinstance(m, nn.Linear)}
    high: list[str] = []
    for name in named:
        if not name or any(name.startswith(h + ".") for h in high):
            continue
        under = {n for n in linears if n == name or n.startswith(name + ".")}
        if under and not under & set(gemms):
            high.append(name)
    return high
