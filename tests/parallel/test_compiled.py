"""What XLA compiles: ring transfers independent of the step's matmuls; memory falling as 1/P.

Overlap is checked on the optimized HLO (``compiled.as_text()``) by data dependence: inside each
ring step (a ``while`` body), no ``collective-permute`` may have a ``dot`` among its transitive
operands, looking through fusions and the ``conditional`` that selects the block kind. The
scheduler is then free to run the transfer concurrently with the matmuls. As a control, the
final dK/dV hop outside the loop *does* depend on the last step's dots, and the analysis sees it.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxcomm.parallel import ring_attention

_HEADER = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9_-]*)\(")
_NAME = re.compile(r"%([\w.-]+)")


def _parse(hlo: str):
  """``{computation: {instruction: (opcode, referenced names)}}`` and the entry's name."""
  computations, current, entry = {}, None, None
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header:
      current = computations.setdefault(header.group(1), {})
      entry = header.group(1) if line.startswith("ENTRY") else entry
      continue
    instruction = _INSTRUCTION.match(line)
    if instruction and current is not None:
      name, rest = instruction.groups()
      opcode = _OPCODE.search(" " + rest.split(", metadata=")[0])
      current[name] = (opcode.group(1) if opcode else "", set(_NAME.findall(rest)))
  return computations, entry


def _dependence(hlo: str):
  computations, entry = _parse(hlo)
  memo = {}

  def has_dot(computation):
    if computation not in memo:
      memo[computation] = False
      memo[computation] = any(
          opcode in ("dot", "convolution") or any(n in computations and has_dot(n) for n in refs)
          for opcode, refs in computations[computation].values())
    return memo[computation]

  def permute_depends_on_dot(computation, instruction):
    body, seen, stack = computations[computation], set(), [instruction]
    while stack:
      for ref in body[stack.pop()][1]:
        if ref in body and ref not in seen:
          seen.add(ref)
          opcode, refs = body[ref]
          if opcode in ("dot", "convolution") or any(
              n in computations and has_dot(n) for n in refs):
            return True
          stack.append(ref)
    return False

  loop_bodies = {ref for comp in computations.values() for opcode, refs in comp.values()
                 if opcode == "while" for ref in refs if ref in computations}
  verdicts = {}
  for computation, body in computations.items():
    for name, (opcode, _) in body.items():
      if opcode.startswith("collective-permute") and not opcode.endswith("done"):
        verdicts[(computation, name)] = permute_depends_on_dot(computation, name)
  return verdicts, loop_bodies, entry, has_dot


def _mesh(size):
  return jax.make_mesh((size,), ("seq",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:size])


def _fwd_bwd(size, layout="zigzag", causal=True):
  attend = jax.shard_map(
      functools.partial(ring_attention, axis_name="seq", causal=causal, layout=layout),
      mesh=_mesh(size), in_specs=P(None, "seq"), out_specs=P(None, "seq"))

  def loss(q, k, v):
    return jnp.sum(attend(q, k, v) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ring_step_transfers_do_not_wait_for_the_step_matmuls(layout):
  q = jnp.ones((1, 64, 2, 16))
  hlo = _fwd_bwd(4, layout).lower(q, q, q).compile().as_text()
  verdicts, loop_bodies, entry, has_dot = _dependence(hlo)
  in_loops = {key: dep for key, dep in verdicts.items() if key[0] in loop_bodies}
  # Forward: K and V; backward: K and V plus the dK and dV accumulators.
  assert len(in_loops) == 6, in_loops
  assert all(has_dot(body) for body in {comp for comp, _ in in_loops})
  assert not any(in_loops.values()), in_loops
  assert any(dep for (comp, _), dep in verdicts.items() if comp == entry)


def _temp_bytes(size, seq=512):
  q = jnp.ones((1, seq, 2, 16))
  return _fwd_bwd(size).lower(q, q, q).compile().memory_analysis().temp_size_in_bytes


def test_per_device_temp_memory_falls_as_one_over_p():
  temps = {size: _temp_bytes(size) for size in (1, 2, 4, 8)}
  for size in (2, 4, 8):
    # Score blocks shrink as 1/P^2 and residuals as 1/P: at least 1/P overall.
    assert temps[size] <= 1.1 * temps[1] / size, temps
