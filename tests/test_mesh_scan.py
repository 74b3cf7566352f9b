"""The main job: every method runs end to end and every output is written (the command line,
refusals, formulas and the other meshes: test_mesh_scan_cli.py)."""

import csv
import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import mesh_scan
from benchmarks.scan import figures
from benchmarks.scan.methods import REGISTRY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERIOD = 8
STEPS = PERIOD  # every periodic method synchronizes once, on the last step
# Periodic methods whose outer step sends its own compressed format (checked separately below)
COMPRESSED_OUTER = ("sparseloco-h8", "sparseloco-h16", "streaming-diloco-h8-q4",
                    "streaming-diloco-h8-q2")
PERIODIC = [name for name, method in REGISTRY.items()
            if method.comm_every > 1 and method.device_local and name not in COMPRESSED_OUTER]


def _run(*argv, timeout=600):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "benchmarks.mesh_scan", *argv],
                        capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def scan(tmp_path_factory):
  """Every registered method on a tiny char LM, 2x4 mesh, :data:`STEPS` steps."""
  out = tmp_path_factory.mktemp("scan")
  result = _run("--quick", "--methods", ",".join(REGISTRY), "--steps", str(STEPS),
                "--timed-steps", "2", "--hidden", "16", "--batch", "4", "--out", str(out))
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return out, result.stdout, json.loads((out / "results.json").read_text())


def test_every_method_runs_and_reports_its_bytes(scan):
  _, stdout, results = scan
  rows = {row["method"]: row for row in results["runs"]}
  assert set(rows) == set(REGISTRY)
  assert all("error" not in row for row in rows.values()), rows
  assert "2 hosts x 4 local devices" in stdout
  assert rows["fp32"]["intra_host_bytes"] == 0  # one flat all-reduce, charged to the host link
  assert rows["fp32"]["inter_host_bytes"] == pytest.approx(
      7 * rows["fp32-hier"]["inter_host_bytes"], rel=0.01)
  assert rows["topk-ef"]["inter_host_bytes"] < rows["sign-ef"]["inter_host_bytes"] \
      < rows["terngrad"]["inter_host_bytes"] < rows["int8"]["inter_host_bytes"] \
      < rows["fp32-hier"]["inter_host_bytes"]
  assert rows["powersgd-r1"]["inter_host_bytes"] < rows["powersgd-r4"]["inter_host_bytes"]
  # DGC across hosts gathers the top-k of each device's host-mean shard, as topk-ef does;
  # topk-ef also pays its non-finite agreement, a 4-byte all-reduce over the 8 devices.
  assert rows["dgc"]["inter_host_bytes"] == rows["topk-ef"]["inter_host_bytes"] - 2 * 7 / 8 * 4
  assert rows["dgc"]["intra_host_bytes"] == rows["topk-ef"]["intra_host_bytes"]
  # accumulation communicates on 2 of the 8 steps, exactly what fp32-hier does on each;
  # staleness delays the gradients, not the allreduce; CHOCO sends 1-bit differences
  loss_mean = 2 * 7 / 8 * 4  # outside every branch: paid on each step
  assert rows["accumulate-k4"]["inter_host_bytes"] == pytest.approx(
      loss_mean + (rows["fp32-hier"]["inter_host_bytes"] - loss_mean) / 4, rel=1e-12)
  assert rows["stale-t2-dcasgd"]["inter_host_bytes"] == rows["fp32-hier"]["inter_host_bytes"]
  assert rows["choco-sign-ring"]["inter_host_bytes"] < rows["gossip-ring"]["inter_host_bytes"] / 20
  # 8 steps. 1-bit Adam: 1 dense warm-up step, 7 1-bit; 0/1 Adam: 2 dense variance steps, 1
  # 1-bit sync, 5 silent. Both add the loss pmean (7 B), fp32-hier adds its non-finite
  # agreement (7 B) to the dense allreduce D: the 1-bit round x from 1-bit Adam's row
  # predicts 0/1 Adam's row exactly.
  every_step = 2 * 7 / 8 * 4
  dense = rows["fp32-hier"]["inter_host_bytes"] - 2 * every_step
  onebit_round = (8 * (rows["onebit-adam"]["inter_host_bytes"] - every_step) - dense) / 7
  assert 0 < onebit_round < dense / 16
  assert rows["zero-one-adam"]["inter_host_bytes"] == pytest.approx(
      every_step + (2 * dense + onebit_round) / 8, rel=1e-9)
  for row in rows.values():
    assert row["ratio_vs_fp32"] == pytest.approx(
        rows["fp32"]["inter_host_bytes"] / row["inter_host_bytes"])
    assert math.isfinite(row["held_out_loss"]) and row["median_step_ms"] > 0
    assert len(row["losses"]) == STEPS and set(row["modeled_ms"]) == set(figures.CLUSTERS)


