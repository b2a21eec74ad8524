"""The private names the package reaches (`precision_annot._src.private`), checked on the torch
and backends installed: each one resolves (a rename fails here, not in a user's run, where
several would go silently wrong), and the package's source reaches no private name the registry
does not list, nor does the registry list one the source no longer reaches."""

from __future__ import annotations

import ast
import importlib
import inspect
import pickletools
import re
import sys
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import precision_annot
from precision_annot._src import seams, tracking
from precision_annot._src.private import BACKENDS, TORCH, PrivateName
from tests.helpers import free_port

# -- resolving each name on the installed torch ---------------------------------------------------


class Built:
    """The real objects names are read on, each built on first use; the distributed ones run on
    a one-rank gloo process group, destroyed with this object."""

    def __init__(self) -> None:
        self.made: dict[str, Any] = {}
        self.grouped = False

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]

    def group(self) -> None:
        if not self.grouped:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
            self.grouped = True

    def ddp(self) -> nn.parallel.DistributedDataParallel:
        self.group()
        return self.once("ddp", lambda: nn.parallel.DistributedDataParallel(nn.Linear(2, 2)))

    def fsdp2(self) -> nn.Module:
        """A bf16 unit whose LayerNorm FSDP2 gathers in its own dtype where torch 2.15 can."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.group()

        def make() -> nn.Module:
            model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
            kwargs: dict[str, Any] = {}
            if seams.FSDP2_KEEPS_PARAM_DTYPE:
                norm = set(map(id, model[1].parameters()))
                kwargs["param_dtype_override_fn"] = lambda p: (
                    torch.float32 if id(p) in norm else None)
            fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                              **kwargs))
            return model

        return self.once("fsdp2", make)  # type: ignore[no-any-return]

    def fsdp1(self) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.group()
        return self.once("fsdp1", lambda: FullyShardedDataParallel(  # type: ignore[no-any-return]
            nn.Linear(2, 2), device_id=torch.device("cpu")))

    def close(self) -> None:
        self.made.clear()
        if self.grouped:
            import gc

            gc.collect()  # wrappers in a reference cycle go before their group
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def built() -> Iterator[Built]:
    made = Built()
    try:
        yield made
    finally:
        made.close()


def _instances(built: Built) -> dict[str, Callable[[], Any]]:
    """Owner path -> a real instance, for attributes only instances have."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return {
        "torch.Tensor": lambda: torch.ones(1),
        "torch.nn.Module": lambda: nn.Linear(2, 2),
        "torch.nn.parallel.DistributedDataParallel": built.ddp,
        "torch.distributed.fsdp.FullyShardedDataParallel": built.fsdp1,
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper":
            lambda: checkpoint_wrapper(nn.Linear(2, 2)),
        "torch._dynamo.eval_frame.OptimizedModule": lambda: torch.compile(nn.Linear(2, 2)),
        "lightning.pytorch.LightningModule": lambda: importlib.import_module(
            "lightning.pytorch").LightningModule(),
        "lightning.pytorch.strategies.DDPStrategy": lambda: importlib.import_module(
            "lightning.pytorch.strategies").DDPStrategy(),
    }


def resolve(dotted: str, instances: dict[str, Callable[[], Any]] | None = None) -> Any:
    """`dotted` by import and getattr; an attribute only instances have is read on the instance
    `instances` builds for its owner's path. AttributeError names what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    else:
        raise ImportError(dotted)
    path = ".".join(parts[:i])
    for part in parts[i:]:
        if not hasattr(obj, part) and path in (instances or {}):
            obj = (instances or {})[path]()
        if not hasattr(obj, part):
            raise AttributeError(f"{path} has no {part!r} (registered as {dotted})")
        obj = getattr(obj, part)
        path = f"{path}.{part}"
    return obj


def _sequence_numbers(built: Built) -> None:
    x = torch.ones(2, requires_grad=True)
    following = torch._C._autograd._get_sequence_nr()
    y = x * 2
    assert y.grad_fn is not None and y.grad_fn._sequence_nr() == following
    seen: list[tuple[int, Any]] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append((torch._C._current_graph_task_id(), torch._C._current_autograd_node()))
        return grad

    y.register_hook(hook)
    y.sum().backward()
    assert torch._C._current_graph_task_id() == -1
    (task, node), = seen
    assert task >= 0 and type(node).__name__ == "MulBackward0"


def _recomputation(built: Built) -> None:
    """What `tracking.recomputing` matches, on a real non-reentrant checkpoint's rerun."""
    assert isinstance(resolve("torch.utils.checkpoint._recomputation_hook"), type)
    seen: list[tuple[bool, str]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        seen.append((tracking.recomputing(), getattr(top[0] if top else None, "__qualname__", "")))
        return x.sin()

    x = torch.ones(2, requires_grad=True)
    torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False).sum().backward()
    (first, _), (again, qualname) = seen
    assert (first, again) == (False, True), seen
    assert "_recomputation_hook" in qualname


