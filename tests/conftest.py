"""Test configuration: 8 simulated CPU devices and XLA's classic CPU emitters, set before the
JAX backend starts."""
import importlib.metadata
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is compile-bound. XLA's new CPU fusion emitters make each compilation about a
# quarter slower here than the classic emitters, whose results are the same (mesh_scan's
# fp32, topk-ef, onebit-adam and demo: losses and bytes bit-identical). Subprocesses (mesh_scan,
# multi-process jobs) inherit the flag. Only on the jaxlib it was measured on: an XLA that
# no longer knows a flag aborts at start.
if (importlib.metadata.version("jaxlib").startswith("0.10.")
    and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_use_fusion_emitters=false").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# The files that take the most CPU (each 30-110 s on 2 cores, measured 2026-11-25), scheduled
# first: with `--dist loadfile` a worker runs a whole file, and a long file started last keeps
# one worker busy while the other idles. The README's command passes
# `--no-loadscope-reorder`, so xdist keeps this order (its default sorts files by their
# number of tests, which put test_mesh_scan's 5 long tests last). Other files keep theirs.
LONGEST_FILES = (
    "tests/test_mesh_scan.py", "tests/reliability/test_faults.py", "tests/test_hsdp.py",
    "tests/parallel/test_moe.py", "tests/optim/test_dgc.py",
    "tests/multiprocess/test_multiprocess.py", "tests/test_mesh_scan_custom.py",
    "tests/parallel/test_ring_attention.py", "tests/test_planner.py",
    "tests/optim/test_quality_classification.py", "tests/models/test_transformer.py",
)


def pytest_collection_modifyitems(items):
  rank = {path: index for index, path in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
