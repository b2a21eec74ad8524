"""The `precision-annot` command: report a plan, audit what runs, suggest islands, check a plan
before launch, export backend configs, run the demo."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precision_annot._src.auditing import audit
from precision_annot._src.checking import BACKENDS, check
from precision_annot._src.diffing import TOLERANCE as DIFF_TOLERANCE
from precision_annot._src.diffing import WIDE_TOLERANCE, diff
from precision_annot._src.findings import SEVERITIES
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import as_policy
from precision_annot._src.resolution import resolve
from precision_annot._src.runtime import apply
from precision_annot._src.samples import step
from precision_annot._src.suggest import suggest
from precision_annot._src.suggest.constants import DEFAULT_TOLERANCE, FP8_TOLERANCE
from precision_annot._src.version import VERSION
from precision_annot._src.watching import plot, report

__all__ = ["main"]


class CLIError(Exception):
    """A user error: printed as one line, without a traceback, exit status 2."""


def load_target(target: str) -> nn.Module:
    """Call `package.module:callable` or `path/to/file.py:callable` and check it gives a module."""
    model = load_object(target)
    if not isinstance(model, nn.Module):
        raise CLIError(
            f"{target} must return an nn.Module. Received: {type(model).__name__}"
        )
    return model


def load_object(target: str, *, call: bool = True) -> Any:
    """Import `package.module:name` or `path/to/file.py:name`; call it if it is callable
    (and `call` is True)."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise CLIError(
            f"TARGET must be 'package.module:callable' or 'path/to/file.py:callable'. "
            f"Received: {target!r}"
        )
    module = _import_file(module_part) if module_part.endswith(".py") or "/" in module_part \
        else _import_module(module_part)
    fn = getattr(module, attr, None)
    if fn is None:
        raise CLIError(f"{module_part!r} has no attribute {attr!r}.")
    if not call or not callable(fn) or isinstance(fn, (nn.Module, torch.Tensor)):
        return fn
    try:
        inspect.signature(fn).bind()
    except TypeError as e:
        raise CLIError(f"Calling {target} failed: it must be callable with no arguments "
                       f"({e}).") from e
    except ValueError:  # no signature to read (a builtin): call it and see
        pass
    return fn()  # the user's factory raising is exit status 3, with its traceback


def _import_file(module_part: str) -> types.ModuleType:
    """A Python file run as a module, its folder on sys.path (as `python file.py` has it)."""
    path = Path(module_part)
    if not path.is_file():
        raise CLIError(f"Cannot import {module_part!r}: no such file.")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise CLIError(f"Cannot import {module_part!r}.")
    folder = str(path.resolve().parent)  # its siblings import, as `python file.py`
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)  # the user's code raising here is exit status 3
    return module


def _import_module(module_part: str) -> types.ModuleType:
    """An importable module; one that is not there is a CLI error, a module it imports that
    is missing is its own error (exit status 3)."""
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_part == e.name
                                  or module_part.startswith(e.name + ".")):
            raise  # the target imports, and something it imports is missing: its error
        raise CLIError(f"Cannot import {module_part!r}: {type(e).__name__}: {e}") from e


def _plan(args: argparse.Namespace) -> PrecisionPlan:
    """The plan of a model target, or a plan file written by `report --json`."""
    if args.target.endswith(".json") and ":" not in args.target:
        if args.default is not None:
            raise CLIError("--default applies to a model target, not to a plan file.")
        try:
            return PrecisionPlan.from_json(Path(args.target).read_text())
        except OSError as e:
            raise CLIError(f"Cannot read {args.target!r}: {e.strerror or e}") from e
        except ValueError as e:
            raise CLIError(f"{args.target}: {e}") from e
    try:
        default = None if args.default is None else as_policy(args.default, argument="--default")
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from e
    return resolve(load_target(args.target), default)


