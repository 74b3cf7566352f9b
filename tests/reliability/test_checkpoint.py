"""Checkpointing all jaxcomm state with orbax: round trips, sharding, killed saves, corruption
(restoring in fresh processes and continuing bit-identically: test_faults.py)."""

import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
import killed_save
from jaxcomm import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KILL_TRIALS = 10
PICKLING = re.compile(r"\bimport (c?pickle|dill)\b|\bfrom (c?pickle|dill) import|"
                      r"allow_pickle=True")


def test_every_kind_of_state_round_trips_with_its_sharding(tmp_path):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {"w": jnp.arange(64.0).reshape(16, 4), "b": jnp.ones(4)}
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.randomk(0.5)), optax.adam(1e-3))
  opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  state = {
      "opt_state": opt_state,
      "powersgd": jaxcomm.powersgd(2).init((16, 8), jnp.float32),
      "ef_powersgd": jaxcomm.error_feedback(jaxcomm.powersgd(1)).init((6, 5), jnp.float32),
      "typed_key": jax.random.key(7), "nothing": None, "empty": (),
  }
  checkpoint.save(tmp_path, 3, state)
  target = {**state, "opt_state": checkpoint.abstract_state(tx, params, mesh)}
  restored = checkpoint.restore(tmp_path, target)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored["opt_state"]),
                              jax.tree.map(np.asarray, opt_state))
  chex.assert_trees_all_equal(restored["powersgd"], state["powersgd"])
  chex.assert_trees_all_equal(restored["ef_powersgd"], state["ef_powersgd"])
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  assert np.array_equal(jax.random.key_data(restored["typed_key"]),
                        jax.random.key_data(state["typed_key"]))
  for got, spec in zip(jax.tree.leaves(restored["opt_state"]),
                       jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
    assert got.sharding.spec == spec and got.sharding.mesh.shape == mesh.shape
  assert "RandomKState" in str(jax.tree.structure(restored["opt_state"]))


def test_steps_are_listed_kept_and_refused_twice(tmp_path):
  assert checkpoint.latest_step(tmp_path / "none") is None
  for step in (1, 2, 5):
    checkpoint.save(tmp_path, step, {"x": jnp.full(3, step)}, max_to_keep=2)
  assert checkpoint.all_steps(tmp_path) == [2, 5] and checkpoint.latest_step(tmp_path) == 5
  np.testing.assert_array_equal(checkpoint.restore(tmp_path, {"x": jnp.zeros(3)})["x"], 5)
  with pytest.raises(ValueError, match="step 5 is already checkpointed"):
    checkpoint.save(tmp_path, 5, {"x": jnp.zeros(3)})


@pytest.mark.parametrize("call, error, match", [
    (lambda d: checkpoint.restore(d, {"x": jnp.zeros(3)}, step=9), FileNotFoundError,
     r"no checkpoint for step 9 .*checkpointed steps: \[1\]"),
    (lambda d: checkpoint.restore(d, {"y": jnp.zeros(3)}), ValueError,
     r"does not match the target at 2 leaves: y is in the target but not in the checkpoint; "
     r"x is in the checkpoint but not in the target\."),
    (lambda d: checkpoint.restore(d, {"x": jnp.zeros(4)}), ValueError,
     r"at 1 leaves: x has shape \(3,\) in the checkpoint, \(4,\) in the target\."),
    (lambda d: checkpoint.restore(d, {"x": jnp.zeros(3)}, residuals="none"), ValueError,
     "residuals must be one of sum, reset"),
    (lambda d: checkpoint.restore(d, {"x": jnp.zeros(3)}, tx=optax.sgd(1.0)), ValueError,
     "tx and params go together"),
    (lambda d: checkpoint.restore(d / "empty", {"x": jnp.zeros(3)}), FileNotFoundError,
     "no checkpoint under"),
    (lambda d: checkpoint.save(d, -1, {}), ValueError, "step must be >= 0, got -1"),
    (lambda d: checkpoint.save(d, 1.5, {}), TypeError, "step must be an int"),
    (lambda d: checkpoint.save(d, 2, {}, max_to_keep=0), ValueError, "max_to_keep must be >= 1"),
    (lambda d: checkpoint.save("", 2, {}), TypeError, "directory must be a non-empty path"),
])
def test_bad_requests_name_the_problem(tmp_path, call, error, match):
  checkpoint.save(tmp_path, 1, {"x": jnp.ones(3)})
  with pytest.raises(error, match=match):
    call(tmp_path)


def test_a_save_killed_at_random_points_leaves_the_newest_complete_one_restorable(tmp_path):
  """10 trials: a saving process is SIGKILLed at a random moment (killed_save.py)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
  result = subprocess.run([sys.executable, os.path.join(HERE, "killed_save.py"), str(tmp_path),
                           str(KILL_TRIALS)], capture_output=True, text=True, env=env,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.count("status 9") == KILL_TRIALS, result.stdout
  target = jax.tree.map(np.zeros_like, killed_save.state(1))
  for trial in range(KILL_TRIALS):
    directory = tmp_path / f"trial{trial}"
    step = checkpoint.latest_step(directory)
    leftovers = [name for name in os.listdir(directory) if not name.isdigit()]
    # Only the save in progress when killed left something, and it is not listed.
    assert all(name.startswith(f"{step + 1}.partial") for name in leftovers), leftovers
    chex.assert_trees_all_equal(checkpoint.restore(directory, target),
                                killed_save.state(step))  # bit for bit
    checkpoint.save(directory, step + 1, killed_save.state(step + 1))  # removes the leftovers
    assert all(name.isdigit() for name in os.listdir(directory))
    chex.assert_trees_all_equal(checkpoint.restore(directory, target),
                                killed_save.state(step + 1))


def _data_files(directory, step):
  root = directory / str(step)
  return sorted(p for p in root.rglob("*") if p.is_file() and "ocdbt.process" in str(p)
                and p.parent.name == "d")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_corrupt_checkpoint_is_named_and_the_newest_good_one_is_used(tmp_path, damage):
  for step in (3, 6):
    checkpoint.save(tmp_path, step, killed_save.state(step))
  file = (tmp_path / "6" / checkpoint.MANIFEST if damage == "manifest"
          else _data_files(tmp_path, 6)[0])
  content = bytearray(file.read_bytes())
  if damage == "flip":
    content[len(content) // 2] ^= 0x01
  if damage == "delete":
    file.unlink()
  else:
    file.write_bytes(bytes(content[:-1] if damage in ("truncate", "manifest") else content))
  target = jax.tree.map(np.zeros_like, killed_save.state(1))
  named = f"checkpoint step 6 is corrupt: (file|its manifest) {re.escape(str(file))} "
  with pytest.warns(UserWarning, match=named + ".* Using an older checkpoint"):
    restored = checkpoint.restore(tmp_path, target)
  chex.assert_trees_all_equal(restored, killed_save.state(3))
  with pytest.raises(checkpoint.CorruptCheckpointError, match=named):
    checkpoint.restore(tmp_path, target, step=6)


def test_a_checkpoint_of_another_method_or_model_shape_is_refused_naming_the_leaf(tmp_path):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {"w": jnp.ones((16, 4)), "b": jnp.ones(4)}
  topk = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.1)), optax.adam(1e-3))
  checkpoint.save(tmp_path, 1, {"params": params,
                                "opt_state": jaxcomm.optim.sharded_init(topk, params, mesh)[0]})
  two_phase = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.sign(), strategy="two_phase"),
                          optax.adam(1e-3))
  target = {"params": params, "opt_state": checkpoint.abstract_state(two_phase, params, mesh)}
  with pytest.raises(ValueError, match=r"opt_state\[0\]\.level_states\[0\]\[1\]\.residual is "
                     r"in the checkpoint but not in the target"):
    checkpoint.restore(tmp_path, target)
  wider = {"w": jnp.ones((16, 8)), "b": jnp.ones(4)}
  target = {"params": wider, "opt_state": checkpoint.abstract_state(topk, wider, mesh)}
  with pytest.raises(ValueError, match=r"params\.w has shape \(16, 4\) in the checkpoint, "
                     r"\(16, 8\) in the target"):
    checkpoint.restore(tmp_path, target)


def test_nothing_is_pickled():
  package = os.path.join(ROOT, "jaxcomm")
  sources = [os.path.join(folder, name) for folder, _, names in os.walk(package)
             for name in names if name.endswith(".py")]
  assert len(sources) > 20
  for source in sources:
    with open(source) as stream:
      assert not PICKLING.search(stream.read()), source
