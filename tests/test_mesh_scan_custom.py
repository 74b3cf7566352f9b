"""The main job on the user's own task: ``--task module:function`` end to end, bad input."""

import json
import re
import sys
import types

import jax
import numpy as np
import pytest

from benchmarks import mesh_scan
from benchmarks.examples import my_task
from benchmarks.scan import cluster, custom_task, recommend, report_html
from benchmarks.scan.methods import REGISTRY
from jaxcomm import links

TASK = "benchmarks.examples.my_task:make_task"
FAST = ["--steps", "4", "--timed-steps", "2", "--batch", "2"]


def test_example_task_scans_end_to_end(tmp_path):
  """The example nnx task trains under every requested method; fp32 learns on it."""
  assert mesh_scan.main(["--task", TASK, "--methods", "fp32,int8,topk-ef", *FAST,
                         "--cluster", "hosts=16,local=8,intra=nvlink4,inter=1gbe",
                         "--out", str(tmp_path)]) == 0
  results = json.loads((tmp_path / "results.json").read_text())
  runs = {row["method"]: row for row in results["runs"]}
  assert set(runs) == {"fp32", "int8", "topk-ef"}
  assert all("error" not in row and row["model"] == "my_task" for row in runs.values())
  task = custom_task.load(TASK, 16, 0, "my_task")  # 2 per device x 8 devices, seed 0
  initial = float(task.loss_fn(task.params, task.held_out))
  assert runs["fp32"]["held_out_loss"] < initial
  assert 0 < runs["topk-ef"]["inter_host_bytes"] < runs["fp32"]["inter_host_bytes"]
  assert "nnx MLP" in results["meta"]["models"]["my_task"]
  advice = json.loads((tmp_path / "recommendation.json").read_text())
  assert advice["cluster"].startswith("16 hosts x 8 devices")
  count = sum(leaf.size for leaf in jax.tree.leaves(task.params))  # the example's own shapes
  assert advice["modeled"]["my_task"]["fp32"]["inter_bytes"] == pytest.approx(
      2 * 127 / 128 * 4 * count)
  (entry,) = advice["recommendations"]
  assert entry["choice"]["method"] in runs and entry["text"].startswith("Recommendation for")
  page = (tmp_path / "report.html").read_text()
  assert entry["text"].splitlines()[0] in page and "pareto_my_task_2x4.png" in page
  # self-contained: every image inline, nothing fetched
  assert page.count('src="data:image/png;base64,') >= 4
  assert not re.search(r"""(src|href)=(?!"data:)|url\(|@import""", page)


def test_method_families_cover_every_method():
  assert {name: report_html.family(name) for name in ("fp32-hier", "sign-ef",
          "streaming-diloco-h8-q2", "topk-ef-2p", "choco-sign-ring")} == {
      "fp32-hier": "references", "sign-ef": "quantizers",
      "streaming-diloco-h8-q2": "periodic (local steps)", "topk-ef-2p":
      "sparsifiers and sketches", "choco-sign-ring": "decentralized"}
  assert "other" not in {report_html.family(name) for name in REGISTRY}


def _module(monkeypatch, **functions):
  module = types.ModuleType("user_task_for_test")
  for name, function in functions.items():
    setattr(module, name, function)
  monkeypatch.setitem(sys.modules, module.__name__, module)
  return module.__name__


def _good(global_batch, seed):
  return my_task.make_task(global_batch, seed)


@pytest.mark.parametrize("answer, words", [
    (lambda t: [t["loss_fn"]], "returned list"),
    (lambda t: {k: v for k, v in t.items() if k != "held_out"}, "without held_out"),
    (lambda t: t | {"extra": 1}, "unknown keys extra"),
    (lambda t: t | {"batch": 3}, "batch is a int, not callable"),
    (lambda t: t | {"batch": lambda step: (np.zeros((5, 16)), np.zeros((5, 4))), },
     "16 rows each"),
    (lambda t: t | {"params": {"w": np.zeros(3, np.int32)}}, "floating-point arrays"),
    (lambda t: t | {"loss_fn": lambda model, batch: model(batch[0])}, "must return a scalar"),
    (lambda t: t | {"lr": -1.0}, "lr must be a positive number"),
])
def test_task_breaking_the_contract_is_one_line_exit_2(monkeypatch, capsys, answer, words):
  name = _module(monkeypatch, make=lambda global_batch, seed: answer(_good(global_batch, seed)))
  assert mesh_scan.main(["--task", f"{name}:make", "--methods", "fp32", *FAST]) == 2
  error = capsys.readouterr().err
  assert words in error and error.count("\n") == 1, error


@pytest.mark.parametrize("spec, words", [
    ("no_such_module_xyz:make", "does not import: ModuleNotFoundError"),
    ("benchmarks.examples.my_task:nothing", "has no callable 'nothing'"),
    ("benchmarks.examples.my_task", "is not MODULE:FUNCTION"),
])
def test_task_that_does_not_resolve_is_one_line_exit_2(capsys, spec, words):
  with pytest.raises(SystemExit) as exit_:
    mesh_scan.main(["--task", spec])
  assert exit_.value.code == 2
  error = capsys.readouterr().err
  assert words in error and error.count("\n") == 1, error


