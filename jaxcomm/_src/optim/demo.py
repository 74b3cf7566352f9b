"""DeMo: decoupled momentum, whose fast components (DCT top-k) are the only thing hosts share."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm._src.mesh_axes import manual_axes, require_axes, require_varying, vary
from jaxcomm._src.topology import HOST_AXIS, LOCAL_AXIS
from jaxcomm._src.validation import (check_bool, check_float, check_float_tree, check_int_range,
                                     check_learning_rate, check_unit_interval)

MAX_CHUNK = 256  # a 256 x 256 block has 65536 coefficients: indices fit in uint16


class DeMoState(NamedTuple):
  """State of :func:`demo`.

  Attributes:
    momentum: per leaf, float32 ``(c, b_r, b_c)`` (matrices) or ``(c, b)`` (vectors): this
      device's ``c`` blocks of its host's momentum ``delta`` (the error-feedback buffer).
      The host's ``G`` devices each own a different ``1/G`` of the blocks; device-local.
    count: int32 steps taken, replicated (drives the learning-rate schedule).
  """
  momentum: Any
  count: jax.Array


class BlockLayout(NamedTuple):
  """How one leaf is cut into DCT blocks and shared among a host's devices.

  Attributes:
    shape: the leaf's shape.
    matrix: ``(rows, cols)`` of the 2-D view (leading dims folded into rows); ``(1, size)``
      for vectors and scalars.
    block: ``(b_r, b_c)`` for matrices or ``(b,)`` for vectors: ``min(chunk, dim)`` per dim.
    grid: blocks along each dimension of the zero-padded view.
    per_device: blocks each of the ``G`` devices owns (the block count padded to ``G``).
  """
  shape: tuple[int, ...]
  matrix: tuple[int, int]
  block: tuple[int, ...]
  grid: tuple[int, ...]
  per_device: int

  @property
  def block_size(self) -> int:
    return math.prod(self.block)


def dct_basis(size: int) -> np.ndarray:
  """The orthonormal DCT-II matrix ``C`` (``size x size``, float32): ``X = C x`` is the DCT
  of ``x`` and ``x = C^T X`` its inverse, ``C C^T = I``."""
  n = np.arange(size)
  basis = np.cos(np.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * size)) * np.sqrt(2 / size)
  basis[0] /= np.sqrt(2)
  return basis.astype(np.float32)


def block_layout(shape: tuple[int, ...], chunk: int, group: int) -> BlockLayout:
  """The :class:`BlockLayout` of a leaf of ``shape`` for ``chunk`` and ``group`` devices."""
  size = math.prod(shape)
  if len(shape) >= 2:
    matrix = (size // shape[-1], shape[-1])
    block = (min(chunk, matrix[0]), min(chunk, matrix[1]))
    grid = (-(-matrix[0] // block[0]), -(-matrix[1] // block[1]))
  else:
    matrix, block = (1, max(size, 1)), (min(chunk, max(size, 1)),)
    grid = (-(-matrix[1] // block[0]),)
  return BlockLayout(tuple(shape), matrix, block, grid, -(-math.prod(grid) // group))


def to_blocks(x: jax.Array, layout: BlockLayout, group: int) -> jax.Array:
  """``x`` zero-padded and cut into ``(group * per_device, *block)`` blocks, row-major."""
  if len(layout.block) == 2:
    (rows, cols), (br, bc), (gr, gc) = layout.matrix, layout.block, layout.grid
    padded = jnp.pad(x.reshape(rows, cols), ((0, gr * br - rows), (0, gc * bc - cols)))
    blocks = padded.reshape(gr, br, gc, bc).transpose(0, 2, 1, 3).reshape(gr * gc, br, bc)
  else:
    (width,), (count,) = layout.block, layout.grid
    blocks = jnp.pad(x.reshape(-1), (0, count * width - x.size)).reshape(count, width)
  extra = group * layout.per_device - blocks.shape[0]
  return jnp.pad(blocks, ((0, extra),) + ((0, 0),) * len(layout.block))


def from_blocks(blocks: jax.Array, layout: BlockLayout) -> jax.Array:
  """Inverse of :func:`to_blocks`: the leaf of ``layout.shape`` (padding dropped)."""
  if len(layout.block) == 2:
    (rows, cols), (br, bc), (gr, gc) = layout.matrix, layout.block, layout.grid
    padded = blocks[:gr * gc].reshape(gr, gc, br, bc).transpose(0, 2, 1, 3)
    return padded.reshape(gr * br, gc * bc)[:rows, :cols].reshape(layout.shape)
  return blocks.reshape(-1)[:math.prod(layout.shape)].reshape(layout.shape)


def dct(blocks: jax.Array, layout: BlockLayout, inverse: bool = False) -> jax.Array:
  """Orthonormal DCT-II of every block (1-D or separable 2-D), as matmuls with the basis."""
  bases = [jnp.asarray(dct_basis(side)) for side in layout.block]
  if inverse:
    bases = [basis.T for basis in bases]
  # float32 on every backend (TPU/GPU default to bf16/tf32 passes); on CPU, where both are
  # float32, timings of the two precisions disagreed between runs (docs/algorithms.md).
  precision = jax.lax.Precision.HIGHEST
  if len(bases) == 1:
    return jnp.einsum("kn,cn->ck", bases[0], blocks, precision=precision)
  return jnp.einsum("kn,cnm,lm->ckl", bases[0], blocks, bases[1], precision=precision)


def sparse_coefficients(momentum: jax.Array, layout: BlockLayout, topk: int):
  """``(values, indices, q)``: the ``topk`` largest-magnitude DCT coefficients of each
  block (float32 ``(c, topk)`` values, uint16 positions in the block) and ``q``, their
  inverse DCT, shaped like ``momentum``."""
  count = momentum.shape[0]
  coefficients = dct(momentum, layout).reshape(count, -1)
  # One 2-D lax.top_k over all blocks: XLA's TopK custom call on CPU, no sort (about 4 ms for
  # 256 blocks of 4096 coefficients; python -m benchmarks.lowcomm_sota --demo-speed).
  indices = jax.lax.top_k(jnp.abs(coefficients), topk)[1]
  values = jnp.take_along_axis(coefficients, indices, axis=1)
  kept = scatter_blocks(values, indices, count, layout)
  return values, indices.astype(jnp.uint16), dct(kept, layout, inverse=True)


def scatter_blocks(values, indices, count: int, layout: BlockLayout) -> jax.Array:
  """Sparse coefficients ``(..., count, k)`` summed into dense ``(count, *block)`` blocks."""
  rows = jnp.broadcast_to(jnp.arange(count)[:, None], values.shape)
  dense = jnp.zeros((count, layout.block_size), jnp.float32)
  dense = dense.at[rows.reshape(-1), indices.astype(jnp.int32).reshape(-1)].add(
      values.reshape(-1))
  return dense.reshape(count, *layout.block)


def demo(learning_rate: float | optax.Schedule, *, beta: float = 0.999, chunk: int = 64,
         topk: int = 32, sign: bool = True, weight_decay: float = 0.0,
         fast_axis: str = LOCAL_AXIS, slow_axis: str = HOST_AXIS
         ) -> optax.GradientTransformation:
  """DeMo over a ``(slow, fast)`` mesh, from per-device gradients to parameter updates.

  Each host averages its devices' gradients at full precision (a reduce-scatter over
  ``fast_axis``: each of its ``G`` devices owns the host mean of ``1/G`` of the blocks) and
  keeps its own momentum ``delta = beta delta + lr_t g``; gradients are never averaged over
  ``slow_axis``. Every leaf is viewed as a matrix (leading dims folded into rows) and cut into
  ``chunk x chunk`` blocks (``min(chunk, dim)`` per side, the edges zero-padded; vectors and
  scalars into ``chunk``-element pieces). Per block: the orthonormal DCT-II (a matmul with the
  basis), the ``k = min(topk, block size)`` largest-magnitude coefficients, their inverse
  DCT ``q``, and ``delta -= q``: the momentum is the error-feedback buffer, what was not sent
  stays in it. The ``(value, index)`` pairs are all-gathered over ``slow_axis``, the decoded
  ``q`` averaged over hosts, and the update is ``-lr_t (sign(mean q) + weight_decay theta)``
  (signum, ``sign=True``) or ``-(mean q) - lr_t weight_decay theta`` (``q`` already carries
  ``lr_t``). With ``k`` equal to the block size every coefficient is sent, ``q = delta`` and
  the update is signSGD (or SGD) on the globally averaged gradient.

  Bytes per device and step, ``H`` hosts, ``G`` devices per host, and per leaf ``c`` blocks
  per device (``ceil(blocks / G)``) of ``B`` elements, ``k`` kept each:

  * ``slow_axis``: one all-gather of ``c k`` float32 values and uint16 indices,
    ``(H - 1) c k (4 + 2)``;
  * ``fast_axis``: a reduce-scatter of the float32 gradient blocks, ``(G - 1) 4 c B``, and an
    all-gather of the direction blocks, ``(G - 1) e c B`` with ``e = 1`` (int8 signs) or ``4``.

  Args:
    learning_rate: ``lr_t``, a float or an optax schedule of the step count.
    beta: momentum decay, in ``[0, 1)`` (0.999 in the paper).
    chunk: block side (elements per vector piece), in ``[1, 256]`` (64 in the paper).
    topk: coefficients kept per block, ``>= 1`` (32 in the paper).
    sign: signum update (the paper's) instead of the averaged ``q`` itself.
    weight_decay: decoupled weight decay, ``>= 0``; needs ``params`` in ``update``.
    fast_axis: the intra-host mesh axis (full precision).
    slow_axis: the inter-host mesh axis (DCT top-k).

  Returns:
    An ``optax.GradientTransformation`` taking this device's gradients
    (:func:`jaxcomm.optim.local_grad`) and returning the same update on every device; create its
    state with :func:`jaxcomm.optim.sharded_init`.

  Example:
    >>> trainer = jaxcomm.data_parallel(loss_fn, jaxcomm.demo(1e-3, weight_decay=0.1),
    ...                                 mesh)  # doctest: +SKIP

  References:
    Peng, Quesnelle & Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870, 2024.
  """
  schedule = check_learning_rate("learning_rate", learning_rate)
  beta = check_unit_interval("beta", beta)
  chunk = check_int_range("chunk", chunk, 1, MAX_CHUNK)
  topk = check_int_range("topk", topk, 1)
  sign = check_bool("sign", sign)
  weight_decay = check_float("weight_decay", weight_decay, inclusive=True)
  if fast_axis == slow_axis:
    raise ValueError(f"fast_axis and slow_axis must differ, both are {fast_axis!r}.")
  axes = (slow_axis, fast_axis)

  def init(params) -> DeMoState:
    require_axes(axes, "demo.init")
    check_float_tree(params, "params")
    return _init_state(params, chunk, fast_axis)

  leaf_update = functools.partial(_leaf_update, beta=beta, chunk=chunk, topk=topk, sign=sign,
                                  fast_axis=fast_axis, slow_axis=slow_axis)

  def update(grads, state: DeMoState, params=None):
    require_axes(axes, "demo.update")
    require_varying(grads, axes, "demo.update")
    if weight_decay and params is None:
      raise ValueError("demo with weight_decay > 0 needs params in update(grads, state, params).")
    lr = schedule(state.count)
    leaves, treedef = jax.tree.flatten(grads)
    results = [leaf_update(g, m, lr)
               for g, m in zip(leaves, treedef.flatten_up_to(state.momentum))]
    scale = lr if sign else 1.0
    updates = [-scale * direction for direction, _ in results]
    if weight_decay:
      updates = [u - lr * weight_decay * p for u, p in zip(updates, jax.tree.leaves(params))]
    updates = [u.astype(g.dtype) for u, g in zip(updates, leaves)]
    return treedef.unflatten(updates), DeMoState(
        momentum=treedef.unflatten([m for _, m in results]), count=state.count + 1)

  return optax.GradientTransformation(init, update)


def _init_state(params, chunk: int, fast_axis: str) -> DeMoState:
  """Zero momentum blocks, this device's ``1/G`` of each leaf's blocks, varying everywhere."""
  group, every = jax.lax.axis_size(fast_axis), manual_axes("demo.init")

  def zeros(leaf):
    layout = block_layout(leaf.shape, chunk, group)
    return vary(jnp.zeros((layout.per_device, *layout.block), jnp.float32), every)

  return DeMoState(momentum=jax.tree.map(zeros, params), count=jnp.zeros((), jnp.int32))


def _leaf_update(grad, momentum, lr, *, beta: float, chunk: int, topk: int, sign: bool,
                 fast_axis: str, slow_axis: str):
  """``(direction for the whole leaf, new momentum blocks)`` for one leaf."""
  group, hosts = jax.lax.axis_size(fast_axis), jax.lax.axis_size(slow_axis)
  layout = block_layout(grad.shape, chunk, group)
  blocks = to_blocks(grad.astype(jnp.float32), layout, group)
  host_mean = jax.lax.psum_scatter(blocks, fast_axis, scatter_dimension=0, tiled=True) / group
  momentum = beta * momentum + lr * host_mean
  values, indices, sent = sparse_coefficients(momentum, layout, min(topk, layout.block_size))
  gathered = jax.lax.all_gather((values, indices), slow_axis, to="invarying")
  mean_q = dct(scatter_blocks(*gathered, layout.per_device, layout), layout,
               inverse=True) / hosts
  direction = jnp.sign(mean_q).astype(jnp.int8) if sign else mean_q
  whole = jax.lax.all_gather(direction, fast_axis, tiled=True, to="invarying")
  return from_blocks(whole.astype(jnp.float32), layout), momentum - sent
