"""The main job: every method runs end to end, every output is written, bad input is refused."""

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import mesh_scan
from benchmarks.scan import figures, projection
from benchmarks.scan.methods import REGISTRY
from jaxcomm import costmodel, links, topk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERIOD = 8
STEPS = PERIOD  # every periodic method synchronizes once, on the last step
# Periodic methods whose outer step sends its own compressed format (checked separately below)
COMPRESSED_OUTER = ("sparseloco-h8", "streaming-diloco-h8-q4", "streaming-diloco-h8-q2")
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


@pytest.mark.parametrize("argv, match", [
    (["--methods", "fp32,zip"], "unknown method 'zip'"),
    (["--models", "gpt5"], "unknown model 'gpt5'"),
    (["--meshes", "2by4"], "mesh '2by4' is not HOSTSxLOCAL"),
    (["--topk-density", "0"], "--topk-density must be in"),
    (["--hidden", "a,b"], "--hidden must be"),
    (["--steps", "5", "--timed-steps", "10"], "--timed-steps"),
    (["--seeds", "0,x"], "--seeds must be comma-separated integers"),
    (["--seeds", "-1"], "--seeds must name at least one seed >= 0"),
    (["--profile", "huge"], "invalid choice: 'huge'"),
])
def test_bad_flags_exit_with_one_line(argv, match, capsys):
  with pytest.raises(SystemExit) as exit_info:
    mesh_scan.parse_args(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert match in err and err.count("\n") == 1


def test_mesh_that_does_not_use_every_device_is_refused(capsys):
  assert mesh_scan.main(["--meshes", "3x2"]) == 2
  err = capsys.readouterr().err
  assert "mesh 3x2 has 6 devices; it must use all 8" in err and err.count("\n") == 1


def test_unwritable_out_is_refused_without_a_traceback(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  result = _run("--quick", "--out", str(blocker / "out"), timeout=120)
  assert result.returncode == 2
  assert "is not writable" in result.stderr and "Traceback" not in result.stderr
  assert result.stderr.count("\n") == 1


def test_iso_quality_counts_full_windows_only():
  losses = [1.0, 0.1, 0.9, 0.5, 0.4, 0.3]
  assert figures.iso_quality_steps(losses, 0.51, 2) == 3  # not 2: mean(1.0, 0.1) = 0.55
  assert figures.iso_quality_steps(losses, 0.45, 2) == 5
  assert figures.iso_quality_steps(losses, 0.1, 2) is None
  np.testing.assert_allclose(figures.smoothed([1.0, 3.0, 5.0], 2), [1.0, 2.0, 4.0])


def test_projection_matches_the_cost_model_and_the_formulas():
  shapes = [(512, 256), (256,)]
  fast, slow = links.link("nvlink4"), links.link("100gbe")
  gather = projection.hierarchical(shapes, 4, 8, topk(0.01), "gather")
  expected = costmodel.project(shapes, 4, 8, fast, slow, topk(0.01).wire_bytes)
  assert gather.seconds(fast, slow) == pytest.approx(expected.total_seconds)
  assert (gather.slow_bytes, gather.fast_bytes) == (expected.slow_bytes, expected.fast_bytes)
  flat = projection.flat_fp32(shapes, 4, 8)
  assert flat.slow_bytes == pytest.approx(2 * 31 / 32 * 4 * (512 * 256 + 256))
  assert flat.seconds(fast, slow) == pytest.approx(
      sum(costmodel.all_reduce_time(4 * math.prod(s), 32, slow) for s in shapes))
  low_rank = projection.powersgd(shapes, 4, 8, rank=2)
  assert low_rank.slow_bytes == pytest.approx(2 * 3 / 4 * 4 * (2 * (512 + 256) + 256))
  # A period divides steps and bytes, so the modeled time too
  assert gather.scaled(1 / 8).seconds(fast, slow) == pytest.approx(gather.seconds(fast, slow) / 8)


def test_one_host_and_one_device_per_host_meshes(tmp_path):
  result = _run("--quick", "--meshes", "1x8,8x1", "--methods", "fp32,fp32-hier,topk-ef-2p",
                "--steps", "4", "--timed-steps", "1", "--hidden", "16", "--batch", "4",
                "--out", str(tmp_path))
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  rows = {(row["mesh"], row["method"]): row
          for row in json.loads((tmp_path / "results.json").read_text())["runs"]}
  assert all(rows["1x8", m]["inter_host_bytes"] == 0 and rows["1x8", m]["ratio_vs_fp32"] is None
             for m in ("fp32", "fp32-hier", "topk-ef-2p"))
  assert all(rows["8x1", m]["intra_host_bytes"] == 0
             for m in ("fp32", "fp32-hier", "topk-ef-2p"))
  assert rows["8x1", "topk-ef-2p"]["inter_host_bytes"] \
      < rows["8x1", "fp32-hier"]["inter_host_bytes"]
  assert not (tmp_path / "loss_vs_bytes_charlm_1x8.png").exists()  # nothing crosses hosts
  assert (tmp_path / "loss_vs_bytes_charlm_8x1.png").exists()


def test_profiles_run_the_lm_quality_table():
  lm = mesh_scan.parse_args(["--profile", "lm"])
  assert lm.seeds == (0, 1) and lm.steps == 1000 and lm.size == "default"
  assert [tuple(scan) for scan in lm.plan] == [(("gpt",), ("2x4",), mesh_scan.LM_METHODS, None)]
  assert set(mesh_scan.LM_METHODS) <= set(REGISTRY)
  default, full = mesh_scan.parse_args([]), mesh_scan.parse_args(["--profile", "full"])
  assert default.seeds == full.seeds == (0,)
  assert mesh_scan.Scan(("gpt",), ("2x4",), mesh_scan.LM_DEFAULT_METHODS,
                        mesh_scan.GPT_DEFAULT_STEPS) in full.plan
  assert set(mesh_scan.LM_DEFAULT_METHODS) <= set(mesh_scan.LM_METHODS)
  runs = lambda plan: {(model, mesh, method) for scan in plan for model in scan.models
                       for mesh in scan.meshes for method in scan.methods}
  assert runs(default.plan) < runs(full.plan)  # the default is a subset, of 35 runs
  assert len(runs(default.plan)) == 35
  assert {m for _, _, m in runs(full.plan)} == set(REGISTRY)
  assert mesh_scan.parse_args(["--profile", "lm", "--seed", "3"]).seeds == (3,)


def _row(method, seed, loss, inter_host, hosts=2):
  return {"model": "m", "mesh": "2x4", "hosts": hosts, "method": method, "steps": 10,
          "seed": seed, "held_out_loss": loss, "inter_host_bytes": inter_host}


def test_quality_averages_each_method_over_its_seeds_against_the_same_seed_fp32():
  rows = [_row("fp32", 0, 2.0, 700.0), _row("fp32", 1, 2.2, 700.0),
          _row("fp32-hier", 0, 2.0, 100.0), _row("fp32-hier", 1, 2.2, 100.0),
          _row("x", 0, 2.02, 4.0), _row("x", 1, 2.31, 6.0),
          {**_row("y", 0, 1.0, 1.0), "error": "ValueError: no"}]
  table = {entry["method"]: entry for entry in figures.quality(rows)}
  assert set(table) == {"fp32", "fp32-hier", "x"}
  x = table["x"]
  assert x["seeds"] == [0, 1] and x["inter_host_bytes"] == 5.0
  assert x["ratio_vs_fp32"] == 140.0 and x["ratio_vs_fp32_hier"] == 20.0
  assert x["held_out_loss"] == pytest.approx(2.165)
  assert x["held_out_std"] == pytest.approx(np.std([2.02, 2.31], ddof=1))
  assert x["gap_range_pct"] == pytest.approx((1.0, 5.0))
  assert x["held_out_gap_pct"] == pytest.approx(3.0)  # mean of the per-seed gaps
  assert figures.best_within(list(table.values()), "m", "2x4", 1.0)["method"] == "fp32-hier"
  assert figures.best_within(list(table.values()), "m", "2x4", 3.5)["method"] == "x"


def test_pareto_front_keeps_the_points_no_other_point_beats_on_both():
  points = [(10.0, 1.0), (1.0, 3.0), (5.0, 2.0), (5.0, 2.5), (20.0, 1.0), (2.0, 3.5),
            (8.0, 0.5)]
  assert figures.pareto_front(points) == [1, 2, 6]
  for index, (x, y) in enumerate(points):
    dominated = any(a <= x and b <= y and (a, b) != (x, y) for a, b in points)
    assert (index in figures.pareto_front(points)) == (not dominated)


def test_include_grows_the_quality_table_without_rerunning(scan, tmp_path, capsys):
  out, _, earlier = scan
  flags = ["--quick", "--steps", str(STEPS), "--timed-steps", "2", "--hidden", "16", "--batch",
           "4", "--include", str(out / "results.json")]
  assert mesh_scan.main([*flags[:2], "4", *flags[3:], "--out", str(tmp_path)]) == 2
  assert "was run with other settings: steps 8 != 4" in capsys.readouterr().err
  result = _run(*flags, "--methods", "fp32,topk-ef", "--out", str(tmp_path))
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert f"included from {out / 'results.json'}: {len(REGISTRY) - 2} runs" in result.stdout
  now = json.loads((tmp_path / "results.json").read_text())
  assert [row["method"] for row in now["runs"]] == ["fp32", "topk-ef"]
  quality = {entry["method"]: entry for entry in now["quality"]}
  before = {entry["method"]: entry for entry in earlier["quality"]}
  assert set(quality) == set(REGISTRY)
  # Same flags, same seed: the rerun reproduces the earlier runs exactly, so they compare.
  for name in ("fp32", "topk-ef", "int8"):
    assert quality[name]["held_out_loss"] == before[name]["held_out_loss"]
    assert quality[name]["held_out_gap_pct"] == pytest.approx(before[name]["held_out_gap_pct"])
