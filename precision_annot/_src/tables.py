"""Text tables: what `str()` of a plan, an audit report or a memory figure prints."""

from __future__ import annotations

__all__ = ["format_table", "human_bytes"]


def format_table(rows: list[tuple[str, ...]], right: set[int] | frozenset[int] = frozenset()
                 ) -> list[str]:
    """Rows as aligned text lines: the header, a rule, then the rest; `right` columns align
    right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w)
                  for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
