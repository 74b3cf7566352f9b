"""Test configuration: 8 simulated CPU devices, set before the JAX backend starts."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Files that take minutes run first: pytest-xdist (--dist loadfile) hands out whole files in
# collection order, and a long file handed out last leaves one worker running alone at the end.
LONGEST_FILES = ("tests/test_mesh_scan.py", "tests/test_hsdp.py",
                 "tests/reliability/test_faults.py", "tests/multiprocess/test_multiprocess.py",
                 "tests/test_mesh_scan_custom.py", "tests/optim/test_quality_classification.py")


def pytest_collection_modifyitems(items):
  """Moves the tests of :data:`LONGEST_FILES` to the front, each file's order kept."""
  rank = {path: index for index, path in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FILES)))
