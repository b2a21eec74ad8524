"""Lightning: precision plugins that run the plan, one per file as Lightning's own are.

Lightning has one precision string for the whole model. These plugins take the plan from the
annotations on the LightningModule (or an explicit `plan=`), apply it in `convert_module`, cast
floating tensors in each batch to the root's compute dtype before the batch is moved to the
device (Lightning issue 17727), run `training_step` under the root's autocast state, and use a
`precision_annot.GradScaler` when fp16 is used anywhere (its state is saved in checkpoints).

- `AnnotatedPrecision` (`trainer.py`): the Trainer plugin; single device, DDP, DeepSpeed.
- `AnnotatedDeepSpeedPrecision` (`deepspeed.py`): the Trainer plugin for `DeepSpeedStrategy`.
- `FabricAnnotatedPrecision` (`fabric.py`): the Fabric plugin.
- `AnnotatedFSDPPrecision` (`fsdp.py`): the Trainer plugin for `FSDPStrategy` (FSDP1).
- `WatchCallback` (`watching.py`): `precision_annot.watch`, logged through the Trainer's loggers.
- `ScheduleCallback` (`scheduling.py`): `precision_annot.schedule`, the plan changed at chosen
  optimizer steps, resumed in the saved phase.
"""

try:
    import lightning  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without lightning installed
    raise ImportError(
        "precision_annot.adapters.lightning needs Lightning: "
        "pip install 'precision-annot[lightning]'"
    ) from e

from precision_annot.adapters.lightning.deepspeed import AnnotatedDeepSpeedPrecision
from precision_annot.adapters.lightning.fabric import FabricAnnotatedPrecision
from precision_annot.adapters.lightning.fsdp import AnnotatedFSDPPrecision
from precision_annot.adapters.lightning.scheduling import ScheduleCallback
from precision_annot.adapters.lightning.trainer import AnnotatedPrecision
from precision_annot.adapters.lightning.watching import WatchCallback

__all__ = ["AnnotatedDeepSpeedPrecision", "AnnotatedFSDPPrecision", "AnnotatedPrecision",
           "FabricAnnotatedPrecision", "ScheduleCallback", "WatchCallback"]
