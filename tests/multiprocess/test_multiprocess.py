"""Real multi-process runs (2 processes x 4 CPU devices, gloo) against the simulated 2x4 mesh.

The launched job writes each process's results to a temporary directory; the simulated mesh of
this pytest process computes the same things with the same seeds. The two agree to float32
rounding, not bit for bit: gloo performs every collective, including the reduce-scatter inside
a process, and sums in another order than XLA's in-process CPU collectives (differences of one
float32 ulp; see docs/multihost.md).
"""

import os
import re
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

import jaxcomm
import mp_workloads
from jaxcomm import distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROCESSES, LOCAL_DEVICES = 2, 4
# One float32 ulp of values of order 1, and its growth over a short training run.
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def launch(*command, timeout=300):
  """Runs ``command`` as the 2-process x 4-device job; returns the launcher's result."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
         "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
      [sys.executable, "-m", "jaxcomm.launch", "-n", str(PROCESSES), "--local-devices",
       str(LOCAL_DEVICES), "--", sys.executable, *command],
      capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


WORKER = os.path.join(HERE, "mp_worker.py")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  out_dir = tmp_path_factory.mktemp("multiprocess")
  result = launch(WORKER, str(out_dir))
  assert result.returncode == 0, result.stdout[-4000:]
  return [dict(np.load(out_dir / f"process_{i}.npz")) for i in range(PROCESSES)]


@pytest.fixture(scope="module")
def simulated():
  mesh = jaxcomm.make_mesh(hosts=PROCESSES, local=LOCAL_DEVICES)
  return {**mp_workloads.allreduce_results(mesh), **mp_workloads.training_results(mesh),
          **mp_workloads.hsdp_results(mesh)}


def _select(results, prefix):
  return {k: v for k, v in results.items() if k.startswith(prefix)}


def test_host_axis_crosses_processes_and_processes_agree(launched):
  for results in launched:
    np.testing.assert_array_equal(results["mesh_shape"], [PROCESSES, LOCAL_DEVICES])
  chex.assert_trees_all_equal(launched[0], launched[1])


@pytest.mark.parametrize("name", sorted(mp_workloads.COMPRESSORS))
def test_compressed_allreduce_equals_the_simulated_mesh(launched, simulated, name):
  expected = _select(simulated, f"{name}/")
  assert len(expected) > 2 * mp_workloads.ALLREDUCE_STEPS  # means of every leaf, every step
  chex.assert_trees_all_close(_select(launched[0], f"{name}/"), expected, **TOLERANCE)


def test_training_matches_the_simulated_run_step_for_step(launched, simulated):
  for index in range(mp_workloads.TRAIN_STEPS):
    prefix = f"step{index}/"
    chex.assert_trees_all_close(_select(launched[0], prefix), _select(simulated, prefix),
                                **TOLERANCE)
  first, last = simulated["step0/loss"], simulated[f"step{mp_workloads.TRAIN_STEPS - 1}/loss"]
  assert last < first  # the compared run really trains


def test_hsdp_matches_the_simulated_run_step_for_step(launched, simulated):
  """Sharded data parallelism (``shard_over='local'``): the fast axis stays inside a process,
  the compressed shard crosses processes; loss and gathered parameters after every step equal
  the simulated 2x4 mesh's."""
  hsdp = _select(simulated, "hsdp/")
  assert len(hsdp) == 1 + mp_workloads.HSDP_STEPS * 5  # shard lengths; loss + 4 leaves a step
  chex.assert_trees_all_close(_select(launched[0], "hsdp/"), hsdp, **TOLERANCE)
  # Leaves of 4, 30x4, 30 (padded to 32) and 16x30 elements: each device holds a quarter.
  np.testing.assert_array_equal(launched[0]["hsdp/shard_lengths"], [1, 30, 8, 120])
  assert hsdp[f"hsdp/step{mp_workloads.HSDP_STEPS - 1}/loss"] < hsdp["hsdp/step0/loss"]


def test_byte_accounting_equals_the_simulated_mesh(launched, simulated):
  accounted = _select(launched[0], "bytes/")
  assert accounted == _select(simulated, "bytes/")
  assert accounted["bytes/host"] > 0 and accounted["bytes/local"] > 0


def test_launcher_stops_the_job_when_a_process_fails():
  """Process 1 dies with status 3; process 0 waits in a collective that cannot finish."""
  started = time.monotonic()
  result = launch(WORKER, "unused-out-dir", "fail", timeout=120)
  assert result.returncode == 3, result.stdout[-4000:]
  # Not left to gloo's own 30 s timeout in process 0, nor to JAX's 100 s heartbeat timeout.
  assert time.monotonic() - started < 25
  assert "the collective completed" not in result.stdout


def test_initialize_refuses_a_running_backend():
  jax.devices()
  with pytest.raises(RuntimeError, match="before any JAX calls"):
    distributed.initialize("127.0.0.1:1", 2, 0)


def test_mesh_scan_joins_the_job_when_launched(tmp_path):
  result = launch("-m", "benchmarks.mesh_scan", "--methods", "topk-ef", "--steps", "3",
                  "--timed-steps", "1", "--hidden", "16", "--out", str(tmp_path))
  assert result.returncode == 0, result.stdout[-4000:]
  assert "2 hosts x 4 local devices" in result.stdout
  rows = re.findall(r"^\[process (\d)\] topk-ef +([\d,]+) ", result.stdout, re.MULTILINE)
  assert sorted(process for process, _ in rows) == ["0", "1"], result.stdout[-4000:]
  assert all(int(inter_host.replace(",", "")) > 0 for _, inter_host in rows)
