"""Inter-host bytes per step and loss of the low-communication algorithms against fp32.

Trains the same MLP on the same generated data on a simulated 2 hosts x 4 devices mesh with
each algorithm and prints, per algorithm, the inter-host bytes each device sends per step
(read from the compiled HLO; collectives that run only on synchronization steps, inside
``lax.cond``/``lax.switch``, are divided by how often they run; for 1-bit Adam and 0/1 Adam,
whose branches hold different collectives, each branch is weighted by the share of steps that
took it, read from the final state) and the final held-out loss next to synchronous fp32
SGD's.

    python -m benchmarks.algorithms --steps 200
    python -m benchmarks.algorithms --steps 20 --algorithms gossip "stale tau=2"

``--algorithms`` keeps the rows whose name contains one of the given strings (case-insensitive);
the fp32 row always runs first, as the reference of the last column.
"""

from __future__ import annotations

import argparse
import os


def algorithms(lr: float):
  import optax

  import jaxcomm
  from benchmarks.scan.methods import onebit_branch_fractions, zero_one_branch_fractions
  from jaxcomm import optim
  # name -> (transformation, device-local params?, executions per step of its collectives:
  # a rate, or fractions(final state) of the branches of the step's one conditional)
  return {
      "fp32 sync SGD": (optax.chain(jaxcomm.compressed_allreduce(), optax.sgd(lr)), False, 1),
      "topk-ef 1% SGD": (optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.01)),
                                     optax.sgd(lr)), False, 1),
      "DGC 1% gather": (optax.chain(optim.dgc(0.01), optax.sgd(lr)), False, 1),
      "DGC 1% two-phase": (optax.chain(optim.dgc(0.01, strategy="two_phase"),
                                       optax.sgd(lr)), False, 1),
      "local SGD H=8": (optim.local_sgd(optax.sgd(lr), 8), True, 1 / 8),
      "DiLoCo H=8 adam": (optim.diloco(optax.adam(3e-3), 8), True, 1 / 8),
      "DiLoCo H=8 sign-ef": (optim.diloco(optax.adam(3e-3), 8, sync=jaxcomm.compressed_allreduce(
          jaxcomm.sign())), True, 1 / 8),
      # each of the 2 fragment branches runs once per 8 steps, with half the parameters
      "streaming DiLoCo H=8 F=2": (optim.diloco(optax.adam(3e-3), 8, fragments=2, delay=1,
                                                mixing=0.5), True, 1 / 8),
      "SlowMo H=8": (optim.slowmo(optax.sgd(lr), 8, lr, beta=0.5), True, 1 / 8),
      "FedAvg H=8 6/8 clients": (optim.fedavg(optax.sgd(lr), 8, client_sizes=range(1, 9),
                                              clients_per_round=6), True, 1 / 8),
      "gossip ring": (optim.gossip(optax.sgd(lr), "ring"), True, 1),
      "gossip hypercube": (optim.gossip(optax.sgd(lr), "hypercube"), True, 1),
      "CHOCO sign hypercube": (optim.gossip(optax.sgd(lr), "hypercube",
                                            compressor=jaxcomm.sign(), consensus_step=0.5),
                               True, 1),
      "stale tau=2 DC-ASGD": (optax.chain(jaxcomm.compressed_allreduce(),
                                          optim.staleness(2, compensation=0.1), optax.sgd(lr)),
                              False, 1),
      "accumulate k=4 topk-ef": (optim.accumulate_gradients(optax.chain(
          jaxcomm.compressed_allreduce(jaxcomm.topk(0.01)), optax.sgd(lr)), 4), False, 1 / 4),
      "1-bit Adam, 20 warm-up": (optim.onebit_adam(3e-3, warmup_steps=20), False,
                                 lambda state: onebit_branch_fractions(int(state.count), 20)),
      "0/1 Adam, freeze 50": (optim.zero_one_adam(
          3e-3, var_freeze_step=50, var_update_scaler=8, local_step_scaler=10,
          local_step_clipper=8), True, zero_one_branch_fractions),
  }


def select(table: dict, wanted: list[str] | None) -> dict:
  """The reference row (the first) and the rows whose name contains one of ``wanted``."""
  if not wanted:
    return table
  unmatched = [w for w in wanted if not any(w.lower() in name.lower() for name in table)]
  if unmatched:
    raise SystemExit(f"--algorithms: no row matches {unmatched}; rows: {list(table)}")
  reference = next(iter(table))
  return {name: row for name, row in table.items()
          if name == reference or any(w.lower() in name.lower() for w in wanted)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--hidden", default="64,64", help="comma-separated hidden widths")
  parser.add_argument("--algorithms", nargs="+", metavar="NAME",
                      help="run only the rows whose name contains one of these (and fp32)")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  from jax.sharding import PartitionSpec as P

  import jaxcomm
  from jaxcomm.optim import data_parallel_step, device_mean, local_training_step, to_device_local
  from models.data import teacher_classification
  from models.mlp import classification_loss, init_mlp

  table = select(algorithms(args.lr), args.algorithms)
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  graphdef, initial = init_mlp(64, [int(w) for w in args.hidden.split(",")], 10, seed=0)
  loss_fn = classification_loss(graphdef)
  inputs, labels = teacher_classification(0, 8 * 32 * 100 + 4096, 64, 10)
  held_out = (inputs[-4096:], labels[-4096:])
  print("| algorithm | inter-host bytes/step/device | held-out loss | vs fp32 |")
  print("|---|---:|---:|---:|")
  reference = None
  for name, (tx, local, rate) in table.items():
    params = to_device_local(initial, mesh) if local else initial
    spec = P(tuple(mesh.axis_names)) if local else P()
    state, specs = jaxcomm.optim.sharded_init(tx, params, mesh, spec)
    step = (local_training_step if local else data_parallel_step)(loss_fn, tx, mesh, specs)
    batch = lambda i: (inputs[(i % 100) * 256:(i % 100 + 1) * 256],
                       labels[(i % 100) * 256:(i % 100 + 1) * 256])
    report = jaxcomm.accounting.measure(step, params, state, batch(0), mesh=mesh)
    for i in range(args.steps):
      params, state, _ = step(params, state, batch(i))
      # One step in flight: with steps dispatched back to back, jaxlib 0.10.2's CPU runtime
      # can deadlock in a collective when the cores are loaded (docs/algorithms.md).
      jax.block_until_ready((params, state))
    if callable(rate):
      (conditional,) = report.conditionals()
      per_step = report.link_bytes(branch_weights={conditional: rate(state)})["host"]
    else:  # every branch's collectives once per synchronization, `rate` syncs per step
      every_branch = {name: [1.0] * branches for name, branches in report.branch_counts}
      per_step = report.link_bytes(branch_weights=every_branch)["host"] * rate
    final = device_mean(params, mesh) if local else params
    loss = float(loss_fn(final, held_out))
    reference = loss if reference is None else reference
    print(f"| {name} | {per_step:,.0f} | {loss:.4f} | {loss - reference:+.4f} |", flush=True)


if __name__ == "__main__":
  main()
