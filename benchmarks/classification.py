"""Held-out accuracy of compressed data parallelism on a real classification task.

scikit-learn's bundled handwritten digits (:func:`models.data.digits`), a 64-256-256-10 MLP,
data parallel over a ``(host, local)`` mesh, the optimizers people use at the learning rate
they use without compression. For each method, optimizer and mesh: mean and standard
deviation of the held-out accuracy over seeds, the gap to ``fp32`` (same optimizer and mesh),
and the inter-host bytes per device per step read from the compiled step's HLO
(:mod:`jaxcomm.accounting`).

  python -m benchmarks.classification                      # the full table (docs/quality.md)
  python -m benchmarks.classification --methods fp32,sign-ef --meshes 8x1 --seeds 0
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import platform
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

import jaxcomm
from models.data import digits
from models.mlp import classification_loss, init_mlp

HIDDEN = (256, 256)
BATCH = 64
AXES = ("host", "local")


def _flat_pmean() -> optax.GradientTransformation:
  """The mean over every device in one flat full-precision all-reduce."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda grads, state, params=None: (jax.lax.pmean(grads, AXES), state))


METHODS: dict[str, Callable[[int], optax.GradientTransformation]] = {
    "fp32": lambda seed: _flat_pmean(),
    "fp32-hier": lambda seed: jaxcomm.compressed_allreduce(None),
    "int8": lambda seed: jaxcomm.compressed_allreduce(jaxcomm.quantize(8), seed=seed),
    "int8-two-phase": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.quantize(8), strategy="two_phase", seed=seed),
    "sign-ef": lambda seed: jaxcomm.compressed_allreduce(jaxcomm.sign(), seed=seed),
    # QSGD (unbiased: classic residuals by default; a norm per bucket of 512 by default, and
    # one norm per tensor) and TernGrad's default (clipped, so biased: bounded residuals).
    "qsgd": lambda seed: jaxcomm.compressed_allreduce(jaxcomm.compress.qsgd(16), seed=seed),
    "qsgd-per-tensor": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.compress.qsgd(16, bucket=None), seed=seed),
    "terngrad": lambda seed: jaxcomm.compressed_allreduce(jaxcomm.compress.terngrad(),
                                                          seed=seed),
    # TernGrad's scalers (docs/quality.md, section 13): one per tensor, per bucket, and the
    # paper's clipping at 2.5 standard deviations (biased: error feedback by default).
    **{f"terngrad-{label}": functools.partial(
        lambda seed, bucket, clip: jaxcomm.compressed_allreduce(
            jaxcomm.compress.terngrad(bucket=bucket, clip=clip), seed=seed),
        bucket=bucket, clip=clip)
       for label, bucket, clip in (("tensor", None, None), ("b64", 64, None),
                                   ("b128", 128, None), ("b512", 512, None),
                                   ("clip2.5", None, 2.5), ("b512-clip2.5", 512, 2.5))},
    # Without error feedback (section 13: unclipped, it still diverges under SGD momentum but
    # holds AdamW, which the residuals cost 5.9 to 41.8 points).
    "terngrad-tensor-none": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.compress.terngrad(bucket=None, clip=None), feedback="none", seed=seed),
    "terngrad-clip2.5-none": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.compress.terngrad(bucket=None, clip=2.5), feedback="none", seed=seed),
    # Clipped, but exchanged as the unbiased ones are (two-phase, classic residuals): the
    # bytes of two-phase on 8 hosts instead of gather's (and 8.8 to 10.4 points lost on AdamW).
    "terngrad-clip2.5-two-phase": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.compress.terngrad(clip=2.5), feedback="residual", strategy="two_phase",
        seed=seed),
    # Per-chunk sign scales (docs/quality.md, section 11).
    **{f"sign-ef-chunk{chunk}": functools.partial(
        lambda seed, chunk: jaxcomm.compressed_allreduce(jaxcomm.sign(chunk), seed=seed),
        chunk=chunk) for chunk in (16, 64, 256)},
    # The mechanisms before docs/quality.md's fix: classic error feedback (residuals), with
    # two-phase (the old automatic choice on more than 2 hosts) and with gather.
    "sign-ef-residual-two-phase": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.sign(), feedback="residual", strategy="two_phase", seed=seed),
    "sign-ef-residual-gather": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.sign(), feedback="residual", strategy="gather", seed=seed),
    "topk-ef-residual-two-phase": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.topk(0.01), feedback="residual", strategy="two_phase", seed=seed),
    "topk-ef-residual-gather": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.topk(0.01), feedback="residual", strategy="gather", seed=seed),
    "topk-ef": lambda seed: jaxcomm.compressed_allreduce(jaxcomm.topk(0.01), seed=seed),
    "topk-ef-gather": lambda seed: jaxcomm.compressed_allreduce(
        jaxcomm.topk(0.01), strategy="gather", seed=seed),
    "powersgd-r2": lambda seed: jaxcomm.powersgd_allreduce(2, seed=seed),
    # RESIDUAL_BOUND's neighbours (docs/quality.md, section 9): 'bounded' feedback is exactly
    # this wrapping with bound=RESIDUAL_BOUND.
    **{f"topk-ef-bound{bound:g}": functools.partial(
        lambda seed, bound: jaxcomm.compressed_allreduce(
            jaxcomm.compress.error_feedback(jaxcomm.topk(0.01), bound=bound), feedback="none",
            strategy="gather", seed=seed), bound=bound) for bound in (1.5, 3, 10)},
}

