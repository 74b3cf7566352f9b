"""benchmarks.classification shortened to one seed, one mesh and one optimizer: the
combinations that diverged or lost accuracy before docs/quality.md's fix (scaled sign and
top-1% with the default feedback and strategy, SGD with momentum 0.9 at fp32's learning rate,
8 hosts; seed 1, where classic sign error feedback with two-phase diverged at step ~195) train
without divergence and end within a stated margin of fp32's held-out accuracy."""

import numpy as np
import pytest

from benchmarks.classification import train

pytest.importorskip("sklearn")

STEPS = 300  # the benchmark's length: top-1% + residuals needs it (120 steps: -3 points)
MESH = (8, 1)
# Points of held-out accuracy behind fp32. Sign + EF21 holds the 1-point target of
# docs/quality.md. Top-1% with residuals does not hold it robustly: its selection flips with
# the last bit of a gradient, so XLA's code for another CPU moves its seed-1 accuracy from
# >= 97.3 (the CPU this test was written on) to 95.54 (AMD EPYC, fp32 identical on both);
# over seeds 0-2 on that CPU it is -1.21 +- 0.86 points (docs/quality.md, section 5). Its
# margin is the measured worst seed plus headroom: an open defect of issue 12, not a target.
MARGIN = {"sign-ef": 1.0, "topk-ef": 3.5}


@pytest.fixture(scope="module")
def fp32():
  return train("fp32", "sgdm", MESH, seed=1, steps=STEPS)


@pytest.mark.parametrize("method", ["sign-ef", "topk-ef"])
def test_compressed_sgd_momentum_matches_fp32(fp32, method):
  result = train(method, "sgdm", MESH, seed=1, steps=STEPS)
  assert np.all(np.isfinite(result.losses))
  # One-batch spikes happen (top-1%: 4.05 from 2.43 at the start); the old mechanism went to
  # 352 (sign, two-phase) and 19.98 (top-1%, two-phase).
  assert result.losses.max() <= result.losses[0] * 2, "the training loss blew up"
  assert result.losses[-10:].mean() < 0.1 * result.losses[0]
  assert 100 * result.accuracy >= 100 * fp32.accuracy - MARGIN[method], (result.accuracy,
                                                                         fp32.accuracy)
