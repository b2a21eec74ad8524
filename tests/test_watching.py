"""`watch` (per-module numerics while training) and `diff` (one step against fp32)."""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
import warnings
import weakref
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import precision_annot as pa
from precision_annot._src.cli import main
from precision_annot._src.recording import relative_error
from precision_annot._src.samples import projected_loss
from precision_annot._src.watching import _interleave, _measure, _stats


class Amplifier(nn.Linear):
    """A Linear whose weight a diverging run makes 4 times larger every step."""


def planted() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), Amplifier(16, 16), nn.Linear(16, 1))
    return pa.apply(model, default="16-true")


def train(model: nn.Module, steps: int, w: pa.watch | None, *, scaler: Any = None
          ) -> list[str]:
    """SGD steps (lr 0: the weights move only by the planted growth); the warnings said."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(steps):
            x = torch.randn(8, 16, generator=gen).half()
            opt.zero_grad()
            loss = model(x).float().pow(2).mean() * 1e-6
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if w is not None:
                w.step()
            with torch.no_grad():
                model[2].weight.mul_(4.0)
    return [str(s.message) for s in said if "watch:" in str(s.message)]


def test_watch_names_the_module_that_grows_past_fp16_and_the_step() -> None:
    """Amplifier's output doubles twice a step; tanh bounds its input. At step 8 it passes half
    of fp16's 65504: watch names it, at that step, and nothing else (the Linear after it
    inherits its values); at step 9 it overflows, first in the forward's order."""
    model = planted()
    with pa.watch(model, every=1) as w:
        said = train(model, 10, w)
    assert said and all("module '2'" in s for s in said), said
    first = said[0]
    margins = [r.outputs["2"].margin for r in w.history]
    step = next(i for i, m in enumerate(margins) if m >= 0.5 or w.history[i].outputs["2"]
                .nonfinite)
    assert f"step {step}:" in first and "the output of module '2'" in first
    assert "keep it in fp32: annotate(model, {'2': 'fp32,output=fp32'})" in first
    assert margins[step - 1] < 0.5 <= margins[step] or w.history[step].outputs["2"].nonfinite
    assert all(r.outputs["0"].margin < 0.01 for r in w.history)  # the rest stays far off
    later = [r for r in w.history if r.first_nonfinite is not None]
    assert later and later[0].first_nonfinite == "2"


def test_unsampled_steps_install_nothing_and_sampled_ones_every_n() -> None:
    model = planted()
    linear = model[0]
    with pa.watch(model, every=3, warn=False) as w:
        hooks = []
        for _ in range(7):
            hooks.append(len(linear._forward_hooks))
            model(torch.randn(2, 16).half()).float().sum().backward()
            w.step()
    assert hooks == [1, 0, 0, 1, 0, 0, 1]  # step 0, 3, 6: measured; the others run bare
    assert [r.step for r in w.history] == [0, 3, 6]
    assert len(linear._forward_hooks) == 0  # closed


