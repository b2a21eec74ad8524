"""The one recorder of what modules return, and the one error measure against fp32, that
`watch`, `diff` and `suggest` share."""

from __future__ import annotations

import copy
import math

import torch
import torch.utils.checkpoint
from torch import nn

import precision_annot as pa
from precision_annot._src import diffing, recording
from precision_annot._src.recording import Recorder, Returned, relative_error
from precision_annot._src.suggest import compare


class Pair(nn.Module):
    """Returns two tensors, the second nested in a dict, and hands its input back too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        y = self.lin(x)
        return y, {"twice": 2 * y, "given": x}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()
        self.shared = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, more = self.pair(x)
        out: torch.Tensor = self.shared(self.shared(y) + more["twice"])
        return out


def record(model: nn.Module, run: object, **kwargs: bool
           ) -> tuple[list[tuple[Returned, torch.Tensor]], list[tuple[Returned, torch.Tensor]]]:
    outs: list[tuple[Returned, torch.Tensor]] = []
    grads: list[tuple[Returned, torch.Tensor]] = []
    with Recorder(dict(model.named_modules()), lambda r, t, m, a: outs.append((r, t)),
                  lambda r, g: grads.append((r, g)), **kwargs):
        run()  # type: ignore[operator]
    return outs, grads


def test_every_call_and_every_floating_tensor_is_recorded_with_its_gradient() -> None:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 4, requires_grad=True)
    outs, grads = record(model, lambda: model(x).sum().backward())
    keys = [r.key for r, _ in outs]
    # pair.lin, then pair's two tensors (its input handed back is not its output), shared's
    # two calls, and the root handing on shared's second output
    assert keys == [("pair.lin", 0, 0), ("pair", 0, 0), ("pair", 0, 1), ("shared", 0, 0),
                    ("shared", 1, 0), ("", 0, 0)]
    by_key = {r.key: (r, t) for r, t in outs}
    assert by_key[("pair", 0, 0)][0].same is by_key[("pair.lin", 0, 0)][0]
    assert by_key[("", 0, 0)][0].same is by_key[("shared", 1, 0)][0]
    assert by_key[("pair", 0, 1)][0].same is None
    # each tensor's gradient, as autograd computes it (checked against torch.autograd.grad)
    torch.manual_seed(0)
    again = Net()
    y, more = again.pair(x)
    first = again.shared(y)
    out = again.shared(first + more["twice"])
    want = dict(zip([("shared", 1, 0), ("shared", 0, 0), ("pair", 0, 1), ("pair", 0, 0)],
                    torch.autograd.grad(out.sum(), [out, first, more["twice"], y]),
                    strict=True))
    got = {r.key: g for r, g in grads}
    for key, g in want.items():
        torch.testing.assert_close(got[key], g, rtol=0, atol=0)
    assert got[("", 0, 0)] is got[("shared", 1, 0)]  # one tensor, one gradient
    # the backward's order: the last tensor first
    assert [r.key for r, _ in grads][:2] == [("shared", 1, 0), ("", 0, 0)]
    assert not any(h for m in model.modules() for h in (m._forward_hooks, m._forward_pre_hooks))


def test_training_only_skips_forwards_without_gradients_but_not_a_no_grad_region_inside() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(2, 4)

    def run() -> None:
        with torch.no_grad():
            model(x * 50)  # an evaluation
        with torch.inference_mode():
            model(x * 50)
        model(x).sum().backward()

    outs, grads = record(model, run, training_only=True)
    assert [r.key for r, _ in outs] == [("0", 0, 0), ("1", 0, 0), ("2", 0, 0), ("", 0, 0)]
    torch.testing.assert_close(outs[0][1], model[0](x))  # the training batch's
    assert {r.name for r, _ in grads} == {"0", "1", "2", ""}


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x) if self.reentrant is None else torch.utils.checkpoint.checkpoint(
            self.block, x, use_reentrant=self.reentrant)
        out: torch.Tensor = self.head(h)
        return out


def test_checkpointing_gives_the_inner_modules_their_gradients_and_no_second_call() -> None:
    """Reentrant checkpointing runs the block under no_grad, then again in backward: the
    second run is not a new call, and its tensors carry the first run's gradients (0.4: the
    3 modules inside had no gradient rows). Non-reentrant: the first run's tensors get them."""
    torch.manual_seed(0)
    model = Checkpointed(None)
    x = torch.randn(2, 4, requires_grad=True)
    plain_outs, plain_grads = record(model, lambda: model(x).sum().backward(),
                                     training_only=True)
    assert {r.name for r, _ in plain_grads} >= {"block.0", "block.1", "block.2"}
    for reentrant in (True, False):
        model.reentrant = reentrant
        outs, grads = record(model, lambda: model(x).sum().backward(), training_only=True)
        assert [r.key for r, _ in outs] == [r.key for r, _ in plain_outs]  # no call twice
        got = {r.key: g for r, g in grads}
        assert len(got) == len(plain_grads)
        for r, g in plain_grads:
            torch.testing.assert_close(got[r.key], g, rtol=0, atol=0)


