"""The complexity gate of `make lint`: no function above radon's cyclomatic complexity 15
(which counts `and` and `or` too), except those in tools/complexity-baseline.txt, each at or
below the score listed there.

The baseline is a ratchet: a listed function that rises fails, and so does an entry that is no
longer needed (the function is gone or at 15 or below), so that the list only shrinks.

Run: `python tools/complexity.py [PATH ...]` (default: precision_annot); `--write` rewrites
the baseline from what is there now.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from radon.complexity import cc_visit

LIMIT = 15
ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tools" / "complexity-baseline.txt"


def scores(paths: list[Path]) -> dict[str, int]:
    """Each function and method above LIMIT, as "path:Class.function" -> its complexity."""
    out: dict[str, int] = {}
    for base in paths:
        for path in sorted(base.rglob("*.py") if base.is_dir() else [base]):
            rel = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) \
                else path
            for block in cc_visit(path.read_text()):
                name = getattr(block, "fullname", block.name)
                if block.complexity > LIMIT:
                    out[f"{rel}:{name}"] = max(out.get(f"{rel}:{name}", 0), block.complexity)
    return out


def read_baseline(path: Path) -> dict[str, int]:
    entries: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                name, score = line.rsplit(maxsplit=1)
                entries[name] = int(score)
    return entries


def problems(found: dict[str, int], allowed: dict[str, int]) -> list[str]:
    out = []
    for name, score in sorted(found.items()):
        if name not in allowed:
            out.append(f"{name}: complexity {score}, above {LIMIT}: split it")
        elif score > allowed[name]:
            out.append(f"{name}: complexity {score}, up from {allowed[name]} in the baseline")
    for name, score in sorted(allowed.items()):
        if name not in found:
            out.append(f"{name}: listed at {score} but now at {LIMIT} or below (or gone): "
                       "remove it from the baseline")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[ROOT / "precision_annot"])
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--write", action="store_true", help="rewrite the baseline")
    args = parser.parse_args(argv)
    found = scores(args.paths)
    if args.write:
        args.baseline.write_text(
            f"# functions above radon complexity {LIMIT}, each not to rise; the list only "
            "shrinks (tools/complexity.py)\n"
            + "".join(f"{name} {score}\n" for name, score in sorted(found.items())))
        return 0
    bad = problems(found, read_baseline(args.baseline))
    for line in bad:
        print(line, file=sys.stderr)
    if not bad:
        print(f"complexity: no function above {LIMIT} outside the baseline "
              f"({len(found)} listed)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