def _cmd_report(args: argparse.Namespace) -> int:
    plan = _plan(args)
    args.emit(plan.to_json() if args.json else plan)
    if args.memory is not None:
        try:
            figure = plan.memory(args.memory)
        except ValueError as e:
            raise CLIError(f"--memory: {e}") from e
        args.emit(("\n" if not args.json else "") + str(figure))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    # deferred: the core reaches an adapter only for the backend asked about
    from precision_annot.adapters import deepspeed as ds_adapter

    plan = _plan(args)
    try:
        config = ds_adapter.to_config(plan, args.base)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from e
    text = json.dumps(config, indent=2) + "\n"
    print("precision-annot: note: call precision_annot.adapters.deepspeed.prepare(model) before "
          "deepspeed.initialize: it applies the plan and sets each parameter's comm_dtype, which "
          "this config relies on. Without it DeepSpeed runs every module as the config alone "
          "says.", file=sys.stderr)
    if args.output is None:
        args.emit(text, end="")
        return 0
    try:
        Path(args.output).write_text(text)
    except OSError as e:
        raise CLIError(f"Cannot write {args.output!r}: {e.strerror or e}") from e
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    model = load_target(args.target)
    try:
        default = None if args.default is None else as_policy(args.default, argument="--default")
        plan = resolve(model, default) if args.plan is None else PrecisionPlan.from_json(
            Path(args.plan).read_text())
        apply(model, plan)
    except (OSError, TypeError, ValueError) as e:
        raise CLIError(str(e)) from e
    sample = load_object(args.sample)
    try:
        with audit(model) as report:
            step(model, sample, backward=not args.forward_only)
    except Exception as e:
        raise CLIError(f"Running the model on {args.sample} failed: {type(e).__name__}: {e}"
                       ) from e
    args.emit(report)
    return 1 if report.divergences else 0


def _loss(args: argparse.Namespace, shape: str) -> Any:
    """The callable `--loss` names, or None."""
    if args.loss is None:
        return None
    loss_fn = load_object(args.loss, call=False)
    if not callable(loss_fn):
        raise CLIError(f"--loss {args.loss} must name a callable: {shape}.")
    return loss_fn


def _cmd_suggest(args: argparse.Namespace) -> int:
    model = load_target(args.target)
    sample = load_object(args.sample)
    loss_fn = _loss(args, "output -> loss")
    try:
        found = suggest(model, sample, low=args.low, loss_fn=loss_fn, tolerance=args.tolerance,
                        measure=args.plot is not None)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from e
    args.emit(found.to_json() if args.json else found)
    for path, text in ((args.out, found.plan.to_json()),):
        if path is not None:
            try:
                Path(path).write_text(text + "\n")
            except OSError as e:
                raise CLIError(f"Cannot write {path!r}: {e.strerror or e}") from e
            print(f"wrote the plan to {path}", file=sys.stderr)
    if args.plot is not None:
        try:
            found.plot(args.plot)
        except ImportError as e:
            raise CLIError(str(e)) from e
        print(f"wrote the plot to {args.plot}", file=sys.stderr)
    return (UNVERIFIED if not found.verified else 0) if found.met else 1


def _cmd_diff(args: argparse.Namespace) -> int:
    model = _model(args)
    sample = load_object(args.sample)
    loss_fn = _loss(args, "(output, sample) -> loss")
    try:
        found = diff(model, sample, loss_fn=loss_fn, tolerance=args.tolerance)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from e
    args.emit(json.dumps(found.to_dict(), indent=2) if args.json else found)
    return 0 if found.first is None else 1


