"""Why per-host AdamW (``compress_updates(adamw)`` without compression) trails data-parallel
AdamW on the GPT quality task, and what a host can do about it without inter-host bytes.

One process, one device: the 8 devices of the 2x4 mesh are simulated by ``vmap`` over their
batch rows (device ``(h, l)`` takes rows ``2 (4h + l) .. +2`` of mesh_scan's global batch, so
every run sees mesh_scan's tokens). Three optimizers, each AdamW with optax's defaults (b1 0.9,
b2 0.999, eps 1e-8, weight decay 1e-4) and lr 3e-3, written out so that only what feeds the
second moment differs:

* ``global``: Adam on the global mean gradient ``g`` (data-parallel AdamW, mesh_scan's fp32);
* ``host``: each host's Adam on its host mean ``g_h`` (``1/H`` of the batch), the hosts'
  updates averaged exactly (``compress_updates(adamw)`` with no compressor);
* ``host-debiased``: as ``host``, but the second moment estimates the global mean's:
  ``E[g^2] = E[g_h^2] - (1 - 1/H) Var[g_h]`` with ``Var[g_h] = s^2 / G`` from the sample
  variance ``s^2`` of the host's ``G`` device gradients (an intra-host reduction, no inter-host
  bytes), floored at ``v_h / H``.

Along ``global``'s own trajectory it also runs the per-host moments as shadows and reports, at
a few steps, the median over coordinates of ``sqrt(v_h / v)`` (how much the host's second
moment is inflated) and the norm ratio and cosine of the averaged per-host step against the
global one, with and without the correction, and with the hosts' ``v`` averaged (which removes
their disagreement but not the inflation)::

  python -m benchmarks.host_adam_diagnostic --steps 300 --seeds 0,1
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.scan import tasks  # noqa: E402

HOSTS, LOCAL, PER_DEVICE = 2, 4, 2
B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 1e-4


def _device_grads(loss_fn):
  """``grads(params, batch) -> pytree with a leading (HOSTS, LOCAL) axis pair``."""
  grad = jax.grad(loss_fn)

  def grads(params, batch):
    split = jax.tree.map(lambda x: x.reshape(HOSTS * LOCAL, PER_DEVICE, *x.shape[1:]), batch)
    per_device = jax.vmap(grad, in_axes=(None, 0))(params, split)
    return jax.tree.map(lambda g: g.reshape(HOSTS, LOCAL, *g.shape[1:]), per_device)

  return grads


def _moments(g):
  """Per host: its mean gradient ``g_h`` and the variance of that mean, ``s^2 / G``."""
  host = g.mean(axis=1)
  noise = ((g - host[:, None]) ** 2).sum(axis=1) / (LOCAL - 1) / LOCAL
  return host, noise


def _step(mode, lr):
  """``step(params, state, device_grads, t) -> params, state``; state is (m, v, w) per host
  (a leading HOSTS axis) or global (HOSTS = 1)."""

  def direction(m, v, w, t):
    m_hat, v_hat = m / (1 - B1 ** t), v / (1 - B2 ** t)
    if mode == "host-debiased":
      v_hat = jnp.maximum(v_hat - (1 - 1 / HOSTS) * w / (1 - B2 ** t), v_hat / HOSTS)
    return m_hat / (jnp.sqrt(v_hat) + EPS)

  def leaf(p, state, g, t):
    m, v, w = state
    if mode == "global":
      feed, noise = g.mean(axis=(0, 1))[None], jnp.zeros_like(p)[None]
    else:
      feed, noise = _moments(g)
    m = B1 * m + (1 - B1) * feed
    v = B2 * v + (1 - B2) * feed ** 2
    w = B2 * w + (1 - B2) * noise
    update = direction(m, v, w, t).mean(axis=0)
    return p - lr * (update + WD * p), (m, v, w)

  def step(params, state, g, t):
    out = jax.tree.map(lambda p, s, gg: leaf(p, s, gg, t), params, state, g,
                       is_leaf=lambda x: isinstance(x, tuple))
    treedef = jax.tree.structure(params)
    pairs = treedef.flatten_up_to(out)
    return (treedef.unflatten([a for a, _ in pairs]), treedef.unflatten([b for _, b in pairs]))

  return step


def _init(params, mode):
  copies = 1 if mode == "global" else HOSTS
  zeros = lambda p: jnp.zeros((copies, *p.shape), p.dtype)  # noqa: E731
  return jax.tree.map(lambda p: (zeros(p), zeros(p), zeros(p)), params)


def train(task, steps: int, mode: str):
  """Held-out loss after ``steps`` steps of ``mode``."""
  grads = jax.jit(_device_grads(task.loss_fn))
  step = jax.jit(_step(mode, task.lr))
  params, state = task.params, _init(task.params, mode)
  for t in range(1, steps + 1):
    params, state = step(params, state, grads(params, task.batch(t - 1)), t)
  return float(jax.jit(task.loss_fn)(params, task.held_out))


def shadow(task, steps: int, report: Sequence[int]):
  """Along the global trajectory, the per-host moments' inflation and step agreement."""
  grads = jax.jit(_device_grads(task.loss_fn))
  step = jax.jit(_step("global", task.lr))
  flat = lambda tree: jnp.concatenate([x.reshape(x.shape[0], -1)  # noqa: E731
                                       for x in jax.tree.leaves(tree)], axis=1)

  @jax.jit
  def observe(moments, g, t):
    m, v, w, mg, vg = moments
    host, noise = _moments(g)
    glob = g.mean(axis=(0, 1))[None]
    m, v, w = B1 * m + (1 - B1) * host, B2 * v + (1 - B2) * host ** 2, B2 * w + (1 - B2) * noise
    mg, vg = B1 * mg + (1 - B1) * glob, B2 * vg + (1 - B2) * glob ** 2
    c1, c2 = 1 - B1 ** t, 1 - B2 ** t
    vd = jnp.maximum(v - (1 - 1 / HOSTS) * w, v / HOSTS)
    ref = (mg / c1 / (jnp.sqrt(vg / c2) + EPS))[0]
    ways = {"host": (m / c1 / (jnp.sqrt(v / c2) + EPS)).mean(0),
            "host, v averaged": (m / c1 / (jnp.sqrt(v.mean(0) / c2) + EPS)).mean(0),
            "host-debiased": (m / c1 / (jnp.sqrt(vd / c2) + EPS)).mean(0)}
    stats = {"sqrt(v_h/v)": jnp.median(jnp.sqrt(v[0] / vg[0])),
             "sqrt(v_deb/v)": jnp.median(jnp.sqrt(vd[0] / vg[0]))}
    for name, u in ways.items():
      stats[f"{name}: norm"] = jnp.linalg.norm(u) / jnp.linalg.norm(ref)
      stats[f"{name}: cos"] = u @ ref / jnp.linalg.norm(u) / jnp.linalg.norm(ref)
    return (m, v, w, mg, vg), stats

  params, state = task.params, _init(task.params, "global")
  size = sum(p.size for p in jax.tree.leaves(params))
  moments = tuple(jnp.zeros((n, size)) for n in (HOSTS, HOSTS, HOSTS, 1, 1))
  rows = []
  for t in range(1, steps + 1):
    g = grads(params, task.batch(t - 1))
    moments, stats = observe(moments, flat(jax.tree.map(
        lambda x: x.reshape(HOSTS * LOCAL, *x.shape[2:]), g)).reshape(HOSTS, LOCAL, size), t)
    if t in report:
      rows.append((t, {k: float(v) for k, v in stats.items()}))
    params, state = step(params, state, g, t)
  return rows


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--modes", default="global,host,host-debiased")
  parser.add_argument("--no-shadow", action="store_true")
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  results = {}
  for seed in seeds:
    task = tasks.gpt("default", HOSTS * LOCAL * PER_DEVICE, args.steps, seed)
    if not args.no_shadow:
      for t, stats in shadow(task, args.steps, {10, 50, 100, args.steps // 2, args.steps}):
        print(f"seed {seed} step {t:5d} " + "  ".join(f"{k} {v:.3f}" for k, v in stats.items()),
              flush=True)
    for mode in args.modes.split(","):
      results[mode, seed] = train(task, args.steps, mode)
      print(f"seed {seed} {mode:14s} held-out {results[mode, seed]:.4f}", flush=True)
  for mode in args.modes.split(","):
    losses = np.array([results[mode, s] for s in seeds])
    gaps = [100 * (results[mode, s] / results["global", s] - 1) for s in seeds
            if ("global", s) in results]
    print(f"{mode:14s} held-out {losses.mean():.4f} gaps to global "
          + ", ".join(f"{gap:+.2f}%" for gap in gaps))
  return 0


if __name__ == "__main__":
  sys.exit(main())