def test_task_module_raising_on_import_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
  (tmp_path / "broken_user_task.py").write_text("raise RuntimeError('no data here')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(SystemExit) as exit_:
    mesh_scan.main(["--task", "broken_user_task:make"])
  assert exit_.value.code == 2
  assert "RuntimeError: no data here" in capsys.readouterr().err


def _entry(method, gap):
  return {"model": "m", "mesh": "2x4", "method": method, "held_out_gap_pct": gap}


def _modeled(**step_ms):
  return {name: {"step_ms": ms, "inter_bytes": 10.0 * ms, "intra_bytes": 1.0}
          for name, ms in step_ms.items()}


def test_recommendation_is_fastest_within_margin_with_runner_up():
  quality = [_entry("fp32", 0.0), _entry("int8", 0.4), _entry("topk-ef", 3.0),
             _entry("powersgd-r1", 0.9), _entry("gossip-ring", -1.0)]
  modeled = _modeled(fp32=100.0, int8=40.0, **{"topk-ef": 10.0, "powersgd-r1": 20.0})
  result = recommend.recommend(quality, modeled, 1.0, "m")
  # topk-ef is fastest but 3% worse; gossip-ring has no model of its time: neither qualifies.
  assert [r["method"] for r in recommend.rank(quality, modeled, 1.0)] == [
      "powersgd-r1", "int8", "fp32"]
  assert result.choice["method"] == "powersgd-r1" and result.runner_up["method"] == "int8"
  assert result.choice["speedup"] == 5.0 and result.compressed_holds
  assert "use powersgd-r1" in result.text and "runner-up int8" in result.text
  assert recommend.recommend(quality, modeled, 5.0, "m").choice["method"] == "topk-ef"


def test_recommendation_says_when_no_compressed_method_holds_quality():
  quality = [_entry("fp32", 0.0), _entry("fp32-hier", 0.0), _entry("int8", 2.0)]
  result = recommend.recommend(quality, _modeled(fp32=100.0, **{"fp32-hier": 30.0}, int8=5.0),
                               1.0, "m")
  assert not result.compressed_holds and result.choice["method"] == "fp32-hier"
  assert "no compressed method holds quality here" in result.text
  assert recommend.recommend(quality[1:], _modeled(int8=5.0), 1.0, "m").choice is None


def test_cluster_syntax_presets_and_explicit_links():
  spec = cluster.parse("hosts=16,local=8,intra=nvlink4,inter=25e9:5e-6,compute_ms=120")
  assert (spec.hosts, spec.local, spec.compute_ms) == (16, 8, 120.0)
  assert spec.intra == links.NVLINK4
  assert (spec.inter.bandwidth_bytes_per_s, spec.inter.latency_s) == (25e9, 5e-6)
  assert cluster.parse("inter=10GbE,hosts=2,local=1,intra=pcie5").inter == links.ETHERNET_10G


def test_cluster_model_uses_the_models_own_shapes():
  """fp32 on the cluster is the ring all-reduce of the model's own gradients on the slow link."""
  spec = cluster.parse("hosts=4,local=2,intra=nvlink4,inter=1:0")
  shapes = [(3, 5), (7,)]
  modeled = cluster.model_step([REGISTRY["fp32"]], None, shapes, spec)["fp32"]
  assert modeled["inter_bytes"] == 2 * 7 / 8 * 4 * (15 + 7)
  assert modeled["step_ms"] == pytest.approx(1e3 * 2 * 7 / 8 * 4 * (15 + 7))
  # The bandwidth sweep is model_step with the inter-host link at each bandwidth.
  swept = cluster.step_ms_over_bandwidths(REGISTRY["fp32"], None, shapes, spec, [1.0, 4.0])
  assert swept == [modeled["step_ms"], modeled["step_ms"] / 4]


@pytest.mark.parametrize("spec, words", [
    ("hosts=16", "lacks local, intra, inter"),
    ("hosts=0,local=8,intra=nvlink4,inter=1gbe", "hosts='0' must be an integer >= 1"),
    ("hosts=2,local=8,intra=nvlink4,inter=25gbe", "unknown link '25gbe'"),
    ("hosts=2,local=8,intra=nvlink4,inter=fast:slow", "BANDWIDTH:LATENCY"),
    ("hosts=2,hosts=2,local=8,intra=nvlink4,inter=1gbe", "each once"),
    ("hosts=2,local=8,intra=nvlink4,inter=1gbe,compute_ms=-3", "compute_ms='-3'"),
])
def test_bad_cluster_is_one_line_exit_2(capsys, spec, words):
  with pytest.raises(SystemExit) as exit_:
    mesh_scan.main(["--cluster", spec])
  assert exit_.value.code == 2
  error = capsys.readouterr().err
  assert words in error and error.count("\n") == 1, error


def test_resume_skips_saved_runs_and_keeps_their_results(tmp_path, monkeypatch):
  """Every run is saved as it finishes; --resume trains only the runs not saved yet."""
  from benchmarks.scan import driver
  trained = []
  real_run = driver.run

  def counting_run(task, method, *rest, **kwargs):
    trained.append(method.name)
    return real_run(task, method, *rest, **kwargs)

  monkeypatch.setattr(driver, "run", counting_run)
  flags = ["--task", TASK, *FAST, "--out", str(tmp_path)]
  assert mesh_scan.main([*flags, "--methods", "fp32"]) == 0
  first = json.loads((tmp_path / "results.json").read_text())["runs"][0]
  assert mesh_scan.main([*flags, "--methods", "fp32,int8", "--resume"]) == 0
  assert trained == ["fp32", "int8"]
  runs = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
  assert runs["fp32"]["losses"] == first["losses"] and "error" not in runs["int8"]
  # other settings (learning rate): the saved run is not reused
  assert mesh_scan.main([*flags, "--methods", "fp32", "--lr", "1e-2", "--resume"]) == 0
  assert trained == ["fp32", "int8", "fp32"]