def _version(built: Built) -> None:
    t = torch.ones(1)
    before = t._version
    t.add_(1)
    assert t._version == before + 1


def _to_copy(built: Built) -> None:
    """`Tensor.to` dispatches as `_to_copy`, the name audit and tracking file as data movement."""
    from torch.utils._python_dispatch import TorchDispatchMode

    resolve("torch.ops.aten._to_copy")
    names: list[str] = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Names():
        torch.ones(2).to(torch.float16)
    assert "_to_copy" in names and "_to_copy" in tracking.DATA_MOVEMENT


def _collectives(built: Built) -> None:
    from precision_annot._src import auditing

    op = torch.ops._c10d_functional.all_reduce
    assert op.default.namespace == "_c10d_functional"
    assert auditing._collective(op.default) and auditing._collective(op)
    assert not auditing._collective(torch.ops.aten.mm.default)
    assert not auditing._collective(torch.add)


def _hook_dicts(built: Built) -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
    found = {k: v for k, v in vars(opt).items() if k.startswith("_optimizer_")}
    assert {"_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
            } <= set(found)
    assert all(isinstance(v, dict) for v in found.values())  # hook storage, left out of pickles


def _hooked_step(built: Built) -> None:
    from precision_annot._src.update.step import own_step

    torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)  # torch wraps the class's step
    step: Any = torch.optim.SGD.step
    assert step.hooked is True and callable(step.__wrapped__)
    assert own_step(torch.optim.SGD).__module__ == "torch.optim.sgd"


def _amp_scaling(built: Built) -> None:
    amp = pytest.importorskip("lightning.fabric.plugins.precision.amp")
    fused = torch.optim.Adam([nn.Parameter(torch.ones(1))], fused=True)
    assert fused._step_supports_amp_scaling is True  # type: ignore[attr-defined]
    assert amp._optimizer_handles_unscaling(fused) is True
    assert amp._optimizer_handles_unscaling(torch.optim.SGD([nn.Parameter(torch.ones(1))])) \
        is False


def _unscale_grads(built: Built) -> None:
    method = resolve("torch.amp.GradScaler._unscale_grads_")
    assert list(inspect.signature(method).parameters) == [
        "self", "optimizer", "inv_scale", "found_inf", "allow_fp16"]


