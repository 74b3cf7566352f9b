"""Reshard after forward: HSDP's parameters gathered where each operation reads them, and
gathered again in the backward pass, so the full model is never resident at once.

:func:`regathered` turns ``loss(shards, *args)`` (whose jaxpr all-gathers every shard over the
fast axis, :func:`jaxcomm._src.optim.hsdp.gather_params`) into the same function evaluated
lazily: every value computed from the shards alone (the all-gather, the slice and reshape
back to the leaf's shape, a transpose or a cast) is deferred to the first operation that
combines it with a value of the batch (a matmul with an activation, a bias add, an
embedding lookup). That operation runs inside a ``jax.custom_vjp`` which

* in the forward pass gathers the shards it reads *tied by data to its batch operand*, so
  XLA cannot schedule the all-gather before the previous layer's output exists (on the CPU
  backend it issues every untied all-gather at the start of the step: docs/hsdp.md), and
  keeps only the shards and its other operands as residuals, never the gathered leaf (an
  operation whose own backward needs no operand, a bias add, now keeps its input too);
* in the backward pass gathers the shards again, tied to the incoming cotangent, and
  differentiates the operation with ``jax.vjp``: the all-gather transposes into the
  reduce-scatter of that leaf's gradient; the cotangent passed on to the layer below is tied
  to the reduce-scattered gradient, so the full-size gradient dies there too.

A tie adds ``-(0 * |t|)`` for one finite scalar ``t`` of the operand (``-0.0`` exactly, so
``shard + tie`` is bit-identical to ``shard``, also for a non-finite operand: a non-finite
``t`` is replaced by 0 first). XLA does not fold ``0 * t`` for floats, and the two gathers
differ by their ties, so common-subexpression elimination cannot merge them.

Bytes per step and fast axis, per leaf of ``d`` elements, ``d' = G ceil(d/G)``: the forward
all-gather and the gradient's reduce-scatter, ``2 (G-1)/G * 4 d'``, as without resharding,
plus ``(G-1)/G * 4 d'`` for the backward re-gather of every leaf whose value the backward
needs (a weight whose input needs a gradient, a norm's scale; not the first layer's weight,
whose input is the batch, nor a bias, whose gradient reads no value: XLA removes those
unused gathers). A leaf read by ``k`` operations (a tied embedding: the lookup and the
output projection) is gathered ``k`` times in the forward pass and once more for each of
those operations whose backward reads it.

Operations inside ``jit`` calls (``jnp.dot``, ``jnp.take``) are followed into; any other
higher-order operation (``scan``, ``cond``, ``custom_jvp``, ``checkpoint``) that reads a
parameter is one operation: its leaves are gathered when it starts and again for its
backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

# Call primitives whose inner jaxpr is followed into (their body is inlined).
_INLINED = frozenset({"pjit", "jit", "closed_call", "core_call"})


class _Node:
  """A value computed from the parameter shards alone, not computed yet: shard ``index``
  (``eqn`` None), or output ``index`` of ``eqn`` on ``inputs``; the outputs of one ``eqn``
  share ``call``, so it is bound once."""

  def __init__(self, eqn, inputs: tuple, index: int, call: "_Node | None" = None):
    self.eqn, self.inputs, self.index = eqn, inputs, index
    self.call = self if call is None else call


class _Literal:
  """A literal of the jaxpr (a concrete constant)."""

  def __init__(self, value):
    self.value = value


class _Static:
  """A value that reads neither the shards nor the batch (a constant, perhaps traced)."""

  def __init__(self, value):
    self.value = value


def _bind(eqn, values: list) -> list:
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _externals(values) -> tuple[list[int], list]:
  """The shard indices and the other non-literal inputs (batch values, :class:`_Static`
  constants; each once) that ``values`` read."""
  shards, externals, seen = set(), [], set()
  stack = list(values)
  while stack:
    value = stack.pop()
    if isinstance(value, _Node):
      if value.eqn is None:
        shards.add(value.index)
      stack.extend(value.inputs)
    elif not isinstance(value, _Literal) and id(value) not in seen:
      seen.add(id(value))
      externals.append(value)
  return sorted(shards), externals


def _floating(x) -> bool:
  return jnp.issubdtype(getattr(x, "dtype", jnp.int32), jnp.floating)


def _tie(shards: list, operands: list) -> list:
  """``shards`` plus ``-0.0`` computed from one scalar of ``operands``: bit-identical values
  that XLA cannot compute before that operand exists."""
  for operand in jax.tree.leaves(operands):
    dtype = getattr(operand, "dtype", None)
    if dtype is not None and operand.size and (jnp.issubdtype(dtype, jnp.floating)
                                               or jnp.issubdtype(dtype, jnp.integer)):
      t = jax.lax.stop_gradient(jnp.ravel(operand)[0]).astype(jnp.float32)
      zero = -(0.0 * jnp.abs(jnp.where(jnp.isfinite(t), t, 0.0)))
      return [shard + zero.astype(shard.dtype) for shard in shards]
  return shards


def _materialized(eqn, inputs: list, shards: list) -> list:
  """``eqn`` applied to ``inputs``, whose nodes are computed from ``shards`` inside a
  ``custom_vjp`` that gathers them tied to ``eqn``'s batch operands (forward) or to its
  cotangents (backward) and keeps only the shards and the external inputs as residuals.
  ``eqn=None``: the nodes ``inputs`` themselves (a loss term of the parameters alone)."""
  used, externals = _externals(inputs)
  ties = [i for i, x in enumerate(externals) if any(x is y for y in inputs)
          and not isinstance(x, _Static)]

  def plain(own: list, values: list) -> list:
    roots = dict(zip(used, own))
    replaced = {id(old): new for old, new in zip(externals, values)}
    calls: dict[int, list] = {}

    def value(x):
      if isinstance(x, _Literal):
        return x.value
      if not isinstance(x, _Node):
        return replaced[id(x)]
      if x.eqn is None:
        return roots[x.index]
      if id(x.call) not in calls:
        calls[id(x.call)] = _bind(x.eqn, [value(i) for i in x.inputs])
      return calls[id(x.call)][x.index]

    computed = [value(x) for x in inputs]
    return computed if eqn is None else _bind(eqn, computed)

  @jax.custom_vjp
  def fused(own: list, values: list) -> list:
    return plain(_tie(own, [values[i] for i in ties]), values)

  def forward(own, values):
    return fused(own, values), (own, values)

  def backward(residuals, cotangents):
    own, values = residuals
    own_ct, values_ct = jax.vjp(lambda o, v: plain(_tie(o, cotangents), v),
                                own, values)[1](cotangents)
    # The batch values' cotangents (what the backward pass goes on with) wait for the
    # shards' reduce-scattered gradients, so that the full-size gradient dies here.
    return own_ct, [_tie([ct], own_ct)[0] if _floating(ct) else ct for ct in values_ct]

  fused.defvjp(forward, backward)
  return fused([shards[i] for i in used],
               [x.value if isinstance(x, _Static) else x for x in externals])


def _run(jaxpr, env: dict, shards: list) -> list:
  """Evaluates ``jaxpr`` with ``env`` (its invars and constvars bound), deferring what reads
  the shards and no batch value; returns its outputs."""

  def read(var):
    return _Literal(var.val) if isinstance(var, Literal) else env[var]

  for eqn in jaxpr.eqns:
    inputs = [read(var) for var in eqn.invars]
    nodes = any(isinstance(x, _Node) for x in inputs)
    batch = any(not isinstance(x, (_Node, _Static, _Literal)) for x in inputs)
    if nodes and eqn.primitive.name in _INLINED:
      inner = eqn.params["jaxpr"]
      inner_env = dict(zip(inner.jaxpr.constvars, map(_Static, inner.consts)))
      inner_env.update(zip(inner.jaxpr.invars, inputs))
      outputs = _run(inner.jaxpr, inner_env, shards)
    elif nodes and not batch:
      first = _Node(eqn, tuple(inputs), 0)
      outputs = [first] + [_Node(eqn, first.inputs, i, first)
                           for i in range(1, len(eqn.outvars))]
    elif nodes:
      outputs = _materialized(eqn, inputs, shards)
    else:
      outputs = _bind(eqn, [x.value if isinstance(x, (_Static, _Literal)) else x
                            for x in inputs])
      if not batch:
        outputs = [_Static(x) for x in outputs]
    env.update(zip(eqn.outvars, outputs))
  return [read(var) for var in jaxpr.outvars]


def regathered(loss: Callable) -> Callable:
  """``loss(shards, *args)``, evaluated so that each parameter leaf is gathered where an
  operation reads it, and gathered again for that operation's backward pass (module
  docstring: the ties, the bytes).

  Args:
    loss: ``loss(shards, *args) -> scalar`` whose body all-gathers ``shards`` (a pytree) over
      the fast axis (:func:`jaxcomm._src.optim.hsdp.gather_params`) and computes the loss
      from the full parameters and ``args`` (the batch, a key); called inside ``shard_map``.

  Returns:
    A function with ``loss``'s signature and values (bit-identical); its gradients are
    ``loss``'s up to the order XLA sums them in.
  """

  def wrapped(shards, *args):
    closed, shape = jax.make_jaxpr(loss, return_shape=True)(shards, *args)
    leaves = jax.tree.leaves(shards)
    env = dict(zip(closed.jaxpr.constvars, map(_Static, closed.consts)))
    env.update(zip(closed.jaxpr.invars, [_Node(None, (), i) for i in range(len(leaves))]
                   + jax.tree.leaves(args)))
    outputs = _run(closed.jaxpr, env, leaves)
    lazy = [i for i, x in enumerate(outputs) if isinstance(x, _Node)]
    if lazy:
      for i, value in zip(lazy, _materialized(None, [outputs[i] for i in lazy], leaves)):
        outputs[i] = value
    outputs = [x.value if isinstance(x, (_Static, _Literal)) else x for x in outputs]
    return jax.tree.unflatten(jax.tree.structure(shape), outputs)

  return wrapped
