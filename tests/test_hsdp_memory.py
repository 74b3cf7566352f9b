"""benchmarks/hsdp_memory.py's device budget: a step whose compiled peak exceeds the simulated
device's share of memory is refused; HSDP with reshard-after-forward fits where replicated does
not, and trains."""

import chex
import pytest

import jaxcomm
from benchmarks import hsdp_memory


def test_the_replicated_step_over_the_budget_is_refused_and_hsdp_under_it_trains():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, replicated_state, replicated = hsdp_memory.compile_step(mesh, "mlp", 2, 64, 8, None,
                                                                  donate=True)
  _, hsdp_state, hsdp = hsdp_memory.compile_step(mesh, "mlp", 2, 64, 8, "local", True,
                                                 donate=True)
  replicated_peak, hsdp_peak = hsdp_memory.peak_bytes(replicated), hsdp_memory.peak_bytes(hsdp)
  assert hsdp_peak < replicated_peak
  budget = (replicated_peak + hsdp_peak) // 2
  _, loss_fn, batch = hsdp_memory.MODELS["mlp"](2, 64, 8)
  with pytest.raises(ValueError, match=rf"exceeds budget_bytes={budget} .*not run"):
    hsdp_memory.train_within(replicated, replicated_state, [batch], budget)
  losses = hsdp_memory.train_within(hsdp, hsdp_state, [batch, batch], budget)
  chex.assert_trees_all_close(losses[0], float(loss_fn(params, batch)), rtol=1e-6)
  assert len(losses) == 2 and losses[1] < losses[0]
  with pytest.raises(ValueError, match=rf"budget_bytes={hsdp_peak - 1} "):
    hsdp_memory.train_within(hsdp, hsdp_state, [batch], hsdp_peak - 1)
