"""The reference of PowerSGD's orthogonalization tests."""

import numpy as np


def gram_schmidt_float64(p, epsilon=1e-8):
  """The textbook modified Gram-Schmidt of ``p``'s columns (``(m, r)``) with ``norm +
  epsilon``, in float64."""
  columns = []
  for index in range(p.shape[1]):
    column = np.asarray(p[:, index], np.float64)
    for previous in columns:
      column = column - np.dot(previous, column) * previous
    columns.append(column / (np.linalg.norm(column) + epsilon))
  return np.stack(columns, axis=1)