def _cmd_watch_report(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.is_file():
        raise CLIError(f"watch-report: no file at {args.path!r}.")
    try:
        args.emit(report(path, top=args.top))
    except (ValueError, KeyError) as e:
        raise CLIError(f"watch-report: {args.path} is not a file watch(path=...) wrote: "
                       f"{type(e).__name__}: {e}") from e
    if args.plot is not None:
        try:
            plot(path, args.plot, top=args.top)
        except ImportError as e:
            raise CLIError(str(e)) from e
        print(f"wrote the plot to {args.plot}", file=sys.stderr)
    return 0


def _check_config(args: argparse.Namespace) -> Any:
    """--config: JSON written inline ('{"units": ["blocks.*"]}'), or a file: DeepSpeed reads
    its file itself (JSON or hjson), the checkpoint backend takes the checkpoint's path; the
    others take a JSON object. For tp, the TP plan's styles are named (`_TP_STYLES`)."""
    if args.config is None:
        return None
    if args.config.lstrip().startswith(("{", "[")):
        try:
            config = json.loads(args.config)
        except json.JSONDecodeError as e:
            raise CLIError(f"--config: not a JSON object: {e}. Received: {args.config!r}") from e
    elif args.backend == "checkpoint":  # the checkpoint itself: a file or a DCP directory
        return {"path": args.config}
    elif not Path(args.config).is_file():
        raise CLIError(f"--config: no file at {args.config!r}.")
    elif args.backend == "deepspeed":
        return args.config
    else:
        try:
            config = json.loads(Path(args.config).read_text())
        except OSError as e:
            raise CLIError(f"Cannot read {args.config!r}: {e.strerror or e}") from e
        except json.JSONDecodeError as e:
            raise CLIError(f"{args.config}: not JSON: {e}") from e
    return _tp_styles(config) if args.backend == "tp" else config


#: the TP styles a JSON config names, as torch's classes (or their short names)
_TP_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel",
              "sequence_parallel": "SequenceParallel"}


def _tp_styles(config: Any) -> Any:
    """A tp config with its `parallelize_plan` written in JSON ({"blocks.0.up": "colwise"}):
    each style name made the torch style it names."""
    tp_plan = config.get("parallelize_plan") if isinstance(config, dict) else None
    if not isinstance(tp_plan, dict):
        return config
    from torch.distributed.tensor import parallel  # deferred: only tp needs it

    styles = {}
    for key, name in tp_plan.items():
        cls = _TP_STYLES.get(name, name) if isinstance(name, str) else ""
        if cls not in _TP_STYLES.values():
            raise CLIError(
                f"--config: parallelize_plan[{key!r}] names a TP style: one of "
                f"{sorted([*_TP_STYLES, *_TP_STYLES.values()])}. Received: {name!r}")
        styles[key] = getattr(parallel, cls)()
    return {**config, "parallelize_plan": styles}


def _cmd_check(args: argparse.Namespace) -> int:
    config = _check_config(args)
    target, model = _check_target(args)  # the user's factory raising is exit status 3
    try:
        found = check(target, args.backend, config)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from e
    del model  # held alive while check ran: backends that need the model (tp, units) see it
    if args.json:
        args.emit(json.dumps([f.to_dict() for f in found], indent=2))
    else:
        for severity in SEVERITIES:
            for finding in (f for f in found if f.severity == severity):
                args.emit(finding)
        counts = [(sum(f.severity == s for f in found), s) for s in SEVERITIES]
        summary = ", ".join(f"{n} {s}{'' if n == 1 else 's'}" for n, s in counts)
        print(f"{summary} ({args.backend or 'any backend'})", file=sys.stderr)
    return 1 if any(f.severity == "error" for f in found) else 0


def _check_target(args: argparse.Namespace) -> tuple[PrecisionPlan, nn.Module | None]:
    """What `check` looks at: the target's plan (resolved with `--default`), and its model,
    which the caller holds while `check` runs so that the plan still reaches it (the modules
    a `units` config or a TP plan selects, a Hugging Face checkpoint's renamed keys); None for
    a plan file."""
    if args.target.endswith(".json") and ":" not in args.target:
        return _plan(args), None
    model = load_target(args.target)
    try:
        default = None if args.default is None else as_policy(args.default,
                                                               argument="--default")
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from e
    return resolve(model, default), model


def _model(args: argparse.Namespace) -> nn.Module:
    """The target's model, with `--default` applied when given."""
    model = load_target(args.target)
    if args.default is not None:
        try:
            apply(model, default=args.default)
        except (TypeError, ValueError) as e:
            raise CLIError(str(e)) from e
    return model


def _cmd_demo(args: argparse.Namespace) -> int:
    # deferred: the demo loads Lightning (seconds to import), which no other command needs
    from precision_annot._src.demo_runner import run_demo

    return run_demo(fast=args.fast, out=args.out)


