"""The one protocol `check` asks every backend through, and where each backend lives.

How to add a backend (a `tp` backend, say):

1. Beside the adapter's export code (`adapters/tp.py`, or `adapters/<name>/checks.py` where
   the adapter is a package), subclass `CheckBackend` and make one instance::

       class TPChecks(CheckBackend):
           name = "tp"
           keys = ("mesh", *LOOP_KEYS)        # the option keys a config dict may hold: once

           def run(self, given: Subject, options: Any) -> Checked:
               return Checked(findings, comm=reduced_in, stored=stored_in)

       CHECKS = TPChecks()

   `options` is what `CheckBackend.options` made of the config the user gave: with `keys` set,
   a dict holding only those keys (an unknown key is a `ValueError` listing the valid ones);
   with `keys = None`, the config is the backend's own format (DeepSpeed's config, the
   Trainer's keyword arguments), and the backend overrides `options` to read it as the backend
   reads it. `LOOP_KEYS` are the training loop's (`grad_scaler`, `optimizer`, `fp8`): `check`
   reads them itself for every backend that lists them.
2. `run` returns its findings and, where it knows them, the dtype it reduces each module's
   gradients in (`comm`) and stores its parameters in (`stored`). For a backend that trains
   (`trains = True`, the default) `check` adds, from those, the numerics that hold for every
   training backend, the loop's findings and the fp8 findings. A backend that is no training
   run (`checkpoint`) sets `trains = False` and says only its own.
3. Name it in `REGISTRY` below (`"tp": "precision_annot.adapters.tp:CHECKS"`). It is imported
   only when asked for, so the core imports no adapter, and `BACKENDS` lists it.
4. Test each finding against the backend really run (tests/adapters/...), not a mock.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from precision_annot._src.findings import Finding
from precision_annot._src.runtime import Subject

__all__ = ["BACKENDS", "LOOP_KEYS", "REGISTRY", "CheckBackend", "Checked", "backend_for"]

#: where each backend's `CheckBackend` instance lives, as "module:attribute"
REGISTRY: dict[str, str] = {
    "local": "precision_annot._src.check_backend:LOCAL",
    "deepspeed": "precision_annot.adapters.deepspeed.checks:CHECKS",
    "fsdp": "precision_annot.adapters.fsdp.checks:FSDP2_CHECKS",
    "fsdp1": "precision_annot.adapters.fsdp.checks:FSDP1_CHECKS",
    "ddp": "precision_annot.adapters.ddp:CHECKS",
    "lightning": "precision_annot.adapters.lightning.checks:CHECKS",
    "tp": "precision_annot.adapters.tp.checks:CHECKS",
    "checkpoint": "precision_annot._src.checkpoints.checks:CHECKS",
}
BACKENDS: tuple[str, ...] = tuple(REGISTRY)

#: the training loop's options, read by `check` for each backend whose `keys` list them:
#: `grad_scaler=True` (the loop scales the loss), `optimizer` (the optimizer it steps), `fp8`
#: ("apply", the default: `apply` converts the fp8 layers; "accelerate": Accelerate does, from
#: `adapters.fp8.ao_recipe_kwargs`)
LOOP_KEYS: tuple[str, ...] = ("grad_scaler", "optimizer", "fp8")
FP8_CONVERTERS = ("apply", "accelerate")


@dataclasses.dataclass(frozen=True)
class Checked:
    """What a backend says about a plan.

    Attributes:
        findings: its own findings.
        comm: the dtype it reduces each parameter-holding module's gradients in, where known
            (None: not known, e.g. another comm hook).
        stored: the dtype it stores each module's parameters in, where it differs from the
            plan's own (None: as planned).
    """

    findings: list[Finding]
    comm: Mapping[str, torch.dtype] | None = None
    stored: Mapping[str, torch.dtype] | None = None


class CheckBackend:
    """One backend `check` can ask: its name, the option keys its config may hold, and `run`."""

    #: the name `check(..., backend=name)` takes
    name: ClassVar[str] = ""
    #: the keys a config dict may hold; None: the config is the backend's own (override
    #: `options`)
    keys: ClassVar[tuple[str, ...] | None] = ()
    #: whether it is a training run: then `check` adds the numerics, loop and fp8 findings
    trains: ClassVar[bool] = True

    def options(self, config: Any) -> Any:
        """The options `run` reads, from the config given to `check`; bad input raises
        (`ValueError` for an unknown key, `TypeError` for a config that is not a dict)."""
        if config is None:
            return None
        keys = self.keys or ()
        if not keys:
            raise ValueError(
                f"check: backend={self.name!r} takes no config. Received: config={config!r}")
        if not isinstance(config, Mapping):
            raise TypeError(f"check: config for backend={self.name!r} is a dict with keys "
                            f"{list(keys)}. Received: {config!r}")
        unknown = sorted(set(config) - set(keys), key=str)
        if unknown:
            raise ValueError(f"check: config for backend={self.name!r} has unknown key "
                             f"{unknown[0]!r}; valid: {list(keys)}.")
        if config.get("fp8", "apply") not in FP8_CONVERTERS:
            raise ValueError(f"check: config 'fp8' says who converts the fp8 layers, one of "
                             f"{list(FP8_CONVERTERS)}. Received: fp8={config['fp8']!r}")
        if not isinstance(config.get("grad_scaler", False), bool):
            raise TypeError("check: config 'grad_scaler' is True when the training loop scales "
                            "the loss, else False. Received: grad_scaler="
                            f"{config['grad_scaler']!r} (of type "
                            f"{type(config['grad_scaler']).__name__})")
        return dict(config)

    def loop(self, options: Any) -> dict[str, Any]:
        """The training loop's options (`LOOP_KEYS`) among `options`, for a backend that lists
        them; {} for one whose config is its own (a DeepSpeed config's `optimizer` section is
        DeepSpeed's)."""
        listed = [k for k in LOOP_KEYS if k in (self.keys or ())]
        if not listed or not isinstance(options, Mapping):
            return {}
        return {k: options[k] for k in listed if k in options}

    def run(self, given: Subject, options: Any) -> Checked:
        """What this backend will refuse, narrow, widen or run badly for `given.plan` (and
        `given.model`, the model inside any wrapper, where there is one)."""
        raise NotImplementedError

    def without_loop(self, options: Any) -> dict[str, Any]:
        """`options` less the training loop's keys: what the adapter's own functions take."""
        return {k: v for k, v in (options or {}).items() if k not in LOOP_KEYS}


class LocalChecks(CheckBackend):
    """One process, no wrapper: only what holds for every backend."""

    name = "local"
    keys = LOOP_KEYS

    def run(self, given: Subject, options: Any) -> Checked:
        return Checked([])


LOCAL = LocalChecks()

_LOADED: dict[str, CheckBackend] = {}


def backend_for(name: str) -> CheckBackend:
    """The backend named `name`, its module imported on first use."""
    if name not in REGISTRY:
        raise ValueError(f"check: backend must be None or one of {list(BACKENDS)}. "
                         f"Received: backend={name!r}")
    if name not in _LOADED:
        module_name, _, attribute = REGISTRY[name].partition(":")
        found = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(found, CheckBackend) or found.name != name:
            raise TypeError(f"{REGISTRY[name]} is not the CheckBackend named {name!r}: "
                            f"{found!r}")
        _LOADED[name] = found
    return _LOADED[name]