def test_watch_records_the_grad_scaler_and_writes_a_report(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    model = planted()
    scaler = pa.GradScaler(init_scale=2.0**16)
    path = tmp_path / "run.jsonl"
    with pa.watch(model, every=1, scaler=scaler, path=path, warn=False) as w:
        train(model, 10, w, scaler=scaler)
    last = w.history[-1]
    assert last.scale is not None and last.scale < 2.0**16  # it backed off
    assert last.skipped is not None and last.skipped >= 1
    lines = path.read_text().splitlines()
    assert len(lines) == 10 and json.loads(lines[0])["outputs"]["2"]["dtype"] == "fp16"
    assert main(["watch-report", str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    # the Amplifier's output, and the gradients that flow back through its weight, reach fp16's
    # limit; the modules before it do not
    top = {tuple(line.split()[:2]) for line in out.splitlines()[3:6]}
    assert "10 sampled steps" in out and top == {("2", "output"), ("1", "grad"), ("0", "grad")}
    pytest.importorskip("matplotlib")
    png = tmp_path / "amax.png"
    assert main(["watch-report", str(path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_watch_rejects_a_bad_every() -> None:
    with pytest.raises(ValueError, match=r"every is a number of steps, 1 or more. Received: "
                                         r"every=0"):
        pa.watch(planted(), every=0)
    with pytest.raises(ValueError, match=r"start is the index of the first step .* 0 or more. "
                                         r"Received: start=-1"):
        pa.watch(planted(), start=-1)


def test_a_resumed_run_goes_on_from_its_step_with_the_same_steps_sampled(tmp_path: Path
                                                                         ) -> None:
    """A run stopped after 5 steps and resumed with start=5 samples and numbers its steps as
    one run of 10 does, in one file (0.4 could only count from 0 again)."""
    model = planted()
    path = tmp_path / "run.jsonl"
    for start, steps in ((0, 5), (5, 5)):
        with pa.watch(model, every=3, path=path, start=start, warn=False) as w:
            hooks = []
            for _ in range(steps):
                hooks.append(len(model[0]._forward_hooks))
                model(torch.randn(2, 16).half()).float().sum().backward()
                w.step()
    assert hooks == [0, 1, 0, 0, 1]  # steps 5..9: 6 and 9 are measured
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 3, 6, 9]


# -- diff ----------------------------------------------------------------------------------------

class Offset(nn.Module):
    """Adds and removes a large offset: in bf16 the small values are lost on the way."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 300.0) - 300.0


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), Offset(),
                         nn.Linear(16, 4))


def test_diff_names_the_first_module_that_departs_from_fp32() -> None:
    model = chain()
    pa.annotate(model, {"*": "fp32", "3": "bf16"})
    x = torch.randn(8, 16)
    report = pa.diff(model, x)
    assert report.first == "3"
    assert report["2"].output_error == 0.0 and report["3"].output_error > 0.5
    assert report["4"].output_error > report.tolerance  # downstream inherits it
    assert [m.name for m in report][:4] == ["0", "1", "2", "3"]  # execution order
    assert "<- first" in str(report)
    assert pa.diff(chain(), x).first is None  # no plan: it is fp32
    assert model[0].weight.dtype == torch.float32 and pa.applied_plan(model) is None  # untouched


def test_diff_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "lossy.py"
    script.write_text(
        "import torch\nfrom torch import nn\nimport precision_annot as pa\n\n"
        "class Offset(nn.Module):\n    def forward(self, x):\n"
        "        return (x + 300.0) - 300.0\n\n"
        "def make():\n    torch.manual_seed(0)\n"
        "    m = nn.Sequential(nn.Linear(16, 16), Offset(), nn.Linear(16, 4))\n"
        "    return pa.annotate(m, {'*': 'fp32', '1': 'bf16'})\n\n"
        "def batch():\n    return torch.randn(8, 16)\n")
    assert main(["diff", f"{script}:make", "--sample", f"{script}:batch", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["first"] == "1"
    assert main(["diff", f"{script}:make", "--sample", f"{script}:batch",
                 "--tolerance", "2"]) == 0
    assert "No module passes it" in capsys.readouterr().out


def test_a_gradient_the_loss_already_overflowed_is_blamed_on_the_loss_not_a_module() -> None:
    model = planted()
    x = torch.randn(8, 16).half()
    with warnings.catch_warnings(record=True) as said, pa.watch(model, every=1) as w:
        warnings.simplefilter("always")
        (model(x).float().sum() * torch.inf).backward()
        w.step()
    messages = [str(s.message) for s in said if "watch:" in str(s.message)]
    assert w.history[0].first_nonfinite is None and w.history[0].first_nonfinite_grad
    assert len(messages) == 1 and "the gradient the loss hands module" in messages[0]
    assert "no module made it" in messages[0]
    # under a watched GradScaler the same step is its to skip: nothing said
    scaler = pa.GradScaler()
    with warnings.catch_warnings(record=True) as said, \
            pa.watch(model, every=1, scaler=scaler) as w:
        warnings.simplefilter("always")
        (model(x).float().sum() * torch.inf).backward()
        w.step()
    assert not [s for s in said if "watch:" in str(s.message)]
    assert w.history[0].first_nonfinite_grad is not None


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([torch.float16, torch.bfloat16, torch.float32,
                        # a module may return fp8 (a quantizer): 0.4 raised NotImplementedError
                        torch.float8_e4m3fn, torch.float8_e5m2]),
       st.lists(st.sampled_from(["zero", "sub", "tiny", "normal", "near", "inf", "nan"]),
                min_size=1, max_size=40), st.integers(0, 2**16))
def test_measured_counts_are_the_counts_written_by_hand(dtype: torch.dtype, kinds: list[str],
                                                        seed: int) -> None:
    f = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(seed)
    pick = {"zero": 0.0, "sub": f.tiny * 0.3, "tiny": f.tiny, "normal": 1.5,
            "near": f.max * 0.75, "inf": float("inf"), "nan": float("nan")}
    signs = torch.randint(0, 2, (len(kinds),), generator=gen) * 2 - 1
    x = (torch.tensor([pick[k] for k in kinds], dtype=torch.float64) * signs).to(dtype)
    if len(kinds) == 1:
        x = x[0]  # a 0-dim tensor, as a loss a module returns
    s = _stats(dtype, [*_measure(x, x).tolist(), 1.0])
    a = x.double().abs()
    finite = torch.isfinite(a)
    assert s.nonfinite == int((~finite).sum()) and s.in_nonfinite == int(s.nonfinite > 0)
    assert s.over * len(kinds) == pytest.approx(int((a > f.max / 2).sum()))
    assert s.under * len(kinds) == pytest.approx(int(((a > 0) & (a < f.tiny)).sum()))
    assert s.amax == (float(a[finite].max()) if finite.any() else 0.0)


def test_a_container_that_hands_on_its_childs_tensor_shares_its_record() -> None:
    model = planted()
    with pa.watch(model, every=1, warn=False) as w:
        model(torch.randn(4, 16).half()).float().sum().backward()
        record = w.step()
    assert record is not None
    assert record.outputs[""] == record.outputs["3"] and record.grads[""] == record.grads["3"]
    assert list(record.grads)[:2] == ["3", ""]  # the child made it: first in the backward
    assert list(record.outputs) == ["0", "1", "2", "3", ""]  # the forward's order


def test_diff_says_when_fp32_itself_is_not_finite_rather_than_reporting_no_error() -> None:
    model = chain()
    pa.annotate(model, {"*": "bf16"})
    with torch.no_grad():
        model[2].weight[0, 0] = torch.nan  # as a step taken on a non-finite loss leaves it
    with pytest.warns(UserWarning, match=r"diff: the fp32 run itself holds values that are "
                                         r"not finite from module '2' on"):
        report = pa.diff(model, torch.randn(8, 16))
    assert report["1"].output_error < report.tolerance
    assert all(math.isnan(report[n].output_error) for n in ("2", "3", "4"))
    assert report.first is None and "nan" in str(report)


@pytest.mark.parametrize("recipe", ["fp8", "fp8-rowwise"])
def test_fp8_linears_report_torchaos_scale_amax_and_underflow(recipe: str) -> None:
    """An fp8 Linear's input and weight: amax, the scale torchao casts them with and the share
    of nonzero values that fall below e4m3's smallest normal once scaled, all checked against
    the same numbers written by hand (448 / amax, per tensor or per row, as a power of 2 in
    the rowwise recipe)."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    pa.annotate(model, {"0": f"compute={recipe}"})
    pa.apply(model, default="bf16-true")
    x = torch.randn(8, 32).bfloat16()
    x[0, :4] = torch.tensor([1e4, 1e-3, 0.0, -2e-4])  # one large row: small ones underflow
    with pa.watch(model, every=1, warn=False) as w:
        model(x).float().sum().backward()
        record = w.step()
    assert record is not None and set(record.fp8) == {"0"}  # the bf16 Linear has none
    by_operand = {s.operand: s for s in record.fp8["0"]}
    e4m3 = torch.finfo(torch.float8_e4m3fn)
    for operand, t in (("input", x), ("weight", model[0].weight.detach())):
        s = by_operand[operand]
        a = t.float().abs()
        rows = a.amax(-1, keepdim=True) if recipe == "fp8-rowwise" else a.amax()
        scale = e4m3.max / rows
        if recipe == "fp8-rowwise":  # torchao's rowwise recipe rounds scales down to 2**k
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        lost = ((a * scale < e4m3.tiny) & (a > 0)).sum() / (a > 0).sum()
        assert s.dtype == torch.float8_e4m3fn and s.amax == float(a.max())
        assert s.scale == pytest.approx(float(scale.min()), rel=1e-6)
        assert s.underflow == pytest.approx(float(lost), abs=1e-9)
    if recipe == "fp8":  # the large value pushes the batch's small ones below e4m3
        assert by_operand["input"].underflow > 0.005
    metrics = record.metrics()
    assert metrics["precision/0/fp8_input_scale"] == by_operand["input"].scale


def test_watch_report_lists_fp8_operands_by_their_worst_underflow(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = pa.apply(pa.annotate(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)),
                                 {nn.Linear: "compute=fp8"}), default="bf16-true")
    path = tmp_path / "fp8.jsonl"
    with pa.watch(model, every=1, warn=False, path=path) as w:
        for spread in (1.0, 1e4, 1.0):  # the second batch holds one large value
            x = torch.randn(8, 32).bfloat16()
            x[0, 0] = spread
            model(x).float().sum().backward()
            w.step()
    worst = max(w.history, key=lambda r: r.fp8["0"][0].underflow)
    assert worst.step == 1
    assert main(["watch-report", str(path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("0 ") and "input" in line)
    assert row.split()[2] == f"{worst.fp8['0'][0].underflow:.2%}" and row.split()[3] == "1"


@pytest.mark.parametrize("bad", [0, -1.0, "1e-2", True, float("nan"), float("inf")])
def test_diff_rejects_a_bad_tolerance_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=r"diff: tolerance is a relative error above 0, e\.g\. "
                                         r"1e-2\. Received: tolerance="):
        pa.diff(chain(), torch.randn(2, 16), tolerance=bad)  # type: ignore[arg-type]


# -- every call, every output, training steps only (0.4 measured something else) -----------------

class FirstCall(nn.Module):
    """`big` overflows fp16 on its only call; the inf flows to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(16, 16)
        self.big = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.big.weight.fill_(6e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.big(self.small(x)))
        return out


class Saturated(FirstCall):
    """`big` overflows; a tanh after it saturates the inf, so the output is finite."""

    def __init__(self) -> None:
        super().__init__()
        self.tanh = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.tanh(self.big(self.small(x))))
        return out


class SecondCall(nn.Module):
    """`shared` runs twice; its second call overflows fp16, and a tanh saturates the inf."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.mid = nn.Linear(16, 16)
        self.tanh = nn.Tanh()
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.shared.weight.fill_(10.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.shared(x))
        out: torch.Tensor = self.head(self.tanh(self.shared(h * 100.0)))
        return out


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x) * 1e6  # the second overflows fp16 in this module's code


class SecondOutput(nn.Module):
    """`heads` returns two tensors, the second holding inf; it reaches the root's output."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = Heads()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, z = self.heads(x)
        out: torch.Tensor = self.head(y) + z.sum(-1, keepdim=True)
        return out


def named_by_debug_underflow_overflow(model: nn.Module, x: torch.Tensor) -> str | None:
    """The module transformers' DebugUnderflowOverflow names (its last frame before it stops
    at an inf or nan), run on a copy; None when it finds none."""
    import contextlib
    import copy
    import io

    from transformers.debug_utils import DebugUnderflowOverflow

    clone = copy.deepcopy(model)
    DebugUnderflowOverflow(clone)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            clone(x)
        except ValueError as e:
            assert "inf/nan detected" in str(e)
        else:
            return None
    prefix = " " * 17 + " "  # its frame header: "{prefix} {module name} {class name}"
    header = [line for line in out.getvalue().splitlines() if line.startswith(prefix)][-1]
    return header[len(prefix):].rpartition(" ")[0]


@pytest.mark.parametrize("planting", [FirstCall, Saturated, SecondCall, SecondOutput],
                         ids=["first-call", "saturated-later", "second-call", "second-output"])
def test_watch_names_the_module_debug_underflow_overflow_names(planting: type[nn.Module]
                                                                ) -> None:
    """0.4 named the module only on the first planting and the saturated one: a shared
    module's second call was never measured, and a second returned tensor holding inf was
    blamed on the root."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = pa.apply(planting(), default="16-true")
    x = torch.randn(4, 16).half()
    named = named_by_debug_underflow_overflow(model, x)
    assert named is not None
    with warnings.catch_warnings(record=True) as said, pa.watch(model, every=1) as w:
        warnings.simplefilter("always")
        model(x).float().sum().backward()
        record = w.step()
    assert record is not None and record.first_nonfinite == named
    messages = [str(s.message) for s in said if "watch:" in str(s.message)]
    assert messages and f"the output of module {named!r} reached" in messages[0], messages


class BackwardOnly(nn.Module):
    """Finite forward; in backward `b`'s large weight overflows the gradient it hands
    `shrink` (fp16)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        with torch.no_grad():
            self.b.weight.fill_(1e3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x) * 1e-4)
        return out


def test_watch_still_finds_a_backward_only_overflow_that_debug_underflow_overflow_cannot_see(
        ) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = pa.apply(BackwardOnly(), default="16-true")
    x = torch.randn(4, 16).half()
    assert named_by_debug_underflow_overflow(model, x) is None  # it watches forwards only
    with pa.watch(model, every=1, warn=False) as w:
        (model(x).float().sum() * 10).backward()
        record = w.step()
    assert record is not None and record.first_nonfinite is None
    assert record.first_nonfinite_grad == "a" and record.grads["b"].nonfinite == 0


def test_watch_samples_the_training_step_not_an_evaluation_run_between_steps() -> None:
    """A no_grad (or inference_mode) evaluation between steps is not a training step: 0.4
    recorded it (amax 51.9 where training's was 1.07) and had no gradient rows."""
    torch.manual_seed(0)
    model = pa.apply(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)),
                     default="bf16-true")
    train_x = torch.randn(8, 16).bfloat16()
    evaluate = (torch.randn(8, 16) * 50).bfloat16()
    with pa.watch(model, every=1, warn=False) as w:
        for no_grad in (torch.no_grad, torch.inference_mode):
            w.step()  # the step before
            with no_grad():
                model(evaluate)
            model(train_x).float().sum().backward()
            record = w.step()
            assert record is not None
            assert record.outputs["0"].amax == float(model[0](train_x).detach().abs().max())
            assert set(record.grads) == set(record.outputs) == {"0", "1", "2", ""}
            assert all(s.tensors == 1 for s in record.outputs.values())  # one call each


def test_warnings_go_on_after_the_first_module_when_a_later_one_overflows() -> None:
    """`a` at 61% of fp16's largest value is said once; `c` overflowing to inf at a later step
    is said too (0.4 said nothing more once `a` was said, though the record named `c`)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Tanh()
            self.c = nn.Linear(4, 4, bias=False)
            with torch.no_grad():
                self.a.weight.copy_(torch.eye(4) * 40000)
                self.c.weight.fill_(1.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.c(self.b(self.a(x)) * self.scale)
            return out

    model = pa.apply(Net(), default="16-true")
    x = torch.ones(2, 4).half()
    with warnings.catch_warnings(record=True) as said, pa.watch(model, every=1) as w:
        warnings.simplefilter("always")
        for step in range(6):
            model.scale = 2e4 if step == 5 else 1.0  # c sums 4 of them: 8e4
            model(x).float().sum().backward()
            w.step()
    messages = [str(s.message) for s in said if "watch:" in str(s.message)]
    assert w.history[5].first_nonfinite == "c"
    assert len(messages) == 2, messages
    assert "step 0: the output of module 'a' reached 4e+04, 61%" in messages[0]
    assert "step 5: the output of module 'c' reached 8 non-finite values" in messages[1]


def test_watch_refuses_a_compiled_model_with_the_fix() -> None:
    """0.4 recorded 0 rows from a compiled model, and said nothing."""
    model = pa.apply(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), default="bf16-true")
    with pytest.raises(ValueError, match=r"watch: the model is compiled \(torch.compile\)"):
        pa.watch(torch.compile(model))
    inplace = copy_of(model)
    inplace.compile()
    with pytest.raises(ValueError, match=r"call the uncompiled one while watch.sampling"):
        pa.watch(inplace)
    x = torch.randn(2, 4).bfloat16()
    # compiled apart from the model watch was given, and run on a sampled step: refused there
    fresh = copy_of(model)
    with pa.watch(fresh, every=1) as w:
        torch.compile(fresh, backend="eager")(x).float().sum().backward()
        with pytest.raises(RuntimeError, match=r"watch: the model ran compiled "
                                               r"\(torch.compile\) on a sampled step"):
            w.step()
    assert not fresh[0]._forward_hooks
    # the fix it gives: the uncompiled model on the sampled steps
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as said, pa.watch(model, every=2) as w:
        warnings.simplefilter("always")
        for step in range(4):
            (model if w.sampling else compiled)(x).float().sum().backward()
            record = w.step()
            assert (record is not None) == (step % 2 == 0)
            assert record is None or set(record.grads) == {"0", "1", ""}
        assert not said
        compiled(x).float().sum().backward()  # a sampled step run compiled after all
        with pytest.raises(RuntimeError, match=r"watch: the model ran compiled"):
            w.step()


def copy_of(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def test_watch_errors_name_the_argument_and_the_fix(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    model = planted()
    with pytest.raises(TypeError, match=r"watch: scaler is the GradScaler the run steps with "
                                        r".* Received: scaler=<object object"):
        pa.watch(model, scaler=object())
    missing = tmp_path / "no" / "run.jsonl"
    with pytest.raises(FileNotFoundError, match=r"watch: path=.* is in a folder that does not "
                                                r"exist"):
        pa.watch(model, path=missing)
    assert not missing.parent.exists() and not model[0]._forward_hooks  # nothing left behind
    with warnings.catch_warnings(record=True) as said, pa.watch(model, every=1) as w:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(torch.randn(2, 16).half())  # an evaluation, and no training step
        record = w.step()
        w.step()
    assert record is not None and not record.outputs
    assert len(said) == 1 and "step 0 was sampled, but no module of the model ran a forward " \
        "with gradients" in str(said[0].message)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2, 3]\n")
    assert main(["watch-report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "line 1 is not a record watch wrote" in err and "Traceback" not in err


# -- diff: the same random stream, every call, and nothing of the caller's changed --------------

class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.drop(self.lin(x)))
        return out


def test_diff_runs_both_steps_on_the_same_random_stream_and_leaves_the_callers_as_it_was(
        ) -> None:
    """A "32-true" plan with dropout: 0.4 drew other masks for fp32 and reported first='1'
    (error 0.74); it also advanced the caller's generator."""
    torch.manual_seed(0)
    model = pa.annotate(Dropped(), {"*": "32-true"})
    mine = model.lin.register_forward_hook(lambda m, a, o: None)
    x = torch.randn(8, 16)
    state = torch.get_rng_state()
    report = pa.diff(model, x)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's stream, untouched
    assert report.first is None and report.first_grad is None
    assert all(m.output_error == 0.0 for m in report), str(report)
    assert list(model.lin._forward_hooks) == [mine.id] and model.training
    # bf16: the same masks too (dropout draws the same numbers in either dtype), so only
    # rounding remains
    bf16 = pa.diff(pa.annotate(Dropped(), {"*": "bf16"}), x)
    assert bf16.first is None and bf16["drop"].output_error < 1e-2, str(bf16)


def test_diff_compares_every_call_and_blames_a_second_call_on_its_module() -> None:
    """0.4 compared the first call only, and blamed the next module for a second call's
    1.00 error."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.offset = Offset()
            self.out = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.offset(self.lin(x) * 1e3)  # large values: bf16 keeps them to 0.5%
            out: torch.Tensor = self.out(self.offset(h * 1e-3))  # lost in bf16 this time
            return out

    torch.manual_seed(0)
    model = pa.annotate(Twice(), {"*": "fp32", "offset": "bf16"})
    report = pa.diff(model, torch.randn(8, 16))
    assert report.first == "offset" and report["offset"].output_error > 0.5
    assert report["offset"].tensors == 2


def test_diff_during_a_watched_step_neither_copies_the_watch_nor_is_recorded_by_it() -> None:
    """0.4's copies kept the watch's hooks, so the watch recorded diff's runs (amax 113.9
    instead of training's 1.11)."""
    torch.manual_seed(0)
    model = pa.apply(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)),
                     default="bf16-true")
    x = torch.randn(8, 16).bfloat16()
    with pa.watch(model, every=1, warn=False) as w:
        pa.diff(model, x * 100)  # before the step's forward
        model(x).float().sum().backward()
        pa.diff(model, x * 100)  # and after it
        record = w.step()
    assert record is not None
    assert record.outputs["0"].amax == float(model[0](x).detach().abs().max())
    assert all(s.tensors == 1 for s in record.outputs.values())


