"""The numbers `suggest` runs by: default tolerances, the island policy, limits."""

from __future__ import annotations

import torch

from precision_annot._src.dtypes import fp16, fp32
from precision_annot._src.policy import Policy

#: gradients of a model with no hot spot, all in the low dtype, measure 6e-3 (fp16) and 2e-2
#: (bf16) on benchmarks/suggest.py's 6-layer LM.
DEFAULT_TOLERANCE = {fp16: 2e-2, torch.bfloat16: 1e-1}
FP8_TOLERANCE = 2e-1
ISLAND = Policy(compute=fp32, storage=fp32, comm=fp32)
FP16_SMALLEST = 2.0 ** -24  # the smallest fp16 subnormal: a gradient below it flushes to zero
MAX_CHECKS = 64
MARGIN = 0.5  # the calibration batch is held to this share of the tolerance
#: how far one CPU's kernels move a plan's error from another's: the same plans measured with
#: AVX2 and AVX-512 kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) moved a gradient error
#: by up to 40% (a T5 with the encoder in fp32: 1.20e-2 and 8.6e-3). A plan within the
#: tolerance whose error misses the margin by less passes it or not by the CPU it runs on
KERNELS = 1.4
MIN_ROWS = 16  # fewer rows (tokens, samples) than this cannot show a model's peaks
SEED = 0  # every run starts from it, so that sampling or noise in a forward repeats
OUTSIDE = "<outside the model>"  # code no module runs: the loss function
