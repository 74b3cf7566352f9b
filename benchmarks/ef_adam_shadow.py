"""What AdamW's moments see when ``compressed_allreduce(c)`` sits in front of it, on the GPT
quality task: the real gradients, not a synthetic stream (docs/quality.md, section 11).

One process, one device: the 8 devices of the 2x4 mesh are simulated by ``vmap`` over
mesh_scan's batch rows, as in :mod:`benchmarks.host_adam_diagnostic`. The parameters follow
data-parallel AdamW's own trajectory (fp32); along it, every compressor runs as a shadow on
each host's mean gradient, split into the 4 contiguous shards of the fast axis, with the
library's own :func:`jaxcomm.compress.estimate_feedback` (EF21) or
:func:`jaxcomm.compress.error_feedback` (``bound=3``, the ``'bounded'`` default), and feeds its
own AdamW moments (b1 0.9, b2 0.999). At a few steps it prints, per compressor, against the
AdamW moments of the exact mean gradient:

* ``v_lo`` / ``v_hi``: the median of ``sqrt(v_c / v)`` over the quarter of coordinates with
  the smallest / largest ``v`` (how much the compressor inflates Adam's denominator where the
  true gradient is small / large; 1 is fp32's);
* ``len`` / ``cos``: the length ratio and cosine of Adam's direction ``m_c / sqrt(v_c)``
  against fp32's ``m / sqrt(v)``::

  python -m benchmarks.ef_adam_shadow --steps 300 --seed 0
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxcomm  # noqa: E402
from benchmarks.host_adam_diagnostic import (B1, B2, EPS, HOSTS, LOCAL, PER_DEVICE,  # noqa: E402
                                             _device_grads, _init, _step)
from benchmarks.scan import tasks  # noqa: E402

COMPRESSORS = {
    "sign": lambda: jaxcomm.compress.estimate_feedback(jaxcomm.sign()),
    "sign-c256": lambda: jaxcomm.compress.estimate_feedback(jaxcomm.sign(256)),
    "sign-c64": lambda: jaxcomm.compress.estimate_feedback(jaxcomm.sign(64)),
    "sign-c16": lambda: jaxcomm.compress.estimate_feedback(jaxcomm.sign(16)),
    "topk": lambda: jaxcomm.compress.error_feedback(jaxcomm.topk(0.01), bound=3.0),
    "topk-residual": lambda: jaxcomm.compress.error_feedback(jaxcomm.topk(0.01)),
    "topk-none": lambda: jaxcomm.topk(0.01),
    "topk-ef21": lambda: jaxcomm.compress.estimate_feedback(jaxcomm.topk(0.01)),
    "int8": lambda: jaxcomm.compress.error_feedback(jaxcomm.quantize(8)),
}
"""Each name's compressor with the feedback ``compressed_allreduce`` would wrap it in: ``sign``
(``sign-cN``: ``N`` elements per scale) with EF21 estimates, the default for sign; ``topk``
(1%) with bounded residuals, its default; ``topk-residual`` with classic residuals,
``topk-none`` without feedback, ``topk-ef21`` with estimates; ``int8`` (stochastic 8-bit
quantization) with residuals, its default."""


def _shards(leaf):
  """``(HOSTS, LOCAL, n)`` host means of a ``(HOSTS, LOCAL, *shape)`` gradient, each host's
  flattened and split into LOCAL contiguous zero-padded shards."""
  host = leaf.mean(axis=1).reshape(HOSTS, -1)
  size = host.shape[1]
  pad = -size % LOCAL
  return jnp.pad(host, ((0, 0), (0, pad))).reshape(HOSTS, LOCAL, -1), size


def _mean_output(compressor, states, g, key):
  """The mean over hosts that ``compressed_allreduce`` returns, flattened over all leaves,
  and the new per-leaf states; ``key`` is the step's (each leaf and device folds in its
  index)."""
  outs, new_states = [], []
  for index, (leaf, state) in enumerate(zip(jax.tree.leaves(g), states)):
    x, size = _shards(leaf)
    keys = jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)), (None, 0))(
        jax.random.fold_in(key, index), jnp.arange(HOSTS * LOCAL).reshape(HOSTS, LOCAL))
    payload, state = jax.vmap(jax.vmap(compressor.encode))(x, state, keys)
    decoded = jax.vmap(jax.vmap(lambda p: compressor.decode(p, (x.shape[2],))))(payload)
    if isinstance(state, jaxcomm.compress.EstimateFeedbackState):
      decoded = state.estimate  # EF21 returns the mean of the estimates
    outs.append(decoded.mean(axis=0).reshape(-1)[:size])
    new_states.append(state)
  return jnp.concatenate(outs), new_states


def shadow(task, steps: int, report: set[int], names: Sequence[str]):
  """``{step: {name: stats}}`` along fp32 AdamW's trajectory."""
  grads = jax.jit(_device_grads(task.loss_fn))
  step = jax.jit(_step("global", task.lr))
  compressors = {name: COMPRESSORS[name]() for name in names}
  leaves = jax.tree.leaves(task.params)

  def init(c):
    return [jax.tree.map(lambda z: jnp.broadcast_to(z, (HOSTS, LOCAL, *z.shape)),
                         c.init((_shards(jnp.zeros((HOSTS, LOCAL, *p.shape)))[0].shape[2],),
                                jnp.float32)) for p in leaves]

  size = sum(p.size for p in leaves)
  zeros = jnp.zeros(size)
  moments = {name: (zeros, zeros, init(c)) for name, c in compressors.items()}
  moments["fp32"] = (zeros, zeros, None)

  @jax.jit
  def observe(moments, g, t):
    new, stats = {}, {}
    exact = jnp.concatenate([x.mean(axis=(0, 1)).reshape(-1) for x in jax.tree.leaves(g)])
    for name, (m, v, states) in moments.items():
      out, states = (exact, None) if name == "fp32" else _mean_output(
          compressors[name], states, g, jax.random.fold_in(jax.random.PRNGKey(0), t))
      new[name] = (B1 * m + (1 - B1) * out, B2 * v + (1 - B2) * out ** 2, states)
    c1, c2 = 1 - B1 ** t, 1 - B2 ** t
    m, v, _ = new["fp32"]
    ref = m / c1 / (jnp.sqrt(v / c2) + EPS)
    lo, hi = v <= jnp.quantile(v, 0.25), v >= jnp.quantile(v, 0.75)
    for name in compressors:
      mc, vc, _ = new[name]
      u = mc / c1 / (jnp.sqrt(vc / c2) + EPS)
      ratio = jnp.sqrt(vc / jnp.maximum(v, 1e-30))
      stats[name] = {"v_lo": jnp.nanmedian(jnp.where(lo, ratio, jnp.nan)),
                     "v_hi": jnp.nanmedian(jnp.where(hi, ratio, jnp.nan)),
                     "len": jnp.linalg.norm(u) / jnp.linalg.norm(ref),
                     "cos": u @ ref / jnp.linalg.norm(u) / jnp.linalg.norm(ref)}
    return new, stats

  params, state = task.params, _init(task.params, "global")
  rows = {}
  for t in range(1, steps + 1):
    g = grads(params, task.batch(t - 1))
    moments, stats = observe(moments, g, t)
    if t in report:
      rows[t] = jax.tree.map(float, stats)
    params, state = step(params, state, g, t)
  return rows


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--compressors", default=",".join(COMPRESSORS),
                      help=f"comma-separated, from: {', '.join(COMPRESSORS)}")
  args = parser.parse_args(argv)
  names = args.compressors.split(",")
  unknown = [name for name in names if name not in COMPRESSORS]
  if unknown:
    parser.error(f"unknown compressors {unknown}; choose from {', '.join(COMPRESSORS)}")
  task = tasks.gpt("default", HOSTS * LOCAL * PER_DEVICE, args.steps, args.seed)
  report = {10, 50, 100, args.steps // 2, args.steps}
  rows = shadow(task, args.steps, report, names)
  print("| compressor | step | sqrt(v_c/v), small-v quarter | large-v quarter | step length "
        "| cosine |\n| --- | --- | --- | --- | --- | --- |")
  for name in names:
    for t in sorted(rows):
      s = rows[t][name]
      print(f"| {name} | {t} | {s['v_lo']:.2f} | {s['v_hi']:.2f} | {s['len']:.3f} "
            f"| {s['cos']:.3f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
