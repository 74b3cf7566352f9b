"""Devices never disagree about which collectives run.

A ``lax.cond``/``lax.switch`` whose branches hold collectives must select its branch from values
every device has (replicated over the mesh): if devices take different branches, some wait in a
collective that the others never enter, and XLA's CPU runtime aborts after its rendezvous
timeout ("Expected 8 threads to join the rendezvous, but only 7 of them arrived"). These tests
read the traced train step, so they check the selectors without running anything.
"""

import jax
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import optim
from lowcomm_helpers import AXES, batch, problem

COLLECTIVES = {"psum", "psum_invariant", "pmax", "pmin", "ppermute", "all_gather",
               "all_gather_invariant", "all_to_all", "reduce_scatter", "psum_scatter"}


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(item, "jaxpr", item)
      if hasattr(inner, "eqns"):
        yield inner


def _has_collective(jaxpr) -> bool:
  return any(eqn.primitive.name in COLLECTIVES or any(map(_has_collective, _subjaxprs(eqn)))
             for eqn in jaxpr.eqns)


def branch_selectors(jaxpr):
  """``(varying axes of the selector, branches hold a collective)`` for every cond/switch."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      found.append((eqn.invars[0].aval.mat.varying,
                    any(_has_collective(b.jaxpr) for b in eqn.params["branches"])))
    for inner in _subjaxprs(eqn):
      found += branch_selectors(inner)
  return found


def traced_step(tx, local):
  loss_fn, params, data, mesh = problem()
  params = (optim.to_device_local(params, mesh) if local
            else jax.device_put(params, NamedSharding(mesh, P())))  # as the step returns it
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh, P(AXES) if local else P())
  make = optim.local_training_step if local else jaxcomm.optim.data_parallel_step
  return jax.make_jaxpr(make(loss_fn, tx, mesh, specs))(params, state, batch(data, 0)).jaxpr


CASES = {
    "accumulate_gradients": (lambda: optim.accumulate_gradients(optax.chain(
        jaxcomm.compressed_allreduce(jaxcomm.topk(0.1)), optax.sgd(0.1)), 4), False),
    "gossip random": (lambda: optim.gossip(optax.sgd(0.1), "random"), True),
    "local_sgd": (lambda: optim.local_sgd(optax.sgd(0.1), 4), True),
    "streaming diloco": (lambda: optim.diloco(optax.sgd(0.1), 4, fragments=2, delay=1,
                                              mixing=0.5), True),
    "fedavg": (lambda: optim.fedavg(optax.sgd(0.1), 4, client_sizes=range(1, 9),
                                    clients_per_round=6), True),
    "dgc warm-up": (lambda: optax.chain(optim.dgc(0.01, warmup_stage_steps=2), optax.sgd(0.1)),
                    False),
    "onebit_adam": (lambda: optim.onebit_adam(1e-3, warmup_steps=2), False),
    "zero_one_adam": (lambda: optim.zero_one_adam(1e-3, var_freeze_step=4), True),
}


@pytest.mark.parametrize("name", CASES)
def test_branches_with_collectives_are_selected_by_replicated_values(name):
  make, local = CASES[name]
  selectors = branch_selectors(traced_step(make(), local))
  guarded = [varying for varying, collective in selectors if collective]
  assert guarded, "expected a cond/switch around collectives"
  assert all(not varying for varying in guarded), selectors


def test_the_check_sees_a_device_dependent_selector():
  _, _, _, mesh = problem()

  @jax.shard_map(mesh=mesh, in_specs=P(AXES), out_specs=P(AXES))
  def diverging(x):
    total = lambda v: jax.lax.pcast(jax.lax.psum(v, AXES), AXES, to="varying")
    return jax.lax.cond(jax.lax.axis_index(AXES) == 0, total, lambda v: v, x)

  x = jax.ShapeDtypeStruct((8,), "float32", sharding=jax.NamedSharding(mesh, P(AXES)))
  assert branch_selectors(jax.make_jaxpr(diverging)(x).jaxpr) == [(frozenset(AXES), True)]
