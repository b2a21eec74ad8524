"""fp8 GEMMs per module, through torchao: the one file that imports it.

A module whose compute is an fp8 recipe (`compute=fp8`, `fp8-rowwise`, `fp8-rowwise-gw-hp`,
`mxfp8`) runs the GEMMs of its `nn.Linear` layers in fp8 and its other ops in the dtype it
would otherwise have. `apply` converts exactly those Linear layers with torchao's own modules
(`Float8Linear.from_float` with `Float8LinearConfig.from_recipe_name`, or `MXFP8Linear`), in
place: the module object, its parameters, hooks and annotations stay, only its class and the
attributes torchao's module adds change, so the converted model runs torchao's code as
`convert_to_float8_training` would. `remove` gives the plain class back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from precision_annot._src.dtypes import FP8_RECIPES, dtype_name

__all__ = ["MX_BLOCK", "MX_HIGH", "Converted", "Gemm", "available", "build", "commit", "config",
           "import_torchao", "REFUSALS", "Refusal", "refusals",
           "install_hint", "is_fp8_tensor", "is_wrapper_subclass", "plain_class",
           "prepare_compile", "revert", "validate"]

install_hint = "pip install 'precision-annot[fp8]' (torchao>=0.18)"


@dataclasses.dataclass(frozen=True)
class Gemm:
    """The fp8 GEMMs of one Linear layer.

    Attributes:
        recipe: the recipe's name in a policy ("fp8", "fp8-rowwise", ...).
        all_gather: its weight is all-gathered in fp8 by FSDP2 (its comm is fp8).
        compute: the dtype its other ops run in (the "bf16" of "fp8-rowwise/bf16"), if set.
    """

    recipe: str
    all_gather: bool = False
    compute: torch.dtype | None = None

    @property
    def torchao_recipe(self) -> str:
        return FP8_RECIPES[self.recipe]


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    # torchao logs a warning for each CUDA kernel library it cannot load on a CPU-only
    # machine; they say nothing about fp8 training, which runs without them.
    log = logging.getLogger("torchao")
    level = log.level
    if not log.handlers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def import_torchao(name: str, what: str) -> Any:
    try:
        with _quiet_import():
            return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{what} runs its GEMMs in fp8 through torchao, which is not "
                          f"installed: {install_hint}.") from e


def available() -> bool:
    """True when torchao's fp8 training can be imported."""
    try:
        import_torchao("torchao.float8", "")
    except ImportError:
        return False
    return True


_KERNELS: dict[tuple[str, str], str | None] = {}


def kernel_refusal(gemm: Gemm, device: torch.device) -> str | None:
    """Why this machine's kernels cannot run the recipe's GEMMs on `device` (the error one
    small layer's forward and backward raised), or None where they run. Some CPU kernel sets
    have no fp8 matrix multiply: oneDNN limited to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`) refused
    it on an AVX-512 CPU ("could not create a primitive descriptor"). Asked once per recipe and
    device type."""
    key = (gemm.recipe, device.type)
    if key not in _KERNELS:
        # no random draw: a probe must not move the caller's random stream
        layer = nn.utils.skip_init(nn.Linear, 64, 64, bias=False,  # type: ignore[no-untyped-call,unused-ignore]
                                   device=device)
        values = torch.linspace(-1, 1, 64 * 64, device=device).reshape(64, 64)
        with torch.no_grad():
            layer.weight.copy_(values)
        try:
            fp8 = build(layer, gemm, "probe")  # sharing the layer's weight
            x = values.t().contiguous().requires_grad_(True)
            with torch.autocast(device.type, dtype=gemm.compute or torch.bfloat16):
                fp8(x).float().sum().backward()
            _KERNELS[key] = None
        except (RuntimeError, NotImplementedError) as e:  # what a kernel raises
            _KERNELS[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return _KERNELS[key]


def config(gemm: Gemm, where: str = "fp8") -> Any:
    """torchao's `Float8LinearConfig` for one recipe (with FSDP2's fp8 all-gather when the
    module's comm is fp8)."""
    float8 = import_torchao("torchao.float8", where)
    cfg = float8.Float8LinearConfig.from_recipe_name(gemm.torchao_recipe)
    if gemm.all_gather:
        cfg = dataclasses.replace(cfg, enable_fsdp_float8_all_gather=True)
    return cfg


def _mx_kernel(module: nn.Module) -> Any:
    common = import_torchao("torchao.quantization.quantize_.common", "mxfp8")
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    if weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (10, 0):
        return common.KernelPreference.AUTO
    return common.KernelPreference.EMULATED  # no MX GEMMs here: torch ops emulate them


_CLASSES: dict[tuple[type, type], type] = {}


def _fp8_class(fp8: type[nn.Module], original: type[nn.Module]) -> type[nn.Module]:
    """torchao's class, or for a subclass of nn.Linear that keeps Linear's forward (such as
    `NonDynamicallyQuantizableLinear`), a class that is both, as FSDP2 makes `FSDPLinear`."""
    if original is nn.Linear or issubclass(original, fp8):
        return fp8
    key = (fp8, original)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{fp8.__name__}{original.__name__}", (fp8, original),
                             {"__module__": original.__module__})
    return _CLASSES[key]


