"""Modeled communication of one step of a large model's gradient allreduce, per method.

Nothing is compiled: these are alpha-beta figures from the gradient shapes
(:mod:`jaxcomm.costmodel`), one collective per leaf and phase (the gather strategy: one
all-gather per step), for ``H`` hosts of ``G`` devices. Each function returns a
:class:`jaxcomm.costmodel.Traffic`, the steps and bytes on each link;
``traffic.seconds(fast_link, slow_link)`` times it on any cluster.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from jaxcomm import costmodel
from jaxcomm.accounting import NO_COST, ring_cost
from jaxcomm._src.collectives.powersgd import block_rows
from jaxcomm._src.compress.powersgd import compression_rate, matrix_shape
from jaxcomm.costmodel import Traffic

Shape = tuple[int, ...]


def flat_fp32(shapes: Iterable[Shape], hosts: int, local: int) -> Traffic:
  """A plain fp32 ``pmean`` over all ``H G`` devices: one ring per leaf, on the slow link.

  With ``H = 1`` the ring never leaves the host and runs on the fast link.
  """
  ring = sum((ring_cost("all-reduce", 4 * math.prod(shape), hosts * local) for shape in shapes),
             NO_COST)
  return Traffic(NO_COST, ring) if hosts > 1 else Traffic(ring, NO_COST)


def hierarchical(shapes: Iterable[Shape], hosts: int, local: int, compressor,
                 strategy: str | None) -> Traffic:
  """Dense reduce-scatter / all-gather inside hosts, ``compressor`` across them:
  :func:`jaxcomm.costmodel.traffic`, whose slow axis runs the strategy
  :func:`jaxcomm.compressed_allreduce` resolves (``strategy=None``: its automatic choice)
  and is costed by that strategy's ``cost``."""
  return costmodel.traffic(list(shapes), hosts, local, compressor, strategy=strategy)


def powersgd(shapes: Iterable[Shape], hosts: int, local: int, rank: int,
             min_compression_rate: float = 2.0) -> Traffic:
  """:func:`jaxcomm.powersgd_allreduce`: leaves viewed as ``m x n`` matrices whose rate
  reaches ``min_compression_rate`` are reduce-scattered by blocks of ``c = ceil(n / G)`` rows
  of ``M^T`` inside hosts and their approximations all-gathered back; per distinct matrix
  shape one ``psum`` of the stacked ``P`` parts (``4 r m`` bytes per leaf) and one of ``r + 1``
  floats per leaf (column norms and a non-finite flag) inside hosts, and across hosts one
  ``psum`` of the stacked ``P`` and one of the stacked blocks of ``Q`` (``4 r c``); other
  leaves dense on both axes (:mod:`jaxcomm.collectives.powersgd`)."""
  fast = NO_COST
  stacked: dict[tuple[int, int], int] = {}
  messages = []
  for shape in shapes:
    if len(shape) >= 2 and compression_rate(tuple(shape), rank) >= min_compression_rate:
      matrix = matrix_shape(tuple(shape))
      stacked[matrix] = stacked.get(matrix, 0) + 1
      padded_bytes = 4 * local * block_rows(matrix[1], local) * matrix[0]
      fast = (fast + ring_cost("reduce-scatter", padded_bytes / local, local)
              + ring_cost("all-gather", padded_bytes, local))
    else:
      fast = fast + ring_cost("all-reduce", 4 * math.prod(shape), local)
      messages.append(4 * math.prod(shape))
  for (rows, cols), count in stacked.items():
    fast = (fast + ring_cost("all-reduce", 4 * rank * rows * count, local)
            + ring_cost("all-reduce", 4 * rank * count, local))
    messages += [4 * rank * rows * count, 4 * rank * block_rows(cols, local) * count]
  return Traffic(fast, sum((ring_cost("all-reduce", m, hosts) for m in messages), NO_COST))