def test_diff_takes_a_one_parameter_loss_fn_as_suggest_does() -> None:
    model = chain()
    pa.annotate(model, {"*": "fp32", "3": "bf16"})
    x = torch.randn(8, 16)
    one = pa.diff(model, x, loss_fn=lambda out: out.pow(2).mean())
    two = pa.diff(model, x, loss_fn=lambda out, sample: (out - sample[:, :4]).pow(2).mean())
    assert one.first == two.first == "3"
    assert one["2"].grad_error is not None and one["2"].grad_error != two["2"].grad_error
    with pytest.raises(TypeError, match=r"diff\(loss_fn=...\) must return the loss: a "
                                        r"floating tensor of one element .* Received: 'loss'"):
        pa.diff(model, x, loss_fn=lambda out: "loss")
    # the forms a Hugging Face user reaches for first, and a loss not reduced (0.4: a repr of
    # the whole dict of tensors, and torch's "grad can be implicitly created only for scalar
    # outputs" from inside the backward)
    for wrong, said in ((lambda out: {"loss": out.sum(), "logits": out}, r"a dict with keys "
                         r"\['loss', 'logits'\]"),
                        (lambda out: (out.sum(), out), "a tuple of 2 items"),
                        (lambda out: out.pow(2), r"a tensor of shape \(8, 4\)")):
        with pytest.raises(TypeError, match=r"out\['loss'\].*Received: " + said):
            pa.diff(model, x, loss_fn=wrong)
    with pytest.raises(TypeError, match=r"diff\(loss_fn=...\) is a function"):
        pa.diff(model, x, loss_fn=3)  # type: ignore[arg-type]


