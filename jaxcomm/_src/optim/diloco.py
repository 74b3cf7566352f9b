"""DiLoCo and streaming DiLoCo: inner optimizer for ``H`` steps, outer Nesterov on the mean
pseudo-gradient."""

from __future__ import annotations

import optax

from jaxcomm._src.compress.quantize import quantize
from jaxcomm._src.optim.compressed_allreduce import compressed_allreduce
from jaxcomm._src.optim.periodic import periodic_averaging
from jaxcomm._src.validation import check_int_range


def diloco(inner: optax.GradientTransformation, period: int, *,
           outer: optax.GradientTransformation | None = None,
           sync: optax.GradientTransformation | None = None, fragments: int = 1,
           delay: int = 0, mixing: float = 0.0) -> optax.GradientTransformation:
  """DiLoCo: ``period`` steps of any optax ``inner`` per device, then an outer step.

  The outer step: ``Delta = mean_i (theta_sync - theta_i)`` (the pseudo-gradient) through
  ``sync``; ``theta_sync <- theta_sync + outer(Delta)``; every device restarts from
  ``theta_sync``. ``sync`` may compress the pseudo-gradient with any jaxcomm compressor and
  error feedback, e.g. ``jaxcomm.compressed_allreduce(jaxcomm.sign())``: the residual of what
  one outer step did not send enters the next one.

  Streaming DiLoCo (``fragments > 1``): the parameters are split into contiguous fragments
  of about equal size; fragment ``f`` synchronizes after step ``t`` when ``t + 1`` is
  ``(f + 1) period / fragments`` modulo ``period``, so each step moves at most one fragment
  (peak bandwidth ``/ fragments``). Its new ``theta_sync`` is merged ``delay`` steps later
  (communication overlapped with compute) as ``theta_i = mixing theta_i + (1 - mixing)
  theta_sync``.

  With ``period = 1``, ``outer = optax.sgd(1.0)``: synchronous training with ``inner``'s
  updates averaged.

  State: :class:`~jaxcomm.optim.periodic.PeriodicState`: ``inner``'s state (device-local),
  ``theta_sync`` and one ``outer`` state per fragment (replicated), ``sync``'s state.

  Bytes per device: per synchronization, those of ``sync`` for the fragment (``D/fragments``
  parameter bytes); per step on average ``sync``'s bytes for ``D`` divided by ``period``.

  Args:
    inner: device-local optimizer, e.g. ``optax.adamw(1e-3)``.
    period: ``H >= 1`` inner steps between outer steps (per fragment).
    outer: outer optimizer; default ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` as in
      the paper.
    sync: averaging transformation (default dense :func:`jaxcomm.compressed_allreduce`).
    fragments: number of fragments synchronized in turn; must divide ``period``.
    delay: steps between a fragment's outer step and its merge, ``0 <= delay <
      period / fragments``.
    mixing: weight of the local parameters in the merge, ``[0, 1)``.

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
    2023; Douillard et al., "Streaming DiLoCo with overlapping communication", 2025.
  """
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
  return periodic_averaging(inner, outer, period, sync=sync, fragments=fragments,
                            delay=delay, mixing=mixing)


def streaming_diloco(inner: optax.GradientTransformation, period: int, *, fragments: int = 2,
                     delay: int = 1, mixing: float = 0.5, bits: int = 4, chunk: int | None = 1024,
                     outer: optax.GradientTransformation | None = None
                     ) -> optax.GradientTransformation:
  """Streaming DiLoCo with quantized outer gradients: :func:`diloco` with fragments,
  overlap and a ``bits``-bit pseudo-gradient exchange across hosts.

  The parameters are split into ``fragments`` contiguous fragments synchronized in turn, one
  every ``period / fragments`` steps; each fragment's pseudo-gradients are averaged by
  :func:`jaxcomm.compressed_allreduce`: full precision inside a host (reduce-scatter), then
  :func:`jaxcomm.quantize` to ``bits`` bits (stochastic rounding, unbiased, codes packed, one
  float32 scale per ``chunk`` elements) all-gathered across hosts and summed in float32, and
  the float32 mean all-gathered back inside the host. The new ``theta_sync`` of a fragment is
  merged ``delay`` inner steps after its outer step, ``theta_i = mixing theta_i +
  (1 - mixing) theta_sync``. ``bits = 32`` is the unquantized dense path of :func:`diloco`.

  Bytes per device per synchronization of a fragment of ``d`` float32 elements per leaf,
  ``H`` hosts, ``G`` devices per host, ``s = ceil(d / G)``: ``2 (G-1) 4 s`` inside the host;
  across hosts ``(H - 1) (4 ceil(ceil(s bits / 8) / 4) + 4 ceil(s / chunk))`` (codes and
  scales gathered as one buffer of 4-byte words; at 32 bits the dense
  ``2 (H-1)/H 4 s``). Each fragment synchronizes once per ``period`` steps, so per step the
  whole model's bytes are divided by ``period``, and the peak per step by ``fragments``.

  Args:
    inner: device-local optimizer, e.g. ``optax.adamw(1e-3)``.
    period: ``H >= 1`` inner steps between outer steps of a fragment; a multiple of
      ``fragments``.
    fragments: parameter fragments synchronized in turn, ``>= 1``.
    delay: ``tau``, inner steps between a fragment's outer step and its merge, in
      ``[0, period / fragments)``.
    mixing: ``alpha``, the weight of the local parameters in the merge, in ``[0, 1)``.
    bits: bits per pseudo-gradient element across hosts, in ``[1, 8]``, or 32 (no
      quantization).
    chunk: elements per quantization scale, ``>= 1``, or ``None`` for one per tensor.
    outer: outer optimizer (default Nesterov SGD, lr 0.7, momentum 0.9, as :func:`diloco`).

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters.

  References:
    Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
    Distributed Free Lunch", arXiv 2501.18512, 2025.
  """
  bits = check_int_range("bits", bits, 1, 32)
  if 32 > bits > 8:
    raise ValueError(f"bits must be in [1, 8] or 32, got {bits}.")
  if chunk is not None:
    check_int_range("chunk", chunk, 1)
  sync = None if bits == 32 else compressed_allreduce(
      quantize(bits, chunk=chunk), strategy="gather", feedback=False)
  return diloco(inner, period, outer=outer, sync=sync, fragments=fragments, delay=delay,
                mixing=mixing)
