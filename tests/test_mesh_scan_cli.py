"""The main job's command line, refusals, formulas and tables, and its one-host and
one-device-per-host meshes: everything of mesh_scan but the all-methods scan (test_mesh_scan.py),
in a file of its own so that pytest-xdist runs it beside that long one."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from benchmarks import mesh_scan
from benchmarks.scan import figures, projection
from benchmarks.scan.methods import REGISTRY
from benchmarks.scan.tasks import TASKS
from jaxcomm import costmodel, links, topk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*argv, timeout=600):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "benchmarks.mesh_scan", *argv],
                        capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


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
  # P (256 x 2) and this device's 512 / 8 rows of Q (512 x 2); the bias dense
  assert low_rank.slow_bytes == pytest.approx(2 * 3 / 4 * 4 * (2 * (256 + 512 // 8) + 256))
  # A period divides steps and bytes, so the modeled time too
  assert gather.scaled(1 / 8).seconds(fast, slow) == pytest.approx(gather.seconds(fast, slow) / 8)


def test_powersgd_projection_equals_the_compiled_collective_bytes():
  """Rows padded (30 over 4 devices), two leaves of one matrix shape stacked, a dense bias."""
  import jax.numpy as jnp
  import jaxcomm
  from update_helpers import measure_update
  params = {"a": jnp.zeros((10, 3, 8)), "b": jnp.zeros((30, 8)), "d": jnp.zeros(12)}
  measured = measure_update(jaxcomm.powersgd_allreduce(2), params,
                            jaxcomm.make_mesh(hosts=2, local=4)).link_bytes()
  modeled = projection.powersgd([p.shape for p in params.values()], 2, 4, rank=2)
  assert (modeled.slow_bytes, modeled.fast_bytes) == pytest.approx(
      (measured["host"], measured["local"]))


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


def test_the_large_lm_profile_trains_the_large_gpt():
  large = mesh_scan.parse_args(["--profile", "lm-large"])
  assert large.seeds == (0, 1) and large.steps == 2000 and large.size == "large"
  assert [tuple(scan) for scan in large.plan] == [
      (("gpt",), ("2x4",), mesh_scan.LM_LARGE_METHODS, None)]
  assert set(mesh_scan.LM_LARGE_METHODS) <= set(mesh_scan.LM_METHODS)
  task = TASKS["gpt"]("large", 16, 1, 0)
  assert sum(leaf.size for leaf in jax.tree.leaves(task.params)) == 2_430_464
  assert "3 layers, d_model 256" in task.description and task.lr == 1e-3


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


def test_per_step_front_leaves_out_the_periodic_methods():
  """A periodic method with the fewest bytes and the lowest loss is the whole frontier; the
  per-step frontier is the one among the others, and each entry carries its period."""
  points = [(100.0, 2.0), (10.0, 2.2), (50.0, 2.1), (1.0, 1.9), (30.0, 2.3)]
  periods = [1, 1, 1, 8, 1]
  assert figures.pareto_front(points) == [3]
  assert figures.per_step_front(points, periods) == [1, 2, 0]
  rows = [_row("fp32", 0, 2.0, 700.0), {**_row("h8", 0, 2.1, 9.0), "comm_every": 8}]
  table = {entry["method"]: entry for entry in figures.quality(rows)}
  assert table["fp32"]["comm_every"] == 1 and table["h8"]["comm_every"] == 8
