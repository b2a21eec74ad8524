"""A one-line progress bar on stderr."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    """A one-line progress display on stderr, for long runs."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.shown = False

    def update(self, what: str, i: int, n: int) -> None:
        if self.enabled:
            width = 24
            filled = int(width * i / max(n, 1))
            self.stream.write(f"\rsuggest: {what} [{'#' * filled}{'.' * (width - filled)}] "
                              f"{i}/{n}   ")
            self.stream.flush()
            self.shown = True

    def done(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()
            self.shown = False
