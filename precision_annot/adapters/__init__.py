"""Backend adapters. Each imports its backend lazily: `precision_annot` itself needs only torch.

- `precision_annot.adapters.deepspeed`: `to_config`, `prepare`.
- `precision_annot.adapters.fsdp`: `fully_shard` (FSDP2); `wrap_policy`, `mixed_precision`
  (FSDP1).
- `precision_annot.adapters.ddp`: `comm_hook`.
- `precision_annot.adapters.tp`: `parallelize_module` (tensor parallel).
- `precision_annot.adapters.dcp`: `LoadPlanner` (torch.distributed.checkpoint).
- `precision_annot.adapters.lightning`: `AnnotatedPrecision`, `FabricAnnotatedPrecision`.
"""
