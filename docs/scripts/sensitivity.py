"""Render docs/img/sensitivity.png: suggest's chart for the demo transformer in fp16.

Run from the repository root: `python docs/scripts/sensitivity.py` (tests run it too).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from precision_annot._src.demo_model import TinyTransformer
from precision_annot._src.demo_runner import _batches, next_token_loss
from precision_annot._src.suggest import Suggestion, suggest


def render(out: Path) -> Suggestion:
    torch.manual_seed(0)
    tokens = _batches(1)[0]
    found = suggest(TinyTransformer(), tokens, low="16-mixed", loss_fn=next_token_loss,
                    measure=True)
    found.plot(out)
    return found


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/img/sensitivity.png")
    print(render(target).islands, "->", target)
