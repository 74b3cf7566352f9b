"""Two-level allreduce: dense over the fast axis, compressed over the slow axis.

Bytes each device sends for one array of ``D`` bytes (``d`` elements), ``G`` devices on the
fast axis, ``H`` on the slow axis, and a compressor whose payload for the ``d/G`` shard is
``c`` bytes:

* fast axis: reduce-scatter ``(G-1)/G * D`` + all-gather ``(G-1)/G * D``, i.e. the
  ``2(G-1)/G * D`` of a ring all-reduce;
* slow axis: all-gather of the payloads, ``(H-1) * c``. Every one of the ``G`` devices of a
  host exchanges its own shard, so all ``G`` NICs work in parallel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.collectives.axes import require_axes
from jaxcomm.compress.base import Compressor, CompressorState, check_float_input


def shard_size(size: int, fast_size: int) -> int:
  """Elements of the ``1/G`` shard each device owns after the fast reduce-scatter."""
  return -(-size // fast_size)


def device_key(key: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """A key distinct on every device of ``axes`` (independent compression noise per device)."""
  index = jnp.zeros((), jnp.int32)
  for axis in axes:
    index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
  return jax.random.fold_in(key, index)


def hierarchical_allreduce(
    x: jax.Array,
    compressor: Compressor | None,
    state: CompressorState,
    key: jax.Array,
    *,
    fast_axis: str,
    slow_axis: str,
) -> tuple[jax.Array, CompressorState]:
  """Mean of ``x`` over ``fast_axis`` x ``slow_axis``, compressed across ``slow_axis`` only.

  Must be called inside ``jax.shard_map`` over both axes. Steps:

  1. divide by the device count ``G*H`` (once, before any sum, so float16 sums cannot
     overflow), flatten, zero-pad to a multiple of ``G`` and reduce-scatter over
     ``fast_axis``: each device owns a ``ceil(d/G)`` shard summed over its host;
  2. encode the shard, all-gather the payloads over ``slow_axis``, decode each and sum them in
     float32 (skipped when the slow axis has one device: nothing crosses hosts);
  3. all-gather the reduced shards over ``fast_axis`` and restore the shape.

  Args:
    x: this device's array (e.g. its local gradient), any shape, float32/bfloat16/float16.
    compressor: compressor for the slow axis; ``None`` sends the shard at full precision.
    state: the compressor's state for a ``(ceil(d/G),)`` shard on this device.
    key: PRNG key, the same on every device; it is folded with the device index.
    fast_axis: the intra-host mesh axis.
    slow_axis: the inter-host mesh axis.

  Returns:
    ``(mean, new_state)``: the mean in ``x``'s dtype and shape (identical on every device), and
    this device's new compressor state.
  """
  require_axes((slow_axis, fast_axis), "hierarchical_allreduce")
  check_float_input(x)
  fast_size = jax.lax.axis_size(fast_axis)
  slow_size = jax.lax.axis_size(slow_axis)
  size = int(np.prod(x.shape, dtype=np.int64))
  shard_len = shard_size(size, fast_size)
  flat = (x / (fast_size * slow_size)).astype(x.dtype).reshape(-1)
  flat = jnp.pad(flat, (0, shard_len * fast_size - size))
  shard = jax.lax.psum_scatter(flat, fast_axis, scatter_dimension=0, tiled=True)
  if compressor is None or slow_size == 1:
    reduced = jax.lax.psum(shard.astype(jnp.float32), slow_axis)
  else:
    payload, state = compressor.encode(shard, state, device_key(key, (slow_axis, fast_axis)))
    gathered = jax.lax.all_gather(payload, slow_axis, to="invarying")
    decoded = jax.vmap(lambda p: compressor.decode(p, (shard_len,)))(gathered)
    reduced = jnp.sum(decoded, axis=0)
  full = jax.lax.all_gather(reduced.astype(x.dtype), fast_axis, tiled=True, to="invarying")
  return full[:size].reshape(x.shape), state