_MODEL = "package.module:callable or path/to/file.py:callable"
_MODEL_OR_PLAN = "package.module:callable, path/to/file.py:callable, or a plan.json"


def _command(sub: Any, name: str, help: str, func: Any, *, target: str | None = _MODEL_OR_PLAN,
             sample: bool = False, default: bool = True) -> argparse.ArgumentParser:
    """A subcommand with the arguments the model commands share: the target, `--sample`,
    `--default`."""
    command: argparse.ArgumentParser = sub.add_parser(name, help=help)
    if target is not None:
        command.add_argument("target", help=target)
    if sample:
        command.add_argument("--sample", required=True, metavar="TARGET",
                             help="a callable giving a batch: a tensor, a dict of keyword "
                                  "arguments, or (args, kwargs)")
    if default:
        command.add_argument("--default", metavar="SPEC", help="default policy, e.g. bf16-mixed")
    command.set_defaults(func=func)
    return command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precision-annot",
        description="Per-module precision for PyTorch: report plans, audit what runs, suggest "
                    "fp32 islands, check before launch, export configs, demo.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True)
    report = _command(sub, "report", "print the precision plan of a model", _cmd_report)
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.add_argument("--memory", metavar="OPTIMIZER", help="also the bytes of parameters, "
                        "gradients, masters and optimizer state per module, for adamw, adam, "
                        "sgd, rmsprop or adagrad")
    export = sub.add_parser("export", help="export a backend config for a model's plan")
    backends = export.add_subparsers(dest="backend", required=True)
    ds = _command(backends, "deepspeed", "a DeepSpeed config (JSON)", _cmd_export)
    ds.add_argument("--base", metavar="CFG.json", help="your config; its settings win")
    ds.add_argument("-o", "--output", metavar="OUT.json", help="write here instead of stdout")
    aud = _command(sub, "audit", "apply the plan, run one step, and report every dtype that "
                   "differs from the plan (exit status 1 if any)", _cmd_audit, target=_MODEL,
                   sample=True)
    aud.add_argument("--plan", metavar="PLAN.json", help="apply this plan instead of resolving")
    aud.add_argument("--forward-only", action="store_true", help="skip the backward")
    sug = _command(sub, "suggest", "find the fp32 islands a model needs in fp16 or bf16, "
                   "verified end to end (exit status 1 if none meets the tolerance, "
                   f"{UNVERIFIED} if the plan met it but no held-out batch or too small a "
                   "sample could verify it)",
                   _cmd_suggest, target=_MODEL, sample=True, default=False)
    sug.add_argument("--low", default="bf16", metavar="SPEC",
                     help="everything else runs in this: bf16, fp16, bf16-mixed, 16-mixed "
                          "(default: bf16)")
    sug.add_argument("--tolerance", type=float, metavar="X",
                     help="largest relative error end to end (default: "
                          f"{DEFAULT_TOLERANCE[torch.float16]:g} fp16, "
                          f"{DEFAULT_TOLERANCE[torch.bfloat16]:g} bf16, {FP8_TOLERANCE:g} fp8)")
    sug.add_argument("--loss", metavar="TARGET",
                     help="a function output -> loss: then gradients are checked too")
    sug.add_argument("--out", metavar="PLAN.json", help="write the suggested plan here")
    sug.add_argument("--plot", metavar="FILE.png", help="write the sensitivity chart here")
    sug.add_argument("--json", action="store_true", help="print the suggestion as JSON")
    chk = _command(sub, "check", "say before launch what a backend will ignore, refuse or run "
                   "badly (exit status 1 if there is an error)", _cmd_check)
    chk.add_argument("--backend", choices=BACKENDS,
                     help="the backend you will launch with (default: what holds for all)")
    chk.add_argument("--config", metavar="CFG.json",
                     help="the backend's config, a file or a JSON object inline: deepspeed: "
                          "the config it will get (JSON or hjson); lightning: the Trainer's "
                          "arguments; checkpoint: the checkpoint's path (or '{\"path\": "
                          "...}'); the others: the keys check() takes for them (a key it "
                          "does not take is refused, naming those it does)")
    chk.add_argument("--json", action="store_true", help="print the findings as JSON")
    dif = _command(sub, "diff", "one step of the plan beside the same step in fp32, module by "
                   "module; names the first module past the tolerance (exit status 1 if one "
                   "is)", _cmd_diff, target=_MODEL, sample=True)
    dif.add_argument("--loss", metavar="TARGET",
                     help="a function (output, sample) -> loss (default: a fixed projection "
                          "of the outputs, each weighted by a fixed pattern of values in [-1, 1), "
                          "not their sum)")
    dif.add_argument("--tolerance", type=float, metavar="X",
                     help="relative error a module passes to be named (default: "
                          f"{DIFF_TOLERANCE[torch.float16]:g} fp16, "
                          f"{DIFF_TOLERANCE[torch.bfloat16]:g} bf16, {WIDE_TOLERANCE:g} wider)")
    dif.add_argument("--json", action="store_true", help="print the report as JSON")
    rep = sub.add_parser("watch-report", help="the modules closest to their dtype's limits in "
                         "a file precision_annot.watch(path=...) wrote")
    rep.add_argument("path", help="the JSON-lines file")
    rep.add_argument("--top", type=int, default=10, help="how many modules (default: 10)")
    rep.add_argument("--plot", metavar="FILE.png", help="draw their largest magnitudes over "
                     "the steps against each dtype's range (needs matplotlib)")
    rep.set_defaults(func=_cmd_watch_report)
    demo = _command(sub, "demo", "annotate, plan and train a small transformer", _cmd_demo,
                    target=None, default=False)
    demo.add_argument("--fast", action="store_true", help="fewer steps")
    demo.add_argument("--out", default="demo-output", help="where to write the DeepSpeed config")
    return parser


