"""benchmarks/slow_link: flags, link rates, and the loopback collectives measurement."""

import os
import subprocess
import sys

import pytest

from benchmarks import slow_link

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
    (["--steps", "4", "--timed-steps", "4"], "--timed-steps"),
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
