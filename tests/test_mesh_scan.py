"""The main job runs end to end and reports what it measured."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import mesh_scan


def test_short_scan_prints_the_table_and_writes_json(tmp_path):
  out = tmp_path / "rows.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.mesh_scan", "--steps", "40", "--timed-steps", "10",
       "--hidden", "64", "--json", str(out)],
      capture_output=True, text=True, env=env, timeout=600,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.returncode == 0, result.stderr
  for method in mesh_scan.METHODS:
    assert f"\n{method} " in result.stdout
  assert "formula (H-1)*8*sum(k)" in result.stdout
  rows = {row["method"]: row for row in json.loads(out.read_text())}
  assert rows["fp32"]["intra_host_bytes"] == 0  # one flat all-reduce, charged to the host link
  assert rows["topk-ef"]["inter_host_bytes"] < rows["sign-ef"]["inter_host_bytes"] \
      < rows["int8"]["inter_host_bytes"] < rows["fp32-hier"]["inter_host_bytes"]
  # Same dense fast-axis traffic; fp32-hier pads to a multiple of all 8 devices, not 4.
  assert rows["fp32-hier"]["intra_host_bytes"] == pytest.approx(
      rows["topk-ef"]["intra_host_bytes"], rel=0.01)
  assert rows["topk-ef"]["intra_host_bytes"] > 0
  assert all(row["finite"] and row["median_step_ms"] > 0 for row in rows.values())


@pytest.mark.parametrize("argv, match", [
    (["--methods", "fp32,zip"], "unknown method 'zip'"),
    (["--topk-fraction", "0"], "--topk-fraction must be in"),
    (["--hidden", "a,b"], "--hidden must be"),
    (["--steps", "5", "--timed-steps", "10"], "--timed-steps"),
])
def test_bad_flags_exit_with_a_clear_error(argv, match, capsys):
  with pytest.raises(SystemExit) as exit_info:
    mesh_scan.parse_args(argv)
  assert exit_info.value.code == 2
  assert match in capsys.readouterr().err


def test_mesh_that_does_not_match_the_devices_is_refused(capsys):
  assert mesh_scan.main(["--hosts", "3", "--local", "2"]) == 2
  assert "must equal --simulated-devices" in capsys.readouterr().err
