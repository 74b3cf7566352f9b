"""The method registry: each entry says how to build one way of averaging gradients.

A :class:`Method` is a name, a one-line summary, ``build(setting)`` returning the *whole*
optimizer (an ``optax.GradientTransformation`` whose first element communicates; methods
such as 1-bit Adam that replace the optimizer return their own chain) and, where the cost
model can describe it, ``project(setting, shapes, hosts, local, fast, slow)`` returning the
modeled communication of one step of a large model (see :mod:`benchmarks.scan.projection`).
``make_step`` builds the train step; every method here uses :func:`jaxcomm.data_parallel_step`
(replicated parameters, batch split over the devices). A method whose parameters differ per
device (gossip, local SGD between syncs) supplies its own.

Adding a method is adding one :func:`register` call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxcomm
from benchmarks.scan import projection

AXES = ("host", "local")


@dataclasses.dataclass(frozen=True)
class Setting:
  """What a builder may read: the flags, the mesh sizes and the parameters.

  Attributes:
    lr: learning rate of the optimizer after the allreduce.
    seed: seed for stochastic compressors.
    topk_fraction: fraction of each shard that top-k and random-k send.
    sketch_fraction: count-sketch cells as a fraction of the shard's elements.
    hosts: size of the slow axis.
    local: size of the fast axis.
    params: the model parameters (a pytree of arrays).
    steps: training steps of the run (sets warm-up lengths).
  """
  lr: float
  seed: int
  topk_fraction: float
  sketch_fraction: float
  hosts: int
  local: int
  params: Any
  steps: int = 1000

  @property
  def shard_elements(self) -> int:
    """Elements of one device's slow-axis shard of all parameters in one bucket."""
    total = sum(leaf.size for leaf in jax.tree.leaves(self.params))
    return -(-total // self.local)


class Method(NamedTuple):
  """One entry of the registry.

  Attributes:
    name: the ``--methods`` name.
    summary: one line for ``--help`` and the docs.
    build: ``build(setting) -> optax.GradientTransformation``, the whole optimizer.
    project: ``project(setting, shapes, hosts, local, fast, slow) -> projection.Comm`` for a
      large model's gradient shapes, or ``None`` where the cost model has no formula.
    make_step: ``make_step(loss_fn, tx, mesh, specs) -> step(params, state, batch)`` returning
      ``(params, state, loss)``.
    device_local: every device trains its own copy of the parameters (local SGD, DiLoCo,
      gossip); the held-out loss is that of the devices' average.
    comm_every: the method's collectives run once every this many steps (they sit inside a
      ``lax.cond``, which the compiled program contains once): bytes per step are divided by it.
    branch_fractions: ``branch_fractions(setting, opt_state) -> fractions``: for a method whose
      step is one outermost ``lax.cond``/``lax.switch`` with collectives in several branches
      (1-bit Adam, 0/1 Adam), the fraction of the run's steps that took each branch, read from
      the final state: each branch's bytes are weighted by it (``None``: every collective
      counts once per step).
  """
  name: str
  summary: str
  build: Callable[[Setting], optax.GradientTransformation]
  project: Callable[..., projection.Comm] | None
  make_step: Callable = jaxcomm.data_parallel_step
  device_local: bool = False
  comm_every: int = 1
  branch_fractions: Callable[[Setting, Any], Sequence[float]] | None = None


REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
  """Adds ``method`` to :data:`REGISTRY` (names are unique)."""
  if method.name in REGISTRY:
    raise ValueError(f"method {method.name!r} is already registered.")
  REGISTRY[method.name] = method
  return method


def _adamw(reduce: optax.GradientTransformation, setting: Setting):
  return optax.chain(reduce, optax.adamw(setting.lr))


def _flat_pmean() -> optax.GradientTransformation:
  """The mean over every device in one flat full-precision all-reduce."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda grads, state, params=None: (jax.lax.pmean(grads, AXES), state))


def _compressed(name: str, summary: str, make_compressor: Callable[[Setting], Any] | None,
                *, strategy: str | None = None, feedback: bool = False,
                bucketed: bool = False, project: Callable | None = None) -> Method:
  """A :func:`jaxcomm.compressed_allreduce` method whose slow-axis compressor is
  ``make_compressor(setting)`` (``None``: full precision); ``bucketed`` packs all leaves into
  one bucket. ``project`` defaults to :func:`projection.hierarchical` per leaf."""

  def compressor(setting):
    return None if make_compressor is None else make_compressor(setting)

  def build(setting):
    bucket_bytes = (4 * sum(leaf.size for leaf in jax.tree.leaves(setting.params))
                    if bucketed else None)
    return _adamw(jaxcomm.compressed_allreduce(
        compressor(setting), strategy=strategy, feedback=feedback, seed=setting.seed,
        bucket_bytes=bucket_bytes), setting)

  def per_leaf(setting, shapes, hosts, local, fast, slow):
    return projection.hierarchical(shapes, hosts, local, fast, slow, compressor(setting),
                                   strategy)

  return Method(name, summary, build, project or per_leaf)


def _sketch(setting: Setting):
  # One row: the estimate s(i) S[h(i)] is unbiased and the sketch linear. Error feedback in
  # parameter space diverges with a count sketch (its error is not contractive: measured);
  # FetchSGD keeps momentum and error inside the sketch, which jaxcomm does not offer.
  width = max(1, math.ceil(setting.sketch_fraction * setting.shard_elements))
  return jaxcomm.count_sketch(width, 1, seed=setting.seed)


def _sketch_project(setting, shapes, hosts, local, fast, slow):
  # The model's gradient in one bucket: one sketch of sketch_fraction of its shard.
  total = sum(math.prod(shape) for shape in shapes)
  big = dataclasses.replace(setting, params=[jax.ShapeDtypeStruct((total,), jnp.float32)])
  return projection.hierarchical([(total,)], hosts, local, fast, slow, _sketch(big), None)


def _powersgd(rank: int) -> Method:
  return Method(
      f"powersgd-r{rank}",
      f"PowerSGD rank {rank} across hosts (dense psum inside), error feedback, warm start",
      lambda setting: _adamw(jaxcomm.powersgd_allreduce(rank, seed=setting.seed), setting),
      lambda setting, shapes, hosts, local, fast, slow: projection.powersgd(
          shapes, hosts, local, fast, slow, rank))


def _diloco(period: int, sync: str | None) -> Method:
  """DiLoCo: ``period`` local AdamW steps per device, then an outer Nesterov step on the
  averaged pseudo-gradient, synchronized at full precision or with 1-bit sign + EF."""
  label = "fp32" if sync is None else "1-bit sign with error feedback"

  def build(setting):
    reduce = jaxcomm.compressed_allreduce(None if sync is None else jaxcomm.sign())
    return jaxcomm.diloco(optax.adamw(setting.lr), period, sync=reduce)

  def project(setting, shapes, hosts, local, fast, slow):
    comm = projection.hierarchical(shapes, hosts, local, fast, slow,
                                   None if sync is None else jaxcomm.sign(), "gather")
    return comm._replace(**{field: getattr(comm, field) / period for field in comm._fields})

  name = f"diloco-h{period}" + ("" if sync is None else "-sign")
  return Method(name, f"DiLoCo: {period} local AdamW steps per device, then an outer Nesterov "
                f"step on the averaged pseudo-gradient ({label} sync)", build, project,
                make_step=jaxcomm.local_training_step, device_local=True, comm_every=period)


def _onebit_warmup(setting: Setting) -> int:
  return max(1, setting.steps // 10)


def _onebit_fractions(setting: Setting, state) -> list[float]:
  """``[1-bit, warm-up]``: ``lax.cond`` puts its false branch first."""
  steps = int(state.count)
  warmup = min(steps, _onebit_warmup(setting))
  return [(steps - warmup) / steps, warmup / steps]


def _zero_one_adam() -> Method:
  """0/1 Adam with a schedule scaled to the run: variance frozen after a quarter of it."""
  clipper = 8

  def build(setting):
    return jaxcomm.zero_one_adam(
        setting.lr, var_freeze_step=max(1, setting.steps // 4), var_update_scaler=8,
        local_step_scaler=max(1, setting.steps // 30), local_step_clipper=clipper)

  def fractions(setting, state) -> list[float]:
    """Steps per branch ``[variance, 1-bit, local, sync]`` from the final state's counters."""
    steps, rounds = int(state.count), int(state.rounds)
    before_freeze = min(steps, max(1, setting.steps // 4))
    variance = int(state.var_updates)
    counts = [variance, before_freeze - variance, steps - rounds, rounds - before_freeze]
    return [count / steps for count in counts]

  def project(setting, shapes, hosts, local, fast, slow):
    comm = projection.hierarchical(shapes, hosts, local, fast, slow, jaxcomm.sign(),
                                   "two_phase")
    return comm._replace(**{field: getattr(comm, field) / clipper for field in comm._fields})

  return Method("zero-one-adam", "0/1 Adam: variance updated on a thinning step set (dense) with "
                "1-bit gradients between, frozen after 1/4 of the run; then local Adam steps "
                f"and 1-bit syncs at gaps doubling up to {clipper}; projected at that gap",
                build, project, make_step=jaxcomm.local_training_step, device_local=True,
                branch_fractions=fractions)


def _entries() -> list[Method]:
  return [
      Method("fp32", "plain jax.lax.pmean over both axes at full precision (the reference)",
             lambda setting: _adamw(_flat_pmean(), setting),
             lambda setting, *args: projection.flat_fp32(*args)),
      _compressed("fp32-hier", "jaxcomm hierarchical allreduce, full precision on both axes",
                  None),
      _compressed("identity", "the identity compressor across hosts (psum of its payload): "
                  "the reference for compression overhead", lambda s: jaxcomm.identity()),
      _compressed("bf16", "bfloat16 cast across hosts, summed with psum (linear)",
                  lambda s: jaxcomm.cast(jnp.bfloat16, axis_size=s.hosts)),
      _compressed("int8", "8-bit stochastic quantization across hosts (unbiased, no error "
                  "feedback)", lambda s: jaxcomm.quantize(8)),
      _compressed("qsgd", "QSGD with 16 levels across hosts (unbiased, no error feedback)",
                  lambda s: jaxcomm.qsgd(16)),
      _compressed("terngrad", "TernGrad, 2 bits per element across hosts (unbiased, no error "
                  "feedback)", lambda s: jaxcomm.terngrad()),
      _compressed("sign-ef", "scaled 1-bit sign across hosts, error feedback, all-gather",
                  lambda s: jaxcomm.sign(), strategy="gather", feedback=True),
      _compressed("sign-ef-2p", "scaled 1-bit sign, error feedback, two-phase (all-to-all, "
                  "re-compress, all-gather)", lambda s: jaxcomm.sign(), strategy="two_phase",
                  feedback=True),
      _compressed("topk-ef", "top-k (--topk-fraction) across hosts, error feedback, all-gather",
                  lambda s: jaxcomm.topk(s.topk_fraction), strategy="gather", feedback=True),
      _compressed("topk-ef-2p", "top-k with error feedback, two-phase (all-to-all, "
                  "re-compress, all-gather)", lambda s: jaxcomm.topk(s.topk_fraction),
                  strategy="two_phase", feedback=True),
      _compressed("randomk-ef", "random-k (--topk-fraction, indices shared, unscaled) across "
                  "hosts, error feedback, psum",
                  lambda s: jaxcomm.randomk(s.topk_fraction, scale=False, seed=s.seed),
                  feedback=True),
      _compressed("sketch", "count sketch (one row, --sketch-fraction of the shard) of all "
                  "gradients in one bucket, psum, every estimate decoded (unbiased, no error "
                  "feedback)", _sketch, bucketed=True, project=_sketch_project),
      _powersgd(1),
      _powersgd(4),
      Method("dgc", "Deep Gradient Compression: momentum correction and masking, top-k "
             "(--topk-fraction) of the velocity over all devices, all-gather; SGD after it",
             lambda s: optax.chain(jaxcomm.dgc(s.topk_fraction), optax.sgd(10 * s.lr)),
             lambda s, shapes, hosts, local, fast, slow: projection.hierarchical(
                 shapes, hosts, local, fast, slow, jaxcomm.topk(s.topk_fraction), "gather")),
      _diloco(8, None),
      _diloco(8, "sign-ef"),
      Method("gossip-ring", "decentralized AdamW: a local step, then averaging with the two ring "
             "neighbours by ppermute (no allreduce)",
             lambda s: jaxcomm.gossip(optax.adamw(s.lr), "ring"), None,
             make_step=jaxcomm.local_training_step, device_local=True),
      Method("onebit-adam", "1-bit Adam: dense Adam for 10% of the steps, then frozen variance "
             "and 1-bit momentum across hosts (two-phase, worker and server error feedback); bytes "
             "per step weigh the warm-up and 1-bit branches by the steps each ran",
             lambda s: jaxcomm.onebit_adam(s.lr, warmup_steps=_onebit_warmup(s)),
             lambda s, shapes, hosts, local, fast, slow: projection.hierarchical(
                 shapes, hosts, local, fast, slow, jaxcomm.sign(), "two_phase"),
             branch_fractions=_onebit_fractions),
      _zero_one_adam(),
  ]


for _method in _entries():
  register(_method)
