"""Every private name of torch, and of the backends, that this package reaches: where, what for,
and the public mechanism considered in its place.

Why: torch may rename or drop a private name in any release without a word, and where the
package reaches one through a `getattr` default, a string match or a fallback, a rename makes it
silently wrong rather than broken (0.5 wrapped a checkpoint generator torch 2.14 no longer calls,
and activation checkpointing lost the applied forward's state with no error). Each name is listed
once, with the torch releases it applies to, so that `tests/test_private_names.py` resolves every
one on the torch it runs on (a rename fails the suite, not a user's run) and scans the package's
source (a private name reached without an entry here, or an entry no longer reached, fails too).
The public alternative recorded with each is what was tried first, and what to try again when
torch offers more.

Names are dotted as the code reaches them: `Class.attr` for an attribute of instances,
`f()` for a call, `[i]` for an item, `*` for a prefix matched. `used_in` names the package's
modules relative to `precision_annot` ("_src.grads"). `since`/`until` are the first and last
torch (major, minor) a name is reached on; None: every torch the package supports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from precision_annot._src import seams

__all__ = ["BACKENDS", "TORCH", "PrivateName"]


@dataclass(frozen=True)
class PrivateName:
    """One private name the package reaches, and why no public one serves."""

    #: dotted as the code reaches it ("torch.Tensor._version", "torch._C._current_autograd_node")
    name: str
    #: the package's modules that reach it, relative to `precision_annot`
    used_in: tuple[str, ...]
    #: what the package reaches it for
    purpose: str
    #: the public alternative considered, and why it does not serve
    public: str
    #: the first torch (major, minor) it is reached on; None: the floor
    since: tuple[int, int] | None = None
    #: the last torch (major, minor) it is reached on; None: the newest
    until: tuple[int, int] | None = None
    #: the (backend) name the package calls that reaches it, where the source never names it
    via: str = ""

    @property
    def parts(self) -> tuple[str, ...]:
        """The private components of the name (of `via` where set), as the source spells them:
        the last is the one the package's code names (the others: modules, an owner)."""
        return tuple(p for p in re.split(r"[.()\[\]*]+", self.via or self.name)
                     if p.startswith("_") and not p.endswith("__"))

    def applies(self, version: tuple[int, ...] = seams.TORCH) -> bool:
        """Whether torch `version` is one the package reaches this name on."""
        return ((self.since is None or tuple(version[:2]) >= self.since)
                and (self.until is None or tuple(version[:2]) <= self.until))


_N = PrivateName
_NO_HOOK_LISTING = ("None: a public `RemovableHandle` removes only from the dict it was made "
                    "for (not a copy's), and torch has no public listing or reordering of hooks.")
_PICKLED = ("None that reads dtypes and shapes without the data or running the file's code: "
            "`torch.load(weights_only=True)` reads every storage and refuses other classes.")