# torchao's MX formats quantize from these dtypes only ("torch.float16 is not supported yet")
MX_HIGH = (torch.bfloat16, torch.float32)
MX_BLOCK = 32  # MX scales blocks of 32 elements along every GEMM's inner dimension


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One layout torchao's fp8 conversion cannot take, stated once: `validate` (so apply
    raises), `resolve` (mxfp8's compute, before a plan exists) and `check` (its finding) all
    read it from `REFUSALS`, as torchao states each invariant once in its config.

    Attributes:
        code: the finding's code in `check`.
        refuses: `refuses(gemm, own_forward)`: the layer's GEMMs cannot run, given its recipe
            and whether its class overrides nn.Linear's forward.
        why: what torchao cannot do, for a layer with these GEMMs.
        fix: the way out, for the first layer's name and its GEMMs.
    """

    code: str
    refuses: Callable[[Gemm, bool], bool]
    why: Callable[[Gemm], str]
    fix: Callable[[str, Gemm], str]

    def message(self, subject: str, name: str, gemm: Gemm) -> str:
        """The error: `subject` (the layer or layers), why, and the fix."""
        return f"{subject}: {self.why(gemm)} {self.fix(name, gemm)}"


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "fp8-linear-subclass", lambda gemm, own_forward: own_forward,
        lambda gemm: f"planned with fp8 GEMMs (compute={gemm.recipe}), it overrides nn.Linear's "
        "forward, which torchao's fp8 module would replace, dropping what it does: apply "
        "refuses it.",
        lambda name, gemm: f"Keep it out of fp8 (annotate(model, {{{name!r}: 'compute=bf16'}})) "
        "or make it a plain nn.Linear."),
    Refusal(
        "fp8-comm-recipe",
        lambda gemm, own_forward: gemm.all_gather and gemm.torchao_recipe != "tensorwise",
        lambda gemm: f"comm=fp8 all-gathers weights in fp8, which torchao does for weights "
        f"scaled per tensor only (compute=fp8), not with compute={gemm.recipe}: apply refuses "
        "it.",
        lambda name, gemm: f"Use compute=fp8 with comm=fp8, or keep compute={gemm.recipe} with "
        "another comm (bf16)."),
    Refusal(
        "fp8-mx-compute",
        lambda gemm, own_forward: gemm.recipe == "mxfp8" and gemm.compute is not None
        and gemm.compute not in MX_HIGH,
        lambda gemm: f"compute=mxfp8/{dtype_name(gemm.compute)}: torchao's MX formats quantize "
        "from bf16 or fp32 only (fp16 is refused when the first GEMM runs), so resolve and "
        "apply refuse it.",
        lambda name, gemm: "Run mxfp8 over bf16 (default 'bf16-mixed' or 'bf16'), or use "
        "compute=fp8 or fp8-rowwise, which take fp16."),
)


def refusals(gemm: Gemm, own_forward: bool) -> list[Refusal]:
    """The `REFUSALS` a layer with `gemm` (whose class overrides nn.Linear's forward, or not)
    runs into."""
    return [r for r in REFUSALS if r.refuses(gemm, own_forward)]


def validate(cls: type[nn.Module], gemm: Gemm, name: str) -> None:
    """Raise, before anything changes, when a module of class `cls` cannot run `gemm`."""
    if not issubclass(cls, nn.Linear):
        raise TypeError(f"fp8 GEMMs are converted on nn.Linear layers; module {name!r} is "
                        f"{cls.__qualname__}.")
    for refusal in refusals(gemm, cls.forward is not nn.Linear.forward):
        raise ValueError(refusal.message(f"Module {name!r} ({cls.__qualname__})", name, gemm))
    where = f"Module {name!r} (compute={gemm.recipe})"
    if gemm.recipe == "mxfp8":
        import_torchao("torchao.prototype.moe_training.mxfp8_linear", where)
    else:
        config(gemm, where)


def build(module: nn.Module, gemm: Gemm, name: str) -> nn.Module:
    """torchao's module for `module` (on the meta device, sharing its parameters), built
    without changing `module`."""
    validate(type(module), gemm, name)
    where = f"Module {name!r} (compute={gemm.recipe})"
    if gemm.recipe == "mxfp8":
        import_torchao("torchao.prototype.moe_training.mxfp8_linear", where)
        with torch.device("meta"):
            new = _mx_class()(module.in_features, module.out_features, bias=False,
                              kernel_preference=_mx_kernel(module))
        new.weight = module.weight
        new.bias = module.bias
        return new
    linear = import_torchao("torchao.float8.float8_linear", where)
    return linear.Float8Linear.from_float(module, config=config(gemm, where))  # type: ignore[no-any-return]


@dataclasses.dataclass(eq=False)
class Converted:
    """What converting one Linear changed, to undo it: its class, the attributes torchao's
    module added, and its weight when torchao wrapped it (for FSDP2's fp8 all-gather)."""

    cls: type[nn.Module]
    added: tuple[str, ...]
    gemm: Gemm
    weight: nn.Parameter | None = None
    guard: Any = None  # the handle of the export guard


class _RefuseExport:
    """A forward pre-hook on a converted layer: `torch.export` cannot trace torchao's fp8
    training tensors (it fails with "Unable to cast NotImplemented to Tensor", naming nothing),
    so it is refused with the layer's name and the way out. One check per call; eager and
    `torch.compile` runs pass through."""

    def __init__(self, name: str, recipe: str) -> None:
        self.name = name
        self.recipe = recipe

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_exporting():
            raise RuntimeError(
                f"torch.export cannot trace module {self.name or '(root)'!r}: it runs its GEMMs "
                f"in fp8 (compute={self.recipe}) through torchao's fp8 training tensors, which "
                "torch.export does not support. Export a copy planned without fp8 (annotate "
                "its Linear layers compute=bf16 and apply again, or precision_annot.remove it);"
                " torch.compile runs the fp8 plan.")


def commit(module: nn.Module, new: nn.Module, gemm: Gemm, name: str = "") -> Converted:
    """Turn `module` (named `name`) into torchao's module `new` (from `build`) in place."""
    d, theirs = module.__dict__, new.__dict__
    added = tuple(k for k in theirs if k not in d)
    for key in added:
        d[key] = theirs[key]
    weight = None
    if new._parameters["weight"] is not module._parameters["weight"]:
        weight = module._parameters["weight"]
        module._parameters["weight"] = new._parameters["weight"]
    original = type(module)
    module.__class__ = _fp8_class(type(new), original)
    guard = module.register_forward_pre_hook(_RefuseExport(name, gemm.recipe))
    return Converted(original, added, gemm, weight, guard)


def plain_class(module: nn.Module) -> type[nn.Module]:
    """The module's class as the user built it: the class before `apply` converted it."""
    converted = getattr(module.__dict__.get("_precision_annot"), "converted", None)
    return converted.cls if isinstance(converted, Converted) else type(module)


def revert(module: nn.Module, converted: Converted) -> None:
    """Give `module` its class back, with the same parameters (and gradients)."""
    if converted.guard is not None:
        converted.guard.remove()
    d = module.__dict__
    for key in converted.added:
        d.pop(key, None)
    if converted.weight is not None:
        wrapped = module._parameters["weight"]
        if wrapped is not None and wrapped.grad is not None:
            grad = wrapped.grad
            converted.weight.grad = getattr(grad, "_tensor", grad)
        module._parameters["weight"] = converted.weight
    module.__class__ = converted.cls


_MX: list[type[nn.Module]] = []


def _mx_class() -> type[nn.Module]:
    """torchao's `MXFP8Linear`, run as `nn.Linear` runs under autocast.

    torchao's module quantizes its input and weight in the dtypes it is given, so fp32 master
    weights under bf16 autocast (the usual mixed precision) fail in its GEMM ("expected m1 and
    m2 to have the same dtype"). Under autocast this class casts both to the autocast dtype
    first, as autocast does for `nn.Linear` and as FSDP2's `param_dtype` does for torchao's
    own training recipe; outside autocast it is torchao's forward unchanged. It also says which
    module and why when a batch's row count cannot be cut into MX blocks for the backward
    GEMMs, where torchao's assertion would name only a shape. Defined on first use (torchao
    is optional) and reachable as `precision_annot._src.float8.MXFP8Linear`, so a converted
    model pickles.
    """
    if _MX:
        return _MX[0]
    mx = import_torchao("torchao.prototype.moe_training.mxfp8_linear", "mxfp8")
    base: type[nn.Module] = mx.MXFP8Linear
    to_mx_mm = mx._to_mxfp8_then_scaled_mm

    def forward(self: Any, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        rows = input.numel() // max(input.shape[-1], 1) if input.dim() else 1
        if rows % MX_BLOCK and torch.is_grad_enabled() and (
                input.requires_grad or weight.requires_grad):
            state = self.__dict__.get("_precision_annot")
            where = (f"module {state.name or '(root)'!r} (MXFP8Linear)" if state is not None
                     else f"MXFP8Linear({self.in_features}, {self.out_features})")
            raise ValueError(
                f"{where}: mxfp8 trains on "
                f"inputs whose rows (tokens: every dimension but the last) are a multiple of "
                f"{MX_BLOCK}, because the weight gradient's GEMM is cut into MX blocks along "
                f"them; this input has {rows} (shape {tuple(input.shape)}). Pad the batch, or "
                "keep this layer out of mxfp8 (compute=bf16).")
        device = input.device.type
        if not torch.is_autocast_enabled(device):
            return base.forward(self, input)  # type: ignore[no-any-return]
        dtype = torch.get_autocast_dtype(device)
        output: torch.Tensor = to_mx_mm(
            input.to(dtype), weight.to(dtype), kernel_preference=self.kernel_preference,
            scale_calculation_mode=self.scale_calculation_mode, wgrad_with_hp=self.wgrad_with_hp)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    cls = type("MXFP8Linear", (base,), {"forward": forward, "__module__": __name__,
                                          "__doc__": _mx_class.__doc__})
    _MX.append(cls)
    return cls


def __getattr__(name: str) -> Any:
    if name == "MXFP8Linear":  # how pickle finds the class of a converted module
        return _mx_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_compile() -> None:
    """What `convert_to_float8_training` does before any fp8 kernel is compiled (a Triton fp8
    store workaround in inductor), so that compiled code is the same as torchao's."""
    with contextlib.suppress(ImportError, AttributeError):
        patch = import_torchao("torchao.float8._inductor_patch", "fp8")
        patch._patch_inductor_min_max_codegen()


_FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                         torch.float8_e5m2fnuz, torch.float8_e8m0fnu})


def is_wrapper_subclass(t: object) -> bool:
    """A tensor subclass that wraps inner tensors (torchao's fp8 training tensors): one that
    implements the flatten protocol `torch.compile` and FSDP2 use, the whole of torch's own
    (private) `is_traceable_wrapper_subclass`."""
    return (isinstance(t, torch.Tensor) and type(t) is not torch.Tensor
            and hasattr(t, "__tensor_flatten__") and hasattr(t, "__tensor_unflatten__"))


def is_fp8_tensor(t: object, depth: int = 0) -> bool:
    """A tensor whose data is fp8: a plain float8 tensor, or a tensor subclass (torchao's
    training tensors, which report their high-precision dtype) holding float8 data."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.dtype in _FP8_DTYPES:
        return True
    if depth > 2 or not is_wrapper_subclass(t):
        return False
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return any(is_fp8_tensor(getattr(t, n, None), depth + 1) for n in names)
