"""DeepSpeed: export the precision sections of a config, prepare the model before `initialize`,
and say before launch what DeepSpeed will do with a config.

- `export.py`: `translate`, `to_config`, `prepare` (the plan as DeepSpeed can run it).
- `checks.py`: `findings`, `reduced` and the `check` backend, worked out by the same code.
- `buffers.py`: which buffers DeepSpeed holds in which dtype (`data_types.keep_in_fp32_modules`,
  `buffer_dtype`), which both ask.
"""

from precision_annot.adapters.deepspeed.checks import (
    findings,
    given_config,
    read_config,
    reduced,
    refused,
    unresolved_auto,
)
from precision_annot.adapters.deepspeed.export import (
    DeepSpeedPlan,
    prepare,
    to_config,
    translate,
)

__all__ = ["DeepSpeedPlan", "findings", "given_config", "prepare", "read_config", "reduced",
           "refused", "to_config", "translate", "unresolved_auto"]
