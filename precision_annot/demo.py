"""`precision-annot demo`: the main job, on CPU."""

from __future__ import annotations

from precision_annot._demo import build_model
from precision_annot.resolution import resolve


def run_demo(*, fast: bool = False) -> int:
    model = build_model()
    plan = resolve(model)
    print("The plan of a small transformer annotated three ways:")
    print("  @precision(fp32) on the Norm class, precision_scope(compute=bf16, storage=fp32)")
    print("  around construction, and annotate(model, {'head': 'compute=fp32,output=fp32'}).\n")
    print(plan)
    return 0
