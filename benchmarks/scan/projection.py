"""Modeled communication of one step of a large model's gradient allreduce, per method.

Nothing is compiled: these are alpha-beta figures from the gradient shapes
(:mod:`jaxcomm.costmodel`), one collective per leaf and phase, for ``H`` hosts of ``G``
devices. Each function returns a :class:`Comm`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from jaxcomm import costmodel
from jaxcomm.accounting import ring_cost
from jaxcomm.compress.powersgd import compression_rate, matrix_shape

Shape = tuple[int, ...]


class Comm(NamedTuple):
  """Bytes each device sends per step on each link, and the modeled seconds.

  Attributes:
    slow_bytes: over the inter-host link.
    fast_bytes: over the intra-host link.
    seconds: modeled communication time, the phases one after another.
  """
  slow_bytes: float
  fast_bytes: float
  seconds: float


def flat_fp32(shapes: Iterable[Shape], hosts: int, local: int, fast, slow) -> Comm:
  """A plain fp32 ``pmean`` over all ``H G`` devices: one ring per leaf, on the slow link.

  With ``H = 1`` the ring never leaves the host and runs on the fast link.
  """
  devices = hosts * local
  on = slow if hosts > 1 else fast
  shapes = list(shapes)
  nbytes = sum(ring_cost("all-reduce", 4 * math.prod(shape), devices).nbytes for shape in shapes)
  seconds = math.fsum(costmodel.all_reduce_time(4 * math.prod(shape), devices, on)
                      for shape in shapes)
  return Comm(nbytes if hosts > 1 else 0.0, 0.0 if hosts > 1 else nbytes, seconds)


def hierarchical(shapes: Iterable[Shape], hosts: int, local: int, fast, slow, compressor,
                 strategy: str | None) -> Comm:
  """Dense reduce-scatter / all-gather inside hosts, ``compressor`` across them:
  :func:`jaxcomm.costmodel.project`, whose slow axis runs the strategy
  :func:`jaxcomm.compressed_allreduce` resolves (``strategy=None``: its automatic choice)
  and is costed by that strategy's ``cost``."""
  result = costmodel.project(list(shapes), hosts, local, fast, slow, compressor,
                             strategy=strategy)
  return Comm(result.slow_bytes, result.fast_bytes, result.total_seconds)


def powersgd(shapes: Iterable[Shape], hosts: int, local: int, fast, slow, rank: int,
             min_compression_rate: float = 2.0) -> Comm:
  """:func:`jaxcomm.powersgd_allreduce`: dense ``psum`` of every leaf inside hosts; across
  hosts, for the leaves viewed as ``m x n`` matrices whose rate reaches
  ``min_compression_rate``, one ``psum`` of the stacked ``P`` (``4 r m`` bytes per leaf) and
  one of the stacked ``Q`` (``4 r n``) per distinct matrix shape; other leaves dense."""
  fast_bytes = slow_bytes = seconds = 0.0
  stacked: dict[tuple[int, int], int] = {}
  messages = []
  for shape in shapes:
    size = 4 * math.prod(shape)
    fast_bytes += ring_cost("all-reduce", size, local).nbytes
    seconds += costmodel.all_reduce_time(size, local, fast)
    if len(shape) >= 2 and compression_rate(tuple(shape), rank) >= min_compression_rate:
      matrix = matrix_shape(tuple(shape))
      stacked[matrix] = stacked.get(matrix, 0) + 1
    else:
      messages.append(size)
  for (rows, cols), count in stacked.items():
    messages += [4 * rank * rows * count, 4 * rank * cols * count]
  slow_bytes = sum(ring_cost("all-reduce", m, hosts).nbytes for m in messages)
  seconds += math.fsum(costmodel.all_reduce_time(m, hosts, slow) for m in messages)
  return Comm(slow_bytes, fast_bytes, seconds)