def _scale_async(built: Built) -> None:
    """watch reads the scale through a getattr default: a rename would drop it silently."""
    from precision_annot._src import watching

    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(1, requires_grad=True).sum())
    scale = watching._scale_tensor(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == scaler.get_scale() == 8.0


def _load_hooks(built: Built) -> None:
    """`runtime._drop_load_hooks` finds its own pre-hooks through `_WrappedHook.hook`."""
    module = nn.Linear(2, 2)

    def pre(*args: Any) -> None:
        return None

    module.register_load_state_dict_pre_hook(pre)
    assert [getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()] == [pre]


def _active_ddp(built: Built) -> None:
    from torch.nn.parallel import DistributedDataParallel

    seen: list[Any] = []

    class Peek(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(DistributedDataParallel._active_ddp_module)
            return super().forward(x)

    built.group()
    ddp = DistributedDataParallel(Peek(2, 2))
    ddp(torch.ones(1, 2))
    assert seen == [ddp] and DistributedDataParallel._active_ddp_module is None


def _comm_hooks(built: Built) -> None:
    """The plan's refusal and `check` read DDP's hook list and its logger, each behind a
    fallback: a rename would make them say "no hook" silently."""
    from precision_annot._src import grads
    from precision_annot.adapters import ddp as ddp_adapter

    built.group()
    plain = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    assert ddp_adapter.registered_hooks(plain) == [] and ddp_adapter.hook_name(plain) is None
    assert grads._comm_hook(plain) == "none"

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    python = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    python.register_comm_hook(None, allreduce_hook)
    assert ddp_adapter.registered_hooks(python) == [allreduce_hook]
    assert ddp_adapter.hook_name(python) == "allreduce_hook"
    assert grads._comm_hook(python) == "other"
    builtin = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)  # type: ignore[operator]
    assert ddp_adapter.registered_hooks(builtin) == []
    assert ddp_adapter.hook_name(builtin) == "BuiltinCommHookType.FP16_COMPRESS"
    assert grads._comm_hook(builtin) == "other"


def _fsdp2_policy(built: Built) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model: Any = built.fsdp2()
    policy = model._get_fsdp_state()._mp_policy
    assert isinstance(policy, MixedPrecisionPolicy) and policy.param_dtype == torch.bfloat16


def _fsdp2_params(built: Built) -> None:
    """What `adapters.fsdp.checks` reads per parameter: its gather dtype and its module."""
    model: Any = built.fsdp2()
    params = model._get_fsdp_state()._fsdp_param_group.fsdp_params
    owners = {type(p._module_info.module).__name__ for p in params}
    assert owners == {"Linear", "LayerNorm"}
    dtypes = {type(p._module_info.module).__name__: p.mp_policy.param_dtype for p in params
              if p._module_info.param_name == "weight"}
    assert dtypes["Linear"] == torch.bfloat16
    kept = torch.float32 if seams.FSDP2_KEEPS_PARAM_DTYPE else torch.bfloat16
    assert dtypes["LayerNorm"] == kept


def _fsdp1_name(built: Built) -> None:
    from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE

    assert FSDP_WRAPPED_MODULE == "_fsdp_wrapped_module"
    assert isinstance(built.fsdp1()._fsdp_wrapped_module, nn.Linear)


def _checkpoint_wrapper_name(built: Built) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = checkpoint_wrapper(nn.Linear(2, 2))
    assert [n for n, _ in wrapped.named_modules()] == ["", "_checkpoint_wrapped_module"]


def _colwise_input(built: Built) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    assert isinstance(inspect.getattr_static(ColwiseParallel, "_prepare_input_fn"),
                      staticmethod)


def _composable(built: Built) -> None:
    module = importlib.import_module("torch.distributed._composable.checkpoint_activation")
    assert callable(getattr(module, seams.CHECKPOINT_GENERATOR))


def _compiled(built: Built) -> None:
    compiled = torch.compile(nn.Linear(2, 2))
    assert type(compiled).__name__ == "OptimizedModule"  # what `wrappers` matches
    assert isinstance(compiled._orig_mod, nn.Linear)
    assert "_orig_mod" in dict(compiled.named_children())


def _profiler_flag(built: Built) -> None:
    from torch.autograd import profiler

    assert profiler._is_profiler_enabled is False
    with torch.profiler.profile():
        assert profiler._is_profiler_enabled is True


def _pickled_names(built: Built, tmp: Path) -> set[tuple[str, str]]:
    """The (module, name) pairs of torch's private rebuild functions in a file the installed
    torch writes for a tensor, a Parameter and a tensor with an attribute."""
    tagged = torch.ones(2)
    tagged.tag = "x"  # type: ignore[attr-defined]
    torch.save({"t": torch.ones(2), "p": nn.Parameter(torch.ones(2)), "s": tagged},
               tmp / "f.pt")
    with zipfile.ZipFile(tmp / "f.pt") as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    found = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL" and isinstance(arg, str):
            module, name = arg.split(" ")
            if module in ("torch._utils", "torch._tensor"):
                found.add((module, name))
    return found


def _rebuilders(built: Built) -> None:
    """Every private rebuild function the installed torch writes into a file is one the
    checkpoint reader knows (a new name would leave its tensors unread)."""
    import tempfile

    from precision_annot._src.checkpoints import reading

    with tempfile.TemporaryDirectory() as tmp:
        written = _pickled_names(built, Path(tmp))
    registered = {tuple(e.name.rsplit(".", 1)) for e in TORCH if e.name.startswith(
        ("torch._utils.", "torch._tensor."))}
    assert written and written <= registered, written - registered
    assert {n for _, n in written} <= set(reading._TENSOR_BUILDERS)


def _fabric_module(built: Built) -> None:
    fabric = pytest.importorskip("lightning.fabric")
    from precision_annot._src import wrappers

    inner = nn.Linear(2, 2)
    wrapped = fabric.Fabric(accelerator="cpu", devices=1).setup_module(inner)
    assert type(wrapped).__name__ == "_FabricModule"  # what `wrappers` matches
    assert wrapped.module is inner and wrappers.unwrap(wrapped) is inner


def _weight_conversions(built: Built) -> None:
    tf = pytest.importorskip("transformers")
    import tempfile

    config = tf.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    with tempfile.TemporaryDirectory() as tmp:
        tf.LlamaForCausalLM(config).save_pretrained(tmp)
        loaded = tf.LlamaForCausalLM.from_pretrained(tmp)
    assert isinstance(loaded._weight_conversions, list)


def _torchao(name: str) -> Any:
    from precision_annot._src.float8 import import_torchao

    pytest.importorskip("torchao")
    return import_torchao(name, "the test")


def _inductor_patch(built: Built) -> None:
    """`float8.prepare_compile` calls it under `suppress(AttributeError)`, as torchao's own
    `convert_to_float8_training` does: a rename would skip it silently."""
    patch = _torchao("torchao.float8._inductor_patch")
    assert callable(patch._patch_inductor_min_max_codegen)
    utils = _torchao("torchao.float8.float8_linear_utils")
    assert "_patch_inductor_min_max_codegen" in inspect.getsource(utils)


def _fp8_weight_tensor(built: Built) -> None:
    fsdp_utils = _torchao("torchao.float8.fsdp_utils")
    config = _torchao("torchao.float8.float8_training_tensor").LinearMMConfig()
    weight = fsdp_utils.WeightWithDynamicFloat8CastTensor(torch.ones(2, 2), config,
                                                          torch.float8_e4m3fn)
    names, _ = weight.__tensor_flatten__()
    assert names[0] == "_tensor" and isinstance(weight._tensor, torch.Tensor)


#: names checked by more than import and getattr: what the package does with them, run
def _accelerate_forward(built: Built) -> None:
    """accelerate's `prepare` under mixed_precision marks the model whose forward it wrapped
    in autocast with `_original_forward` (what `schedule` refuses a model by)."""
    import accelerate
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        model = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(nn.Linear(2, 2))
        assert "_original_forward" in model.__dict__
    finally:
        AcceleratorState._reset_state(True)


CHECKS: dict[str, Callable[[Built], None]] = {
    "torch._C._current_graph_task_id": _sequence_numbers,
    "torch._C._current_autograd_node": _sequence_numbers,
    "torch.autograd.graph.Node._sequence_nr()": _sequence_numbers,
    "torch._C._autograd._get_sequence_nr": _sequence_numbers,
    "torch._C._autograd._top_saved_tensors_default_hooks": _recomputation,
    "torch.utils.checkpoint._recomputation_hook": _recomputation,
    "torch.Tensor._version": _version,
    "torch.ops.aten._to_copy": _to_copy,
    "torch.ops._c10d_functional": _collectives,
    "torch.optim.Optimizer._optimizer_*": _hook_dicts,
    "torch.optim.Optimizer.step.hooked": _hooked_step,
    "torch.optim.Optimizer._step_supports_amp_scaling": _amp_scaling,
    "torch.amp.GradScaler._unscale_grads_": _unscale_grads,
    "torch.amp.GradScaler._get_scale_async": _scale_async,
    "torch.nn.Module._load_state_dict_pre_hooks": _load_hooks,
    "torch.nn.parallel.DistributedDataParallel._active_ddp_module": _active_ddp,
    "torch.nn.parallel.DistributedDataParallel._comm_hooks": _comm_hooks,
    "torch.nn.parallel.DistributedDataParallel.logger._get_ddp_logging_data()": _comm_hooks,
    "torch.distributed.fsdp.FSDPModule._get_fsdp_state()._mp_policy": _fsdp2_policy,
    "torch.distributed.fsdp.FSDPModule._get_fsdp_state()._fsdp_param_group"
    ".fsdp_params[i].mp_policy": _fsdp2_params,
    "torch.distributed.fsdp.FSDPModule._get_fsdp_state()._fsdp_param_group"
    ".fsdp_params[i]._module_info.module": _fsdp2_params,
    "torch.distributed.fsdp.FullyShardedDataParallel._fsdp_wrapped_module": _fsdp1_name,
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper"
    "._checkpoint_wrapped_module": _checkpoint_wrapper_name,
    "torch.distributed.tensor.parallel.ColwiseParallel._prepare_input_fn": _colwise_input,
    "torch.distributed._composable.checkpoint_activation": _composable,
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod": _compiled,
    "torch.autograd.profiler._is_profiler_enabled": _profiler_flag,
    "torch._utils._rebuild_tensor_v2": _rebuilders,
    "lightning.fabric.wrappers._FabricModule": _fabric_module,
    "accelerate.Accelerator.prepare()._original_forward": _accelerate_forward,
    "transformers.PreTrainedModel._weight_conversions": _weight_conversions,
    "torchao.float8._inductor_patch._patch_inductor_min_max_codegen": _inductor_patch,
    "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor._tensor": _fp8_weight_tensor,
}


def _check(entry: PrivateName, built: Built) -> None:
    special = CHECKS.get(entry.name)
    if special is None:
        resolve(entry.name, _instances(built))
    else:
        special(built)


@pytest.mark.parametrize("entry", TORCH, ids=lambda e: e.name)
def test_each_private_torch_name_is_in_the_installed_torch(entry: PrivateName,
                                                             built: Built) -> None:
    if not entry.applies():
        pytest.skip(f"reached on torch {entry.since or 'floor'} to {entry.until or 'newest'}, "
                    f"not on {torch.__version__}")
    _check(entry, built)


@pytest.mark.parametrize("entry", BACKENDS, ids=lambda e: e.name)
def test_each_private_backend_name_is_in_the_installed_backend(entry: PrivateName,
                                                                built: Built) -> None:
    top = entry.name.split(".")[0]
    if top == "torchao":
        _torchao("torchao")  # (torchao's import prints warnings the package's import quiets)
    else:
        pytest.importorskip(top)
    _check(entry, built)


def test_every_name_is_listed_once_and_checkable() -> None:
    names = [e.name for e in (*TORCH, *BACKENDS)]
    assert len(names) == len(set(names))
    assert set(CHECKS) <= set(names), set(CHECKS) - set(names)
    unresolvable = [n for n in names if re.search(r"[()\[\]*]", n) and n not in CHECKS]
    assert unresolvable == []  # a call, an item or a prefix needs a check of its own
    for e in (*TORCH, *BACKENDS):
        assert e.purpose and e.public and e.used_in, e.name
        assert e.since is None or e.until is None or e.since <= e.until, e.name
    # the checkpoint generator's two names cover every torch the package supports, once
    old, new = (e for e in TORCH if e.name.startswith(
        "torch.utils.checkpoint._checkpoint_without_reentrant_generator"))
    for version in [seams.FLOOR, (2, 14, 0), seams.NEWEST]:
        assert old.applies(version) != new.applies(version), version


# -- the package's source: no private name reached that is not listed ----------------------------

PACKAGE = Path(precision_annot.__file__).parent
FOREIGN = ("torch", "torchao", "lightning", "pytorch_lightning", "lightning_fabric",
           "transformers", "deepspeed", "accelerate")
_DOTTED = re.compile(rf"(?:{'|'.join(FOREIGN)})(?:\.\w+)+")
_ACCESSORS = frozenset({"getattr", "hasattr", "setattr", "delattr"})
#: Python's own private names (not torch's): the frame helper and namedtuple's API
PYTHON = {"_getframe": "sys._getframe", "_asdict": "namedtuple._asdict",
          "_fields": "namedtuple._fields"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign(module: str) -> bool:
    return module.split(".")[0] in FOREIGN


@dataclass
class Module:
    """One module of the package: what its names stand for."""

    name: str  # relative to precision_annot: "_src.grads"
    tree: ast.Module
    imported: dict[str, str] = field(default_factory=dict)  # local name -> foreign path
    own_modules: set[str] = field(default_factory=set)  # local names of package modules

    def __post_init__(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.bind(a.asname or a.name.split(".")[0],
                              a.name if a.asname else a.name.split(".")[0], 0)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    self.bind(a.asname or a.name, f"{node.module or ''}.{a.name}", node.level)

    def bind(self, local: str, path: str, level: int) -> None:
        """What the local name an import binds stands for."""
        if level == 0 and _foreign(path):
            self.imported[local] = path
        elif level or path.startswith("precision_annot"):
            self.own_modules.add(local)

    def foreign_path(self, node: ast.expr) -> str | None:
        """The foreign dotted path an expression names ("torch.amp.GradScaler"), else None."""
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.imported:
            return ".".join([self.imported[node.id], *reversed(chain)])
        return None


def _modules() -> list[Module]:
    """The package's modules but the registry itself (its names are data)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != "_src.private":
            out.append(Module(name, ast.parse(path.read_text())))
    return out


def _defined_in(body: list[ast.stmt]) -> Iterator[tuple[str, ast.stmt]]:
    """The names a class body defines: methods and class attributes."""
    for s in body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield s.name, s
        elif isinstance(s, (ast.Assign, ast.AnnAssign)):
            for t in s.targets if isinstance(s, ast.Assign) else [s.target]:
                if isinstance(t, ast.Name):
                    yield t.id, s


def _overrides(mod: Module) -> Iterator[tuple[str, int, str]]:
    """Private names a class defines over a foreign base class that has them (torch's
    `_apply`, GradScaler's `_unscale_grads_`): reached, though the package defines them."""
    for node in ast.walk(mod.tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = []
        for base in node.bases:
            path = mod.foreign_path(base)
            try:
                found = resolve(path) if path else None
            except (ImportError, AttributeError):
                found = None
            if isinstance(found, type):
                bases.append(found)
        for name, stmt in _defined_in(node.body):
            if _private(name) and any(hasattr(b, name) for b in bases):
                yield name, stmt.lineno, f"override {node.name}.{name}"


def _own_attributes(modules: list[Module], overridden: set[str]) -> set[str]:
    """The private attribute names the package gives its own objects: its classes' methods and
    class attributes, `self._x = ...` / `cls._x = ...`, and `setattr(self, "_x", ...)`; not
    `module._parameters[k] = v`, which writes into torch's attribute."""
    own: set[str] = set()
    for mod in modules:
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef):
                own.update(name for name, _ in _defined_in(node.body))
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                own.update(_self_targets(node))
            elif isinstance(node, ast.Call) and _sets_on_self(node):
                own.add(str(node.args[1].value))  # type: ignore[attr-defined]
    return {n for n in own if _private(n)} - overridden


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _self_targets(node: ast.Assign | ast.AnnAssign | ast.AugAssign) -> Iterator[str]:
    """`x` of each `self.x` / `cls.x` the statement assigns (unpacked tuples too)."""
    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
        for t in target.elts if isinstance(target, ast.Tuple) else [target]:
            if isinstance(t, ast.Attribute) and _is_self(t.value):
                yield t.attr


def _sets_on_self(node: ast.Call) -> bool:
    """`setattr(self, "_x", v)` or `object.__setattr__(self, "_x", v)`."""
    return ast.unparse(node.func) in ("setattr", "object.__setattr__") and len(node.args) > 1 \
        and _is_self(node.args[0]) and isinstance(node.args[1], ast.Constant)


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings or bare string statements."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


@dataclass
class Scan:
    #: module -> {(private name, line, how it is reached)}: each must be registered
    reached: dict[str, set[tuple[str, int, str]]]
    #: module -> every name its code spells (attributes, imports, definitions, strings)
    named: dict[str, set[str]]


class _Scanner:
    def __init__(self, mod: Module, own: set[str], own_classes: set[str], scan: Scan,
                 defined: frozenset[str] = frozenset()) -> None:
        self.mod, self.own, self.own_classes = mod, own, own_classes
        self.defined = defined  # the package's own functions, classes and module-level names
        self.reached = scan.reached[mod.name]
        self.named = scan.named[mod.name]
        self.parents = {child: node for node in ast.walk(mod.tree)
                        for child in ast.iter_child_nodes(node)}
        self.docs = _docstrings(mod.tree)

    def hit(self, name: str, node: ast.AST, how: str) -> None:
        self.reached.add((name, getattr(node, "lineno", 0), how))

    def run(self) -> None:
        for name, line, how in _overrides(self.mod):
            self.reached.add((name, line, how))
        for node in ast.walk(self.mod.tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.named.add(node.name)
            elif isinstance(node, ast.Attribute):
                self.named.add(node.attr)
                if _private(node.attr) and not self.is_own(node):
                    self.hit(node.attr, node, ast.unparse(node))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in self.docs:
                self.string(node, node.value)

    def imports(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                self.imported(node, a.name, f"import {a.name}", _foreign(a.name))
            return
        foreign = node.level == 0 and _foreign(node.module or "")
        for a in node.names:
            self.imported(node, f"{node.module}.{a.name}", f"from {node.module} import {a.name}",
                          foreign)

    def imported(self, node: ast.AST, path: str, how: str, foreign: bool) -> None:
        names = [p for p in path.split(".") if _private(p)]
        self.named.update(names)
        if foreign:
            for name in names:
                self.hit(name, node, how)

    def is_own(self, node: ast.Attribute) -> bool:
        if node.attr.startswith("_precision_annot"):
            return True
        base = node.value
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) \
                and base.func.id == "super":  # the parent's: own where every base is ours
            cls = self.parents.get(node)
            while cls is not None and not isinstance(cls, ast.ClassDef):
                cls = self.parents.get(cls)
            return cls is not None and all(isinstance(b, ast.Name) and b.id in self.own_classes
                                           for b in cls.bases)
        return node.attr in self.own or (isinstance(base, ast.Name)
                                         and base.id in self.mod.own_modules)

    def string(self, node: ast.Constant, text: str) -> None:
        if text.isidentifier():
            self.named.add(text)
        if isinstance(self.parents.get(node), (ast.JoinedStr, ast.BinOp)):
            return  # a piece of a longer string ("_amax" in f"{key}_amax"), no name
        if _DOTTED.fullmatch(text):  # a module path: "torch.distributed._composable..."
            for name in (p for p in text.split(".") if _private(p)):
                self.named.add(name)
                self.hit(name, node, f"module path {text!r}")
        if _private(text) and text.isidentifier() and text not in self.own \
                and text not in self.defined and not text.startswith("_precision_annot"):
            # handed to getattr & co. here, or held in a constant or a tuple of names that
            # reaches getattr elsewhere (`getattr(module, seams.CHECKPOINT_GENERATOR)`): a
            # private identifier spelled as a string is reached either way
            consumer = self.attribute_named(node)
            self.hit(text, node, ast.unparse(consumer) if consumer is not None
                     else f"string {text!r}")

    def attribute_named(self, node: ast.Constant) -> ast.expr | None:
        """The expression that reads an attribute by this string, if any: `getattr(x, "_a")`
        (hasattr, setattr, delattr), `x.__dict__["_a"]`, `x.__dict__.get("_a")`."""
        parent, child = self.parents.get(node), node
        while isinstance(parent, (ast.IfExp, ast.BoolOp)):  # getattr(x, "_a" if c else "_b")
            parent, child = self.parents.get(parent), parent
        if isinstance(parent, ast.Subscript):
            found = parent.slice is child and _is_dict(parent.value)
        elif isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name):
            found = parent.func.id in _ACCESSORS and child in parent.args[1:2]
        elif isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute):
            found = parent.func.attr in ("get", "pop", "setdefault") \
                and child in parent.args[:1] and _is_dict(parent.func.value)
        else:
            found = False
        return parent if found and isinstance(parent, ast.expr) else None


def _is_dict(node: ast.expr) -> bool:
    """`x.__dict__`: an object's attributes read as a dict."""
    return isinstance(node, ast.Attribute) and node.attr == "__dict__"


def scan_package() -> Scan:
    modules = _modules()
    scan = Scan(defaultdict(set), defaultdict(set))
    overridden = {name for mod in modules for name, _, _ in _overrides(mod)}
    own = _own_attributes(modules, overridden)
    own_classes = {n.name for m in modules for n in ast.walk(m.tree) if isinstance(n, ast.ClassDef)}
    defined = {n.name for m in modules for n in ast.walk(m.tree)
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    defined |= {t.id for m in modules for s in m.tree.body if isinstance(s, ast.Assign)
                for t in s.targets if isinstance(t, ast.Name)}
    for mod in modules:
        _Scanner(mod, own, own_classes, scan, frozenset(defined)).run()
    return scan


@pytest.fixture(scope="module")
def scanned() -> Scan:
    return scan_package()


def test_the_source_reaches_no_private_name_that_is_not_registered(scanned: Scan) -> None:
    """Each private name of another package the source reaches (an import of a private module
    or name, `x._name` on an object not the package's own, a string literal handed to
    getattr/hasattr/setattr or a `__dict__`, a private method overridden, a private module
    path) is in the registry, with that module in its `used_in`."""
    registered: dict[str, set[str]] = defaultdict(set)  # module -> names registered for it
    for entry in (*TORCH, *BACKENDS):
        for module in entry.used_in:
            registered[module].update(entry.parts)
    missing = sorted(f"precision_annot.{module}:{line}: {name} ({how})"
                     for module, hits in scanned.reached.items()
                     for name, line, how in hits
                     if name not in registered[module] and name not in PYTHON)
    assert missing == [], "\n".join(["reached, not in _src/private.py:", *missing])


def test_every_registered_name_is_still_reached_where_it_says(scanned: Scan) -> None:
    """No stale entry: the name each entry's code spells (its last private part) is named in
    one of its `used_in` modules, and each of those modules exists."""
    stale = []
    for entry in (*TORCH, *BACKENDS):
        assert set(entry.used_in) <= set(scanned.named), (entry.name, entry.used_in)
        spelled = entry.parts[-1] if entry.parts else entry.name.rsplit(".", 1)[-1]
        if not any(spelled in scanned.named[m] for m in entry.used_in):
            stale.append(f"{entry.name}: {spelled!r} not in {', '.join(entry.used_in)}")
    assert stale == [], "\n".join(["registered, no longer reached:", *stale])


def test_the_scan_sees_each_way_of_reaching_a_private_name(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The scan itself, on a made-up package: what it reports and what it leaves as own."""
    package = tmp_path / "precision_annot"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "m.py").write_text(
        "import torch\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "class Mine:\n"
        "    _slot = 1\n"
        "    def __init__(self):\n"
        "        self._count = 0\n"
        "    def _helper(self):\n"
        "        return self._count + self._slot\n"
        "class Scaler(torch.amp.GradScaler):\n"
        "    def _unscale_grads_(self, *a):\n"
        "        return super()._unscale_grads_(*a)\n"
        "def f(module, v):\n"
        "    module._parameters['w'] = v\n"
        "    getattr(module, '_buffers')\n"
        "    module.__dict__.get('_compiled_call_impl')\n"
        "    Mine()._helper()\n"
        "    setattr(module, '_precision_annot_x', 1)\n"
        "    return torch._C._current_graph_task_id(), 'torch.distributed._composable.x'\n"
        "NAME = '_hidden_generator'\n"
        "def g():\n"
        "    for name in ('public', '_hidden_helper'):\n"
        "        getattr(torch.utils.checkpoint, name, None)\n"
        "    return getattr(torch.utils.checkpoint, NAME, None), f'{NAME}_amax'\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    reached = {(name, how.split(" ")[0]) for name, _, how in scan_package().reached["m"]}
    assert {name for name, _ in reached} == {
        "_python_dispatch", "_unscale_grads_", "_parameters", "_buffers",
        "_compiled_call_impl", "_C", "_current_graph_task_id", "_composable",
        "_hidden_generator", "_hidden_helper"}  # names held in a constant or a tuple too
    assert ("_unscale_grads_", "override") in reached
