"""Where torch changed between the releases the package supports, in one place.

Each seam is keyed on the installed torch's version (`TORCH`), and the rest of the package
asks here instead of testing the version itself: `tests/test_seams.py` runs each branch on
the torch that takes it. The private torch names the package must still reach are listed in
`private.py`, beside the public mechanism considered for each.
"""

from __future__ import annotations

import re

import torch

__all__ = ["CHECKPOINT_GENERATOR", "FLOOR", "NEWEST", "TORCH", "at_least", "parse", "tested"]


def parse(version: str) -> tuple[int, int, int]:
    """`"2.15.0+cu132"` -> `(2, 15, 0)`; pre-releases count as their release
    (`"2.16.0a0+git..."` -> `(2, 16, 0)`)."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


#: the installed torch, (major, minor, patch)
TORCH = parse(torch.__version__)

#: the oldest torch the package supports (pyproject.toml's floor; test_seams checks they agree)
FLOOR = (2, 13, 0)

#: the newest torch the test suite ran on (the second lock, requirements/lock-latest.txt)
NEWEST = (2, 15, 0)


def tested() -> str:
    """The torch releases the package was tested on, for messages: "2.13 to 2.15"."""
    return f"{FLOOR[0]}.{FLOOR[1]} to {NEWEST[0]}.{NEWEST[1]}"


def at_least(major: int, minor: int) -> bool:
    """The installed torch is `major.minor` or newer."""
    return TORCH[:2] >= (major, minor)


#: the generator every non-reentrant `torch.utils.checkpoint` checkpoint starts through: torch
#: 2.14 moved the work to `..._impl` and left the old name as a wrapper that `checkpoint` no
#: longer calls (wrapping the old name there changed nothing, silently)
CHECKPOINT_GENERATOR = ("_checkpoint_without_reentrant_generator_impl" if at_least(2, 14)
                        else "_checkpoint_without_reentrant_generator")