def test_every_file_is_written(scan):
  out, _, results = scan
  with open(out / "runs.csv") as handle:
    assert len(list(csv.DictReader(handle))) == len(REGISTRY)
  with open(out / "curves.csv") as handle:
    assert len(list(csv.DictReader(handle))) == STEPS * len(REGISTRY)
  projected = {row["method"]: row for row in results["projection"]}
  assert projected["topk-ef"]["speedup"]["nvlink+1gbe"] > 10
  for name in ("loss_vs_bytes_charlm_2x4.png", "step_time_vs_bandwidth_charlm_2x4.png",
               "pareto_charlm_2x4.png"):
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  quality = {entry["method"]: entry for entry in results["quality"]}
  assert set(quality) == set(REGISTRY)
  assert all(entry["seeds"] == [0] and entry["held_out_std"] == 0 for entry in quality.values())
  runs = {row["method"]: row for row in results["runs"]}
  for name, entry in quality.items():
    assert entry["held_out_loss"] == runs[name]["held_out_loss"]
    assert entry["ratio_vs_fp32_hier"] == pytest.approx(runs[name]["ratio_vs_fp32_hier"])
  assert (out / "quality.md").read_text().count("\n| charlm | 2x4 |") == len(REGISTRY)


def test_periodic_methods_pay_one_allreduce_per_period(scan):
  _, _, results = scan
  rows = {row["method"]: row for row in results["runs"]}
  projected = {row["method"]: row for row in results["projection"]}
  assert {"local-sgd-h8", "diloco-h8", "diloco-h8-sign", "streaming-diloco-h8", "slowmo-h8",
          "fedavg-h8", "fedprox-h8"} <= set(PERIODIC)
  for name in PERIODIC:
    # The compiled step holds the synchronization once (streaming DiLoCo: one branch per
    # fragment, all parameters together), run once per period; sign-sync DiLoCo sends what
    # sign-ef sends per step. Both sides also pay the same scalar agreement and loss means.
    reference = "sign-ef" if name.endswith("-sign") else "fp32-hier"
    assert rows[name]["comm_every"] == REGISTRY[name].comm_every == PERIOD
    # the loss mean, outside every branch, runs on each step (charged to the host link)
    for link, every_step in (("inter_host_bytes", 2 * 7 / 8 * 4), ("intra_host_bytes", 0)):
      assert rows[name][link] == pytest.approx(
          every_step + (rows[reference][link] - every_step) / PERIOD, rel=0.01), link
    for field in ("slow_bytes", "fast_bytes"):
      assert projected[name][field] == pytest.approx(projected[reference][field] / PERIOD)
    assert math.isfinite(rows[name]["held_out_loss"])
  # The synchronization ran on the last step: local SGD's leaves the devices' mean where it
  # was, DiLoCo's outer Nesterov step moves it (by 1.33 times the pseudo-gradient at first).
  assert rows["diloco-h8"]["held_out_loss"] != pytest.approx(
      rows["local-sgd-h8"]["held_out_loss"], rel=1e-3)
  assert rows["gossip-ring"]["comm_every"] == 1


def test_compressed_outer_steps_and_demo_send_less_than_their_dense_counterparts(scan):
  _, _, results = scan
  rows = {row["method"]: row["inter_host_bytes"] for row in results["runs"]}
  assert rows["sparseloco-h8"] < rows["streaming-diloco-h8-q2"] < rows["streaming-diloco-h8-q4"] \
      < rows["streaming-diloco-h8"] < rows["fp32-hier"]
  assert rows["demo"] < rows["fp32-hier"] / 5
  # the same outer exchange amortized over twice the period (the loss mean runs every step)
  every_step = 2 * 7 / 8 * 4
  assert rows["sparseloco-h16"] - every_step == pytest.approx(
      (rows["sparseloco-h8"] - every_step) / 2, rel=1e-9)


def test_include_grows_the_quality_table_without_rerunning(scan, tmp_path, capsys):
  out, _, earlier = scan
  flags = ["--quick", "--steps", str(STEPS), "--timed-steps", "2", "--hidden", "16", "--batch",
           "4", "--include", str(out / "results.json")]
  assert mesh_scan.main([*flags[:2], "4", *flags[3:], "--out", str(tmp_path)]) == 2
  assert "was run with other settings: steps 8 != 4" in capsys.readouterr().err
  # In this process (the scan above ran in its own): the same results, without a second
  # start of Python, JAX and the plotting libraries.
  assert mesh_scan.main([*flags, "--methods", "fp32,topk-ef", "--out", str(tmp_path)]) == 0
  assert f"included from {out / 'results.json'}: {len(REGISTRY) - 2} runs" \
      in capsys.readouterr().out
  now = json.loads((tmp_path / "results.json").read_text())
  assert [row["method"] for row in now["runs"]] == ["fp32", "topk-ef"]
  quality = {entry["method"]: entry for entry in now["quality"]}
  before = {entry["method"]: entry for entry in earlier["quality"]}
  assert set(quality) == set(REGISTRY)
  # Same flags, same seed: the rerun reproduces the earlier runs exactly, so they compare.
  for name in ("fp32", "topk-ef", "int8"):
    assert quality[name]["held_out_loss"] == before[name]["held_out_loss"]
    assert quality[name]["held_out_gap_pct"] == pytest.approx(before[name]["held_out_gap_pct"])