def test_watch_records_the_model_it_watches_not_a_copy_made_during_a_sampled_step() -> None:
    """An EMA or evaluation copy made with deepcopy keeps the watched model's hooks; it runs
    without being recorded."""
    import copy

    torch.manual_seed(0)
    model = pa.apply(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)),
                     default="bf16-true")
    x = torch.randn(8, 16).bfloat16()
    with pa.watch(model, every=1, warn=False) as w:
        twin = copy.deepcopy(model)
        twin(x * 100).float().sum().backward()
        model(x).float().sum().backward()
        record = w.step()
    assert record is not None
    assert record.outputs["0"].amax == float(model[0](x).detach().abs().max())
    assert all(s.tensors == 1 for s in record.outputs.values())


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.utils.checkpoint

        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)
        out: torch.Tensor = self.head(h)
        return out


def test_watch_gives_the_modules_inside_reentrant_checkpointing_their_gradient_rows() -> None:
    """0.4 left the 3 modules inside without gradient rows (they ran under no_grad, then
    again in backward), and measured the rerun as a second call."""
    torch.manual_seed(0)
    model = pa.apply(Checkpointed(), default="bf16-true")
    x = torch.randn(8, 16).bfloat16().requires_grad_()
    with pa.watch(model, every=1, warn=False) as w:
        model(x).float().sum().backward()
        record = w.step()
    assert record is not None
    assert set(record.grads) == set(record.outputs) == {
        "block.0", "block.1", "block.2", "block", "head", ""}
    assert all(s.tensors == 1 for s in record.outputs.values())


