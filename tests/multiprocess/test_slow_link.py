"""benchmarks/slow_link: flags, link rates, and the loopback collectives measurement."""

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from benchmarks import slow_link
from jaxcomm import accounting

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("rate, bytes_per_second", [
    ("1gbit", 1.25e8), ("100mbit", 1.25e7), ("2.5Gbit", 3.125e8), ("800kbit", 1e5)])
def test_rates_are_read_in_tc_units(rate, bytes_per_second):
  assert slow_link._rate_bytes_per_second(rate) == pytest.approx(bytes_per_second)


def test_an_unknown_rate_unit_is_refused():
  with pytest.raises(ValueError, match="rate must end with"):
    slow_link.main(["--rates", "1gbps", "--skip-collectives"])


@pytest.mark.parametrize("argv, match", [
    (["--methods", "fp32,zip"], "unknown method 'zip'"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--local-devices", "1,x"], "--local-devices must be comma-separated ints"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--payload-mb", "0"], "--payload-mb must be > 0"),
    (["--local-devices", "0"], "--local-devices must be >= 1"),
])
def test_bad_flags_exit_with_a_clear_error(argv, match, capsys):
  with pytest.raises(SystemExit) as exit_info:
    slow_link.parse_args(argv)
  assert exit_info.value.code == 2
  assert match in capsys.readouterr().err


def test_collectives_table_from_two_real_processes():
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.slow_link", "--skip-slow-link", "--payload-mb", "0.25",
       "--repeats", "1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  table = [line.split() for line in result.stdout.splitlines()
           if line.split()[:1] and line.split()[0] in slow_link.COLLECTIVES]
  assert sorted((row[0], row[1]) for row in table) == sorted(
      (name, dtype) for name in slow_link.COLLECTIVES for dtype in ("float32", "int8"))
  assert all(float(row[2]) > 0 for row in table)


def test_ratio_and_speedup_follow_their_formulas():
  rows = [{"method": "fp32", "local": 2, "inter_host_bytes": 1.25e6, "wire_bytes": 2.5e6,
           "step_ms": {"none": 30.0, "1gbit": 60.0}},
          {"method": "sign-ef", "local": 2, "inter_host_bytes": 1.25e4, "wire_bytes": 2.5e4,
           "step_ms": {"none": 40.0, "1gbit": 42.0}}]
  fp32, sign = slow_link.slow_link_rows(rows, ["1gbit"])
  assert fp32["link_ms"] == pytest.approx(1e3 * 2.5e6 / 1.25e8)
  assert fp32["ratio"] == pytest.approx(60.0 / (30.0 + 20.0))
  assert sign["ratio"] == pytest.approx(42.0 / (40.0 + 0.2))
  assert sign["speedup"] == pytest.approx(60.0 / 42.0) and fp32["speedup"] == 1.0


def test_a_rate_request_returns_once_the_launcher_has_set_it(tmp_path, monkeypatch):
  applied = []
  monkeypatch.setattr(slow_link, "set_rate", applied.append)
  stop = threading.Event()
  server = threading.Thread(target=slow_link._serve_rates, args=(str(tmp_path), stop))
  server.start()
  try:
    control = slow_link.RateControl(str(tmp_path), active=True)
    for rate in ("1gbit", "none", "1gbit"):
      control.set(rate, timeout=30)
  finally:
    stop.set()
    server.join()
  assert applied == ["1gbit", "none", "1gbit"]
  slow_link.RateControl(str(tmp_path), active=False).set("5mbit", timeout=0.1)  # no launcher


def test_link_bytes_per_process_count_every_host_group_and_one_ring_edge():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)

  def step(x):
    hier = jax.lax.psum(jax.lax.psum_scatter(x[0], "local", tiled=True), "host")
    return (hier.sum() + jax.lax.psum(x[0], ("host", "local")).sum())[None]

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(("host", "local")),
                              out_specs=P(("host", "local"))))
  report = accounting.measure(run, jnp.ones((8, 1000)), mesh=mesh)
  per_device = {op.axes: op.bytes_per_device for op in report.collectives}
  assert per_device[("host",)] == 2 * 1 / 2 * 250 * 4  # the 1/4 shard, over 2 hosts
  assert per_device[("host", "local")] == 2 * 7 / 8 * 1000 * 4
  assert slow_link.process_link_bytes(report, 4) == (4 * per_device[("host",)]
                                                     + per_device[("host", "local")])