#: suggest's exit status when its plan met the tolerance only on the data it was chosen on
UNVERIFIED = 4
#: the exit status when the code a command runs (the model, a loader) raises: distinct from 1
#: (an error found, a divergence, no plan met) and 2 (bad input)
CRASHED = 3


@contextlib.contextmanager
def results_only(on: bool = True) -> Iterator[Callable[..., None]]:
    """Keep stdout for the command's result: while it runs, whatever else writes to stdout
    (DeepSpeed's logger saying "Setting accelerator to CPU", a print in the user's model) goes
    to stderr, at the file descriptor as well as `sys.stdout`, so `--json` output parses. Yields
    the function that writes the result to the real stdout."""
    real = sys.stdout
    if not on:
        yield functools.partial(print, file=real, flush=True)
        return
    try:
        fd: int | None = real.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured)
        fd = None
    saved = None
    if fd is not None:
        real.flush()
        saved = os.dup(fd)
        os.dup2(2, fd)
    out = os.fdopen(saved, "w", closefd=False) if saved is not None else real
    sys.stdout = sys.stderr
    try:
        yield functools.partial(print, file=out, flush=True)
    finally:
        sys.stdout.flush()
        sys.stdout = real
        if saved is not None and fd is not None:
            os.dup2(saved, fd)
            os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # targets import from the current directory, as with -m
    parser = _parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            with results_only(args.command != "demo") as emit:
                args.emit = emit
                status = int(args.func(args))
        except CLIError as e:
            status = 2
            error = str(e)
        except KeyboardInterrupt:
            raise
        except BrokenPipeError:  # `precision-annot report ... | head` closed the pipe
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the exit's flush does not raise again
            return 128 + 13  # as a process stopped by SIGPIPE
        except Exception as e:  # the user's model (or a loader) raised: not "no plan met" (1)
            import traceback

            traceback.print_exc(file=sys.stderr)
            status = CRASHED
            error = (f"{type(e).__name__} raised while running the command (the traceback is "
                     f"above): {e}"[:2000])
        else:
            error = ""
    for w in caught:
        if issubclass(w.category, UserWarning) and "precision_annot" in w.filename:
            print(f"precision-annot: warning: {w.message}", file=sys.stderr)
    if error:
        print(f"precision-annot: error: {error}", file=sys.stderr)
    return status
