"""Decentralized gossip over ``ppermute``: exact mixing and CHOCO-SGD compressed gossip."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm._src.compress.base import Compressor
from jaxcomm._src.compress.delta import delta_encode
from jaxcomm._src.keys import as_key, check_seed
from jaxcomm._src.mesh_axes import device_count, device_index, manual_axes
from jaxcomm._src.validation import check_float

GRAPHS = ("ring", "torus", "hypercube", "exponential", "complete", "random")


class GossipState(NamedTuple):
  """State of :func:`gossip`.

  Attributes:
    inner: the inner optimizer's state, device-local.
    public: CHOCO-SGD's public copy ``x_hat_i`` of this device's parameters (what its
      neighbors know of it), device-local; ``None`` for exact gossip.
    neighborhood: CHOCO-SGD's ``s_i = sum_j W_ij x_hat_j`` (self included), device-local;
      ``None`` for exact gossip.
    key: PRNG key shared by all devices (random peers, stochastic compressors).
    count: int32 step counter.
  """
  inner: Any
  public: Any
  neighborhood: Any
  key: jax.Array
  count: jax.Array


def check_mixing_matrix(matrix, atol: float = 1e-6) -> np.ndarray:
  """Returns ``matrix`` as float64 if it is square, non-negative and doubly stochastic."""
  w = np.asarray(matrix, dtype=np.float64)
  if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1:
    raise ValueError(f"mixing_matrix must be a square matrix, got shape {w.shape}.")
  rows, cols = w.sum(axis=1), w.sum(axis=0)
  if np.any(w < 0) or not np.allclose(rows, 1, atol=atol) or not np.allclose(cols, 1, atol=atol):
    raise ValueError("mixing_matrix must be doubly stochastic (non-negative, rows and columns "
                     f"summing to 1); got row sums {rows.round(6).tolist()} and column sums "
                     f"{cols.round(6).tolist()}.")
  return w


def _neighbor_sources(graph: str, shape: tuple[int, ...]) -> list[np.ndarray]:
  """For each permutation of the graph, ``sources[i]``: the device ``i`` receives from."""
  n = int(np.prod(shape))
  index = np.arange(n)
  if graph == "ring":
    shifts = sorted({1 % n, -1 % n} - {0})
    return [(index + s) % n for s in shifts]
  if graph == "complete":
    return [(index + s) % n for s in range(1, n)]
  if graph == "exponential":
    return [(index + 2 ** b) % n for b in range(int(np.ceil(np.log2(n))))] if n > 1 else []
  if graph == "hypercube":
    if n & (n - 1):
      raise ValueError(f"graph='hypercube' needs a power-of-two device count, got {n}.")
    return [index ^ (1 << b) for b in range(n.bit_length() - 1)]
  coords = np.stack(np.unravel_index(index, shape), axis=1)  # torus over the mesh axes
  sources = []
  for axis, size in enumerate(shape):
    for step in sorted({1 % size, -1 % size} - {0}):
      moved = coords.copy()
      moved[:, axis] = (moved[:, axis] + step) % size
      sources.append(np.ravel_multi_index(moved.T, shape))
  return sources


def _uniform(sources: list[np.ndarray], n: int) -> np.ndarray:
  w = np.eye(n) / (len(sources) + 1)
  for src in sources:
    w[np.arange(n), src] += 1 / (len(sources) + 1)
  return w


def _from_matrix(w: np.ndarray) -> list[np.ndarray]:
  n = w.shape[0]
  index = np.arange(n)
  return [(index + s) % n for s in range(1, n) if np.any(w[index, (index + s) % n] > 0)]


def gossip(inner: optax.GradientTransformation, graph: str = "ring", *,
           mixing_matrix=None, compressor: Compressor | None = None,
           consensus_step: float = 1.0,
           seed: int | jax.Array = 0) -> optax.GradientTransformation:
  """Decentralized SGD: a local step of ``inner``, then mixing with neighbors only.

  Exact gossip: ``x_i <- sum_j W_ij x_j^{+}`` over ``x^{+} = x + inner update`` (adapt, then
  combine), with ``W`` doubly stochastic; one ``ppermute`` per neighbor. Graphs over the
  ``N`` devices of the mesh (row-major over its axes): ``'ring'`` (2 neighbors),
  ``'torus'`` (2 per mesh axis of size > 2, 1 per axis of size 2), ``'hypercube'``
  (``log2 N``), ``'exponential'`` (device ``i`` hears ``i + 2^b``, ``ceil(log2 N)`` peers),
  ``'complete'`` (``N - 1``), all with uniform weights ``1 / (degree + 1)``; or
  ``'random'``: each step one peer shift ``s`` drawn from the shared key, ``W = (I + P_s)/2``;
  or any ``mixing_matrix`` (``N x N``, doubly stochastic), sent along the cyclic shifts it
  uses. A complete graph with uniform weights is an allreduce.

  CHOCO-SGD (``compressor`` given): delta compression of the parameters
  (:mod:`jaxcomm.compress.delta`). Each device keeps its public copy ``x_hat_i`` and
  ``s_i = sum_j W_ij x_hat_j``; it sends ``q_i = C(x_i^{+} - x_hat_i)`` to its neighbors,
  ``x_hat_i += q_i``, ``s_i += sum_j W_ij q_j`` and
  ``x_i = x_i^{+} + consensus_step (s_i - x_hat_i)``. ``x^{+} - x_hat`` is the error
  feedback: what a compressed message left out is sent later. Static graphs only.

  Bytes per device per step: ``degree`` ``ppermute`` s of the parameters, ``degree * D``
  (``degree * c`` compressed): set by the number of neighbors, not the number of devices.

  Args:
    inner: device-local optimizer, e.g. ``optax.sgd(0.1)``.
    graph: a name from :data:`GRAPHS`; ignored when ``mixing_matrix`` is given.
    mixing_matrix: an ``N x N`` doubly stochastic matrix, ``W[i, j]`` the weight device ``i``
      gives device ``j``.
    compressor: a stateless :class:`~jaxcomm.Compressor` for CHOCO-SGD; ``None``: exact.
    consensus_step: CHOCO-SGD's ``gamma`` in (0, 1].
    seed: an int seed or a PRNG key (typed ``jax.random.key`` or legacy ``PRNGKey``) of the
      shared key.

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters.

  References:
    Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS
    2017 (D-PSGD); Koloskova, Stich & Jaggi, "Decentralized Stochastic Optimization and Gossip
    Algorithms with Compressed Communication", ICML 2019 (CHOCO-SGD); Assran et al.,
    "Stochastic Gradient Push for Distributed Deep Learning", ICML 2019 (exponential graph).
  """
  matrix = None if mixing_matrix is None else check_mixing_matrix(mixing_matrix)
  if matrix is None and graph not in GRAPHS:
    raise ValueError(f"graph must be one of {', '.join(GRAPHS)}; got {graph!r}.")
  if compressor is not None:
    _check_choco(compressor, random_graph=matrix is None and graph == "random")
  consensus_step = check_float("consensus_step", consensus_step)
  seed = check_seed("seed", seed)
  if consensus_step > 1.0:
    raise ValueError(f"consensus_step must be in (0, 1], got {consensus_step}.")

  def init(params) -> GossipState:
    manual_axes("gossip.init")
    zeros = None if compressor is None else jax.tree.map(jnp.zeros_like, params)
    return GossipState(inner=inner.init(params), public=zeros, neighborhood=zeros,
                       key=as_key(seed), count=jnp.zeros((), jnp.int32))

  def update(grads, state: GossipState, params=None):
    if params is None:
      raise ValueError("gossip needs params in update(grads, state, params).")
    axes = manual_axes("gossip.update")
    steps, inner_state = inner.update(grads, state.inner, params)
    adapted = optax.apply_updates(params, steps)
    key, step_key = jax.random.split(state.key)
    public, neighborhood = state.public, state.neighborhood
    if compressor is None:
      mixed = _exact(adapted, step_key, axes, matrix, graph)
    else:
      mixed, public, neighborhood = _choco(adapted, public, neighborhood, step_key, axes,
                                           _topology(matrix, graph, axes), compressor,
                                           consensus_step)
    updates = jax.tree.map(lambda new, old: (new - old).astype(old.dtype), mixed, params)
    return updates, GossipState(inner=inner_state, public=public, neighborhood=neighborhood,
                                key=key, count=state.count + 1)

  return optax.GradientTransformation(init, update)


def _check_choco(compressor, random_graph: bool) -> None:
  if not isinstance(compressor, Compressor):
    raise TypeError(f"compressor must be a jaxcomm.Compressor or None, got "
                    f"{type(compressor).__name__}.")
  if compressor.stateful:
    raise ValueError(f"compressor must be stateless for CHOCO-SGD; {compressor.name} keeps "
                     "state.")
  if random_graph:
    raise ValueError("graph='random' cannot carry CHOCO-SGD (compressor): its neighbor sums "
                     "need a static graph.")


def _topology(matrix: np.ndarray | None, graph: str, axes) -> tuple[list[np.ndarray], np.ndarray]:
  """``(sources per permutation, W)`` for the devices of ``axes``."""
  shape = tuple(jax.lax.axis_size(a) for a in axes)
  n = int(np.prod(shape))
  if matrix is not None:
    if matrix.shape[0] != n:
      raise ValueError(f"mixing_matrix is {matrix.shape[0]}x{matrix.shape[0]} for {n} "
                       "devices.")
    return _from_matrix(matrix), matrix
  sources = _neighbor_sources(graph, shape)
  return sources, _uniform(sources, n)


def _receive(tree, sources, axes):
  """Every leaf of ``tree`` from device ``sources[i]``, on device ``i`` (one ``ppermute``)."""
  pairs = [(int(src), dst) for dst, src in enumerate(sources)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axes, pairs), tree)


def _mix(tree, own_weight, sources, weights, axes):
  """``own_weight[i] x_i + sum_p weights[p][i] x_{sources[p][i]}`` on device ``i``."""
  me = device_index(axes)
  out = jax.tree.map(lambda x: jnp.asarray(own_weight, jnp.float32)[me] * x, tree)
  for src, w in zip(sources, weights):
    got = _receive(tree, src, axes)
    out = jax.tree.map(lambda acc, x, w=w: acc + jnp.asarray(w, jnp.float32)[me] * x, out, got)
  return out


def _exact(x, key, axes, matrix: np.ndarray | None, graph: str):
  """Exact gossip: ``sum_j W_ij x_j``; a random peer shift drawn from ``key`` for 'random'."""
  n = device_count(axes)
  if matrix is None and graph == "random":
    index = np.arange(n)
    branches = [lambda t, s=s: _mix(t, np.full(n, 0.5), [(index + s) % n], [np.full(n, 0.5)],
                                    axes) for s in range(1, n)]
    return jax.lax.switch(jax.random.randint(key, (), 0, n - 1), branches, x)
  sources, w = _topology(matrix, graph, axes)
  return _mix(x, np.diag(w), sources, [w[np.arange(n), src] for src in sources], axes)


def _choco(x, public, neighborhood, key, axes, topology, compressor: Compressor,
           consensus_step: float):
  """CHOCO-SGD: ``(mixed x, new public copy, new neighborhood sum)``."""
  sources, w = topology
  n = w.shape[0]
  leaves, treedef = jax.tree.flatten(x)
  key = jax.random.fold_in(key, device_index(axes))
  payloads, decoded, public = zip(*[
      delta_encode(compressor, leaf, hat, jax.random.fold_in(key, i))
      for i, (leaf, hat) in enumerate(zip(leaves, jax.tree.leaves(public)))])
  public = treedef.unflatten(list(public))
  shapes = [leaf.shape for leaf in leaves]
  me = device_index(axes)
  update = [jnp.asarray(np.diag(w), jnp.float32)[me] * q for q in decoded]
  for src in sources:
    got = _receive(payloads, src, axes)
    weight = jnp.asarray(w[np.arange(n), src], jnp.float32)[me]
    update = [acc + weight * compressor.decode(p, shape)
              for acc, p, shape in zip(update, got, shapes)]
  neighborhood = jax.tree.map(lambda s, q: s + q, neighborhood, treedef.unflatten(update))
  mixed = jax.tree.map(lambda xi, s, hat: xi + consensus_step * (s - hat), x, neighborhood,
                       public)
  return mixed, public, neighborhood
