"""The complexity gate of `make lint`: no function or method above radon's cyclomatic
complexity 15 (which counts `and` and `or` too, where ruff's C901 does not).

Run: `python tools/complexity.py [PATH ...]` (default: precision_annot).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from radon.complexity import cc_visit

LIMIT = 15
ROOT = Path(__file__).resolve().parent.parent


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[ROOT / "precision_annot"])
    args = parser.parse_args(argv)
    found = scores(args.paths)
    for name, score in sorted(found.items()):
        print(f"{name}: complexity {score}, above {LIMIT}: split it into named steps",
              file=sys.stderr)
    if not found:
        print(f"complexity: no function above {LIMIT}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
