"""Activation checkpointing over applied models: the rerun in backward sees what the forward saw.

torch.utils.checkpoint runs a checkpointed function again during backward, outside the
boundaries that were running around it. Before 0.5 an entry guard there acted as if called on
its own (rounding an fp32 residual stream to the compute dtype) and a parameter held in
another dtype than its region computes in was seen in its own: without reentrance torch
raised CheckpointError, with `use_reentrant=True` the gradients were another computation's.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.testing import assert_close

from precision_annot import annotate, apply, bf16, fp16, fp32, precision
from precision_annot._src.boundary import in_applied_forward

PRESETS = ["bf16-mixed", "16-mixed", "bf16-true", "16-true"]
LOW = {"bf16-mixed": bf16, "16-mixed": fp16, "bf16-true": bf16, "16-true": fp16}
ISLAND = "fp32,output=fp32"  # as transformers' kept modules: the fp32 output flows on


class Norm(nn.Module):
    """T5's RMS norm: the product with its input keeps the input's dtype in its graph, so an
    input rounded in the rerun changes what backward reads (what torch's check caught)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # a side effect torch.compile refuses
            self.seen.append(x.dtype)
        x = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class Block(nn.Module):
    """x + wo(relu(wi(norm(x)))), T5's feed-forward layer: with `wo` an fp32 island handing
    back fp32, the residual stream leaving a block is fp32."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = Norm(d)
        self.wi = nn.Linear(d, 2 * d)
        self.wo = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.wo(torch.relu(self.wi(self.norm(x))))


class Stack(nn.Module):
    """Blocks, each run through `checkpoint` when `reentrant` is not None."""

    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.reentrant: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = run(block, x, reentrant=self.reentrant)
        return x


def run(fn: Callable[..., Any], *args: Any, reentrant: bool | None, **kwargs: Any) -> Any:
    if reentrant is None:
        return fn(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=reentrant, **kwargs)


def step(fn: Callable[..., Any], x: torch.Tensor, module: nn.Module | None = None
         ) -> dict[str, torch.Tensor]:
    """One forward and backward from a fresh input: the loss, the input's gradient and every
    parameter's of `module` (`fn` itself when None), by name."""
    module = module if module is not None else fn  # type: ignore[assignment]
    assert isinstance(module, nn.Module)
    x = x.detach().clone().requires_grad_(True)
    loss = fn(x).float().pow(2).sum()
    loss.backward()
    assert not in_applied_forward()  # the rerun left nothing set in this thread
    assert x.grad is not None
    out = {"loss": loss.detach(), "x": x.grad}
    out.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    module.zero_grad(set_to_none=True)
    return out


def assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        assert_close(got[name], value, rtol=0, atol=0, msg=name)


def stack(preset: str, island: str = ISLAND) -> Stack:
    torch.manual_seed(0)
    model = Stack()
    annotate(model, {"blocks.*.wo": island})
    return apply(model, default=preset)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("preset", PRESETS)
def test_checkpointed_blocks_compute_what_the_plain_model_does(preset: str,
                                                               reentrant: bool) -> None:
    """Each block checkpointed inside the applied model's forward: the rerun sees the fp32
    residual stream the first run saw, and loss and gradients are bit for bit those of the
    model without checkpointing."""
    model = stack(preset)
    x = torch.randn(4, 8)
    plain = step(model, x)
    seen = [LOW[preset], fp32, fp32]  # the stream after the first block is fp32
    assert [b.norm.seen for b in model.blocks] == [[d] for d in seen]
    for block in model.blocks:
        block.norm.seen.clear()
    model.reentrant = reentrant
    assert_same(plain, step(model, x))
    assert [b.norm.seen for b in model.blocks] == [[d, d] for d in seen]  # and in the rerun


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("island", ["fp32", ISLAND])
def test_an_island_handing_back_its_input_dtype(island: str, reentrant: bool) -> None:
    """An island without output=fp32 hands back the low dtype: the stream stays low, and the
    rerun still matches."""
    model = stack("bf16-mixed", island)
    x = torch.randn(4, 8)
    plain = step(model, x)
    model.reentrant = reentrant
    assert_same(plain, step(model, x))


class Rotary(Block):
    """A block that also takes an fp32 table (rotary frequencies), which its boundary keeps
    (keep_dtype)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__(d)
        self.table_seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self.table_seen.append(table.dtype)
        h = self.norm(x)
        return x + self.wo(torch.relu(self.wi(h * table.to(h.dtype))))


class Twice(nn.Module):
    """One block called twice inside one checkpointed region, with a table from a
    non-persistent fp32 buffer (kept in fp32 by every preset)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.block = precision(keep_dtype=("table",))(Rotary(d))
        self.register_buffer("table", torch.linspace(1.0, 1.0 + 2.0 ** -12, d),
                             persistent=False)  # values only fp32 holds
        self.reentrant: bool | None = None

    def region(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table
        return self.block(self.block(x, table), table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run(self.region, x, reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("preset", ["bf16-mixed", "16-true"])
def test_a_module_called_twice_and_a_kept_argument(preset: str, reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Twice()
    annotate(model, {"block.wo": ISLAND})
    apply(model, default=preset)
    x = torch.randn(4, 8)
    plain = step(model, x)
    assert model.block.norm.seen == [LOW[preset], fp32]  # the second call gets fp32
    assert model.block.table_seen == [fp32, fp32]
    model.block.norm.seen.clear()
    model.block.table_seen.clear()
    model.reentrant = reentrant
    assert_same(plain, step(model, x))
    assert model.block.norm.seen == [LOW[preset], fp32] * 2
    assert model.block.table_seen == [fp32] * 4


class Mixed(nn.Module):
    """A model stored in bf16 and computed in fp32: while its forward runs, each weight is
    seen as an fp32 copy (its boundary's region). The norm is a leaf checkpointed on its
    own: the rerun has no boundary around it."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.norm = Norm(d)
        self.out = nn.Linear(d, d)
        self.reentrant: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(run(self.norm, self.inp(x), reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_parameter_seen_in_its_regions_dtype_is_seen_so_in_the_rerun(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = apply(Mixed(), default="compute=fp32,storage=bf16")
    assert model.norm.weight.dtype == bf16
    x = torch.randn(4, 8)
    plain = step(model, x)
    assert plain["norm.weight"].dtype == bf16 and model.norm.seen == [fp32]
    model.reentrant = reentrant
    assert_same(plain, step(model, x))
    assert model.norm.seen == [fp32] * 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_module_checkpointed_on_its_own_sets_up_its_boundary_both_times(
        reentrant: bool) -> None:
    """checkpoint(model.blocks[1], x) from outside the model: its entry guard acts as its
    boundary would, in the forward and in the rerun alike; and checkpoint(model, x)."""
    model = stack("bf16-true")
    block = model.blocks[1]
    x = torch.randn(4, 8)

    def alone(checkpointed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda inp: run(block, inp, reentrant=reentrant if checkpointed else None)

    plain = step(alone(False), x, block)
    assert block.norm.seen == [bf16]  # cast at entry, as its boundary would
    assert_same(plain, step(alone(True), x, block))
    assert block.norm.seen == [bf16] * 3
    whole = step(model, x)
    assert_same(whole, step(lambda inp: run(model, inp, reentrant=reentrant), x, model))


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-true", "16-mixed"])
def test_composable_checkpoint_and_fsdps_checkpoint_wrapper(preset: str) -> None:
    """torch's other checkpoint entry points: the composable `checkpoint(module)` and the
    `checkpoint_wrapper` FSDP users apply with `apply_activation_checkpointing`, of both
    kinds: the loss and every gradient bit for bit those without checkpointing."""
    composable = pytest.importorskip("torch.distributed._composable")
    wrapper = pytest.importorskip(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    model = stack(preset)
    x = torch.randn(4, 8)
    plain = step(model, x)
    hooked = copy.deepcopy(model)
    for block in hooked.blocks:
        composable.checkpoint(block)
    assert_same(plain, step(hooked, x))
    for impl in (wrapper.CheckpointImpl.NO_REENTRANT, wrapper.CheckpointImpl.REENTRANT):
        wrapped = copy.deepcopy(model)
        wrapper.apply_activation_checkpointing(
            wrapped, checkpoint_wrapper_fn=functools.partial(
                wrapper.checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda m: isinstance(m, Block))
        assert sum(isinstance(m, wrapper.CheckpointWrapper) for m in wrapped.modules()) == 3
        assert_same(plain, {k.replace("._checkpoint_wrapped_module", ""): v
                            for k, v in step(wrapped, x).items()})


_OUT_OF_REACH = """
import torch, torch.utils.checkpoint as c
from torch import nn
from precision_annot._src import seams
real = getattr(c, seams.CHECKPOINT_GENERATOR)
if {renamed!r}:  # as torch 2.14 left the old name: it is there, and checkpoint calls another
    c._old_generator = lambda *args, **kwargs: real(*args, **kwargs)
    seams.CHECKPOINT_GENERATOR = "_old_generator"
else:
    seams.CHECKPOINT_GENERATOR = "_no_such_generator"
from precision_annot import apply
from precision_annot._src.recompute import CheckpointSupportError
for attempt in range(2):
    try:
        apply(nn.Sequential(nn.Linear(2, 2)), default="bf16-mixed")
        print("applied")
    except CheckpointSupportError as error:
        print("refused:", error)
assert c.CheckpointFunction.__module__ == "torch.utils.checkpoint"
assert getattr(c, seams.CHECKPOINT_GENERATOR, None) in (None, getattr(c, "_old_generator", 0))
y = c.checkpoint(torch.sin, torch.ones(2, requires_grad=True), use_reentrant=False)
y.sum().backward()
print("checkpoint still runs")
"""


@pytest.mark.slow  # over make test's budget: run by make test-all
@pytest.mark.parametrize("renamed", [True, False])
def test_a_checkpoint_start_out_of_reach_is_refused_at_apply(renamed: bool) -> None:
    """Where torch starts a checkpoint through a name this package does not wrap (torch 2.14
    renamed the generator and kept the old name, which nothing called: the rerun then ran
    without the captured state, silently), `apply` refuses, every time, naming the torch
    and what to do, and torch's checkpoint is left as it was."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OUT_OF_REACH.format(renamed=renamed)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3 and lines[2] == "checkpoint still runs", done.stdout
    for line in lines[:2]:
        assert line.startswith("refused: precision_annot: with torch "), line
        assert "rerun in backward without its boundaries' state" in line
        assert "tested on (" in line
    assert ("a non-reentrant checkpoint reran without the state" in lines[0]) is renamed
    assert ("_no_such_generator" in lines[0]) is not renamed


def test_reentrant_checkpoint_keeps_torchs_autograd_function() -> None:
    """The reentrant entry point is still torch's CheckpointFunction (a subclass of it, under
    its name): isinstance checks and the graph's node names are unchanged."""
    from torch.utils.checkpoint import CheckpointFunction

    stack("bf16-mixed")  # something applied: the rerun support is installed
    assert issubclass(CheckpointFunction, torch.autograd.Function)
    assert CheckpointFunction.__name__ == "CheckpointFunction"
    y = torch.utils.checkpoint.checkpoint(torch.sin, torch.ones(2, requires_grad=True),
                                          use_reentrant=True)
    assert type(y.grad_fn).__name__ == "CheckpointFunctionBackward"


@pytest.mark.slow  # compiles: 5 s each
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_applied_model_compiles_fullgraph(reentrant: bool) -> None:
    """torch.compile traces a checkpoint as a graph of its own (the rerun is the compiler's),
    through the boundaries: one graph, and the eager model's loss and gradients."""
    model = stack("bf16-mixed")
    x = torch.randn(4, 8)
    plain = step(model, x)
    model.reentrant = reentrant
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = step(compiled, x, model)
    assert_same(plain, got)


# -- transformers ---------------------------------------------------------------------------------

def t5(preset: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """T5 with its own fp32 list (the feed-forward `wo` layers, handing back fp32) under a
    low-precision plan; eager attention, whose kernels do not depend on which inputs need
    gradients (SDPA's do: with it transformers alone differs with and without checkpointing)."""
    tf = pytest.importorskip("transformers")
    from precision_annot.adapters.transformers import rules

    config = tf.T5Config(vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_layers=2,
                         num_heads=4, decoder_start_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(config)
    annotate(model, rules(model))
    apply(model, default=preset)
    model.train()  # dropout on: the rerun draws the same masks
    gen = torch.Generator().manual_seed(1)
    return model, {"input_ids": torch.randint(0, 128, (2, 12), generator=gen),
                   "labels": torch.randint(0, 128, (2, 6), generator=gen), "use_cache": False}


def t5_step(preset: str, reentrant: bool | None
            ) -> tuple[dict[str, torch.Tensor], set[tuple[str, tuple[torch.dtype, ...]]]]:
    """The loss and every gradient of one step, and each (module, floating input dtypes) a
    module's forward was called with."""
    model, batch = t5(preset)
    if reentrant is not None:
        with warnings.catch_warnings():  # transformers 5 renames it activation_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    seen: set[tuple[str, tuple[torch.dtype, ...]]] = set()
    for name, module in model.named_modules():
        module.register_forward_pre_hook(
            lambda _, args, kwargs, name=name: seen.add((name, tuple(
                a.dtype for a in (*args, *kwargs.values())
                if isinstance(a, torch.Tensor) and a.is_floating_point()))), with_kwargs=True)
    torch.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(**batch).loss
    loss.backward()
    assert not in_applied_forward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), **grads}, seen


@pytest.mark.parametrize("preset", [  # the tiny models above take every preset, fast
    "bf16-mixed", "16-true", *(pytest.param(p, marks=pytest.mark.slow)
                               for p in ("16-mixed", "bf16-true"))])
def test_t5_with_its_fp32_islands_under_non_reentrant_checkpointing(preset: str) -> None:
    """transformers' gradient_checkpointing_enable(use_reentrant=False) on T5 with its fp32
    `wo` islands: torch raised CheckpointError (the rerun rounded the fp32 residual stream to
    the low dtype); now loss and gradients are bit for bit those without checkpointing."""
    plain, seen = t5_step(preset, None)
    checkpointed, seen_checkpointed = t5_step(preset, False)
    assert_same(plain, checkpointed)
    assert seen_checkpointed == seen


@pytest.mark.parametrize("preset", ["bf16-mixed", pytest.param("16-true", marks=pytest.mark.slow)])
def test_t5_with_its_fp32_islands_under_reentrant_checkpointing(preset: str) -> None:
    """use_reentrant=True: every module's forward sees in the rerun the dtypes it saw in the
    plain forward (it saw the residual stream in the low dtype, and the gradients were another
    computation's: 0.0115 from the plain step's in bf16). Reentrant checkpointing sums a
    gradient reaching several layers (the shared position bias) in another order, so the
    gradients are compared within the low dtype's tolerance (transformers alone: 5e-4)."""
    plain, seen = t5_step(preset, None)
    checkpointed, seen_checkpointed = t5_step(preset, True)
    assert seen_checkpointed == seen
    assert plain.keys() == checkpointed.keys()
    for name, value in plain.items():
        assert checkpointed[name].dtype == value.dtype, name
        assert_close(checkpointed[name], value, rtol=0, atol=4e-3, msg=name)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


@pytest.mark.slow  # the Trainer: 1 to 4 s each
@pytest.mark.parametrize("kind", ["t5", "llama"])
def test_the_trainer_with_gradient_checkpointing_trains_an_applied_model(
        kind: str, tmp_path: Any) -> None:
    """Trainer(gradient_checkpointing=True) on T5 (its fp32 `wo`) and Llama (fp32 norms and
    rotary table) in bf16: two steps with clipping and an evaluation; the islands are
    trained in fp32, the rest in bf16."""
    tf = pytest.importorskip("transformers")
    from precision_annot.adapters.transformers import rules
    from tests.adapters.hf_models import build

    torch.manual_seed(0)
    model, _ = build(kind)
    annotate(model, [*rules(model), *([("*norm", "fp32"), ("model.rotary_emb", "fp32")]
                                      if kind == "llama" else [])])
    apply(model, default="bf16")
    islands = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == fp32}
    assert islands and all(".wo." in n or "norm" in n for n in islands), islands.keys()
    args = tf.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-2,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        max_grad_norm=1.0, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    trainer = tf.Trainer(model=model, args=args, train_dataset=Tokens(),
                         eval_dataset=Tokens())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert any(math.isfinite(log.get("eval_loss", math.nan)) for log in trainer.state.log_history)
    for name, before in islands.items():
        now = model.get_parameter(name)
        assert now.dtype == fp32 and not torch.equal(now, before), name


@pytest.mark.parametrize("kind", ["checkpoint", "non_reentrant_checkpoint"])
@pytest.mark.parametrize("preset", PRESETS)
def test_deepspeeds_own_activation_checkpointing_reruns_as_the_forward_ran(
        preset: str, kind: str) -> None:
    """DeepSpeed's activation checkpointing (`deepspeed.checkpointing.checkpoint` and
    `non_reentrant_checkpoint`) reruns through its own functions, not torch's, and restores no
    autocast: inside an applied model the rerun rounded the fp32 residual stream and ran
    outside the plan's autocast (gradients 0.073 / 0.035 / 0.0039 / 0.0047 off for bf16-mixed,
    bf16-true, 16-mixed, 16-true). Now loss and gradients are those without checkpointing,
    bit for bit."""
    checkpointing = pytest.importorskip(
        "deepspeed.runtime.activation_checkpointing.checkpointing")
    model = stack(preset)
    checkpointed = getattr(checkpointing, kind)

    class DeepSpeedStack(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpointed(block, x) if self.reentrant else block(x)
            return x

    ds = DeepSpeedStack()
    ds.load_state_dict(model.state_dict())
    annotate(ds, {"blocks.*.wo": ISLAND})
    apply(ds, default=preset)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    plain = step(ds, x)
    ds.reentrant = True
    assert_same(plain, step(ds, x))


# -- the probe the first apply runs, and what torch.compile refuses ----------------------------

_FRESH = """
import torch
from torch import nn
import precision_annot as pa
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
pa.annotate(model, {{"1": "fp32"}})
before = {{k: v.dtype for k, v in model.state_dict().items()}}
packed = []
{setup}
try:
    with {context}:
        pa.apply(model, default="bf16-true")
    print("applied")
except Exception as e:
    print("raised", type(e).__name__, str(e)[:120])
    print("left", {{k: str(v.dtype) for k, v in model.state_dict().items()}} if
          {{k: v.dtype for k, v in model.state_dict().items()}} != before else "unchanged")
print("packed", len(packed))
"""

_CONTEXTS = {
    # a user serving a model builds and applies it under inference mode
    "inference_mode": ("", "torch.inference_mode()"),
    # apply inside a region that forbids saved-tensor hooks (non-reentrant checkpointing uses them)
    "disable_saved_tensors_hooks": ("", "torch.autograd.graph.disable_saved_tensors_hooks('no')"),
    # a user's own saved-tensor hooks (offloading, memory accounting) around apply
    "saved_tensors_hooks": ("def pack(t):\n    packed.append(t.shape)\n    return t",
                            "torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)"),
}


@pytest.mark.slow  # over make test's budget: run by make test-all
@pytest.mark.parametrize("where", list(_CONTEXTS))
def test_the_first_apply_in_a_process_leaves_no_trace_of_its_probe(where: str) -> None:
    """The first apply in a process runs one checkpoint of each kind (the probe), in a thread
    of its own, before it changes anything, so nothing of the caller's thread reaches it.
    Measured when it ran in the caller's thread, in the middle of apply: under inference_mode
    the first apply raised "Inference tensors cannot be saved for backward", left the
    parameters cast ({'0.weight': bf16, ...}) and the wrappers installed unprobed; under
    disable_saved_tensors_hooks it raised the user's message; a user's saved_tensors_hooks
    packed 3 tensors of the probe's."""
    import subprocess
    import sys
    import textwrap

    setup, context = _CONTEXTS[where]
    code = textwrap.dedent(_FRESH.format(setup=setup, context=context))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "applied", done.stdout
    assert lines[-1] == "packed 0", done.stdout


def _stack(preset: str, island: str) -> Stack:
    torch.manual_seed(0)
    model = Stack()
    annotate(model, {"blocks.*.wo": island})
    return apply(model, default=preset)


@pytest.mark.slow  # compiles: 5 s each
@pytest.mark.xfail(strict=True, reason="torch.compile refuses the island's parameter copies "
                   "inside a checkpoint's graph (\"Unsafe side effect\"): loud, not wrong")
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_model_with_an_island_computing_wider_than_it_stores_compiles(
        reentrant: bool) -> None:
    """bf16-true with `wo` computing in fp32 over its bf16 storage (a Region): torch.compile
    (fullgraph, aot_eager) of the checkpointed model raises "Unsupported HOP: Unsafe side
    effect ... Mutating a variable from outside the scope of this HOP" on torch 2.13, 2.14 and
    2.15 (also at 4f4ba85). The same by hand (F.linear on .float() copies of the bf16 weights
    inside the checkpointed block) compiles fullgraph (/tmp/breaker40/compile_hand.py)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    reference = _stack("bf16-true", "compute=fp32")
    expected = step(torch.compile(reference, fullgraph=True, backend="aot_eager"), x, reference)
    model = _stack("bf16-true", "compute=fp32")
    model.reentrant = reentrant
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = step(torch.compile(model, fullgraph=True, backend="aot_eager"), x, model)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


