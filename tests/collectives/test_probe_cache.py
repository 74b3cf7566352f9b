"""The strategies' shape probe is traced once per compressor structure, shape, dtype and axis
size: equal compressors built by separate calls share it, different ones never do."""

import jax.numpy as jnp
import numpy as np

import jaxcomm
from jaxcomm.collectives import strategies
from jaxcomm.compress import error_feedback


def _misses(make, shape=(4096,), axis_size=4):
  """Probe misses of ``strategies.summed_nbytes`` for ``make()``, and its bytes."""
  before = strategies._traced_probe.cache_info().misses
  nbytes = strategies.summed_nbytes(make(), shape, jnp.float32, axis_size)
  return strategies._traced_probe.cache_info().misses - before, nbytes


def test_equal_compressors_built_apart_share_one_probe():
  make = lambda: error_feedback(jaxcomm.topk(0.013))  # noqa: E731
  assert make() != make()  # new closures each call: the tuple's own equality differs
  first, nbytes = _misses(make)
  again, same = _misses(make)
  assert (first, again, same) == (1, 0, nbytes)
  assert _misses(make, axis_size=2)[0] == 1  # another axis size is another probe
  assert _misses(make, shape=(4095,))[0] == 1


def test_different_parameters_never_share_a_probe():
  for make in (lambda: jaxcomm.topk(0.017), lambda: jaxcomm.topk(0.019),
               lambda: jaxcomm.topk(0.017, value_dtype=jnp.bfloat16),
               lambda: jaxcomm.topk(k=17), lambda: jaxcomm.topk(k=18)):
    misses, nbytes = _misses(make)
    assert misses == 1, make().name
    assert nbytes == make().wire_bytes((4096,), jnp.float32)  # int32 indices: summed as sent
  assert _misses(lambda: jaxcomm.topk(k=17))[0] == 0


def _closure(value):
  return lambda: value


def test_values_it_cannot_see_into_are_compared_by_identity():
  table = np.arange(3)
  assert strategies._structure(_closure(table)) == strategies._structure(_closure(table))
  assert strategies._structure(_closure(table)) != strategies._structure(_closure(table.copy()))
  assert strategies._structure(_closure(1)) != strategies._structure(_closure(1.0))
  assert strategies._structure(_closure((1, "a"))) == strategies._structure(_closure((1, "a")))
