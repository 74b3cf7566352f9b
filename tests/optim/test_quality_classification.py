"""benchmarks.classification shortened to one seed, one mesh and one optimizer: the
combinations that diverged or lost accuracy before docs/quality.md's fixes (scaled sign and
top-1% with the default feedback and strategy, SGD with momentum 0.9 at fp32's learning rate,
8 hosts; seed 1, where classic sign error feedback with two-phase diverged at step ~195; QSGD
with one norm per tensor and unclipped TernGrad, their defaults before section 13, which went
to NaN) train without divergence and end within a stated margin of fp32's held-out accuracy."""

import numpy as np
import pytest

from benchmarks.classification import train

pytest.importorskip("sklearn")

STEPS = 300  # the benchmark's length: top-1% + residuals needs it (120 steps: -3 points)
MESH = (8, 1)
# Points of held-out accuracy behind fp32: the 1-point target of docs/quality.md for both.
# Top-1% held it only with bounded residuals (the default since section 9): with classic
# ones its seed 1 was 95.54 against fp32's 98.33 on this CPU (stale residual bursts into the
# momentum); with the bound, 98.16 +- 0.52 against 98.22 +- 0.45 over seeds 0-4.
MARGIN = {"sign-ef": 1.0, "topk-ef": 1.5, "qsgd": 1.0, "terngrad": 1.0}
# One seed of top-1% moves by more than a point under a change of float rounding alone (its
# selection is discontinuous): seed 1 was 97.21 after top-k's gathered payloads were summed by
# one scatter-add instead of a tree of dense adds, 96.94 with XLA's backend at -O0, about 98
# before, while the mean over seeds 0-4 stayed 98.16 (+- 0.72) against fp32's 98.22 (-0.06
# points; docs/quality.md, section 5). 1.5 points is 2 of its seed-to-seed deviations and
# still fails the classic residuals (-2.79).


@pytest.fixture(scope="module")
def fp32():
  return train("fp32", "sgdm", MESH, seed=1, steps=STEPS)


# QSGD's and TernGrad's defaults (docs/quality.md section 13): one norm per tensor and one
# unclipped scaler per tensor went to NaN on this run (seeds 0-2); buckets of 512 and clipping
# at 2.5 standard deviations hold 1 point (TernGrad seed 1: 98.05 against fp32's 98.33).
@pytest.mark.parametrize("method", ["sign-ef", "topk-ef", "qsgd", "terngrad"])
def test_compressed_sgd_momentum_matches_fp32(fp32, method):
  result = train(method, "sgdm", MESH, seed=1, steps=STEPS)
  assert np.all(np.isfinite(result.losses))
  # The old mechanisms went to 352 (sign, two-phase), 19.98 (top-1%, two-phase) and 3.15
  # (top-1%, classic residuals, seeds 0-4); bounded top-1% stays at the first batch's loss.
  assert result.losses.max() <= result.losses[0] * 2, "the training loss blew up"
  assert result.losses[-10:].mean() < 0.1 * result.losses[0]
  assert 100 * result.accuracy >= 100 * fp32.accuracy - MARGIN[method], (result.accuracy,
                                                                 fp32.accuracy)
