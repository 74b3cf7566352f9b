"""The compressor contract: an immutable value of pure functions plus static facts.

A :class:`Compressor` works on one array. ``encode`` turns it into a *payload*, a pytree of
arrays that is exactly what crosses the wire (``sum(leaf.nbytes)`` is the bytes sent), and
``decode`` turns a payload back into a float32 array of the original shape. Any state a
compressor needs between calls (residuals, warm-start factors) is an explicit pytree made by
``init`` and threaded through ``encode``; randomness comes from an explicit PRNG key.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Shape = tuple[int, ...]
Payload = Any
CompressorState = Any

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


InitFn = Callable[[Shape, Any], CompressorState]
EncodeFn = Callable[[jax.Array, CompressorState, jax.Array], tuple[Payload, CompressorState]]
DecodeFn = Callable[[Payload, Shape], jax.Array]
WireBytesFn = Callable[[Shape, Any], int]
DecodeSumFn = Callable[[Payload, Shape], jax.Array]
SubtractDecodedFn = Callable[[jax.Array, Payload], jax.Array]
UnsentNonfiniteFn = Callable[[Payload], jax.Array]


class Compressor(NamedTuple):
  """A gradient compressor: pure functions plus the static facts collectives need.

  Attributes:
    init: ``init(shape, dtype) -> state``; ``()`` for stateless compressors.
    encode: ``encode(x, state, key) -> (payload, state)``. ``x`` is a float array of the
      shape given to ``init``; ``key`` is a PRNG key (ignored by deterministic compressors).
    decode: ``decode(payload, shape) -> jax.Array`` of dtype float32 and that shape.
    wire_bytes: ``wire_bytes(shape, dtype) -> int``, the payload's bytes from the closed-form
      formula in the compressor's docstring (tests check it against the real payload).
    linear: whether payloads may be summed before decoding: the payload is additive in the
      encoded input, ``encode(x1) + encode(x2) == encode(x1 + x2)`` leaf by leaf (see
      :func:`sum_payloads`) when the shared parts of the state (keys, agreed scales) are the
      same, so a ``psum`` of the devices' payloads is the payload of the sum of their inputs
      and can replace a gather. Where the decoder is itself linear,
      ``decode(p1 + p2) == decode(p1) + decode(p2)`` too.
    unbiased: whether ``E[decode(encode(x))] == x`` over the key.
    name: a short human-readable name, e.g. ``'topk(0.01)'``.
    matrix_method: ``None`` for compressors of any array (the engine hands them a flattened
      1-D shard). For a compressor that factorizes whole matrices with a collective between
      its steps (PowerSGD), the static parameters of that method: the engine then runs the
      method's own collective on each leaf's matrix instead of compressing a shard.
    decode_sum: ``None``, or ``decode_sum(payloads, shape) -> jax.Array``: the float32 sum
      of the decodings of payloads stacked on a leading axis (as a gather returns them), for
      a compressor that computes it more cheaply than one dense decode per payload (top-k:
      one scatter-add of every payload's values into one buffer). The gather and two-phase
      strategies sum the gathered payloads with it where it is given.
    subtract_decoded: ``None``, or ``subtract_decoded(x, payload) -> jax.Array``:
      ``x - decode(payload, x.shape)`` for a float32 ``x``, bit for bit, for a compressor
      that computes it without a dense decode (top-k: its values subtracted at its indices,
      a scatter XLA can do in place). Error feedback's residual uses it where it is given
      (:func:`subtract_decoded`).
    unsent_nonfinite: ``None``, or ``unsent_nonfinite(payload) -> bool scalar``: whether
      ``x - decode(payload, x.shape)`` holds a NaN or an Inf, for the ``x`` that ``encode``
      made the payload from, read off the payload alone, for a compressor whose payload
      always carries a non-finite entry of its input (exact top-k: NaN and Inf rank above
      every finite magnitude, so one is kept whenever the input holds one). Error feedback
      then checks ``k`` values instead of the whole residual.
  """
  init: InitFn
  encode: EncodeFn
  decode: DecodeFn
  wire_bytes: WireBytesFn
  linear: bool
  unbiased: bool
  name: str
  matrix_method: Any = None
  decode_sum: DecodeSumFn | None = None
  subtract_decoded: SubtractDecodedFn | None = None
  unsent_nonfinite: UnsentNonfiniteFn | None = None

  @property
  def needs_matrix(self) -> bool:
    """Whether the compressor works on each leaf's matrix, not on a flattened shard."""
    return self.matrix_method is not None

  @property
  def stateful(self) -> bool:
    """Whether ``init`` makes state carried between calls (any array); the one place this is
    probed (shapes only, nothing computed)."""
    return bool(jax.tree.leaves(jax.eval_shape(lambda: self.init((1,), jnp.float32))))


def _alone(value: jax.Array) -> jax.Array:
  return value


class AxisContext(NamedTuple):
  """What the engine tells a compressor about the devices whose payloads it combines.

  ``compress/`` knows nothing of meshes: a compressor that needs the other devices (an agreed
  scale, the number of payloads a sum adds up) reads :func:`axis_context` inside ``encode`` and
  ``decode``, and the engine (:mod:`jaxcomm.collectives.strategies`) sets it around every
  exchange with :func:`combining`. Outside the engine a compressor works alone: one device.

  Attributes:
    size: the number ``n`` of devices whose payloads are combined.
    agree_max: ``agree_max(value) -> value``, the maximum of ``value`` over those devices (the
      engine runs a ``pmax``: ``2(n-1)/n`` times the value's bytes per device).
  """
  size: int = 1
  agree_max: Callable[[jax.Array], jax.Array] = _alone


_AXIS_CONTEXT: contextvars.ContextVar[AxisContext] = contextvars.ContextVar(
    "jaxcomm_axis_context", default=AxisContext())


def axis_context() -> AxisContext:
  """The :class:`AxisContext` of the exchange being traced (one device outside the engine)."""
  return _AXIS_CONTEXT.get()


@contextlib.contextmanager
def combining(context: AxisContext) -> Iterator[None]:
  """While active, :func:`axis_context` is ``context`` (the engine's side of the contract)."""
  token = _AXIS_CONTEXT.set(context)
  try:
    yield
  finally:
    _AXIS_CONTEXT.reset(token)


def stateless_init(shape: Shape, dtype: Any) -> tuple[()]:
  """The ``init`` of compressors that keep no state between calls."""
  del shape, dtype
  return ()


def payload_nbytes(payload: Payload) -> int:
  """Bytes of a payload (arrays or ``jax.ShapeDtypeStruct``): what crosses the wire."""
  return int(sum(np.prod(leaf.shape, dtype=np.int64) * np.dtype(leaf.dtype).itemsize
                 for leaf in jax.tree.leaves(payload)))


def replicated_fields(payload: Payload) -> tuple[str, ...]:
  """Fields of a payload that are identical on every device and must not be summed.

  A payload class lists them in a class attribute ``REPLICATED`` (e.g. the shared PRNG key
  of shared random-k, from which the receiver regenerates the indices).
  """
  return tuple(getattr(type(payload), "REPLICATED", ()))


def _sum_leaves(payload: Payload, reduce: Callable[[jax.Array], jax.Array],
                take_replicated: Callable[[jax.Array], jax.Array]) -> Payload:
  """Applies ``reduce`` to the summed leaves and ``take_replicated`` to the replicated ones.

  Integer leaves are widened to int32 first (int8 sums overflow after a few devices), unless
  the payload class sets ``OVERFLOW_SAFE = True``: its encoder bounded the codes so that the
  sum over the axis fits their own dtype, and the sum is sent at that width.
  """
  widen = not getattr(type(payload), "OVERFLOW_SAFE", False)

  def summed(leaf):
    if widen and jnp.issubdtype(leaf.dtype, jnp.integer):
      leaf = leaf.astype(jnp.int32)
    return reduce(leaf).astype(leaf.dtype)

  keep = replicated_fields(payload)
  if not keep:
    return jax.tree.map(summed, payload)
  return type(payload)(**{
      field: take_replicated(leaf) if field in keep else jax.tree.map(summed, leaf)
      for field, leaf in zip(payload._fields, payload)})


def sum_payloads(payloads: Payload) -> Payload:
  """Sums payloads stacked on a leading axis, as a ``psum`` of a linear payload would.

  Integer leaves are widened to int32 first (unless the payload is ``OVERFLOW_SAFE``);
  :func:`replicated_fields` are taken from the first payload instead of summed. This is the
  reference the linearity tests use.

  Args:
    payloads: a payload pytree whose leaves have a leading axis of size ``n`` (e.g. the output
      of ``jax.vmap(encode)`` or of an ``all_gather``).

  Returns:
    One payload: the leaf-wise sum over the leading axis.
  """
  return _sum_leaves(payloads, sum_stacked, lambda leaf: leaf[0])


def sum_stacked(stacked: jax.Array) -> jax.Array:
  """``stacked.sum(axis=0)`` computed as a pairwise tree of elementwise adds of its rows.

  XLA's CPU backend runs a reduction over the leading (major) axis of a row-major array at
  about 35 ns per element (jaxlib 0.10: 80 ms for ``(2, 2359296)`` float32, 400 ms for
  ``(8, 2359296)``), while adds of row slices fuse into one loop at memory speed (1.7 and
  2.7 ms). Every sum of decoded payloads (:func:`decode_and_sum`) or stacked payloads in the
  library goes through here.

  Args:
    stacked: array of shape ``(n, *shape)``, ``n >= 1``.

  Returns:
    Array of ``shape`` and ``stacked``'s dtype (integers are not widened: widen first).
  """
  rows = [stacked[i] for i in range(stacked.shape[0])]
  while len(rows) > 1:
    rows = [rows[i] + rows[i + 1] for i in range(0, len(rows) - 1, 2)] + rows[len(rows) // 2 * 2:]
  return rows[0]


def decode_and_sum(compressor: Compressor, payloads: Payload, shape: Shape) -> jax.Array:
  """The float32 sum of the decodings of ``payloads`` stacked on a leading axis.

  ``compressor.decode_sum`` where the compressor has one, else each payload decoded and the
  ``(n, *shape)`` results summed by :func:`sum_stacked`. Every sum of gathered payloads in
  the library goes through here.

  Args:
    compressor: the compressor that encoded the payloads.
    payloads: a payload pytree whose leaves have a leading axis of size ``n >= 1``.
    shape: the shape of one decoded payload.

  Returns:
    float32 array of ``shape``.
  """
  if compressor.decode_sum is not None:
    return compressor.decode_sum(payloads, shape)
  return sum_stacked(decode_each(compressor, payloads, shape))


def decode_each(compressor: Compressor, payloads: Payload, shape: Shape) -> jax.Array:
  """The decodings of ``payloads`` stacked on a leading axis: float32 ``(n, *shape)``.

  The payloads are decoded one by one, not in one ``vmap`` over the leading axis: in the
  batched form XLA's CPU backend fused the ``n`` decodes and their consumer into a loop that
  it did not vectorize where a decode broadcasts a value per chunk or unpacks sub-byte codes
  (two hosts, 32,768 elements, decoded and summed: TernGrad's 2-bit codes 39 -> 15 us,
  QSGD's buckets 55 -> 27 us with its norms in memory); the rows are the same, bit for bit.
  """
  count = jax.tree.leaves(payloads)[0].shape[0]
  return jnp.stack([compressor.decode(jax.tree.map(lambda leaf, i=i: leaf[i], payloads), shape)
                    for i in range(count)])


def subtract_decoded(compressor: Compressor, x: jax.Array, payload: Payload) -> jax.Array:
  """``x - decode(payload, x.shape)`` (float32 ``x``): ``compressor.subtract_decoded`` where
  the compressor has one, else a dense decode and a subtraction."""
  if compressor.subtract_decoded is not None:
    return compressor.subtract_decoded(x, payload)
  return x - compressor.decode(payload, x.shape)


def psum_payload(payload: Payload, axis_name: str) -> Payload:
  """``psum`` of a linear compressor's payload over a named axis (``shard_map`` or ``vmap``).

  Integer leaves are widened to int32 (unless the payload is ``OVERFLOW_SAFE``);
  :func:`replicated_fields` are left as they are. Only meaningful when ``compressor.linear``.
  """
  return _sum_leaves(payload, lambda leaf: jax.lax.psum(leaf, axis_name), lambda leaf: leaf)


def num_elements(shape: Shape) -> int:
  return int(np.prod(shape, dtype=np.int64))

