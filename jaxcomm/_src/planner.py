"""The implementation of :mod:`jaxcomm.planner` (private: import that module)."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src.collectives.strategies import resolve
from jaxcomm._src.compress.base import Compressor
from jaxcomm._src.validation import check_float
from jaxcomm._src.compress.policy import CompressionPolicy, path_string, policy
from jaxcomm._src.compress.quantize import quantize
from jaxcomm._src.compress.sign import sign
from jaxcomm._src.compress.topk import topk
from jaxcomm._src.keys import as_key, check_seed
from jaxcomm._src.links import Link, link


@functools.cache
def default_candidates() -> tuple[Compressor, ...]:
  """int8, 1-bit sign, and top-k at 10%, 1% and 0.1%: the same compressor values on every
  call, so that every :func:`plan` with them reuses one compiled error measurement."""
  return (quantize(8), sign(), topk(0.1), topk(0.01), topk(0.001))


class LeafPlan(NamedTuple):
  """The decision for one gradient leaf.

  Attributes:
    path: the leaf's path (``'dense/kernel'``).
    shape: its shape.
    compressor: the chosen compressor, ``None`` for full precision.
    strategy: the slow-axis strategy ``compressed_allreduce`` will run for it.
    slow_bytes: modeled bytes each device sends over the slow link per step.
    slow_seconds: modeled slow-link seconds per step.
    relative_error: measured ``||C(x) - x|| / ||x||`` on the sample (0 for full precision).
  """
  path: str
  shape: tuple[int, ...]
  compressor: Compressor | None
  strategy: str
  slow_bytes: float
  slow_seconds: float
  relative_error: float


class Plan(NamedTuple):
  """A per-leaf communication plan.

  Attributes:
    leaves: one :class:`LeafPlan` per gradient leaf, in ``jax.tree.leaves`` order.
    policy: a :class:`~jaxcomm.compress.CompressionPolicy` with one exact-path rule per leaf:
      pass it to ``jaxcomm.compressed_allreduce(plan.policy)``.
    dense_seconds: modeled slow-link seconds per step with everything at full precision.
  """
  leaves: tuple[LeafPlan, ...]
  policy: CompressionPolicy
  dense_seconds: float

  @property
  def seconds(self) -> float:
    """Modeled slow-link seconds per step under the plan."""
    return sum(leaf.slow_seconds for leaf in self.leaves)

  def describe(self) -> str:
    """A table of the decisions, one line per leaf, and the totals."""
    lines = [f"{'leaf':<40} {'shape':<16} {'choice':<16} {'strategy':<10} {'slow B':>12} "
             f"{'slow ms':>9} {'rel. error':>10}"]
    for leaf in self.leaves:
      name = "full precision" if leaf.compressor is None else leaf.compressor.name
      lines.append(f"{leaf.path:<40} {str(leaf.shape):<16} {name:<16} {leaf.strategy:<10} "
                   f"{leaf.slow_bytes:>12,.0f} {1e3 * leaf.slow_seconds:>9.3f} "
                   f"{leaf.relative_error:>10.3f}")
    lines.append(f"modeled slow-link time per step: {1e3 * self.seconds:.3f} ms "
                 f"(full precision: {1e3 * self.dense_seconds:.3f} ms)")
    return "\n".join(lines)


def _slow_cost(compressor: Compressor | None, shard: int, hosts: int, slow: Link,
               dtype) -> tuple[str, float, float]:
  """Strategy name and modeled (bytes per device, seconds) of one shard's exchange over the
  slow axis: the strategy ``compressed_allreduce`` resolves, asked for its ``cost``."""
  strategy = resolve(None, compressor, hosts)
  cost = strategy.cost(compressor, shard, hosts, dtype)
  return strategy.name, cost.nbytes, cost.seconds(slow)


@functools.partial(jax.jit, static_argnums=0)
def _round_trip_errors(candidates: tuple[Compressor, ...], flats: list[jax.Array],
                       key: jax.Array) -> jax.Array:
  """``||C(x) - x|| / ||x||`` of each candidate on each flat leaf, ``(candidates, leaves)``.
  Compiled once per candidates and leaf sizes (the candidates are a static argument)."""
  norms = [jnp.linalg.norm(flat) for flat in flats]
  rows = []
  for compressor in candidates:
    row = []
    for flat, norm in zip(flats, norms):
      payload, _ = compressor.encode(flat, compressor.init(flat.shape, flat.dtype), key)
      difference = jnp.linalg.norm(compressor.decode(payload, flat.shape) - flat)
      row.append(jnp.where(norm == 0.0, 0.0, difference / jnp.where(norm == 0.0, 1.0, norm)))
    rows.append(jnp.stack(row))
  return jnp.stack(rows)


def _relative_errors(candidates: Sequence[Compressor], leaves: Sequence[jax.Array],
                     key: jax.Array) -> np.ndarray:
  """``||C(x) - x|| / ||x||`` of one compressed round trip of each flattened leaf under each
  candidate, shape ``(len(candidates), len(leaves))`` (0 for an all-zero leaf). Compiled as
  one program: one per (candidate, leaf) would cost a compilation each, hundreds on a real
  model, and eagerly each of the compressor's operations would be its own compilation."""
  if not candidates or not leaves:
    return np.zeros((len(candidates), len(leaves)))
  return np.asarray(_round_trip_errors(
      tuple(candidates), [leaf.reshape(-1).astype(jnp.float32) for leaf in leaves], key))


