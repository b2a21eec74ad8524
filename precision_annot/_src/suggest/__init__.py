"""`suggest`: find the fp32 islands a model needs to run in fp16 or bf16, for training.

1. **Measure.** One fp32 reference run (forward, and backward with `loss_fn`) records each
   module's first inputs and output, the largest value its own ops produce, and its parameters'
   gradients. Then each module that runs is run once by itself in `low` on its recorded inputs:
   the relative error of its output, and whether a non-finite value appears inside it.
2. **Choose.** Candidate plans (everything in `low`, some modules in fp32) are run end to end and
   compared with the reference: outputs, and with `loss_fn` the loss and the gradients. Islands
   are added greedily: where a non-finite value first appears, else the next most sensitive
   module; when a value overflows on leaving an island, its parent takes its place. Then each
   island is dropped again if the plan still passes without it.
3. **Return** a `Suggestion`: the islands, the rules, the plan, the table, and what the checks
   measured.

Cost: the reference run, one run of each module by itself (so each level of the module tree
costs about one forward in `low`), and a few end-to-end runs (each a copy of the model, a
forward and, with `loss_fn`, a backward).

The package, one job per module: `pipeline` (the `suggest` call, read as the steps above),
`reference` (the fp32 runs), `watch` (the dispatch mode that books each module's peaks and
non-finite values), `measure` (each module alone), `search` (the end-to-end checks), `choose`
(which islands), `outcome` (met or not, and why), `batches` (calibration and held-out batches),
`records` (a batch and what its fp32 run recorded), `low` (the low policy and fp8's speed
islands), `plans`, `compare`, `report` (the returned types) and `progress`.
"""

from precision_annot._src.suggest.compare import relative_error
from precision_annot._src.suggest.pipeline import suggest
from precision_annot._src.suggest.report import Check, Sensitivity, Suggestion

__all__ = ["Check", "Sensitivity", "Suggestion", "relative_error", "suggest"]
