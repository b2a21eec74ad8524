"""precision_annot: declare precision per PyTorch module once, run it on every backend.

Declare with `precision` (class, instance or function), `precision_scope` or `annotate`;
`resolve` computes each module's `Policy` into a `PrecisionPlan`; `apply` makes it real
locally, and `precision_annot.adapters` hand it to Lightning, DeepSpeed, FSDP and DDP.
`audit` proves what ran, `suggest` finds the fp32 islands a model needs, and `check` says
before launch what a backend will ignore, refuse or run badly.
"""

from precision_annot.annotation import annotate, precision
from precision_annot.auditing import audit
from precision_annot.checking import check
from precision_annot.dtypes import bf16, fp16, fp32, fp64
from precision_annot.findings import Finding
from precision_annot.plan import PrecisionPlan
from precision_annot.policy import Policy
from precision_annot.resolution import resolve
from precision_annot.runtime import apply, remove
from precision_annot.scaler import GradScaler
from precision_annot.scope import precision_scope
from precision_annot.suggestion import suggest
from precision_annot.version import VERSION

__all__ = [
    "fp64",
    "fp32",
    "fp16",
    "bf16",
    "Policy",
    "precision",
    "precision_scope",
    "annotate",
    "resolve",
    "apply",
    "remove",
    "PrecisionPlan",
    "audit",
    "GradScaler",
    "suggest",
    "check",
    "Finding",
]

__version__ = VERSION
