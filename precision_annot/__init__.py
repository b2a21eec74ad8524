"""precision_annot: declare precision per PyTorch module once, run it on every backend.

Declare with `precision` (class, instance or function), `precision_scope` or `annotate`;
`resolve` computes each module's `Policy` into a `PrecisionPlan`; `apply` makes it real
locally, and `precision_annot.adapters` hand it to Lightning, DeepSpeed, FSDP and DDP.
`audit` proves what ran, `suggest` finds the fp32 islands a model needs, and `check` says
before launch what a backend will refuse, narrow, widen or run badly.

Everything public is named here (and in `precision_annot.adapters`); the implementation lives
in `precision_annot._src`, whose modules are internal.
"""

from precision_annot._src.annotation import annotate, precision
from precision_annot._src.auditing import AuditReport, Divergence, audit
from precision_annot._src.boundary import DriftError
from precision_annot._src.checking import check
from precision_annot._src.diffing import DiffReport, diff
from precision_annot._src.dtypes import bf16, fp16, fp32, fp64
from precision_annot._src.findings import Finding, Severity
from precision_annot._src.memory import MemoryReport
from precision_annot._src.plan import ModulePlan, PrecisionPlan
from precision_annot._src.policy import Policy
from precision_annot._src.resolution import resolve
from precision_annot._src.runtime import applied_plan, apply, remove
from precision_annot._src.scaler import GradScaler
from precision_annot._src.schedule import Schedule, schedule
from precision_annot._src.scope import precision_scope
from precision_annot._src.suggest import Suggestion, suggest
from precision_annot._src.update.optimizer import PlanOptimizer, optimizer
from precision_annot._src.version import VERSION
from precision_annot._src.watching import WatchRecord, watch

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
    "applied_plan",
    "PrecisionPlan",
    "ModulePlan",
    "DriftError",
    "audit",
    "AuditReport",
    "Divergence",
    "GradScaler",
    "suggest",
    "Suggestion",
    "check",
    "Finding",
    "Severity",
    "optimizer",
    "PlanOptimizer",
    "MemoryReport",
    "diff",
    "DiffReport",
    "watch",
    "WatchRecord",
    "schedule",
    "Schedule",
]

__version__ = VERSION