# fp32's learning rates: the recipe most people run (SGD 0.1 with momentum 0.9) and AdamW's
# usual 1e-3, both at global batch 256.
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgdm": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-3),
}


class Result(NamedTuple):
  """One training run: held-out accuracy, last training losses, host bytes per step."""
  accuracy: float
  losses: np.ndarray
  host_bytes: float


def parse_mesh(text: str) -> tuple[int, int]:
  """``'8x1'`` -> ``(hosts, local)``."""
  hosts, _, local = text.partition("x")
  if not (hosts.isdigit() and local.isdigit()):
    raise ValueError(f"mesh must look like HOSTSxLOCAL (e.g. 2x4), got {text!r}.")
  return int(hosts), int(local)


def batches(inputs: np.ndarray, labels: np.ndarray, steps: int, seed: int, batch: int):
  """``steps`` batches of ``batch`` samples, reshuffled every epoch, from ``seed``."""
  rng = np.random.default_rng(seed + 1000)
  order = np.concatenate([rng.permutation(len(labels))
                          for _ in range(math.ceil(steps * batch / len(labels)) + 1)])
  for step in range(steps):
    index = order[step * batch:(step + 1) * batch]
    yield inputs[index], labels[index]


def train(method: str, optimizer: str, mesh_shape: tuple[int, int], seed: int, steps: int,
          batch: int = BATCH, observe: Callable | None = None,
          compiled_steps: dict | None = None) -> Result:
  """Trains one run and returns its :class:`Result`.

  Args:
    method: a key of :data:`METHODS`.
    optimizer: a key of :data:`OPTIMIZERS`.
    mesh_shape: ``(hosts, local)``.
    seed: seeds the model, the data order and the compressor's randomness (the split is
      fixed).
    steps: training steps.
    batch: global batch size (split over all devices).
    observe: called as ``observe(step, batch, params_before, opt_state_after)`` after every
      step (diagnostics).
    compiled_steps: a dict shared by runs that differ only in ``seed``: the compiled step
      and its bytes are reused (every method here uses its seed only in ``init``).
  """
  (train_x, train_y), (held_x, held_y) = digits()
  mesh = jaxcomm.make_mesh(hosts=mesh_shape[0], local=mesh_shape[1])
  graphdef, params = init_mlp(train_x.shape[1], HIDDEN, 10, seed=seed)
  loss_fn = classification_loss(graphdef)
  tx = optax.chain(METHODS[method](seed), OPTIMIZERS[optimizer]())
  opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  compiled_steps = {} if compiled_steps is None else compiled_steps
  losses = []
  for index, data in enumerate(batches(train_x, train_y, steps, seed, batch)):
    if index == 0 and (method, optimizer, mesh_shape, batch) not in compiled_steps:
      # Compiled once: the step that runs is the one whose HLO is read.
      step = jaxcomm.optim.data_parallel_step(loss_fn, tx, mesh, specs)
      compiled = step.lower(params, opt_state, data).compile()
      report = jaxcomm.accounting.report_from_hlo(compiled.as_text(), mesh)
      compiled_steps[method, optimizer, mesh_shape, batch] = (compiled,
                                                              report.link_bytes(AXES)["host"])
    compiled, host_bytes = compiled_steps[method, optimizer, mesh_shape, batch]
    previous = params
    params, opt_state, loss = compiled(params, opt_state, data)
    jax.block_until_ready(params)
    losses.append(float(loss))
    if observe is not None:
      observe(index, data, previous, opt_state)
  logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, held_x)
  accuracy = float(np.mean(np.argmax(np.asarray(logits), axis=1) == held_y))
  return Result(accuracy, np.asarray(losses), host_bytes)


def _carried(level_state) -> jax.Array | None:
  """The float32 mass a level carries per device: residual or the estimate's error."""
  if isinstance(level_state, jaxcomm.compress.ErrorFeedbackState):
    return level_state.residual
  if isinstance(level_state, jaxcomm.collectives.TwoPhaseState):
    return level_state.worker_residual
  return None


