"""Mixture-of-experts layer with expert parallelism: top-k routing and all-to-all dispatch.

Each device routes its own ``T`` tokens (one routing group per device, as in GShard): a
linear router gives ``logits = x W_g``, a softmax gives the gate probabilities, every token
picks its ``k`` most probable experts, and each expert accepts at most
``C = ceil(capacity_factor * T * k / E)`` tokens from the group. Assignments beyond
capacity are dropped (their output is 0; the caller's residual connection carries the
token). Kept assignments are packed into a ``(E, C, d)`` buffer that one all-to-all over the
expert axes sends to the device holding each expert (``E / P`` experts per device); every
device runs its experts' MLPs on the ``P * C`` slots it received, a second all-to-all sends
the results back, and each token sums its experts' outputs weighted by the gate.

Bytes per device for one exchange of the ``(E, C, d)`` buffer, ``S = E * C * d * itemsize``
(plus ``E * C * 4`` bytes of fp32 per-slot scales with ``dispatch_dtype='int8'``, where
``itemsize = 1``): flat, one all-to-all over all ``P`` expert devices, ``(P - 1) / P * S``;
hierarchical on a ``(slow, fast) = (H, L)`` mesh, ``(L - 1) / L * S`` over the fast axis and
then ``(H - 1) / H * S`` over the slow axis (the same off-host bytes as flat, in ``L`` times
fewer messages). A forward pass exchanges twice (dispatch and combine), the backward twice
more (their transposes, the same all-to-alls).

Deduplicated hierarchical dispatch (``dedup=True``, DeepSeek-V3 / DeepEP style) sends a token
across hosts once per destination host, however many of its ``k`` experts live there, in
``R = min(T, (E/H) C)`` rows per host plus 8 bytes of slot metadata per slot: per forward
``(H - 1) (2 R row + 8 (E/H) C)`` bytes over the slow axis instead of ``2 (H - 1) (E/H) C row``
(:func:`moe_layer`).

References:
  Lepikhin et al. 2021, "GShard: Scaling Giant Models with Conditional Computation and
  Automatic Sharding", https://arxiv.org/abs/2006.16668
  Fedus, Zoph & Shazeer 2022, "Switch Transformers: Scaling to Trillion Parameter Models with
  Simple and Efficient Sparsity", https://arxiv.org/abs/2101.03961
  Zoph et al. 2022, "ST-MoE: Designing Stable and Transferable Sparse Expert Models" (router
  z-loss), https://arxiv.org/abs/2202.08906
  Hwang et al. 2023, "Tutel: Adaptive Mixture-of-Experts at Scale" (hierarchical, 2D
  all-to-all), https://arxiv.org/abs/2206.03382
  DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (node-limited routing, one inter-node send
  per token and node, forwarded inside the node), https://arxiv.org/abs/2412.19437
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

DISPATCH_DTYPES = (None, "int8")


class MoEParams(NamedTuple):
  """Weights of a mixture-of-experts layer (global shapes; experts are sharded on axis 0).

  Attributes:
    router: ``(d, E)`` router weights ``W_g``, replicated.
    w_in: ``(E, d, hidden)`` first expert matrices.
    w_out: ``(E, hidden, d)`` second expert matrices.
  """
  router: jax.Array
  w_in: jax.Array
  w_out: jax.Array


class MoEStats(NamedTuple):
  """Routing statistics of one group (one device's tokens).

  Attributes:
    aux_loss: load-balancing loss ``E * sum_e f_e P_e``: ``f_e`` the fraction of the group's
      ``T * k`` assignments (before capacity) that go to expert ``e``, ``P_e`` the mean gate
      probability of ``e``; 1 when routing is uniform.
    z_loss: router z-loss ``mean_t logsumexp(logits_t) ** 2`` (ST-MoE).
    dropped: assignments (token, choice) dropped because their expert was full.
    dropped_tokens: tokens that lost all ``k`` of their assignments.
  """
  aux_loss: jax.Array
  z_loss: jax.Array
  dropped: jax.Array
  dropped_tokens: jax.Array


class Routing(NamedTuple):
  """Dispatch and combine tensors of one group of ``T`` tokens.

  Attributes:
    dispatch: ``(T, E, C)`` 0/1: token ``t`` occupies slot ``c`` of expert ``e``.
    combine: ``(T, E, C)``: ``dispatch`` times the token's gate for ``e``.
    stats: the group's :class:`MoEStats`.
  """
  dispatch: jax.Array
  combine: jax.Array
  stats: MoEStats


class MoELayer(NamedTuple):
  """A configured layer (see :func:`moe_layer`).

  Attributes:
    init: ``init(key) -> MoEParams`` with global shapes.
    apply: ``apply(params, x) -> (y, MoEStats)``, inside ``jax.shard_map``, on local
      ``params`` (sharded by ``param_specs``) and local tokens ``x (..., d)``.
    param_specs: ``MoEParams`` of ``PartitionSpec`` for the ``shard_map`` ``in_specs``.
    exchange_bytes: ``exchange_bytes(tokens, itemsize=4) -> {axes: bytes}``, what each
      device sends per all-to-all exchange of the dispatch buffer for ``tokens`` local tokens
      (with ``dedup``: the combine's exchange, which carries no slot metadata).
    top_k: experts per token.
    forward_bytes: ``forward_bytes(tokens, itemsize=4) -> {axes: bytes}``, what each device
      sends in one forward pass (dispatch and combine, metadata included).
  """
  init: Callable[[jax.Array], MoEParams]
  apply: Callable[[MoEParams, jax.Array], tuple[jax.Array, MoEStats]]
  param_specs: MoEParams
  exchange_bytes: Callable[..., dict[tuple[str, ...], float]]
  top_k: int
  forward_bytes: Callable[..., dict[tuple[str, ...], float]]


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
  """Slots per expert for one group: ``ceil(capacity_factor * tokens * top_k / num_experts)``."""
  return math.ceil(capacity_factor * tokens * top_k / num_experts)


def route(x: jax.Array, router: jax.Array, *, top_k: int, capacity_factor: float) -> Routing:
  """Top-k routing of one group of tokens with capacity drops.

  Gates: the softmax probabilities of the chosen experts, renormalized to sum to 1 over the
  ``k`` choices when ``k > 1`` (GShard's top-2, Mixtral); with ``k = 1`` the raw probability
  (Switch). Priority for capacity is choice-major, then by position: every token's first
  choice is placed before any second choice, and within a choice earlier tokens first, so
  the drops are deterministic.

  Args:
    x: ``(T, d)`` tokens.
    router: ``(d, E)`` router weights.
    top_k: experts per token.
    capacity_factor: ``C = ceil(capacity_factor * T * top_k / E)``.

  Returns:
    :class:`Routing` with ``(T, E, C)`` tensors in fp32.
  """
  tokens, num_experts = x.shape[0], router.shape[1]
  slots = capacity(tokens, num_experts, top_k, capacity_factor)
  logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  top_probs, experts = jax.lax.top_k(probs, top_k)                       # (T, k)
  gates = top_probs / jnp.sum(top_probs, -1, keepdims=True) if top_k > 1 else top_probs
  chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)        # (T, k, E)
  queue = chosen.transpose(1, 0, 2).reshape(top_k * tokens, num_experts)
  ahead = (jnp.cumsum(queue, axis=0) - queue) * queue                   # earlier, same expert
  position = jnp.sum(ahead, -1).reshape(top_k, tokens).T                # (T, k)
  slot = jax.nn.one_hot(position, slots, dtype=jnp.float32)             # 0 when >= C
  placed = chosen.astype(jnp.float32)[..., None] * slot[:, :, None, :]  # (T, k, E, C)
  dropped = position >= slots
  stats = MoEStats(
      aux_loss=num_experts * jnp.sum(jnp.mean(chosen, (0, 1)) * jnp.mean(probs, 0)),
      z_loss=jnp.mean(jax.nn.logsumexp(logits, -1) ** 2),
      dropped=jnp.sum(dropped, dtype=jnp.int32),
      dropped_tokens=jnp.sum(jnp.all(dropped, -1), dtype=jnp.int32))
  return Routing(jnp.sum(placed, 1), jnp.einsum("tkec,tk->tec", placed, gates), stats)


def expert_mlp(w_in: jax.Array, w_out: jax.Array, x: jax.Array) -> jax.Array:
  """``gelu(x w_in) w_out`` per expert: ``w_in (E, d, h)``, ``w_out (E, h, d)``, ``x (E, n, d)``."""
  hidden = jax.nn.gelu(jnp.einsum("end,edh->enh", x, w_in))
  return jnp.einsum("enh,ehd->end", hidden, w_out).astype(x.dtype)


def moe_reference(params: MoEParams, x: jax.Array, *, num_groups: int, top_k: int,
                  capacity_factor: float) -> tuple[jax.Array, MoEStats]:
  """Dense single-device MoE: every token through every expert, kept outputs gate-weighted.

  Splits ``x (N, d)`` into ``num_groups`` consecutive groups routed independently (one per
  device of the sharded layer), so the capacity drops are the sharded layer's.

  Returns:
    ``(y (N, d), MoEStats)`` with per-group statistics stacked on a leading axis.
  """
  if x.shape[0] % num_groups:
    raise ValueError(f"tokens ({x.shape[0]}, x.shape[0]) must be divisible by "
                     f"num_groups={num_groups}.")
  groups = x.reshape(num_groups, -1, x.shape[-1])
  routing = jax.vmap(functools.partial(route, router=params.router, top_k=top_k,
                                       capacity_factor=capacity_factor))(groups)
  every = jax.vmap(lambda w_in, w_out: expert_mlp(w_in[None], w_out[None], x[None])[0])(
      params.w_in, params.w_out)                                         # (E, N, d)
  weights = jnp.sum(routing.combine, -1).reshape(x.shape[0], -1)         # (N, E)
  return jnp.einsum("ne,end->nd", weights, every), routing.stats


def _exchange(buffer: jax.Array, axes: tuple[str, ...], hierarchical: bool) -> jax.Array:
  """``(P, ...)`` blocks by destination device -> ``(P, ...)`` blocks by source device.

  Flat: one all-to-all over ``axes``, ``(P - 1) / P * S`` bytes per device for a buffer of
  ``S`` bytes. Hierarchical on ``axes = (slow, fast)`` (Tutel's 2D all-to-all): first inside
  the host, where device ``(h, l)`` hands its local peer ``l'`` every block bound for local
  index ``l'`` on any host, ``(L - 1) / L * S`` over ``fast``; ``l'`` is then the gateway
  that sends host ``h'`` the blocks of all ``L`` local devices in one message,
  ``(H - 1) / H * S`` over ``slow``. A permutation that is its own inverse (and transpose).
  """
  if not hierarchical:
    return jax.lax.all_to_all(buffer, axes, 0, 0, tiled=True)
  slow, fast = axes
  grid = buffer.reshape(jax.lax.axis_size(slow), -1, *buffer.shape[1:])
  grid = jax.lax.all_to_all(grid, fast, 1, 1, tiled=True)
  grid = jax.lax.all_to_all(grid, slow, 0, 0, tiled=True)
  return grid.reshape(buffer.shape)


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 codes of ``x (..., d)`` with one fp32 absmax scale per row ``(..., 1)``."""
  scale = jnp.max(jnp.abs(x), -1, keepdims=True).astype(jnp.float32) / 127
  scale = jnp.where(scale > 0, scale, 1.0)
  return jnp.round(x / scale).astype(jnp.int8), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _int8_exchange(exchange: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
  """``exchange`` of ``x`` sent as int8 codes plus per-row fp32 scales, dequantized on arrival.

  Rounding has no useful derivative, so the gradient is straight-through: the cotangent takes
  the transposed exchange (the same permutation), itself sent as int8 with per-row scales.
  """
  codes, scales = _quantize(x)
  return (exchange(codes).astype(jnp.float32) * exchange(scales)).astype(x.dtype)


def _int8_exchange_fwd(exchange, x):
  return _int8_exchange(exchange, x), None


def _int8_exchange_bwd(exchange, _, cotangent):
  return (_int8_exchange(exchange, cotangent),)


_int8_exchange.defvjp(_int8_exchange_fwd, _int8_exchange_bwd)


def _route_and_exchange(params: MoEParams, tokens: jax.Array, send, devices: int, *,
                        top_k: int, capacity_factor: float) -> tuple[jax.Array, MoEStats]:
  """Routes ``tokens (T, d)``, sends the ``(E, C, d)`` buffer to the experts' devices with
  ``send`` (blocks by destination -> by source), runs the local experts on the ``P C``
  received slots, sends the results back and combines them: ``(T, d)`` and the stats."""
  routing = route(tokens, params.router, top_k=top_k, capacity_factor=capacity_factor)
  local_experts, d_model = params.w_in.shape[0], tokens.shape[-1]
  slots = routing.dispatch.shape[-1]
  buffer = jnp.einsum("tec,td->ecd", routing.dispatch.astype(tokens.dtype), tokens)
  received = send(buffer.reshape(devices, local_experts, slots, d_model))
  expert_in = received.transpose(1, 0, 2, 3).reshape(local_experts, -1, d_model)
  expert_out = expert_mlp(params.w_in, params.w_out, expert_in)
  returned = send(expert_out.reshape(local_experts, devices, slots, d_model)
                  .transpose(1, 0, 2, 3))
  returned = returned.reshape(devices * local_experts, slots, d_model)
  return jnp.einsum("tec,ecd->td", routing.combine.astype(tokens.dtype), returned), routing.stats


def host_rows(tokens: int, num_experts: int, hosts: int, slots: int) -> int:
  """Rows per destination host of deduplicated dispatch: ``R = min(T, (E / H) C)``, the most
  distinct tokens that can hold kept slots of one host's ``E / H`` experts."""
  return min(tokens, num_experts // hosts * slots)


def _move(x: jax.Array, axis: str, split: int) -> jax.Array:
  return jax.lax.all_to_all(x, axis, split, split, tiled=True)


def _dedup_plan(routing: Routing, hosts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Which tokens cross to each host, and where their rows land in its experts' slots.

  Returns:
    ``rows (T, H, R)``: 0/1, token ``t`` is row ``r`` of host ``h``'s buffer (it holds a kept
    slot of an expert of ``h``; rows in token order); ``index (H, E/H, C)`` int32: the row that
    fills each slot of ``h``'s experts, ``R`` when empty; ``gate (H, E/H, C)``: its gate.
  """
  tokens, experts, slots = routing.dispatch.shape
  width = host_rows(tokens, experts, hosts, slots)
  per_host = routing.dispatch.reshape(tokens, hosts, experts // hosts, slots)
  needs = jnp.any(per_host > 0, (2, 3)).astype(jnp.int32)                 # (T, H)
  position = jnp.cumsum(needs, 0) - needs                                  # < R where needed
  rows = jax.nn.one_hot(position, width, dtype=jnp.float32) * needs[..., None]
  filled = jnp.sum(per_host, 0)
  index = jnp.einsum("thec,th->hec", per_host, position.astype(jnp.float32))
  index = jnp.where(filled > 0, jnp.round(index), width).astype(jnp.int32)
  gate = jnp.sum(routing.combine.reshape(per_host.shape), 0)
  return rows, index, gate


def _dedup_route_and_exchange(params: MoEParams, tokens: jax.Array, send, axes, *, top_k: int,
                              capacity_factor: float) -> tuple[jax.Array, MoEStats]:
  """Hierarchical dispatch sending each token across hosts once per destination host.

  Device ``(h, l)`` sends host ``h'`` its ``R`` distinct tokens with kept slots there (one
  ``(R, d)`` block, over ``slow`` to the gateway ``(h', l)``) with each slot's row index and
  gate; the gateway copies the rows into the ``(E/H, C, d)`` slots of ``h'``'s experts and
  fans them out over ``fast``. Back, the gateway sums each row's gate-weighted expert outputs
  and returns one ``(R, d)`` block per host. ``send(x, axis, split)`` is the all-to-all.
  """
  slow, fast = axes
  hosts, local = jax.lax.axis_size(slow), jax.lax.axis_size(fast)
  routing = route(tokens, params.router, top_k=top_k, capacity_factor=capacity_factor)
  rows, index, gate = _dedup_plan(routing, hosts)
  d_model, local_experts = tokens.shape[-1], params.w_in.shape[0]
  slots, width = index.shape[-1], rows.shape[-1]
  outgoing = jnp.einsum("thr,td->hrd", rows.astype(tokens.dtype), tokens)  # (H, R, d)
  arrived = send(outgoing, slow, 0)                                        # by source host
  index, gate = _move(index, slow, 0), _move(gate, slow, 0)
  padded = jnp.pad(arrived, ((0, 0), (0, 1), (0, 0)))                      # row R is zero
  fanned = jnp.take_along_axis(padded, index.reshape(hosts, -1, 1), axis=1)
  fanned = send(fanned.reshape(hosts, local, local_experts, slots, d_model), fast, 1)
  expert_in = fanned.transpose(2, 0, 1, 3, 4).reshape(local_experts, -1, d_model)
  expert_out = expert_mlp(params.w_in, params.w_out, expert_in)
  back = expert_out.reshape(local_experts, hosts, local, slots, d_model).transpose(1, 2, 0, 3, 4)
  back = send(back, fast, 1).reshape(hosts, -1, d_model)                   # at the gateway
  weighted = back * gate.reshape(hosts, -1, 1).astype(back.dtype)
  summed = jax.vmap(lambda v, i: jax.ops.segment_sum(v, i, width + 1))(
      weighted, index.reshape(hosts, -1))[:, :width]
  returned = send(summed, slow, 0)                                         # (H, R, d) by host
  return jnp.einsum("thr,hrd->td", rows.astype(tokens.dtype), returned), routing.stats


def _int8_move(x: jax.Array, axis: str, split: int) -> jax.Array:
  return _int8_exchange(functools.partial(_move, axis=axis, split=split), x)


def _dedup_bytes(mesh: Mesh, axes: tuple[str, ...], rows: int, slots: int, row: int, *,
                 metadata: int) -> dict[tuple[str, ...], float]:
  """Bytes per device of one deduplicated exchange: ``H R`` rows of ``row`` bytes (and
  ``metadata`` bytes per slot of the ``E C`` slots) over ``slow``, ``(H-1)/H`` of them off
  the device; the ``E C`` fanned-out slots over ``fast``, ``(L-1)/L`` of them."""
  (slow, fast), sent = axes, {}
  hosts, local = mesh.shape[slow], mesh.shape[fast]
  if hosts > 1:
    sent[(slow,)] = (hosts - 1) / hosts * (hosts * rows * row + slots * metadata)
  if local > 1 and row:
    sent[(fast,)] = (local - 1) / local * slots * row
  return sent


def _all_to_all_bytes(mesh: Mesh, axes: tuple[str, ...], hierarchical: bool,
                      size: int) -> dict[tuple[str, ...], float]:
  """Bytes per device of one exchange of ``size`` bytes, keyed like ``accounting``'s
  ``bytes_per_axes`` (axes of size 1 carry nothing and are left out)."""
  groups = [(axis,) for axis in axes[::-1]] if hierarchical else [axes]
  sent = {}
  for group in groups:
    spanned = tuple(axis for axis in group if mesh.shape[axis] > 1)
    n = math.prod(mesh.shape[axis] for axis in group)
    if spanned:
      sent[spanned] = (n - 1) / n * size
  return sent


def _check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{name} must be an int; got {value!r}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1; got {name}={value}.")


def _check_config(mesh, num_experts, top_k, capacity_factor, d_model, hidden, axes,
                  hierarchical, dispatch_dtype, dedup) -> None:
  """Raises ValueError/TypeError naming the first bad argument of :func:`moe_layer`."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}.")
  for name, value in (("num_experts", num_experts), ("top_k", top_k), ("d_model", d_model),
                      ("hidden", hidden)):
    _check_positive_int(name, value)
  if top_k > num_experts:
    raise ValueError(f"top_k={top_k} must be <= num_experts={num_experts}.")
  if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
    raise TypeError(f"capacity_factor must be a number; got {capacity_factor!r}.")
  if not capacity_factor > 0:
    raise ValueError(f"capacity_factor must be > 0; got capacity_factor={capacity_factor}.")
  unknown = [axis for axis in axes if axis not in mesh.axis_names]
  if unknown or len(set(axes)) != len(axes) or not axes:
    raise ValueError(f"expert_axes={axes!r} must be distinct axes of the mesh "
                     f"{tuple(mesh.axis_names)}; unknown: {unknown}.")
  devices = math.prod(mesh.shape[axis] for axis in axes)
  if num_experts % devices:
    raise ValueError(f"num_experts={num_experts} is not divisible by the {devices} devices of "
                     f"expert_axes={axes!r}; each device holds num_experts / {devices}.")
  if hierarchical and len(axes) != 2:
    raise ValueError(f"hierarchical=True needs expert_axes=(slow, fast), two axes; got "
                     f"expert_axes={axes!r}.")
  if dedup and not hierarchical:
    raise ValueError(f"dedup=True needs hierarchical=True (a gateway per host fans tokens "
                     f"out); got hierarchical={hierarchical!r}.")
  if dispatch_dtype not in DISPATCH_DTYPES:
    raise ValueError(f"dispatch_dtype={dispatch_dtype!r} is unknown; expected one of "
                     f"{DISPATCH_DTYPES}.")


def moe_layer(mesh: Mesh, *, num_experts: int, d_model: int, hidden: int, top_k: int = 2,
              capacity_factor: float = 1.25, expert_axes: str | Sequence[str] | None = None,
              hierarchical: bool = False, dispatch_dtype: str | None = None,
              dedup: bool = False) -> MoELayer:
  """An expert-parallel MoE layer: experts sharded over ``expert_axes`` of ``mesh``.

  ``apply`` runs inside ``jax.shard_map`` over ``mesh`` with the tokens sharded over (at
  least) ``expert_axes``: each device routes its ``T`` local tokens as one group (see
  :func:`route`), exchanges the ``(E, C, d)`` dispatch buffer by all-to-all, runs its
  ``E / P`` experts on the ``P * C`` received slots, exchanges the results back and combines
  them with the gates. The output equals :func:`moe_reference` with one group per device.

  Bytes per device per exchange, ``S = E * C * (d * itemsize + scale_bytes)`` with
  ``C = capacity(T, E, k, capacity_factor)``: flat ``(P - 1) / P * S`` over ``expert_axes``;
  hierarchical ``(L - 1) / L * S`` over the fast axis and ``(H - 1) / H * S`` over the slow
  one. Four exchanges per training step (dispatch, combine, and their transposes).

  Args:
    mesh: the ``shard_map`` mesh.
    num_experts: ``E``; divisible by ``P``, the devices of ``expert_axes``.
    d_model: token width ``d``.
    hidden: expert MLP width.
    top_k: experts per token, ``1 <= top_k <= E``.
    capacity_factor: ``> 0``; slots per expert are ``ceil(capacity_factor * T * k / E)``.
    expert_axes: mesh axes the experts are sharded over, major first (default: all axes).
    hierarchical: exchange inside the host first (``expert_axes = (slow, fast)``), so the
      slow axis carries one message per destination host instead of one per device.
    dispatch_dtype: ``None`` (the activations' dtype) or ``'int8'``: codes with one fp32
      scale per slot, ``itemsize = 1`` and ``scale_bytes = 4``, for both directions; the
      gradient is straight-through.
    dedup: with ``hierarchical``, send each token across hosts once per destination host
      however many of its ``k`` experts live there, in ``R = min(T, (E/H) C)`` rows per host
      (:func:`host_rows`), plus 8 bytes of slot metadata (int32 row index, fp32 gate) per slot
      of that host's experts; the gateway fans the rows out to its host's experts and sums
      their gate-weighted outputs before they cross back. Same output as without it. Slow
      axis per forward: ``(H-1) (2 R row + 8 (E/H) C)`` instead of ``2 (H-1) (E/H) C row``
      (``row = d itemsize + scale_bytes``): smaller when ``R d < (E/H) C (d - 4)``, i.e.
      only when ``capacity_factor k > H`` roughly; fast axis ``2 (L-1)/L E C row``.

  Returns:
    A :class:`MoELayer`.

  Raises:
    ValueError, TypeError: naming the parameter: non-positive sizes, ``top_k`` outside
      ``[1, E]``, ``capacity_factor <= 0``, an axis not in ``mesh``, ``E`` not divisible by
      ``P``, a hierarchical layer without two axes, an unknown ``dispatch_dtype``, ``dedup``
      without ``hierarchical``.

  Example:
    >>> layer = moe_layer(mesh, num_experts=8, d_model=64, hidden=128)  # doctest: +SKIP
    >>> y, stats = jax.shard_map(layer.apply, mesh=mesh, in_specs=(layer.param_specs,
    ...     P(mesh.axis_names)), out_specs=(P(mesh.axis_names), P()))(params, x)  # doctest: +SKIP
  """
  axes = tuple(mesh.axis_names) if expert_axes is None else (
      (expert_axes,) if isinstance(expert_axes, str) else tuple(expert_axes))
  _check_config(mesh, num_experts, top_k, capacity_factor, d_model, hidden, axes,
                hierarchical, dispatch_dtype, dedup)
  devices = math.prod(mesh.shape[axis] for axis in axes)
  exchange = functools.partial(_exchange, axes=axes, hierarchical=hierarchical)
  send = functools.partial(_int8_exchange, exchange) if dispatch_dtype == "int8" else exchange
  if dedup:
    send = _int8_move if dispatch_dtype == "int8" else _move

  def init(key: jax.Array) -> MoEParams:
    keys = jax.random.split(key, 3)

    def experts(key, shape):
      # Drawn flat and reshaped: the same values under JAX's default (partitionable)
      # threefry, and XLA:CPU compiles a rank-3 draw about 10x slower (2.5 s of CPU).
      return jax.random.normal(key, (math.prod(shape),)).reshape(shape)

    return MoEParams(
        router=jax.random.normal(keys[0], (d_model, num_experts)) * d_model ** -0.5,
        w_in=experts(keys[1], (num_experts, d_model, hidden)) * d_model ** -0.5,
        w_out=experts(keys[2], (num_experts, hidden, d_model)) * hidden ** -0.5)

  def apply(params: MoEParams, x: jax.Array) -> tuple[jax.Array, MoEStats]:
    if x.shape[-1] != d_model or params.w_in.shape[0] != num_experts // devices:
      raise ValueError(f"apply needs local tokens (..., d_model={d_model}) and "
                       f"{num_experts // devices} local experts; got x.shape={x.shape}, "
                       f"params.w_in.shape={params.w_in.shape}.")
    flat = x.reshape(-1, d_model)
    y, stats = (_dedup_route_and_exchange(params, flat, send, axes, top_k=top_k,
                                          capacity_factor=capacity_factor) if dedup else
                _route_and_exchange(params, flat, send, devices, top_k=top_k,
                                    capacity_factor=capacity_factor))
    return y.reshape(x.shape), stats

  def exchange_bytes(tokens: int, itemsize: int = 4) -> dict[tuple[str, ...], float]:
    slots = capacity(tokens, num_experts, top_k, capacity_factor)
    row = d_model + 4 if dispatch_dtype == "int8" else d_model * itemsize
    if dedup:
      return _dedup_bytes(mesh, axes, host_rows(tokens, num_experts, mesh.shape[axes[0]], slots),
                          num_experts * slots, row, metadata=0)
    return _all_to_all_bytes(mesh, axes, hierarchical, num_experts * slots * row)

  def forward_bytes(tokens: int, itemsize: int = 4) -> dict[tuple[str, ...], float]:
    per_exchange = exchange_bytes(tokens, itemsize)
    if not dedup:
      return {key: 2 * value for key, value in per_exchange.items()}
    slots = capacity(tokens, num_experts, top_k, capacity_factor)
    meta = _dedup_bytes(mesh, axes, 0, num_experts * slots, 0, metadata=8)
    return {key: 2 * value + meta.get(key, 0.0) for key, value in per_exchange.items()}

  specs = MoEParams(router=P(), w_in=P(axes), w_out=P(axes))
  return MoELayer(init, apply, specs, exchange_bytes, top_k, forward_bytes)