class Noisy(nn.Module):
    """Draws noise in the dtype it computes in (a double draws other numbers than a float
    from the same generator state, as CUDA's dropout draws another mask for bf16)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + torch.rand_like(h)


def test_diff_hands_the_second_run_the_first_runs_draws_whatever_dtype_they_are_drawn_in(
        ) -> None:
    torch.manual_seed(0)
    drawn = torch.rand(16, dtype=torch.float64)
    torch.manual_seed(0)
    assert not torch.allclose(drawn.float(), torch.rand(16))  # not the same numbers
    model = pa.annotate(nn.Sequential(Noisy(), nn.Linear(16, 4)), {"*": "64-true"})
    report = pa.diff(model, torch.randn(8, 16))
    assert report.first is None and report["0"].output_error < 1e-6, str(report)


class Quantize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e4m3fn)


class Dequantize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 2


def test_watch_measures_an_fp8_output_against_fp8s_limits() -> None:
    """A module that returns fp8 (a quantizer) and one handed fp8: 0.4 raised
    NotImplementedError from inside the training step's forward."""
    model = nn.Sequential(nn.Linear(4, 4), Quantize(), Dequantize())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    x = torch.tensor([[300.0, 1.0, 0.5, -2.0]])
    with pa.watch(model, every=1, warn=False) as w:
        model(x).sum().backward()
        record = w.step()
    assert record is not None
    q = record.outputs["1"]
    assert q.dtype == torch.float8_e4m3fn and q.amax == 288.0  # 300 in e4m3
    assert q.margin == 288.0 / 448.0 and q.over == 0.25  # 288 > 448 / 2
    assert record.outputs["2"].amax == 576.0 and record.outputs["2"].dtype == torch.float32


