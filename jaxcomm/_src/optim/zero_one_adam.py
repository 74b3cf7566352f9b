"""0/1 Adam (Lu et al. 2023): adaptive variance freezing and skipped synchronization rounds.

1-bit Adam needs a dense warm-up and then communicates 1-bit momentum every step. 0/1 Adam
removes both costs. Before ``var_freeze_step`` the variance is updated only on an
exponentially thinning set of steps ``T_v`` (the gradient is averaged at full precision on
those steps and by 1-bit elsewhere); after it the variance is frozen, each device takes
local Adam steps with its own momentum, and the devices synchronize only on a thinning set
of steps ``T_u`` (gaps 1, 2, 4, ... up to ``local_step_clipper``), averaging the momentum
accumulated since the last synchronization with the 1-bit collective.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.collectives.hierarchical import init_states
from jaxcomm._src.collectives.strategies import Strategy, TwoPhase
from jaxcomm._src.keys import unread_key
from jaxcomm._src.mesh_axes import first_invariant, require_axes, require_varying, vary
from jaxcomm._src.optim import hsdp
from jaxcomm._src.optim.onebit_adam import adam_setup, allreduce_leaves
from jaxcomm._src.topology import HOST_AXIS, LOCAL_AXIS
from jaxcomm._src.validation import check_float_tree, check_int_range, check_learning_rate

# Branches of one step, in the order of the ``lax.switch``.
VARIANCE, ONEBIT, LOCAL, SYNC = range(4)
MAX_DOUBLINGS = 30  # 2**30 steps: intervals never grow further (and int32 never overflows)


class ZeroOneAdamState(NamedTuple):
  """State of :func:`zero_one_adam`.

  Attributes:
    count: int32 steps taken.
    mu: first moment, float32, device-local: equal on every device until the variance
      freezes, this device's own between synchronizations afterwards.
    nu: second moment, float32, replicated; frozen after ``var_freeze_step``.
    anchor: float32 parameters at the last synchronization, device-local (equal on every
      device).
    weight_sum: float32 sum of the local steps' weights ``lr_t / (1 - b1^t)`` since the last
      synchronization.
    local_steps: int32 local steps since the last synchronization.
    next_var_step: int32 1-based step of the next variance update.
    steps_per_kind: int32 ``(4,)``: steps taken of each kind, in the order variance, 1-bit,
      local, synchronization (the branches of the step's ``lax.switch``, so
      ``steps_per_kind / count`` weighs their bytes in
      ``CommReport.link_bytes(branch_weights=...)``).
    residuals: per leaf, the slow level's error feedback (two-phase: worker and server
      residuals).
  """
  count: jax.Array
  mu: Any
  nu: Any
  anchor: Any
  weight_sum: jax.Array
  local_steps: jax.Array
  next_var_step: jax.Array
  steps_per_kind: jax.Array
  residuals: tuple

  @property
  def var_updates(self) -> jax.Array:
    """Variance updates so far (the variance's bias correction)."""
    return self.steps_per_kind[VARIANCE]

  @property
  def rounds(self) -> jax.Array:
    """Steps that communicated (dense or 1-bit): ``count - rounds`` were skipped."""
    return self.count - self.steps_per_kind[LOCAL]


def _doubling(steps: jax.Array, every: int) -> jax.Array:
  """``2 ** (steps // every)``, capped at ``2 ** MAX_DOUBLINGS``."""
  exponent = jnp.clip(steps // every, 0, MAX_DOUBLINGS)
  return jnp.left_shift(jnp.ones_like(exponent), exponent)


def zero_one_adam(learning_rate: optax.ScalarOrSchedule, *, var_freeze_step: int,
                  var_update_scaler: int = 16, local_step_scaler: int = 32768,
                  local_step_clipper: int = 16, b1: float = 0.9, b2: float = 0.999,
                  eps: float = 1e-8, fast_axis: str = LOCAL_AXIS,
                  slow_axis: str = HOST_AXIS, strategy: str | Strategy | None = TwoPhase()
                  ) -> optax.GradientTransformation:
  """0/1 Adam over a ``(slow, fast)`` mesh for device-local parameters.

  Step ``t`` (1-based) is one of four kinds; all devices agree on the kind (it depends on
  replicated counters only) and only that kind's collectives run (``lax.switch``):

  * variance step (``t <= var_freeze_step`` and ``t`` in ``T_v``): the gradient is averaged
    at full precision, ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``. ``T_v`` starts
    with every step; after each ``var_update_scaler`` variance updates (the paper's kappa)
    the gap between them doubles: ``T_v = {1, ..., k, k+2, k+4, ..., 3k, 3k+4, ...}``.
  * 1-bit step (``t <= var_freeze_step``, not in ``T_v``): the gradient is averaged by
    1-bit, ``m = b1 m + (1 - b1) g``; ``v`` is unchanged.

    Both update the parameters as Adam does, ``theta -= w_t m / (sqrt(v_hat) + eps)``, with
    ``w_t = lr_t / (1 - b1^t)`` and ``v_hat = v / (1 - b2^k)`` after ``k`` variance updates.
  * local step (``t > var_freeze_step``): no communication; each device updates its own
    momentum with its own gradient and takes the same Adam step on its own parameters.
  * synchronization (``t > var_freeze_step`` and ``t`` in ``T_u``): a local step, then the
    devices average their accumulated momenta ``u_i = (anchor - theta_i) (sqrt(v_hat) +
    eps) = sum_s w_s m_i,s`` by 1-bit; every device sets ``theta = anchor - mean(u) /
    (sqrt(v_hat) + eps)`` (the anchor, the same on all of them) and ``m = mean(u) / sum_s
    w_s``. The gap between synchronizations starts at 1 and doubles every
    ``local_step_scaler`` steps after the freeze, up to ``local_step_clipper`` (the paper's
    ``H``). The 1-bit residuals restart from zero at the freeze: they held gradients, now
    they hold accumulated momenta (as DeepSpeed does).

  1-bit averaging is full precision over ``fast_axis`` and scaled sign over ``slow_axis``
  with ``strategy`` (by default the two-phase collective, worker and server error feedback). Coordinates whose
  variance is still 0 (no gradient on any variance step) are not updated, as in
  :func:`jaxcomm.onebit_adam`.

  With ``var_update_scaler >= var_freeze_step`` every step before the freeze is a variance
  step: Adam on the mean gradient (tested equal to ``optax.adam``). With
  ``local_step_clipper=1`` every step after it synchronizes: 1-bit Adam after its warm-up
  (tested equal to :func:`jaxcomm.onebit_adam` once ``b1^t`` is negligible, since 0/1 Adam
  compresses ``w_t m`` where 1-bit Adam compresses ``m``).

  Bytes per device and step, for a leaf of ``D`` bytes (``d`` elements), ``G`` devices per
  host and ``H`` hosts: ``2 (G-1)/G D`` over the fast axis and ``2 (H-1)/H D/G`` over the
  slow axis on a variance step; ``2 (G-1)/G D`` and about ``2 (ceil(d/G)/8 + 4 H)`` on a
  1-bit step or a synchronization; nothing on a local step. ``state.rounds`` counts the
  steps that communicated.

  Args:
    learning_rate: a float or an optax schedule of the 0-based step.
    var_freeze_step: the last step that may update the variance, ``>= 1``.
    var_update_scaler: variance updates between doublings of their gap, ``>= 1``.
    local_step_scaler: steps after the freeze between doublings of the synchronization gap,
      ``>= 1``.
    local_step_clipper: the largest synchronization gap ``H``, ``>= 1``.
    b1: first-moment decay, in [0, 1).
    b2: second-moment decay, in [0, 1).
    eps: added to the root of the variance, ``>= 0``.
    fast_axis: intra-host mesh axis.
    slow_axis: inter-host mesh axis.
    strategy: how the slow axis sums the 1-bit values, as for :func:`jaxcomm.onebit_adam`.

  Returns:
    An ``optax.GradientTransformation`` whose ``update(grads, state, params)`` takes this
    device's gradients of its own parameters (:func:`jaxcomm.optim.to_device_local`, stepped by
    :func:`jaxcomm.optim.local_training_step`) and returns each device's parameter update; create
    its state with ``jaxcomm.optim.sharded_init(tx, params, mesh, PartitionSpec(mesh.axis_names))``.
    The parameters of all devices are equal after every step up to the freeze and, to the
    rounding of ``p + (new - p)`` in ``optax.apply_updates``, after every synchronization
    (the state's ``anchor`` holds the exact synchronized parameters; a device's rounding is
    part of its next accumulated momentum, so it never grows). Under
    ``jaxcomm.data_parallel(..., shard_over=fast_axis)`` each host is one worker holding its
    parameters, momentum and anchor as ``1/G`` shards (docs/hsdp.md).

  References:
    Lu, Li, He, Tang, Zhang, Wang, Gao, Zhang & Yang, "Maximizing Communication Efficiency
    for Large-scale Training via 0/1 Adam", ICLR 2023.
  """
  schedule = check_learning_rate("learning_rate", learning_rate)
  freeze = check_int_range("var_freeze_step", var_freeze_step, 1)
  var_scaler = check_int_range("var_update_scaler", var_update_scaler, 1)
  sync_scaler = check_int_range("local_step_scaler", local_step_scaler, 1)
  clipper = check_int_range("local_step_clipper", local_step_clipper, 1)
  b1, b2, eps, compressed_levels, dense_levels = adam_setup(b1, b2, eps, fast_axis, slow_axis,
                                                            strategy)
  hyper = _Hyper(b1, b2, eps, (fast_axis, slow_axis), compressed_levels, dense_levels)

  def init(params) -> ZeroOneAdamState:
    return _init_state(params, hyper)

  def update(grads, state: ZeroOneAdamState, params=None):
    if params is None:
      raise ValueError("zero_one_adam needs params in update(grads, state, params).")
    require_axes(hyper.axes, "zero_one_adam.update")
    require_varying(grads, hyper.axes, "zero_one_adam.update")
    t = state.count + 1
    frozen = t > freeze
    var_step = ~frozen & (t == state.next_var_step)
    gap = jnp.minimum(_doubling(t - freeze - 1, sync_scaler), clipper)
    sync = frozen & (state.local_steps + 1 >= gap)
    kind = jnp.where(frozen, jnp.where(sync, SYNC, LOCAL), jnp.where(var_step, VARIANCE, ONEBIT))
    step, treedef, param_leaves = _step_inputs(hyper, state, grads, params, schedule,
                                               var_step, freeze)
    branches = [functools.partial(branch, hyper, step)
                for branch in (_variance_step, _onebit_step, _local_step, _sync_step)]
    new_local, new_mu, new_nu, new_anchor, weight_sum, residuals = jax.lax.switch(
        kind, branches, state.residuals)
    updates = [(new - old).astype(p.dtype) for new, old, p in
               zip(new_local, step.local, param_leaves)]
    return treedef.unflatten(updates), ZeroOneAdamState(
        count=t, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu),
        anchor=treedef.unflatten(new_anchor), weight_sum=weight_sum,
        local_steps=jnp.where(frozen & ~sync, state.local_steps + 1, 0),
        next_var_step=jnp.where(var_step, t + _doubling(step.var_updates, var_scaler),
                                state.next_var_step),
        steps_per_kind=state.steps_per_kind.at[kind].add(1), residuals=residuals)

  return hsdp.shard_aware(optax.GradientTransformation(init, update))


class _Hyper(NamedTuple):
  """The static configuration of one :func:`zero_one_adam`."""
  b1: float
  b2: float
  eps: float
  axes: tuple[str, str]
  compressed_levels: tuple
  dense_levels: tuple


class _Step(NamedTuple):
  """One step's inputs, as float32 leaf lists in the gradients' leaf order."""
  grads: list
  local: list  # this device's parameters
  mu: list
  nu: list
  anchor: list
  weight: jax.Array  # w_t = lr_t / (1 - b1^t)
  weight_sum: jax.Array
  key: jax.Array
  var_updates: jax.Array  # variance updates including this step's
  first_sync: jax.Array  # whether this is the first step after the freeze


def _init_state(params, hyper: _Hyper) -> ZeroOneAdamState:
  require_axes(hyper.axes, "zero_one_adam.init")
  check_float_tree(params, "params")
  replicated = first_invariant(params, hyper.axes)
  if replicated:
    raise ValueError(
        f"zero_one_adam needs device-local parameters: params{replicated[0]} is "
        f"replicated over mesh axis {replicated[1]!r}. Give every device its own copy "
        "with jaxcomm.optim.to_device_local and step it with jaxcomm.optim.local_training_step.")
  as_float = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  int_zero = jnp.zeros((), jnp.int32)
  return ZeroOneAdamState(
      count=int_zero, mu=jax.tree.map(jnp.zeros_like, as_float),
      nu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
      anchor=as_float, weight_sum=jnp.zeros((), jnp.float32), local_steps=int_zero,
      next_var_step=int_zero + 1, steps_per_kind=jnp.zeros((4,), jnp.int32),
      residuals=tuple(init_states(hyper.compressed_levels, leaf.size, jnp.float32)
                      for leaf in jax.tree.leaves(params)))


def _step_inputs(hyper: _Hyper, state: ZeroOneAdamState, grads, params, schedule,
                 var_step: jax.Array, freeze: int):
  """``(_Step, treedef, parameter leaves)`` of one update."""
  grad_leaves, treedef = jax.tree.flatten(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
  param_leaves = treedef.flatten_up_to(params)
  t = (state.count + 1).astype(jnp.float32)
  step = _Step(
      grads=grad_leaves, local=[p.astype(jnp.float32) for p in param_leaves],
      mu=treedef.flatten_up_to(state.mu), nu=treedef.flatten_up_to(state.nu),
      anchor=treedef.flatten_up_to(state.anchor),
      weight=schedule(state.count) / (1 - hyper.b1 ** t), weight_sum=state.weight_sum,
      key=unread_key(),
      var_updates=state.var_updates + var_step, first_sync=state.count + 1 == freeze + 1)
  return step, treedef, param_leaves


def _momenta(hyper: _Hyper, step: _Step, gradients) -> list:
  return [hyper.b1 * m + (1 - hyper.b1) * g for m, g in zip(step.mu, gradients)]


def _denominators(hyper: _Hyper, step: _Step, variances) -> list:
  """``sqrt(v_hat) + eps``, ``v_hat`` bias-corrected by the variance updates so far."""
  correction = 1 - hyper.b2 ** jnp.maximum(step.var_updates, 1).astype(jnp.float32)
  return [jnp.sqrt(v / correction) + hyper.eps for v in variances]


def _adam_step(step: _Step, params, momenta, variances, scales) -> list:
  """``params - w_t m / (sqrt(v_hat) + eps)``, zero where the variance is 0."""
  return [jnp.where(v > 0, p - step.weight * m / d, p)
          for p, m, v, d in zip(params, momenta, variances, scales)]


def _synchronous(hyper: _Hyper, step: _Step, new_mu, new_nu, residuals):
  """Steps before the freeze: every device applies the same update to the anchor."""
  new_mu = [vary(m, hyper.axes) for m in new_mu]
  new_anchor = _adam_step(step, step.anchor, new_mu, new_nu,
                          _denominators(hyper, step, new_nu))
  return new_anchor, new_mu, new_nu, new_anchor, jnp.zeros((), jnp.float32), residuals


def _variance_step(hyper: _Hyper, step: _Step, residuals):
  """Full-precision mean gradient; momentum and variance updated."""
  averaged, _ = allreduce_leaves(step.grads, [((), ())] * len(step.mu), hyper.dense_levels,
                                 step.key)
  new_nu = [hyper.b2 * v + (1 - hyper.b2) * g * g for v, g in zip(step.nu, averaged)]
  return _synchronous(hyper, step, _momenta(hyper, step, averaged), new_nu, residuals)


def _onebit_step(hyper: _Hyper, step: _Step, residuals):
  """1-bit mean gradient; momentum updated, variance kept."""
  averaged, residuals = allreduce_leaves(step.grads, residuals, hyper.compressed_levels,
                                         step.key)
  return _synchronous(hyper, step, _momenta(hyper, step, averaged), step.nu, residuals)


def _local_step(hyper: _Hyper, step: _Step, residuals):
  """No communication: this device's own momentum and Adam step."""
  new_mu = _momenta(hyper, step, step.grads)
  return (_adam_step(step, step.local, new_mu, step.nu, _denominators(hyper, step, step.nu)),
          new_mu, step.nu, step.anchor, step.weight_sum + step.weight, residuals)


def _sync_step(hyper: _Hyper, step: _Step, residuals):
  """A local step, then the 1-bit mean of the momenta accumulated since the anchor."""
  scales = _denominators(hyper, step, step.nu)
  stepped = _adam_step(step, step.local, _momenta(hyper, step, step.grads), step.nu, scales)
  residuals = jax.tree.map(lambda r: jnp.where(step.first_sync, jnp.zeros_like(r), r),
                           residuals)
  accumulated = [(a - p) * d for a, p, d in zip(step.anchor, stepped, scales)]
  averaged, residuals = allreduce_leaves(accumulated, residuals, hyper.compressed_levels,
                                         step.key)
  new_anchor = [vary(jnp.where(v > 0, a - u / d, a), hyper.axes)
                for a, u, v, d in zip(step.anchor, averaged, step.nu, scales)]
  new_mu = [vary(u / (step.weight_sum + step.weight), hyper.axes) for u in averaged]
  return new_anchor, new_mu, step.nu, new_anchor, jnp.zeros((), jnp.float32), residuals