TORCH: tuple[PrivateName, ...] = (
    # -- autograd ------------------------------------------------------------------------------
    _N("torch._C._current_graph_task_id",
       ("_src.auditing", "_src.recording", "_src.suggest.watch", "_src.tracking"),
       "whether this thread runs a backward (-1 outside): charge ops to forward or backward, "
       "and tell a checkpoint's rerun from a new call",
       "None: `torch.autograd.graph` has no such query in 2.13 or 2.15 (torch's own checkpoint "
       "makes this call)."),
    _N("torch._C._current_autograd_node", ("_src.tracking",),
       "the Node running in backward, to charge its ops to the module whose forward made it",
       "2.15's `torch.autograd.graph.node_creation_hook` with `Node.metadata` could tag Nodes "
       "as they are made; 2.13 has none, and it costs a call per Node made while auditing."),
    _N("torch.autograd.graph.Node._sequence_nr()", ("_src.tracking",),
       "map the running Node to the module whose forward made it (bisect over numbers)",
       "As `_current_autograd_node`: 2.15's `node_creation_hook` only."),
    _N("torch._C._autograd._get_sequence_nr", ("_src.tracking",),
       "the next Node's sequence number when a module's forward starts",
       "As `_current_autograd_node`: 2.15's `node_creation_hook` only."),
    _N("torch._C._autograd._top_saved_tensors_default_hooks", ("_src.tracking",),
       "the innermost saved-tensors pack hook: is a non-reentrant checkpoint recomputing?",
       "None: `torch.autograd.graph.saved_tensors_hooks` only installs hooks; a flag of the "
       "package's own would miss checkpoints of models it did not apply."),
    _N("torch.utils.checkpoint._recomputation_hook", ("_src.tracking",),
       "matched in the pack hook's `__qualname__` during a checkpoint's recompute (a rename "
       "would make `recomputing()` silently False)",
       "As `_top_saved_tensors_default_hooks`; torch 2.15 rebased the class on "
       "`_checkpoint_internal_hook`, its `pack_hook` qualname unchanged."),
    _N("torch.Tensor._version", ("_src.boundary", "_src.grads", "_src.recording"),
       "detect in-place writes: into a boundary's cast copy, into the gradient handed to DDP",
       "None: `torch.autograd.graph.increment_version` only bumps it; a read is free."),
    _N("torch.autograd.Variable._execution_engine.queue_callback", ("_src.seams",),
       "run a callback after DDP's own end-of-backward callback (fp32 gradients restored)",
       "`torch.autograd.graph.queue_callback` from torch 2.15, the same call "
       "(`seams.queue_callback` takes it there); 2.13 and 2.14 have no public one.",
       until=(2, 14)),
    # -- dispatch ------------------------------------------------------------------------------
    _N("torch.utils._python_dispatch.TorchDispatchMode",
       ("_src.auditing", "_src.diffing", "_src.suggest.watch"),
       "base class of the op-level recorders (the dtype each op computes in after autocast)",
       "None: no public module re-exports it in 2.13 or 2.15; it is the documented way to "
       "write a dispatch mode (`torch.overrides.TorchFunctionMode` sees ops before autocast)."),
    _N("torch.ops.aten._to_copy", ("_src.auditing", "_src.suggest.watch", "_src.tracking"),
       "what `Tensor.to` dispatches as: a cast is data movement, not compute",
       "None: the dispatcher's own op name (compared with `overloadpacket.__name__`)."),
    _N("torch.ops.aten._unsafe_view", ("_src.tracking",),
       "a view: data movement, not compute", "None: the dispatcher's own op name."),
    _N("torch.ops.aten._local_scalar_dense", ("_src.tracking",),
       "what `Tensor.item` dispatches as: data movement", "None: the dispatcher's own op name."),
    _N("torch.ops.aten._reshape_alias", ("_src.tracking",),
       "a view: data movement, not compute", "None: the dispatcher's own op name."),
    _N("torch.ops.aten._scaled_mm", ("_src.auditing",),
       "an fp8 GEMM (torchao's), recorded as a GEMM", "None: the dispatcher's own op name."),
    _N("torch.ops.aten._scaled_grouped_mm", ("_src.auditing",),
       "an fp8 grouped GEMM (MoE), recorded as a GEMM", "None: the dispatcher's own op name."),
    _N("torch.ops.aten._grouped_mm", ("_src.auditing",),
       "a grouped GEMM (MoE), recorded as a GEMM", "None: the dispatcher's own op name."),
    _N("torch.ops._c10d_functional", ("_src.auditing",),
       "the namespace of DTensor's functional collectives: a reduction's dtype is recorded",
       "None: the namespace DTensor issues; it is read through the public "
       "`OpOverload.namespace` and `str(op)`."),
    # -- optimizers and the scaler ---------------------------------------------------------------
    _N("torch._fused_adam_", ("_src.update_kernels",),
       "the fused Adam kernel, called once per chunk on widened scratch views",
       "`torch.optim.adam.adam(fused=True)` calls it bit for bit for one call over whole lists, "
       "but increments the steps at each call: chunked, its bias correction differs."),
    _N("torch._fused_adamw_", ("_src.update_kernels",),
       "the fused AdamW kernel, called once per chunk", "As `_fused_adam_`, with `adamw`."),
    _N("torch._fused_sgd_", ("_src.update_kernels",),
       "the fused SGD kernel per chunk, its first step decided by the package",
       "`torch.optim.sgd.sgd(fused=True)` infers the first step from all-None buffers: with "
       "the package's own buffers its first step differs."),
    _N("torch._foreach_add_", ("_src.update_kernels",),
       "increment the step counters, as torch's `_fused_adam` does",
       "Per-tensor `Tensor.add_`: the same values at one dispatch per parameter per step."),
    _N("torch._foreach_sub_", ("_src.update_kernels",),
       "undo the step increment when the GradScaler found inf (as `_fused_adam` does)",
       "Per-tensor `Tensor.sub_`: one dispatch per parameter per step."),
    _N("torch._foreach_copy_", ("_src.update_kernels",),
       "widen chunks into scratch views and write updated masters back",
       "Per-tensor `Tensor.copy_`: the same bytes at one dispatch per piece per chunk."),
    _N("torch.optim.optimizer._get_fused_kernels_supported_devices", ("_src.update_kernels",),
       "the device types with fused kernels: the check `torch.optim`'s `fused=True` makes",
       "None: a list written here would drift from torch's."),
    _N("torch.optim.Optimizer._optimizer_*", ("_src.update.optimizer",),
       "the prefix of the optimizer's six per-instance hook dicts, left out of a planned "
       "optimizer's `__getstate__` as torch's own leaves them",
       "None: they are the hook storage; a rename would pickle hook dicts, not change numbers."),
    _N("torch.optim.Optimizer.step.hooked", ("_src.update.step",),
       "`step.hooked`/`__wrapped__`, set by the private `Optimizer._patch_step_function`: the "
       "class's own step called unwrapped, so step hooks fire once",
       "None: torch wraps each optimizer class's step once and says so only there."),
    _N("torch.optim.Optimizer._step_supports_amp_scaling",
       ("adapters.lightning.fabric", "adapters.lightning.strategies"),
       "skip `scaler.unscale_` for optimizers that unscale in their own step, as Lightning does",
       "None public: read by Lightning's (private) helper, which the package calls rather than "
       "naming torch's attribute itself.",
       via="lightning.fabric.plugins.precision.amp._optimizer_handles_unscaling"),
    _N("torch.amp.GradScaler._unscale_grads_", ("_src.scaler",),
       "overridden: unscale fp16-stored gradients (torch refuses them) and widen planned ones",
       "Overriding public `unscale_` means writing it again; torch's own `ShardedGradScaler` "
       "overrides this method."),
    _N("torch.amp.GradScaler._get_scale_async", ("_src.watching",),
       "watch: the scale as a device tensor, with no host sync",
       "Public `get_scale()` reads it to the host: a sync per step."),
    # -- nn.Module -----------------------------------------------------------------------------
    _N("torch.nn.Module._parameters",
       ("_src.auditing", "_src.boundary", "_src.checkpoints.reading", "_src.execution",
        "_src.float8", "_src.runtime", "_src.suggest.search", "adapters.tp.grads",
        "adapters.transformers"),
       "a module's own parameters as stored (real tensors under a CastingDict); swap one "
       "(the fp8 weight); install the CastingDict; keys of a pickled module",
       "Reads: `named_parameters(recurse=False)` would serve; writes and the dict swap: none "
       "(`register_parameter` refuses a non-Parameter)."),
    _N("torch.nn.Module._buffers",
       ("_src.auditing", "_src.boundary", "_src.checkpoints.reading", "_src.execution",
        "_src.resolution", "_src.runtime", "adapters.transformers"),
       "a module's own buffers as stored (bypassing the CastingDict); install the CastingDict",
       "Reads: `named_buffers(recurse=False)` would serve; writes and the dict swap: none."),
    _N("torch.nn.Module._non_persistent_buffers_set",
       ("_src.checkpoints.reading", "_src.execution", "_src.resolution"),
       "persistent buffers take the plan's storage dtype, non-persistent ones keep theirs",
       "None but `state_dict()` key membership: a whole state_dict per module, hooks run."),
    _N("torch.nn.Module._modules", ("_src.checkpoints.reading", "_src.execution", "_src.wrappers"),
       "does a module have children; a wrapper's inner module registered as a child",
       "`children()` / `named_children()` would serve (not on a hot path)."),
    _N("torch.nn.Module._forward_hooks", ("_src.grads", "_src.recording", "_src.tracking"),
       "find and remove the package's own forward hooks (on copies too); keep one last",
       _NO_HOOK_LISTING),
    _N("torch.nn.Module._forward_pre_hooks",
       ("_src.recording", "adapters.tp", "adapters.tp.grads"),
       "find and remove the package's own forward pre-hooks; do not hook a module twice",
       _NO_HOOK_LISTING),
    _N("torch.nn.Module._forward_pre_hooks_with_kwargs", ("_src.recording",),
       "clean the side table when a hook is deleted by id (as `RemovableHandle` does)",
       _NO_HOOK_LISTING),
    _N("torch.nn.Module._forward_hooks_with_kwargs", ("_src.recording",),
       "clean the side table when a hook is deleted by id", _NO_HOOK_LISTING),
    _N("torch.nn.Module._forward_hooks_always_called", ("_src.recording",),
       "clean the side table when a hook is deleted by id", _NO_HOOK_LISTING),
    _N("torch.nn.Module._load_state_dict_pre_hooks", ("_src.runtime",),
       "remove the applied state's own load pre-hooks on `remove`, copies included (each "
       "wrapped in torch's `_WrappedHook`, whose `.hook` is read)", _NO_HOOK_LISTING),
    _N("torch.nn.Module._load_state_dict_post_hooks", ("_src.runtime",),
       "remove the applied state's own load post-hooks on `remove`, copies included",
       _NO_HOOK_LISTING),
    _N("torch.nn.Module._apply", ("_src.runtime", "adapters.tp"),
       "observe `.to()`/`.half()` of modules holding planned tensors (an instance override)",
       "None: `_apply` writes `param.data` or `_parameters` directly, so the public global "
       "registration hooks do not fire."),
    _N("torch.nn.Module._replicate_for_data_parallel", ("_src.runtime",),
       "a `nn.DataParallel` replica gets its own boundary, rebound to it",
       "None: `DataParallel`'s replicate calls it and nothing public."),
    _N("torch.nn.Module._compiled_call_impl", ("_src.suggest.reference", "_src.wrappers"),
       "detect `module.compile()` (compiled in place); clear it on a copy",
       "None: no public 'is compiled' or 'uncompile' for `nn.Module.compile`."),
    # -- DDP -----------------------------------------------------------------------------------
    _N("torch.nn.parallel.DistributedDataParallel._active_ddp_module", ("_src.grads",),
       "which DDP module runs the applied model's forward: arm the wide-gradient hand-over",
       "None: `DDP._get_active_ddp_module` is private too."),
    _N("torch.nn.parallel.DistributedDataParallel._comm_hooks", ("_src.grads", "adapters.ddp"),
       "is the plan's comm hook registered (refuse a silently narrowed reduction; check)",
       "None: no getter; a missing list degrades to the logger's record (below)."),
    _N("torch.nn.parallel.DistributedDataParallel.logger._get_ddp_logging_data()",
       ("_src.grads", "adapters.ddp"),
       "the name of the comm hook registered, a built-in C++ one included",
       "None: the built-in hooks are in no Python list."),
    # -- FSDP ----------------------------------------------------------------------------------
    _N("torch.distributed.fsdp.FSDPModule._get_fsdp_state()._mp_policy", ("adapters.fsdp.checks",),
       "`check`: the MixedPrecisionPolicy each FSDP2 unit was sharded with",
       "None: FSDPModule has no policy getter in 2.13 or 2.15 (2.15 stores it without "
       "`param_dtype_override_fn`)."),
    _N("torch.distributed.fsdp.FSDPModule._get_fsdp_state()._fsdp_param_group"
       ".fsdp_params[i].mp_policy", ("adapters.fsdp.checks",),
       "`check`: the dtype FSDP2 gathers each parameter in (2.15's per-parameter override)",
       "None: FSDP2 keeps the resolved override only on its private parameter objects."),
    _N("torch.distributed.fsdp.FSDPModule._get_fsdp_state()._fsdp_param_group"
       ".fsdp_params[i]._module_info.module", ("adapters.fsdp.checks",),
       "`check`: the module owning a parameter FSDP2 gathers in another dtype",
       "None: FSDPParam is private; its module is known to no public object."),
    _N("torch.distributed.fsdp.FullyShardedDataParallel._fsdp_wrapped_module",
       ("_src.auditing", "_src.wrappers", "adapters.fsdp.export"),
       "FSDP1's wrapper attribute: strip it from module names, unwrap the root",
       "Unwrapping: FSDP1's public `.module`; names: none (it is in every FQN FSDP1 makes)."),
    _N("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper"
       "._checkpoint_wrapped_module", ("_src.auditing", "adapters.fsdp.export"),
       "strip `checkpoint_wrapper`'s level from module names",
       "None: it is in every FQN of a wrapped module."),
    _N("torch.distributed.fsdp.wrap.CustomPolicy._run_policy", ("adapters.fsdp.export",),
       "overridden: FSDP1 `wrap_policy(plan)` learns module names from the root it is given",
       "Public `CustomPolicy(lambda_fn)` gets only each module, not its name."),
    # -- tensor parallel -----------------------------------------------------------------------
    _N("torch.distributed.tensor.parallel.ParallelStyle._apply", ("adapters.tp.styles",),
       "overridden: install the plan's TP state after torch's sharding",
       "None: implementing `_apply` is the extension point `ParallelStyle` offers."),
    _N("torch.distributed.tensor.parallel.ColwiseParallel._prepare_input_fn",
       ("adapters.tp.styles",),
       "overridden: skip the input redistribution of a layer that gathers its input itself",
       "None: public `PrepareModuleInput` redistributes."),
    # -- activation checkpointing --------------------------------------------------------------
    _N("torch.utils.checkpoint._checkpoint_without_reentrant_generator",
       ("_src.recompute", "_src.seams"),
       "where every non-reentrant checkpoint starts: wrapped so its rerun runs under the "
       "applied forward's captured state (`recompute.install` probes it, and refuses loudly)",
       "None reaches every checkpoint: `context_fn` is the caller's (transformers and "
       "`checkpoint_wrapper` pass none); callers bound the public `checkpoint` at import.",
       until=(2, 13)),
    _N("torch.utils.checkpoint._checkpoint_without_reentrant_generator_impl",
       ("_src.recompute", "_src.seams"),
       "as the torch 2.13 generator: torch 2.14 moved the work here and `checkpoint` calls "
       "only this one (`seams.CHECKPOINT_GENERATOR`)",
       "As the torch 2.13 generator.", since=(2, 14)),
    _N("torch.distributed._composable.checkpoint_activation", ("_src.recompute",),
       "the composable `checkpoint(module)` imported the generator by name: wrapped there too",
       "None: its module path is private."),
    # -- Dynamo and inductor -------------------------------------------------------------------
    _N("torch._dynamo.utils.disable_cache_limit", ("_src.update_kernels",),
       "lift Dynamo's recompile limit around the compiled low-bit step (as torchao does)",
       "None: `torch.compiler.config` exposes no cache limit in 2.13 or 2.15."),
    _N("torch._dynamo.maybe_mark_dynamic", ("_src.update_kernels",),
       "mark state tensors' first dim dynamic: the low-bit step compiles once per layout",
       "None in `torch.compiler`; it is the documented dynamic-shape API, in a private package."),
    _N("torch._dynamo.eval_frame.OptimizedModule._orig_mod", ("_src.auditing", "_src.wrappers"),
       "unwrap `torch.compile(model)`; strip `_orig_mod` from module names",
       "None: it is in every FQN of a compiled module."),
    # -- profiler ------------------------------------------------------------------------------
    _N("torch.autograd.profiler._is_profiler_enabled", ("_src.boundary",),
       "open a `record_function` range for a boundary cast only while a profiler records",
       "Always entering public `torch.profiler.record_function` costs ~8 us per boundary call "
       "(0.3 us for the flag): on the forward's hot path."),
    # -- checkpoint files ------------------------------------------------------------------------
    _N("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", ("_src.checkpoints.reading",),
       "a class DCP's `.metadata` pickle names: read as a stand-in of that name, none of DCP's "
       "own code run",
       "Public `FileSystemReader.read_metadata()` unpickles anything the file names."),
    _N("torch.distributed.checkpoint.filesystem._StorageInfo", ("_src.checkpoints.reading",),
       "as `_MEM_FORMAT_ENCODING`",
       "Public `FileSystemReader.read_metadata()` unpickles anything the file names."),
    _N("torch.serialization._get_layout", ("_src.checkpoints.reading",),
       "named by DCP metadata pickles: read by a local function of the same meaning", _PICKLED),
    *(_N(f"torch._utils.{name}", ("_src.checkpoints.reading",),
         "named by `torch.save` pickles (tensors, parameters): matched to a local builder",
         _PICKLED)
      for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                   "_rebuild_qtensor", "_rebuild_meta_tensor_no_storage",
                   "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_cpu_tensor",
                   "_rebuild_parameter", "_rebuild_parameter_with_state")),
    *(_N(f"torch._tensor.{name}", ("_src.checkpoints.reading",),
         "named by `torch.save` pickles (subclasses, tensors with attributes): matched to a "
         "local builder", _PICKLED)
      for name in ("_rebuild_from_type", "_rebuild_from_type_v2")),
)

