"""The public surface, adapters that import their backend lazily, and the shape of the package:
no import cycle, no private name imported across modules."""

from __future__ import annotations

import subprocess
import sys

import precision_annot


def test_public_names() -> None:
    assert set(precision_annot.__all__) == {
        "fp64", "fp32", "fp16", "bf16", "Policy", "precision", "precision_scope", "annotate",
        "resolve", "apply", "remove", "PrecisionPlan", "audit", "GradScaler", "suggest",
        "check", "Finding",
        # what those return or raise, and the plan an applied model holds
        "ModulePlan", "AuditReport", "Divergence", "Suggestion", "Severity", "DriftError",
        "applied_plan",
        # the update half: one optimizer for the plan, and the plan's memory figures
        "optimizer", "PlanOptimizer", "MemoryReport",
        # numerics: one step against fp32, and per-module statistics while training
        "diff", "DiffReport", "watch", "WatchRecord",
        # precision over time: a plan that changes at chosen steps
        "schedule", "Schedule",
    }
    for name in precision_annot.__all__:
        assert getattr(precision_annot, name) is not None


def test_core_and_adapters_import_no_backend_until_used() -> None:
    code = (
        "import sys, precision_annot\n"
        "from precision_annot.adapters import ddp, fsdp, deepspeed\n"
        "bad = [m for m in ('lightning', 'deepspeed', 'pytorch_lightning') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert 'torch.distributed.fsdp' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _imports() -> tuple[dict[str, set[str]], list[str]]:
    """The package's own import graph (module -> modules it imports) and its private imports."""
    import ast
    from pathlib import Path

    root = Path(precision_annot.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    private = []
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            source = node.module if isinstance(node, ast.ImportFrom) else None
            if source and source.startswith("precision_annot"):
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    deps.add(full if full in modules else source)
                    if full not in modules and alias.name.startswith("_"):
                        private.append(f"{name} imports {full}")
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph, private


def test_the_package_imports_form_no_cycle_and_no_private_name_crosses_modules() -> None:
    graph, private = _imports()
    assert private == []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join([*path, node, dep])}"
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    # the core needs no adapter; the entry points reach them lazily, for the backend asked about
    core = {n for n in graph if not n.startswith("precision_annot.adapters")}
    for name in core - {"precision_annot._src.cli", "precision_annot._src.demo_runner"}:
        assert not {d for d in graph[name] if d.startswith("precision_annot.adapters")}, name


def test_an_import_of_the_package_inside_a_function_says_why_it_is_deferred() -> None:
    """Imports of the package's own modules sit at the top of a module, except those that
    defer an optional backend or break a cycle, each with a comment saying so."""
    import ast
    from pathlib import Path

    root = Path(precision_annot.__file__).parent
    unexplained = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                own = (isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith(
                    "precision_annot")) or (isinstance(inner, ast.Import) and any(
                        a.name.startswith("precision_annot") for a in inner.names))
                if not own:
                    continue
                said = " ".join(lines[max(0, inner.lineno - 3):inner.lineno])  # a block of two
                if "deferred" not in said and "cycle" not in said:
                    unexplained.append(f"{path.relative_to(root)}:{inner.lineno}")
    assert unexplained == []