def test_a_copy_of_a_recorded_model_keeps_none_of_the_recorders_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    mine = model[0].register_forward_hook(lambda m, a, o: None)
    with Recorder(dict(model.named_modules()), lambda r, t, m, a: None):
        copied = copy.deepcopy(model)
        recording.drop_recorders(copied)
    assert list(copied[0]._forward_hooks) == [mine.id] and not copied[0]._forward_pre_hooks
    assert not copied[1]._forward_hooks and not copied._forward_hooks


def test_one_error_measure_a_masked_inf_in_both_runs_is_equal_its_finite_entries_compared(
        ) -> None:
    want = torch.tensor([[1.0, -math.inf], [2.0, 4.0]])
    got = torch.tensor([[1.5, -math.inf], [2.0, 4.0]])
    expected = 0.5 / math.sqrt(1 + 4 + 16)
    assert relative_error(got, want) == expected
    assert relative_error(got.half(), want) == expected
    assert relative_error(torch.tensor([[1.5, 0.0], [2.0, 4.0]]), want) == math.inf
    assert relative_error(torch.tensor([[1.5, -math.inf], [math.inf, 4.0]]), want) == math.inf
    assert relative_error(got, want[0]) != relative_error(got, want[0])  # shapes differ: nan
    # one home: suggest's and diff's measures are this one
    assert compare.relative_error is relative_error
    assert diffing._error(got, want) == expected


class Masked(nn.Module):
    """Attention-style scores: masked entries are -inf; the kept ones lose their small part
    to a large offset in a low dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[-2], x.shape[-1], dtype=torch.bool).triu(1)
        return ((x + 300.0) - 300.0).masked_fill(mask, -math.inf)


def test_diff_compares_the_finite_entries_of_a_masked_output() -> None:
    """0.4 skipped the module (error nan, first None) while its finite entries were 100% off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Masked(), nn.Softmax(-1))
    pa.annotate(model, {"*": "fp32", "1": "bf16"})
    x = torch.randn(8, 8) * 0.01
    report = pa.diff(model, x)
    assert report.first == "1"
    lin = model[0](x)
    want = Masked()(lin)
    got = Masked()(lin.bfloat16()).float()
    assert report["1"].output_error == relative_error(got, want) > 0.5
    assert math.isfinite(report["1"].output_error)



def test_a_data_parallel_replica_is_recorded_as_its_module_and_a_deep_copy_is_not() -> None:
    """DataParallel (CUDA only) runs replicas made by `_replicate_for_data_parallel`, which
    share the module's hook dicts; a deep copy has its own. Called here on the CPU, directly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    x = torch.randn(2, 4)

    def run() -> None:
        copy.deepcopy(model)(x * 100)
        replica = model._replicate_for_data_parallel()
        for key, child in model._modules.items():
            assert child is not None
            copied = child._replicate_for_data_parallel()
            copied.__dict__["_parameters"] = dict(child._parameters)  # as replicate() sets them
            replica._modules[key] = copied
        replica(x)

    outs, _ = record(model, run)
    assert [r.key for r, _ in outs] == [("0", 0, 0), ("1", 0, 0), ("", 0, 0)]
    torch.testing.assert_close(outs[0][1], model[0](x))


class Learned(nn.Module):
    """A learned positional table handed out as it is: the module returns its parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2, 4))

    def forward(self) -> torch.Tensor:
        return self.table


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = Learned()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x + self.pos())
        return out