# -- diff: its own copy of the sample, one copy of the model at a time, a loss that reaches ------

class Cached(nn.Module):
    """Attends over the keys of earlier calls, kept in a cache the caller hands in (as a KV
    cache is): each forward appends to it."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        cache.append(self.k(x))
        keys = torch.cat(cache)
        out: torch.Tensor = self.out((x @ keys.T).softmax(-1) @ keys)
        return out


def test_diff_runs_each_step_on_its_own_copy_of_the_sample_and_leaves_the_callers() -> None:
    """0.4 handed both runs the caller's sample: the plan's run appended to the caller's cache,
    the fp32 run then attended over 3 keys where the plan's had 2 (or raised, through a
    freed graph), and the backward put gradients in the caller's input."""
    torch.manual_seed(0)
    model = pa.annotate(Cached(), {"*": "32-true"})
    past = [torch.randn(4, 8)]
    x = torch.randn(4, 8, requires_grad=True)
    report = pa.diff(model, ((x,), {"cache": past}))
    assert len(past) == 1 and x.grad is None  # the caller's, as they were
    assert report.first is None and report.first_grad is None, str(report)
    assert all(m.output_error == 0.0 for m in report), str(report)


class Counted(nn.Linear):
    """Counts the copies of itself alive when each forward runs."""

    alive: ClassVar[weakref.WeakSet[nn.Module]] = weakref.WeakSet()
    seen: ClassVar[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counted.alive.add(self)
        Counted.seen.append(len(Counted.alive))
        return super().forward(x)


def test_diff_holds_one_copy_of_the_model_at_a_time() -> None:
    """0.4 held both copies (the plan's and fp32's) while the fp32 run ran. The plan's copy
    is freed when let go, without waiting for the garbage collector (the applied plan's
    boundary holds its module: a reference cycle)."""
    model = pa.apply(nn.Sequential(Counted(8, 8), nn.Linear(8, 1)), default="bf16-true")
    Counted.seen.clear()
    pa.diff(model, torch.randn(4, 8))
    assert Counted.seen == [1, 1]  # each run's copy alone (the caller's model never ran)


def test_diffs_default_loss_reaches_through_a_normalization_and_a_softmax() -> None:
    """A model ending in a LayerNorm (at its initial weights) or a softmax: the sum of its
    output is a constant, whose gradient is 0 but for rounding, and 0.4 reported gradient
    errors of 1e28 and named a 'first (backward)' module for it. The default loss is now a
    fixed projection of the output, whose gradient reaches every element; judged against the
    same cotangent pulled back by hand."""
    for last in (nn.LayerNorm(32), nn.Softmax(-1)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), last)
        pa.annotate(model, {"*": "bf16"})
        x = torch.randn(8, 16)
        report = pa.diff(model, x)
        assert report.first_grad is None, str(report)
        # by hand: the same loss in fp32 and in bf16, the gradient at the second Linear
        wants = []
        for dtype in (torch.float32, torch.bfloat16):
            net = copy.deepcopy(model).to(dtype)
            h = net[2](net[1](net[0](x.to(dtype))))
            (g,) = torch.autograd.grad(projected_loss(net[3](h)), h)
            wants.append(g)
        assert float(wants[0].abs().max()) > 1e-2  # a gradient that reaches, unlike the sum's
        assert report["2"].grad_error == pytest.approx(
            relative_error(wants[1], wants[0]), rel=0.2, abs=2e-3)
        assert report["2"].grad_error < report.tolerance


