"""``compress_updates``: the optimizer first, on each host; its updates compressed across hosts.

Error feedback in front of an adaptive optimizer feeds it what the compressor released: for a
sparsifier, each coordinate's accumulated residual in a burst every ``~1/density`` steps. Adam's
second moment then sees the bursts' squares (``v`` grows by about ``1/density`` against the
dense gradient's) and every step shrinks by ``~sqrt(1/density)``; scaled sign sends one
magnitude on every coordinate and flattens Adam's per-coordinate scaling (docs/quality.md,
section 8). The known remedy (DGC's momentum correction, 1-bit Adam, DeMo) compresses *after*
the local momentum. This transformation generalizes it to any optax optimizer and any
compressor: each host runs the optimizer on its full-precision mean gradient, so its moments
see dense gradients, and only the resulting update crosses hosts, compressed, with error
feedback on the update itself (nothing after it integrates the residual's delay). Under
hybrid sharded data parallelism each device runs the optimizer on its ``1/G`` shard of the
host mean instead (docs/hsdp.md, section 8).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.compress.base import Compressor
from jaxcomm._src.mesh_axes import manual_axes, require_axes, require_varying, vary, vary_tree
from jaxcomm._src.optim import hsdp
from jaxcomm._src.optim.compressed_allreduce import compressed_allreduce
from jaxcomm._src.topology import HOST_AXIS, LOCAL_AXIS


class CompressUpdatesState(NamedTuple):
  """State of :func:`compress_updates`.

  Attributes:
    inner: the inner optimizer's state for this host (its moments are device-local, the same
      on a host's devices; scalar counters replicated).
    allreduce: the :class:`~jaxcomm.optim.CompressedAllReduceState` of the updates' mean.
  """
  inner: Any
  allreduce: Any


def _at_least_1d(tree):
  return jax.tree.map(jnp.atleast_1d, tree)


def _shards(fast_axis: str, host_variance: bool, caller: str) -> hsdp.ShardedLeaves | None:
  """The sharded leaves under ``data_parallel(..., shard_over=fast_axis)``, else ``None``."""
  shards = hsdp.sharded_leaves_over(fast_axis, caller)
  if shards is None:
    return None
  if host_variance:
    raise ValueError(f"{caller}: host_variance=True needs every device's own gradient, which "
                     f"shard_over={shards.axis!r} never forms (each device receives the sum of "
                     "its shard, reduce-scattered): use host_variance=False or shard_over=None.")
  return shards


def _zero_padding(means, shards: hsdp.ShardedLeaves):
  """``means`` with the zero padding of the flat shards restored (the compressed mean of a
  padded zero need not be 0, e.g. sign's): the parameters' padding then stays exactly 0, so
  the inner optimizer's update there (weight decay of the parameter) stays 0 and the
  compressor sees the zeros the replicated path pads with."""
  index, leaves = jax.lax.axis_index(shards.axis), jax.tree.leaves(means)

  def restored(mean, shape, dim):
    size = math.prod(shape)
    if dim is not None or size == mean.size * jax.lax.axis_size(shards.axis):
      return mean
    return jnp.where(index * mean.size + jnp.arange(mean.size) < size, mean, 0)

  return jax.tree.unflatten(jax.tree.structure(means), [
      restored(mean, shape, dim) for mean, shape, dim in zip(leaves, shards.shapes, shards.dims)])


def _host_variance(grads, host_mean, fast_axis: str, slow_axis: str) -> dict:
  """``{'host_variance': s^2 / G, 'hosts': H}``: the variance of the host mean from the
  sample variance of the host's ``G`` device gradients (one fp32 all-reduce over
  ``fast_axis``)."""
  local = jax.lax.axis_size(fast_axis)
  if local < 2:
    raise ValueError(f"host_variance=True needs >= 2 devices on {fast_axis!r}, got {local}.")
  squares = jax.lax.pmean(jax.tree.map(lambda g: jnp.square(jnp.atleast_1d(g)), grads),
                          fast_axis)
  variance = jax.tree.map(lambda q, m: jnp.maximum(q - m * m, 0) / (local - 1), squares,
                          host_mean)
  return {"host_variance": variance, "hosts": jax.lax.axis_size(slow_axis)}


def compress_updates(inner: optax.GradientTransformation, compressor: Compressor | None = None,
                     *, feedback: bool | str = "residual", host_variance: bool = False,
                     fast_axis: str = LOCAL_AXIS, slow_axis: str = HOST_AXIS,
                     **allreduce_options
                     ) -> optax.GradientTransformation:
  """Runs ``inner`` per host on the host's mean gradient; averages its updates across hosts
  through :func:`jaxcomm.compressed_allreduce` with error feedback.

  Per step, on every device: ``g_h = pmean(g, fast_axis)`` (full precision);
  ``u_h, s_h = inner.update(g_h, s_h, params)``; the output is the compressed mean over hosts
  of ``u_h`` (``compressed_allreduce(compressor, feedback=feedback, ...)`` on ``u_h``, which
  every device of the host holds). With ``feedback='residual'`` (default) what top-k or sign
  did not send stays in the residual and joins the next update: ``sum_t output_t =
  sum_t mean_h u_h,t - mean(residual_T)``, the error-feedback identity on the parameter
  trajectory itself, with no optimizer after it to amplify the residual's delay.

  With ``compressor=None`` (or the identity) and one host it is ``optax.chain(
  compressed_allreduce(), inner)``; with several hosts and a linear ``inner`` (``optax.sgd``,
  momentum included) too (both equal to float32 rounding, tested). With several hosts and Adam,
  each host's moments see its own mean gradient (``1/H`` of the global batch), not the global
  one: the uncompressed form is itself a (close) variant of data-parallel Adam, measured in
  docs/results.md. Its second moment is inflated by the host mean's larger noise;
  ``host_variance=True`` with :func:`jaxcomm.optim.host_adamw` corrects it (docs/quality.md,
  section 10).

  Under hybrid sharded data parallelism (``jaxcomm.data_parallel(..., shard_over=fast_axis)``,
  docs/hsdp.md) each device's gradient already is its ``1/G`` shard of the host mean (the
  reduce-scatter that transposes the parameter all-gather), so there is no ``pmean``:
  ``inner`` runs on the shard, the allreduce sends that shard across hosts (the shard the
  replicated path compresses) and the output is this device's shard of the mean, with the
  zero padding of flat shards kept exactly 0. It equals the replicated form to float rounding
  (tested for ``None``, sign and top-k with AdamW) when ``inner`` is elementwise, which
  ``data_parallel``'s ``init`` checks (:func:`jaxcomm.optim.hsdp.check_shardable`; ``inner``
  runs as :func:`jaxcomm.optim.hsdp.user_optimizer`): an ``inner`` that combines elements
  (``optax.clip_by_global_norm``, LAMB, ``optax.add_noise``) or looks at a leaf's rank or
  shape (a weight-decay mask by rank) is a ``ValueError`` there, as are a
  ``fast_axis`` other than the sharded axis and ``host_variance=True`` (each device's own
  gradient is never formed). A skipped step is skipped as replicated.

  Bytes per device and step: the host mean ``2 (G-1)/G D`` over ``fast_axis``, then those of
  ``compressed_allreduce`` on the updates (``D`` bytes): ``(G-1)/G D`` reduce-scatter and
  all-gather over ``fast_axis`` and, over ``slow_axis``, ``(H-1) c`` with ``gather`` for a
  payload of ``c`` bytes per ``1/G`` shard; ``host_variance=True`` adds one more
  ``2 (G-1)/G D`` all-reduce over ``fast_axis`` (no inter-host byte). Under ``shard_over``:
  over ``slow_axis`` the same ``(H-1) c``; over ``fast_axis`` only scalar agreements (the
  step's parameter all-gather and gradient reduce-scatter, ``(G-1)/G D'`` each for the
  padded size ``D'``, are the trainer's): ``2 (G-1)/G D'`` in all instead of ``4 (G-1)/G D``.
  Memory: the inner state per device plus the allreduce's residual shard; under
  ``shard_over`` the inner state of the shard, ``1/G`` of it.

  Args:
    inner: the optimizer, e.g. ``optax.adamw(3e-3)`` (its output is applied as is) or
      ``optax.scale_by_adam()`` followed by a learning rate later in the chain. A
      parameter-free ``inner`` gets ``params`` in ``update`` as usual. Its state leaves that
      depend on the gradient must not be scalars (Adam's moments follow the parameters, made
      at least 1-D here; its step count is replicated).
    compressor: the slow axis's compressor, e.g. ``jaxcomm.topk(0.01)``; ``None``: full
      precision.
    feedback: as in :func:`jaxcomm.compressed_allreduce`; ``'residual'`` by default (the
      update is the last thing the optimizer produces, so conserving its mass is what holds
      the trajectory; an EF21 estimate would return a lagging estimate instead).
    host_variance: also pass ``inner.update`` the keywords ``host_variance`` (the variance of
      the host mean, ``s^2 / G`` from the sample variance ``s^2`` of the host's ``G >= 2``
      device gradients) and ``hosts`` (``H``), for :func:`jaxcomm.optim.host_adamw`, whose
      second moment then estimates the global mean gradient's. ``inner`` must be an
      ``optax.GradientTransformationExtraArgs``; transformations in it that do not take these
      keywords ignore them (``optax.adamw`` is unchanged by them). Not under ``shard_over``.
    fast_axis: the intra-host mesh axis; under ``shard_over``, the sharded axis.
    slow_axis: the inter-host mesh axis.
    **allreduce_options: further keywords of :func:`jaxcomm.compressed_allreduce`
      (``strategy``, ``seed``, ``nonfinite``, ``residual_dtype``, ``bucket_bytes``).

  Returns:
    An ``optax.GradientTransformation`` taking this device's gradients
    (:func:`jaxcomm.optim.local_grad`) and returning the same update on every device (under
    ``shard_over``: the same shard on every host); create its state with
    :func:`jaxcomm.optim.sharded_init`, or let :func:`jaxcomm.data_parallel` do it.

  Example:
    >>> tx = jaxcomm.optim.compress_updates(optax.adamw(3e-3),
    ...                                     jaxcomm.topk(0.01))  # doctest: +SKIP

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018 (momentum correction); Tang et al.,
    "1-bit Adam", ICML 2021; Peng, Quesnelle & Kingma, "DeMo", arXiv 2411.19870, 2024
    (compress after the local momentum); Karimireddy et al., "Error Feedback Fixes SignSGD",
    ICML 2019.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError("inner must be an optax.GradientTransformation, got "
                    f"{type(inner).__name__}.")
  if host_variance and not isinstance(inner, optax.GradientTransformationExtraArgs):
    raise TypeError("host_variance=True passes keywords to inner.update: inner must be an "
                    "optax.GradientTransformationExtraArgs (e.g. jaxcomm.optim.host_adamw), "
                    f"got {type(inner).__name__}.")
  if isinstance(compressor, Compressor) and compressor.needs_matrix:
    raise ValueError(f"compressor={compressor.name} compresses whole matrices: "
                     "compress_updates takes flat-shard compressors (top-k, sign, ...).")
  inner = hsdp.user_optimizer(inner, "compress_updates.inner")
  allreduce = compressed_allreduce(compressor, feedback=feedback, fast_axis=fast_axis,
                                   slow_axis=slow_axis, **allreduce_options)
  axes = (slow_axis, fast_axis)

  def init(params) -> CompressUpdatesState:
    require_axes(axes, "compress_updates.init")
    every = manual_axes("compress_updates.init")
    shards = _shards(fast_axis, host_variance, "compress_updates.init")
    if shards is not None:
      if len(jax.tree.leaves(params)) != len(shards.shapes):
        raise ValueError(f"compress_updates.init: under shard_over it takes every parameter "
                         f"leaf ({len(shards.shapes)}), got {len(jax.tree.leaves(params))}: do "
                         "not wrap it in optax.masked or optax.multi_transform.")
    state = inner.init(_at_least_1d(params))
    # The moments will differ between hosts: device-local from the start (no data moves).
    state = jax.tree.map(lambda leaf: vary(leaf, every) if leaf.ndim else leaf, state)
    return CompressUpdatesState(inner=state, allreduce=allreduce.init(params))

  def update(grads, state: CompressUpdatesState, params=None):
    require_varying(grads, axes, "compress_updates.update")
    every = manual_axes("compress_updates.update")
    shards = _shards(fast_axis, host_variance, "compress_updates.update")
    # Under shard_over each gradient already is this device's shard of the host mean.
    host_mean = (_at_least_1d(grads) if shards is not None
                 else jax.lax.pmean(_at_least_1d(grads), fast_axis))
    extra = _host_variance(grads, host_mean, fast_axis, slow_axis) if host_variance else {}
    updates, inner_state = inner.update(host_mean, state.inner,
                                        None if params is None else _at_least_1d(params), **extra)
    updates = jax.tree.map(lambda u, g: u.reshape(g.shape), updates, grads)
    mean, allreduce_state = allreduce.update(vary_tree(updates, every), state.allreduce)
    if shards is not None:
      mean = _zero_padding(mean, shards)
    # A step the allreduce skipped (a NaN or Inf on some device) leaves the moments too.
    skipped = allreduce_state.skipped_steps > state.allreduce.skipped_steps
    inner_state = jax.tree.map(lambda new, old: jnp.where(skipped, old, new), inner_state,
                               state.inner)
    return mean, CompressUpdatesState(inner=inner_state, allreduce=allreduce_state)

  return hsdp.shard_aware(optax.GradientTransformation(init, update))
