"""FedAvg and FedProx: sampled clients train locally, the server averages by sample count."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm._src.mesh_axes import device_count, device_index
from jaxcomm._src.optim.periodic import periodic_averaging
from jaxcomm._src.validation import check_float, check_int_range


def _check_sizes(client_sizes) -> np.ndarray | None:
  if client_sizes is None:
    return None
  sizes = np.asarray(client_sizes)
  if sizes.ndim != 1 or sizes.size == 0 or not np.issubdtype(sizes.dtype, np.number) \
      or np.any(sizes <= 0) or not np.all(np.isfinite(sizes)):
    raise ValueError("client_sizes must be a non-empty sequence of positive sample counts, "
                     f"got {client_sizes!r}.")
  return sizes.astype(np.float32)


def client_weights(client_sizes: np.ndarray | None, clients_per_round: int | None):
  """``weight(key, axes)``: ``n_k / sum_{sampled} n`` on a sampled client, 0 elsewhere."""

  def weight(key, axes):
    me = device_index(axes)
    count = device_count(axes)
    if client_sizes is not None and client_sizes.size != count:
      raise ValueError(f"client_sizes has {client_sizes.size} entries for {count} clients "
                       "(one per device; one per host under data_parallel(..., shard_over=)).")
    sizes = jnp.ones(count) if client_sizes is None else jnp.asarray(client_sizes)
    if clients_per_round is None:
      sampled = jnp.ones(count, jnp.bool_)
    else:
      if clients_per_round > count:
        raise ValueError(f"clients_per_round={clients_per_round} exceeds the {count} clients.")
      chosen = jax.random.choice(key, count, (clients_per_round,), replace=False)
      sampled = jnp.zeros(count, jnp.bool_).at[chosen].set(True)
    active = jnp.where(sampled, sizes, 0.0)
    return active[me] / jnp.sum(active)

  return weight


def fedavg(inner: optax.GradientTransformation, period: int, *,
           client_sizes: Sequence[float] | None = None, clients_per_round: int | None = None,
           mu: float = 0.0, server_learning_rate: optax.ScalarOrSchedule = 1.0,
           sync: optax.GradientTransformation | None = None,
           seed: int | jax.Array = 0) -> optax.GradientTransformation:
  """FedAvg (FedProx with ``mu > 0``): each device is a client (each host under
  ``jaxcomm.data_parallel(..., shard_over=)``, its model kept as ``1/G`` shards).

  Every round of ``period`` steps, ``clients_per_round`` clients are drawn without
  replacement from a PRNG key shared by all devices; the server sets
  ``w = w - server_lr sum_{k sampled} (n_k / n) (w - w_k)`` with ``n = sum_{k sampled} n_k``
  (``server_lr = 1``: ``w = sum_k (n_k / n) w_k``), and every client restarts from ``w``.
  Unsampled clients compute but contribute weight 0. FedProx adds
  ``(mu / 2) ||w_k - w||^2`` to each client's loss, i.e. ``mu (w_k - w)`` to its gradient;
  ``mu = 0`` is FedAvg exactly.

  State: :class:`~jaxcomm.optim.periodic.PeriodicState` (``key`` draws the clients).

  Bytes per device per round: those of ``sync`` for all parameters (unsampled clients send
  zeros: a real deployment would skip them); per step divided by ``period``.

  Args:
    inner: the client optimizer, e.g. ``optax.sgd(0.1)``.
    period: ``>= 1`` client steps per round.
    client_sizes: per-client sample counts ``n_k`` (one per client); ``None``: equal.
    clients_per_round: clients sampled per round; ``None``: all.
    mu: FedProx proximal coefficient ``>= 0``.
    server_learning_rate: a float ``> 0`` or an optax schedule of the round.
    sync: averaging transformation (default dense :func:`jaxcomm.compressed_allreduce`).
    seed: an int seed or a PRNG key (typed ``jax.random.key`` or legacy ``PRNGKey``) of the
      shared client-sampling key.

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters.

  References:
    McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
    Data", AISTATS 2017; Li et al., "Federated Optimization in Heterogeneous Networks",
    MLSys 2020 (FedProx).
  """
  check_int_range("period", period, 1)
  if clients_per_round is not None:
    check_int_range("clients_per_round", clients_per_round, 1)
  sizes = _check_sizes(client_sizes)
  if not callable(server_learning_rate):
    server_learning_rate = check_float("server_learning_rate", server_learning_rate)
  return periodic_averaging(inner, optax.sgd(server_learning_rate), period, sync=sync,
                            proximal=check_float("mu", mu, minimum=0.0, inclusive=True),
                            client_weight=client_weights(sizes, clients_per_round), seed=seed)


def fedprox(inner: optax.GradientTransformation, period: int, mu: float,
            **kwargs) -> optax.GradientTransformation:
  """FedProx: :func:`fedavg` with the proximal term ``(mu / 2) ||w_k - w||^2``, ``mu >= 0``.

  References:
    Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020.
  """
  return fedavg(inner, period, mu=mu, **kwargs)