def test_watch_report_reads_a_file_whose_run_stopped_while_writing_and_an_empty_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run killed while writing its last record (the run one wants the report of): 0.4
    refused the whole file (exit 2, 'line 3 is not JSON'). An empty file gave an empty
    table."""
    model = planted()
    path = tmp_path / "run.jsonl"
    with pa.watch(model, every=1, path=path, warn=False) as w:
        train(model, 3, w)
    text = path.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[: len(text) - 40])
    assert main(["watch-report", str(cut)]) == 0
    said = capsys.readouterr()
    assert said.out.startswith(f"2 sampled steps in {cut}")
    assert re.search(r"warning: watch-report: the last line of .*cut.jsonl \(line 3\) was cut "
                     r"short", said.err)
    middle = tmp_path / "middle.jsonl"
    lines = text.splitlines()
    middle.write_text("\n".join([lines[0], lines[1][:40], lines[2]]) + "\n")
    assert main(["watch-report", str(middle)]) == 2  # damage elsewhere is still refused
    assert "line 2 is not JSON" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["watch-report", str(empty)]) == 0
    assert "0 sampled steps" in capsys.readouterr().out


class Reads(pa.GradScaler):
    """Counts the reads of its scale to the host (`get_scale` calls `.item()`: on a GPU, a
    wait for the device)."""

    reads = 0

    def get_scale(self) -> float:
        Reads.reads += 1
        return super().get_scale()


def test_steps_that_are_not_sampled_read_no_loss_scale_from_the_device() -> None:
    """0.4 read the GradScaler's scale (`.item()`) at every step to count skips: on a GPU, a
    host sync on every training step, sampled or not (a fused optimizer's step avoids its own
    to keep the device busy). Skips are now counted on the device and read on sampled steps:
    the same counts as the scale read every step by hand."""
    model = planted()
    scaler = Reads(init_scale=2.0**16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gen = torch.Generator().manual_seed(1)
    scales = [scaler.get_scale()]
    with pa.watch(model, every=4, scaler=scaler, warn=False) as w:
        Reads.reads = 0
        for _ in range(12):
            x = torch.randn(8, 16, generator=gen).half()
            opt.zero_grad()
            scaler.scale(model(x).float().pow(2).mean() * 1e-6).backward()
            scaler.step(opt)
            scaler.update()
            reads = Reads.reads
            w.step()
            assert Reads.reads - reads <= (1 if w.history and w.history[-1].step == w.index - 1
                                           else 0)
            Reads.reads = reads
            scales.append(float(scaler._scale))  # by hand, after the fact
            with torch.no_grad():
                model[2].weight.mul_(4.0)  # the planted growth: the scaler backs off
    lowered = [b < a for a, b in itertools.pairwise(scales)]
    skipped = [sum(lowered[:k + 1]) for k in range(12)]
    assert [r.step for r in w.history] == [0, 4, 8]
    assert [r.skipped for r in w.history] == [skipped[k] for k in (0, 4, 8)]
    assert [r.scale for r in w.history] == [scales[k + 1] for k in (0, 4, 8)]
    assert skipped[-1] >= 2  # the planted growth makes it back off


class Routed(nn.Module):
    """Top-1 routing over 4 experts: a near tie can go another way in bf16 than in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            picked = chosen == e
            if picked.any():
                out[picked] = expert(x[picked]).to(out.dtype)
        return out


def test_diff_says_where_the_runs_routed_tokens_apart_not_that_fp32_is_not_finite() -> None:
    """A router that sends a token to another expert in bf16 than in fp32 hands those experts
    tensors of other shapes in the two runs: 0.4 warned that the fp32 run itself held values
    that are not finite ("look at the weights and the batch"), which it did not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Routed(), nn.Linear(16, 2))
    pa.annotate(model, {"*": "bf16"})
    x = torch.randn(256, 16)
    low = pa.apply(copy.deepcopy(model))  # the routes by hand, in fp32 and under the plan
    with torch.no_grad():
        want = model[1].router(model[0](x)).argmax(-1)
        got = low[1].router(low[0](x.bfloat16())).argmax(-1)
    other = want != got
    moved = {int(e) for e in torch.cat([want[other], got[other]])}
    assert moved  # the seed's batch does route some tokens apart
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        report = pa.diff(model, x)
    messages = [str(s.message) for s in said]
    assert not any("fp32 run itself" in m for m in messages), messages
    apart = [m for m in messages if "returned tensors of other shapes" in m]
    assert len(apart) == 1 and all(f"'1.experts.{e}'" in apart[0] for e in moved)
    assert {n for n in (f"1.experts.{e}" for e in range(4))
            if math.isnan(report[n].output_error)} == {f"1.experts.{e}" for e in moved}


class Handed(nn.Module):
    """`second` handed the first Linear's output with an inf in it, by keyword (as transformers
    calls its attention: `self_attn(hidden_states=...)`) or by position."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.keyword = keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h = h.index_fill(1, torch.tensor([0]), torch.inf)  # code between modules makes an inf
        out: torch.Tensor = self.second(input=h) if self.keyword else self.second(h)
        return out