def test_a_parameter_a_module_returns_keeps_no_gradient_hook_after_the_recorder_closes() -> None:
    """A gradient hook on a parameter stays on it for good: 0.4 left one per sampled step,
    each firing on every later backward into the closed step's lists (5 steps: 5 hooks)."""
    torch.manual_seed(0)
    model = WithTable()
    for _ in range(5):
        _, grads = record(model, lambda: model(torch.randn(2, 4)).sum().backward())
        assert [r.key for r, _ in grads if r.name == "pos"] == [("pos", 0, 0)]
    assert not model.pos.table._backward_hooks
    model(torch.randn(2, 4)).sum().backward()  # a later step: nothing fires
    assert len([r for r, _ in grads if r.name == "pos"]) == 1
    with pa.watch(model, every=1, warn=False) as w:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            w.step()
    assert not model.pos.table._backward_hooks
    assert [r.grads["pos"].tensors for r in w.history] == [1, 1, 1]


def test_a_batch_made_under_inference_mode_is_recorded_as_any_other() -> None:
    """An input made under torch.inference_mode (a frozen encoder's output, a preprocessed
    batch) has no version counter: plain PyTorch trains on it, 0.4's watch and diff raised
    RuntimeError reading it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 1))
    model[0].requires_grad_(False)  # a frozen first layer: torch needs none of its input saved
    with torch.inference_mode():
        x = torch.randn(3, 4)
    outs, _ = record(model, lambda: model(x).sum().backward(), training_only=True)
    assert [r.key for r, _ in outs] == [("0", 0, 0), ("2", 0, 0), ("", 0, 0)]
    with pa.watch(model, every=1, warn=False) as w:
        model(x).sum().backward()
        record_ = w.step()
    assert record_ is not None and set(record_.outputs) == {"0", "2", ""}
    assert pa.diff(model, x).first is None


def test_reentrant_checkpointing_called_from_the_loop_is_recorded_from_its_run_in_backward(
        ) -> None:
    """`checkpoint(model, x, use_reentrant=True)` in the training loop runs the model under
    no_grad outside any module's forward, which training_only took for an evaluation: 0.4
    recorded nothing of the step. The run in backward (the same values) is the call now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(2, 4, requires_grad=True)
    plain_outs, plain_grads = record(model, lambda: model(x).sum().backward(),
                                     training_only=True)

    def checkpointed() -> None:
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True)
        out.sum().backward()

    outs, grads = record(model, checkpointed, training_only=True)
    assert [r.key for r, _ in outs] == [r.key for r, _ in plain_outs]
    for (_, got), (_, want) in zip(outs, plain_outs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert {r.key for r, _ in grads} == {r.key for r, _ in plain_grads}
    want_grads = {r.key: g for r, g in plain_grads}
    for r, g in grads:
        torch.testing.assert_close(g, want_grads[r.key], rtol=0, atol=0)


def test_a_calls_keyword_arguments_are_handed_on_beside_its_positional_ones() -> None:
    """transformers calls its attention by keyword (`self_attn(hidden_states=...)`): what a
    module was handed is `(args, kwargs)`, so `watch` can tell an input that was not finite
    whichever way it came (0.5 handed on the positional arguments only)."""
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    seen: list[recording.Inputs] = []
    with Recorder({"lin": lin}, lambda r, t, m, inputs: seen.append(inputs)):
        lin(input=x)
        lin(x)
    assert len(seen) == 2
    (args, kwargs), (args2, kwargs2) = seen
    assert args == () and kwargs.keys() == {"input"} and kwargs["input"] is x
    assert len(args2) == 1 and args2[0] is x and kwargs2 == {}
