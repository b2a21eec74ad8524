"""Selectors, as `annotate` and `fsdp.fully_shard(units=...)` take them.

A selector is a qualified module name (exact, or an fnmatch glob matched against the whole
name), an `nn.Module` subclass (isinstance), a module instance (identity), or a predicate
`(name, module) -> bool`. `Matcher` is the compiled form: it selects, and it explains a
selector that matches nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import TypeAlias

from torch import nn

__all__ = ["Matcher", "Named", "Selector", "matcher"]

Selector: TypeAlias = str | type[nn.Module] | nn.Module | Callable[[str, nn.Module], bool]
Named: TypeAlias = Sequence[tuple[str, nn.Module]]

_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclasses.dataclass(frozen=True)
class Matcher:
    """A compiled selector.

    Attributes:
        label: how messages name it, e.g. "glob 'enc.*'".
        kind: "name", "glob", "class", "instance" or "predicate".
        test: `(name, module) -> bool`.
    """

    label: str
    kind: str
    test: Callable[[str, nn.Module], bool]

    def select(self, named: Named, *, rule: str = "") -> list[tuple[str, nn.Module]]:
        """The (name, module) pairs it matches; an error raised by a predicate is re-raised
        with `rule` and the module named."""
        hits = []
        for name, module in named:
            try:
                hit = self.test(name, module)
            except Exception as e:
                if not _rewrappable(e):
                    raise
                raise type(e)(
                    f"{rule or self.label} raised on module {name or '(root)'!r}: "
                    f"{type(e).__name__}: {e}"
                ) from e
            if hit:
                hits.append((name, module))
        return hits

    def no_match(self, named: Named, what: str) -> str:
        """Why nothing matched, with the closest names or the classes there are."""
        names = [n for n, _ in named]
        if self.kind in ("name", "glob"):
            text = self.label.split(" ", 1)[1].strip("'\"")
            leaves = [n for n in names if n.rsplit(".", 1)[-1] == text]
            if leaves:
                shown = ", ".join(repr(n) for n in leaves[:3]) + (", ..." if len(leaves) > 3
                                                                  else "")
                hint = (f"{len(leaves)} modules end in {text!r} ({shown}): a selector matches "
                        f"the whole name, so write the glob {'*.' + text!r} to select them all.")
            else:
                close = difflib.get_close_matches(text, [n for n in names if n], n=5,
                                                  cutoff=0.4)
                hint = (f"Closest module names: {', '.join(repr(c) for c in close)}" if close
                        else f"Module names start with: {', '.join(repr(n) for n in names[1:6])}")
        elif self.kind == "instance":
            hint = "The module instance is not part of this model."
        else:
            types = sorted({type(m).__qualname__ for _, m in named})
            hint = f"Module classes in the model: {', '.join(types[:10])}"
        return f"{what}: the {self.label} matches no module. {hint}"


def matcher(selector: object) -> Matcher:
    """Compile a selector; anything that is not one raises `TypeError` listing what is."""
    if isinstance(selector, nn.Module):
        target = selector
        return Matcher(f"instance {type(target).__qualname__}", "instance",
                       lambda _n, m: m is target)
    if isinstance(selector, str):
        if _GLOB_CHARS.search(selector):
            _check_glob(selector)
            regex = re.compile(fnmatch.translate(selector))
            return Matcher(f"glob {selector!r}", "glob",
                           lambda name, _m: regex.match(name) is not None)
        return Matcher(f"name {selector!r}", "name", lambda name, _m: name == selector)
    if isinstance(selector, type):
        if not issubclass(selector, nn.Module):
            raise TypeError(
                "A class selector must be an nn.Module subclass. "
                f"Received: selector={selector.__qualname__}"
            )
        cls = selector
        return Matcher(f"class {cls.__qualname__}", "class", lambda _n, m: isinstance(m, cls))
    if callable(selector):
        fn: Callable[[str, nn.Module], bool] = selector
        return Matcher(f"predicate {selector!r}", "predicate", lambda name, m: bool(fn(name, m)))
    raise TypeError(
        "A selector is a module name or glob (str), an nn.Module subclass, a module instance, "
        f"or a predicate (name, module) -> bool. Received: selector={selector!r} "
        f"(of type {type(selector).__name__})"
    )


def _check_glob(pattern: str) -> None:
    depth = 0
    for ch in pattern:
        if ch == "[":
            if depth:
                raise ValueError(f"Invalid glob {pattern!r}: nested '['.")
            depth = 1
        elif ch == "]" and depth:
            depth = 0
    if depth:
        raise ValueError(
            f"Invalid glob {pattern!r}: '[' is never closed. Globs use fnmatch syntax: "
            "*, ?, [seq], [!seq]."
        )


def _rewrappable(error: Exception) -> bool:
    """True when `type(error)(message)` builds the same kind of error with a new message."""
    try:
        return type(error)("probe").args == ("probe",)
    except Exception:
        return False
