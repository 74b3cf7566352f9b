"""Gradient accumulation: optax.MultiSteps communicates every micro-step; the wrapper does not."""

import chex
import jax
import optax

import jaxcomm
from jaxcomm._src.optim.accumulation import accumulate_gradients
from lowcomm_helpers import DEVICES, train

K = 4


def counting(calls):
  """An identity transformation that counts, at run time, how often its update executes."""

  def update(updates, state, params=None):
    jax.debug.callback(lambda: calls.append(1))
    return updates, state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_multisteps_runs_the_collective_every_micro_step_the_wrapper_once_per_k():
  multi_calls, wrapped_calls = [], []
  chain = lambda calls: optax.chain(counting(calls),
                                    jaxcomm.compressed_allreduce(jaxcomm.topk(0.1)),
                                    optax.sgd(0.1))
  multi = optax.MultiSteps(chain(multi_calls), every_k_schedule=K).gradient_transformation()
  # MultiSteps' accumulator is created from the replicated parameters, so inside shard_map
  # it is typed replicated and compressed_allreduce refuses it: mark it device-local.
  multi = multi._replace(init=lambda params, init=multi.init: init(
      jax.tree.map(lambda p: jax.lax.pcast(p, ("host", "local"), to="varying"), params)))
  wrapped = accumulate_gradients(chain(wrapped_calls), K)
  multi_params = train(multi, 2 * K)[0]
  wrapped_params = train(wrapped, 2 * K)[0]
  jax.effects_barrier()
  assert len(multi_calls) == 2 * K * DEVICES  # the allreduce ran on every micro-step
  assert len(wrapped_calls) == 2 * DEVICES  # once per K micro-steps
  chex.assert_trees_all_close(multi_params, wrapped_params, atol=1e-6)