def diagnose(method: str, optimizer: str, mesh_shape: tuple[int, int], seed: int, steps: int,
             every: int = 10) -> None:
  """Prints, every ``every`` steps and per gradient leaf: the mean gradient's norm, sign's
  contraction ``delta = ||g||_1^2 / (d ||g||_2^2)`` on it, the norm of the devices' carried
  residuals relative to the gradient (``N ||e_i|| / ||g||``, ``N`` devices: the inputs are
  divided by ``N`` before compression) and the norm of the mean the allreduce returned
  relative to the true mean gradient's."""
  (train_x, train_y), _ = digits()
  graphdef, params = init_mlp(train_x.shape[1], HIDDEN, 10, seed=seed)
  loss_fn = classification_loss(graphdef)
  grad_fn = jax.jit(jax.grad(loss_fn))
  devices = mesh_shape[0] * mesh_shape[1]
  momentum = {"sgdm": 0.9, "adamw": None}[optimizer]
  history = {}

  def observe(step, data, before, opt_state):
    grads = jax.tree.leaves(grad_fn(before, data))
    trace = jax.tree.leaves(opt_state[1][0].trace) if momentum else None
    previous, history["trace"] = history.get("trace"), trace
    if step % every:
      return
    states = opt_state[0].level_states
    parts = []
    for index, grad in enumerate(grads):
      g = np.asarray(grad).ravel()
      norm = np.linalg.norm(g)
      delta = np.sum(np.abs(g)) ** 2 / (g.size * norm ** 2 + 1e-30)
      carried = _carried(states[index][-1]) if states[index] else None
      ratio = (np.nan if carried is None else devices * np.mean(
          np.linalg.norm(np.asarray(carried).reshape(devices, -1), axis=1)) / norm)
      out = (np.nan if previous is None else np.linalg.norm(
          np.asarray(trace[index]) - momentum * np.asarray(previous[index])) / norm)
      parts.append(f"{g.size}:|g|={norm:.3g} d={delta:.3f} e/g={ratio:.2f} out/g={out:.2f}")
    print(f"step {step:4d} " + " ; ".join(parts), flush=True)

  result = train(method, optimizer, mesh_shape, seed, steps, observe=observe)
  print(f"held-out accuracy {result.accuracy:.4f}, max loss {result.losses.max():.2f}")


def table(methods: Sequence[str], optimizers: Sequence[str], meshes: Sequence[str],
          seeds: Sequence[int], steps: int) -> list[dict]:
  """Runs every combination and returns one row per (method, optimizer, mesh)."""
  rows = []
  for mesh in meshes:
    for optimizer in optimizers:
      baseline = None
      for method in methods:
        compiled_steps = {}
        results = [train(method, optimizer, parse_mesh(mesh), seed, steps,
                         compiled_steps=compiled_steps) for seed in seeds]
        accuracy = np.array([r.accuracy for r in results]) * 100
        if method == "fp32":
          baseline = accuracy.mean()
        rows.append(dict(method=method, optimizer=optimizer, mesh=mesh,
                         mean=accuracy.mean(), std=accuracy.std(),
                         gap=None if baseline is None else accuracy.mean() - baseline,
                         max_loss=max(float(np.max(r.losses)) for r in results),
                         host_bytes=results[0].host_bytes))
        print(_format(rows[-1]), flush=True)
  return rows


HEADER = ("| method | optimizer | mesh | held-out accuracy % (mean ± std) | gap to fp32 (points) "
          "| max train loss | inter-host bytes / device / step |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")


def _format(row: dict) -> str:
  gap = "n/a" if row["gap"] is None else f"{row['gap']:+.2f}"
  return (f"| {row['method']} | {row['optimizer']} | {row['mesh']} | {row['mean']:.2f} ± "
          f"{row['std']:.2f} | {gap} | {row['max_loss']:.2f} | {row['host_bytes']:,.0f} |")


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--methods", default=",".join(METHODS),
                      help=f"comma-separated, from {', '.join(METHODS)}; put fp32 first for gaps")
  parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                      help=f"comma-separated, from {', '.join(OPTIMIZERS)}")
  parser.add_argument("--meshes", default="8x1,2x4", help="comma-separated HOSTSxLOCAL")
  parser.add_argument("--seeds", default="0,1,2", help="comma-separated ints")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--diagnose", action="store_true",
                      help="per-leaf residual / gradient norms over the steps of the first "
                           "method, optimizer, mesh and seed (docs/quality.md)")
  args = parser.parse_args(argv)
  methods = args.methods.split(",")
  optimizers = args.optimizers.split(",")
  for name, chosen, known in (("method", methods, METHODS), ("optimizer", optimizers, OPTIMIZERS)):
    unknown = [c for c in chosen if c not in known]
    if unknown:
      parser.error(f"unknown {name}(s) {unknown}; choose from {', '.join(known)}")
  if args.diagnose:
    diagnose(methods[0], optimizers[0], parse_mesh(args.meshes.split(",")[0]),
             int(args.seeds.split(",")[0]), args.steps)
    return
  print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{platform.machine()} CPU, {jax.device_count()} simulated devices, steps={args.steps}, "
        f"seeds={args.seeds}, batch={BATCH}")
  print(HEADER)
  table(methods, optimizers, args.meshes.split(","), [int(s) for s in args.seeds.split(",")],
        args.steps)


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  main()
