"""One process of a launched job: ``mp_worker.py OUT_DIR [fail]``.

Joins the job from the launcher's environment and writes ``OUT_DIR/process_<i>.npz`` with the
results of :mod:`mp_workloads` on the ``(processes, local devices)`` mesh. With ``fail``,
process 1 dies (``os._exit(3)``, as a crash would) right after joining while the others block in
a collective that can never complete; the launcher must stop them. (A Python exception would not
do: the process would then wait in JAX's shutdown barrier at exit.)
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxcomm.distributed  # noqa: E402

if not jaxcomm.distributed.initialize_from_env():
  sys.exit("mp_worker.py must be started by python -m jaxcomm.launch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
import mp_workloads  # noqa: E402

out_dir = sys.argv[1]
mesh = jaxcomm.make_mesh()
if sys.argv[2:] == ["fail"]:
  if jax.process_index() == 1:
    os._exit(3)
  ones = jax.jit(lambda: jnp.ones(mesh.size),
                 out_shardings=NamedSharding(mesh, P(mp_workloads.AXES)))()
  np.asarray(jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, mp_workloads.AXES), mesh=mesh,
                                   in_specs=P(mp_workloads.AXES), out_specs=P()))(ones))
  raise SystemExit("the collective completed although process 1 had exited")
results = {"mesh_shape": np.array([mesh.shape["host"], mesh.shape["local"]]),
           **mp_workloads.allreduce_results(mesh), **mp_workloads.training_results(mesh),
           **mp_workloads.hsdp_results(mesh)}
np.savez(os.path.join(out_dir, f"process_{jax.process_index()}.npz"), **results)
print(f"wrote {len(results)} results")
