"""Real processes (2 x 4 CPU devices, gloo): checkpoint, a process killed mid-step, restart.

1. Job A (launcher): 10 uninterrupted steps, checkpoint after step 4.
2. Job F (two processes started directly, as separate hosts would be, heartbeat 5 s):
   restores step 4, checkpoints after step 6, and process 1 is SIGKILLed during step 8.
   Process 0, blocked in a collective, must exit with the coordination service's error
   within the heartbeat timeout plus a margin.
3. Job C (launcher): restores the last checkpoint (6) and finishes: bit-identical to job A.
Job A also matches the simulated 2x4 mesh of this process to float32 rounding.
"""

import os
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

import jaxcomm
import rel_training
from jaxcomm import checkpoint, distributed, launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "rel_training.py")
HEARTBEAT_SECONDS = 5
DETECTION_BOUND = HEARTBEAT_SECONDS + 10  # margin for two busy shared cores


def _env(cache):
  """The jobs' environment. ``cache``: a persistent compilation cache the three jobs share, so
  jobs F and C load the programs job A compiled (about 4 s of CPU each, not 1.5 s to write)."""
  return {**os.environ, "JAX_PLATFORMS": "cpu",
          "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
          "JAX_COMPILATION_CACHE_DIR": str(cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _launched(cache, *args, timeout=300):
  result = subprocess.run(
      [sys.executable, "-m", "jaxcomm.launch", "-n", "2", "--local-devices", "4", "--",
       sys.executable, WORKER, *args], capture_output=True, text=True, env=_env(cache),
      cwd=ROOT, timeout=timeout)
  assert result.returncode == 0, result.stdout[-4000:]
  return result


def _direct(cache, *args):
  """Two processes without the launcher (which would stop the survivor itself)."""
  coordinator = f"127.0.0.1:{launch.free_port()}"
  return [subprocess.Popen(
      [sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, cwd=ROOT, env={**launch.process_env(i, 2, coordinator, 4, _env(cache)),
                                distributed.HEARTBEAT_TIMEOUT_ENV: str(HEARTBEAT_SECONDS)})
      for i in range(2)]


def _params(npz):
  values = dict(np.load(npz))
  return values.pop("losses"), values


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("faults")
  cache = tmp / "xla_cache"
  _launched(cache, str(tmp / "a.npz"), "--save-dir", str(tmp / "ck_a"), "--save-at", "4")
  survivor, victim = _direct(cache, str(tmp / "f.npz"), "--start", "4", "--restore",
                             str(tmp / "ck_a"), "--save-dir", str(tmp / "ck_f"), "--save-at", "6",
                             "--die-at", "8")
  victim_status = victim.wait(timeout=300)
  died = time.monotonic()
  survivor_status = survivor.wait(timeout=300)
  detection = time.monotonic() - died
  print(f"fault detection: survivor exited {detection:.2f} s after the victim died")
  output = survivor.stdout.read()
  latest = jaxcomm.checkpoint.latest_step(tmp / "ck_f")
  _launched(cache, str(tmp / "c.npz"), "--start", str(latest), "--restore", str(tmp / "ck_f"))
  return dict(tmp=tmp, victim_status=victim_status, survivor_status=survivor_status,
              detection=detection, output=output, latest=latest)


def test_a_killed_process_makes_the_other_exit_with_a_clear_error_in_bounded_time(runs):
  assert runs["victim_status"] == -9
  assert runs["survivor_status"] != 0
  assert "stopped sending heartbeats" in runs["output"], runs["output"][-3000:]
  assert "Terminating process because the JAX distributed service detected fatal errors" in \
      runs["output"]
  assert runs["detection"] < DETECTION_BOUND
  assert "saved step 6" in runs["output"] and "saved step 8" not in runs["output"]


def test_restart_from_the_last_checkpoint_reproduces_the_uninterrupted_run(runs):
  assert runs["latest"] == 6
  losses_a, params_a = _params(runs["tmp"] / "a.npz")
  losses_c, params_c = _params(runs["tmp"] / "c.npz")
  chex.assert_trees_all_equal(params_c, params_a)  # bit for bit, across three jobs
  np.testing.assert_array_equal(losses_c, losses_a[6:])
  # The restart really carried state: checkpoint 6 (written by job F's two processes, read
  # here on the simulated 2x4 mesh) holds the step count and non-zero residuals.
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = rel_training.initial_model()[1]
  target = {"params": params,
            "opt_state": checkpoint.abstract_state(rel_training.optimizer(), params, mesh)}
  saved = checkpoint.restore(runs["tmp"] / "ck_f", target, step=6)["opt_state"][0]
  assert int(saved.count) == 6
  for kind in ("worker_residual", "server_residual"):
    assert any(np.any(np.asarray(getattr(levels[1], kind)) != 0) for levels in saved.level_states)


def test_the_multi_process_run_matches_the_simulated_mesh_to_float32_rounding(runs):
  params, losses = rel_training.train(jaxcomm.make_mesh(hosts=2, local=4), 0,
                                      rel_training.STEPS)
  losses_a, params_a = _params(runs["tmp"] / "a.npz")
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  chex.assert_trees_all_close(params_a, flat, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(losses_a, losses, rtol=1e-5)