def plan(grads, *, hosts: int, local: int, slow_link: Link | str,
         max_error: float = 0.9, candidates: Sequence[Compressor] | None = None,
         seed: int | jax.Array = 0) -> Plan:
  """Per leaf, the candidate with the least modeled slow-link time within ``max_error``.

  The fast (intra-host) phases are the same for every candidate, so only the slow link
  decides. Each candidate's error is measured on the sample gradient leaf; with error
  feedback a biased compressor's error is delayed rather than lost, so the budget is a
  bound on how far each step's update may stray, not on final quality (the default 0.9
  admits top-1% on most gradients; lower it for sensitive runs).

  Args:
    grads: a sample gradient pytree (arrays), e.g. from one step on real data.
    hosts: ``H``, devices on the slow axis.
    local: ``G``, devices per host (each compresses a ``ceil(d/G)`` shard).
    slow_link: the inter-host :class:`~jaxcomm.links.Link` or a preset name (``'100gbe'``).
    max_error: largest admissible relative error, in [0, 1].
    candidates: compressors to consider besides full precision; default
      :func:`default_candidates`.
    seed: int seed or PRNG key (typed or legacy) of the stochastic compressors' error
      measurement.

  Returns:
    A :class:`Plan`; ``print(plan.describe())`` shows it, and
    ``jaxcomm.compressed_allreduce(plan.policy)`` runs it.
  """
  for name, value in (("hosts", hosts), ("local", local)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
  max_error = check_float("max_error", max_error, inclusive=True)
  if max_error > 1.0:
    raise ValueError(f"max_error must be in [0, 1], got {max_error}.")
  slow = link(slow_link) if isinstance(slow_link, str) else slow_link
  if not isinstance(slow, Link):
    raise TypeError(f"slow_link must be a jaxcomm.links.Link or a preset name, got {slow_link!r}.")
  seed = check_seed("seed", seed)
  candidates = default_candidates() if candidates is None else tuple(candidates)
  for candidate in candidates:
    if not isinstance(candidate, Compressor):
      raise TypeError(f"candidates must be jaxcomm.Compressor values, got {candidate!r}.")
  key = as_key(seed)
  named = jax.tree_util.tree_leaves_with_path(grads)
  errors = _relative_errors(candidates, [leaf for _, leaf in named], key)
  decisions, rules, dense_seconds = [], [], 0.0
  for index, (path, leaf) in enumerate(named):
    name, shard = path_string(path), -(-int(np.prod(leaf.shape)) // local)
    dense = LeafPlan(name, tuple(leaf.shape), None,
                     *_slow_cost(None, shard, hosts, slow, leaf.dtype), 0.0)
    dense_seconds += dense.slow_seconds
    best = dense
    for candidate, error in zip(candidates, errors[:, index]):
      strategy, nbytes, seconds = _slow_cost(candidate, shard, hosts, slow, leaf.dtype)
      if seconds < best.slow_seconds and error <= max_error:
        best = LeafPlan(name, tuple(leaf.shape), candidate, strategy, nbytes, seconds,
                        float(error))
    decisions.append(best)
    rules.append((f"^{re.escape(name)}$", best.compressor))
  chooser = policy(None, rules=rules, min_bytes=0, full_precision=())
  return Plan(tuple(decisions), chooser, dense_seconds)