@pytest.mark.parametrize("keyword", [False, True])
def test_a_module_handed_inf_by_keyword_was_handed_it_as_by_position(keyword: bool) -> None:
    """0.5: `second(input=h)` got in_nonfinite=0 and "keep it in fp32"; `second(h)` was
    correctly said to be handed the values."""
    model = pa.apply(Handed(keyword), default="bf16-true")
    with warnings.catch_warnings(record=True) as said, pa.watch(model, every=1) as w:
        warnings.simplefilter("always")
        model(torch.randn(4, 8).bfloat16()).float().sum().backward()
        w.step()
    record = w.history[0]
    assert record.first_nonfinite == "second" and record.outputs["second"].in_nonfinite == 1
    assert record.outputs["second"].nonfinite == 4 * 8  # every output reads the inf
    messages = [str(s.message) for s in said if "watch:" in str(s.message)]
    assert len(messages) == 1 and "module 'second', the first to hold non-finite values " \
        "(32), was handed them" in messages[0]
    assert "fp32" not in messages[0]


def overflowing() -> nn.Sequential:
    """An fp16 model whose second Linear's output passes fp16's range on the first batch, its
    weights finite: the step taken on that loss leaves every weight it reaches not finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.fill_(2000.0)
    return pa.apply(model, default="16-true")


def test_weights_left_non_finite_by_a_step_on_an_overflowed_loss_are_said_so() -> None:
    """A step taken on a loss that overflowed leaves the weights nan; 0.5 then said "keep '0'
    in fp32" of the first module to use them. The parameters are read when the module runs (the
    step that overflowed ran on finite weights, though they are nan by the time it ends)."""
    model = overflowing()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as said, pa.watch(model, every=1) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            loss = model(torch.randn(4, 8, generator=gen).half() * 30).float().pow(2).mean()
            loss.backward()
            opt.step()  # taken whatever the loss: what a loop without a GradScaler does
            w.step()
    assert not torch.isfinite(model[0].weight).all()  # by hand: the step left them nan
    messages = [str(s.message) for s in said if "watch:" in str(s.message)]
    assert len(messages) == 2
    assert "the output of module '2' reached" in messages[0] and "keep it in fp32" in messages[0]
    assert "step 1: module '0', the first to hold non-finite values" in messages[1]
    assert "computed them from weights that were already not finite" in messages[1]
    assert "GradScaler" in messages[1] and "clip" in messages[1]
    assert "keep it in fp32" not in messages[1] and "annotate" not in messages[1]
    step0, step1 = w.history
    assert step0.first_nonfinite == "2" and step0.outputs["2"].weights_nonfinite == 0
    assert step0.outputs["2"].in_nonfinite == 0
    assert step1.first_nonfinite == "0" and step1.outputs["0"].weights_nonfinite == 1
    assert step1.outputs["0"].in_nonfinite == 0


@pytest.mark.slow  # 12 s: transformers' import and a Trainer; the plain loop above in make test
def test_a_hugging_face_trainer_run_whose_weights_went_nan_is_told_so(tmp_path: Path) -> None:
    """A Llama from a small config, fp16 ("16-true"), its head planted past fp16's range: the
    Trainer steps on the overflowed loss (its clipping turns the inf gradients into nan), and
    the next step's first non-finite module is the embedding, whose weights are nan. 0.5 said
    "keep 'model.embed_tokens' in fp32"."""
    transformers = pytest.importorskip("transformers")
    from precision_annot.adapters import transformers as hf
    from tests.adapters.hf_models import build

    torch.manual_seed(0)
    model, batch = build("llama")
    pa.apply(model, default="16-true")
    with torch.no_grad():
        model.lm_head.weight.mul_(3e5)  # finite weights (at most 2.5e4), logits past 65504
    assert torch.isfinite(model.lm_head.weight).all()
    rows = [{"input_ids": batch["input_ids"][i], "labels": batch["labels"][i]} for i in (0, 1)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=100,
        log_level="error")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    callback = hf.watch_callback(trainer, every=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train()
    assert not torch.isfinite(model.model.embed_tokens.weight).all()
    messages = [str(s.message) for s in said if "watch:" in str(s.message)]
    assert len(messages) == 2 and "'lm_head' reached" in messages[0]
    assert "module 'model.embed_tokens', the first to hold non-finite values" in messages[1]
    assert "weights that were already not finite" in messages[1]
    assert "keep it in fp32" not in messages[1]
    step0, step1 = callback.watch.history
    assert step0.first_nonfinite == "lm_head" and step0.outputs["lm_head"].weights_nonfinite == 0
    assert step1.first_nonfinite == "model.embed_tokens"
    assert step1.outputs["model.embed_tokens"].weights_nonfinite == 1


@pytest.mark.parametrize(("orders", "merged"), [
    ([[0, 1, 5, 6], [0, 3, 4, 5, 6]], [0, 1, 3, 4, 5, 6]),  # rank 1's expert before its parent
    ([[0, 5, 6], [0, 3, 5, 6], [0, 2, 5, 6, 7]], [0, 3, 2, 5, 6, 7]),
    ([[], [2, 1]], [2, 1]),  # rank 0 ran nothing
    ([[1, 2], [2, 1]], [1, 2]),  # two orders that disagree: the first rank's
])
def test_the_reduced_order_keeps_a_module_one_rank_ran_where_it_ran(
        orders: list[list[int]], merged: list[int]) -> None:
    assert _interleave(orders) == merged