BACKENDS: tuple[PrivateName, ...] = (
    # -- Lightning -----------------------------------------------------------------------------
    _N("lightning.fabric.plugins.precision.amp._optimizer_handles_unscaling",
       ("adapters.lightning.fabric", "adapters.lightning.strategies"),
       "skip `scaler.unscale_` for optimizers that unscale in their own step, as Lightning does",
       "None: inlining it would name torch's private `_step_supports_amp_scaling` here."),
    _N("lightning.fabric.connector._convert_precision_to_unified_args",
       ("adapters.lightning.checks",),
       "validate a `precision=` value exactly as Lightning does",
       "None: the valid values are Lightning's private `_PRECISION_INPUT`."),
    _N("lightning.pytorch.plugins.precision.Precision._after_closure",
       ("adapters.lightning.strategies",),
       "mirror Lightning's `optimizer_step`: `on_before_optimizer_step` callbacks and clipping",
       "None: it is the step's own private part."),
    _N("lightning.pytorch.strategies.FSDPStrategy._setup_model", ("adapters.lightning.checks",),
       "does a user FSDP strategy replace `_setup_model` (Lightning's passes FSDP1 "
       "`device_id=None` on CPU, which FSDP1 refuses)", "None."),
    _N("lightning.pytorch.strategies.DDPStrategy._ddp_kwargs", ("adapters.lightning.checks",),
       "the user's DDP arguments (bucket size) for `check`", "None public."),
    _N("lightning.pytorch.strategies.DDPStrategy._ddp_comm_hook",
       ("adapters.lightning.checks", "adapters.lightning.strategies"),
       "the user's DDP comm hook: the plan's hook is registered only without one",
       "None public."),
    _N("lightning.pytorch.LightningModule._compiler_ctx", ("adapters.lightning.watching",),
       "watch runs a compiled LightningModule's methods eagerly, then restores them",
       "Public `to_uncompiled`/`from_compiled` swap the same methods but clear the context: "
       "not a temporary swap."),
    _N("lightning.pytorch.Callback._generate_state_key", ("adapters.lightning.watching",),
       "a distinct checkpoint key per WatchCallback",
       "A protected helper meant for subclasses (Lightning's own callbacks use it)."),
    _N("lightning.fabric.wrappers._FabricModule", ("_src.wrappers",),
       "the class (by name) of Fabric's `setup()` wrapper, unwrapped through its public "
       "`module` property", "None: the class has no public name."),
    _N("accelerate.Accelerator.prepare()._original_forward", ("_src.schedule",),
       "whether accelerate's `prepare` wrapped the model's forward in its mixed_precision "
       "autocast, which a plan applied after it does not take back (the schedule refuses it)",
       "None: accelerate marks the wrap only with this attribute it sets on the model.",
       via="_original_forward"),
    # -- transformers --------------------------------------------------------------------------
    _N("transformers.PreTrainedModel._keep_in_fp32_modules",
       ("_src.resolution", "adapters.deepspeed.buffers", "adapters.transformers"),
       "the modules transformers (and DeepSpeed's `keep_in_fp32_modules='auto'`) keep in fp32",
       "None: no accessor; DeepSpeed reads the same attribute."),
    _N("transformers.PreTrainedModel._keep_in_fp32_modules_strict",
       ("_src.resolution", "adapters.deepspeed.buffers", "adapters.transformers"),
       "as `_keep_in_fp32_modules`, in fp32 even under another dtype",
       "None: no accessor."),
    _N("transformers.PreTrainedModel._no_split_modules", ("adapters.transformers",),
       "FSDP units per transformer block", "None: accelerate reads it too."),
    _N("transformers.PreTrainedModel._can_record_outputs", ("adapters.transformers",),
       "the router and module names transformers records outputs for", "None."),
    _N("transformers.PreTrainedModel._weight_conversions", ("adapters.transformers",),
       "checkpoint key renames of a loaded model (set at load, read by transformers itself)",
       "Falls back to public `transformers.conversion_mapping.get_model_conversion_mapping`."),
    # -- torchao -------------------------------------------------------------------------------
    _N("torchao.prototype.moe_training.mxfp8_linear._to_mxfp8_then_scaled_mm", ("_src.float8",),
       "MXFP8Linear's forward with input and weight cast to the autocast dtype",
       "Its body is `mx_mm.apply(...)` in the same prototype module: no more public."),
    _N("torchao.float8._inductor_patch._patch_inductor_min_max_codegen", ("_src.float8",),
       "the inductor workaround `convert_to_float8_training` applies, so compiled fp8 code is "
       "torchao's (skipped silently where torchao lacks it)", "None."),
    _N("torchao.optim.quant_utils._fp32_to_bf16_sr", ("_src.update.step", "_src.update_kernels"),
       "stochastic rounding fp32 -> bf16 for `master='stochastic'` (torchao's AdamW uses it)",
       "None among `quant_utils`' public names."),
    _N("torchao.optim.AdamW8bit._subclass_zeros", ("_src.update.formats",),
       "make a zero low-bit state as torchao's optimizers do (with `_new_buffer`)",
       "Public `OptimState8bit.zeros` and kin (what `update_kernels.lowbit_state` calls) build "
       "the same states, but for `_new_buffer`'s move to the parameter's device."),
    _N("torchao.optim.AdamW8bit._new_buffer", ("_src.update.formats",),
       "torchao's buffer factory: block-size threshold and DTensor wrapping in one place",
       "As `_subclass_zeros`."),
    _N("torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor._tensor", ("_src.float8",),
       "on revert, a plain gradient from torchao's FSDP fp8 weight wrapper",
       "None: its `__tensor_flatten__` names the same attribute."),
)
