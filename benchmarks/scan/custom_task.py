"""The user's own task: ``--task module:function`` adapted into a :class:`~benchmarks.scan.tasks.Task`.

The contract (checked here; a breach is a one-line ``ValueError`` / ``TypeError``):

``function(global_batch: int, seed: int) -> dict`` with the keys

* ``loss_fn``: ``loss_fn(params, batch) -> scalar`` (for an ``nnx.Module`` in ``params``:
  ``loss_fn(model, batch)``), the mean loss of one device's share of a batch;
* ``params``: the initial parameters, a pytree of arrays or an ``nnx.Module`` whose only
  variables are ``nnx.Param`` (converted as :func:`jaxcomm.data_parallel` does);
* ``batch``: ``batch(step: int) -> pytree of numpy arrays``, each with ``global_batch`` rows
  (the scan shards the rows over every device), deterministic in ``step``: every method sees
  the same data;
* ``held_out``: a fixed batch (any number of rows) on which the held-out loss is measured;
* optional ``lr`` (AdamW learning rate, default 1e-3) and ``description`` (one line).

``benchmarks/examples/my_task.py`` is a worked example.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax
import numpy as np

from benchmarks.scan.tasks import Task

REQUIRED = ("loss_fn", "params", "batch", "held_out")
OPTIONAL = ("lr", "description")


def resolve(spec: str) -> Callable:
  """``'package.module:function'`` -> the function.

  Raises:
    ValueError: ``spec`` is not ``module:function``, the module does not import or has no such
      callable.
  """
  module_name, _, function_name = spec.partition(":")
  if not module_name or not function_name.isidentifier():
    raise ValueError(f"--task {spec!r} is not MODULE:FUNCTION, e.g. "
                     "benchmarks.examples.my_task:make_task")
  try:
    module = importlib.import_module(module_name)
  except Exception as error:  # the user's module may fail in any way on import
    raise ValueError(f"--task {spec!r}: module {module_name!r} does not import: "
                     f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                     ) from None
  function = getattr(module, function_name, None)
  if not callable(function):
    raise ValueError(f"--task {spec!r}: module {module_name!r} has no callable "
                     f"{function_name!r}")
  return function


def load(spec: str, global_batch: int, seed: int, name: str) -> Task:
  """Calls the ``--task`` function and checks its answer against the contract above.

  Args:
    spec: ``module:function``.
    global_batch: rows of each training batch (examples per device x devices).
    seed: the run's seed.
    name: the task's name in the tables (the function's name).

  Raises:
    ValueError / TypeError: the answer breaks the contract (names the key and what is allowed).
  """
  answer = resolve(spec)(global_batch=global_batch, seed=seed)
  if not isinstance(answer, dict):
    raise TypeError(f"--task {spec!r} returned {type(answer).__name__}; it must return a dict "
                    f"with keys {', '.join(REQUIRED)} (optional {', '.join(OPTIONAL)})")
  missing = [key for key in REQUIRED if key not in answer]
  unknown = sorted(set(answer) - set(REQUIRED) - set(OPTIONAL))
  if missing or unknown:
    raise ValueError(f"--task {spec!r} returned a dict " + (
        f"without {', '.join(missing)}" if missing else f"with unknown keys {', '.join(unknown)}")
        + f"; it needs {', '.join(REQUIRED)} (optional {', '.join(OPTIONAL)})")
  for key in ("loss_fn", "batch"):
    if not callable(answer[key]):
      raise TypeError(f"--task {spec!r}: {key} is a {type(answer[key]).__name__}, not callable")
  params, loss_fn = _pytree_params(answer["params"], answer["loss_fn"], spec)
  _check_batch(answer["batch"](0), global_batch, spec)
  lr = answer.get("lr", 1e-3)
  if not isinstance(lr, (int, float)) or not lr > 0:
    raise ValueError(f"--task {spec!r}: lr must be a positive number, got {lr!r}")
  loss = loss_fn(params, jax.tree.map(lambda a: a[:max(1, global_batch // jax.device_count())],
                                      answer["batch"](0)))
  if np.shape(loss) != ():
    raise ValueError(f"--task {spec!r}: loss_fn must return a scalar, got shape "
                     f"{np.shape(loss)}")
  count = sum(np.size(leaf) for leaf in jax.tree.leaves(params))
  description = answer.get("description") or f"{spec} ({count:,} params)"
  return Task(name, str(description), params, loss_fn, answer["batch"], answer["held_out"],
              float(lr))


def _pytree_params(params, loss_fn, spec: str):
  """``(pure-dict params, loss_fn(params, batch))`` from an ``nnx.Module`` or a pytree."""
  from flax import nnx

  from jaxcomm._src.train import split_params
  if isinstance(params, nnx.Module):
    graphdef, state = split_params(params)
    user_loss = loss_fn
    loss_fn = lambda p, batch: user_loss(nnx.merge(graphdef, p), batch)  # noqa: E731
    params = nnx.to_pure_dict(state)
  leaves = jax.tree.leaves(params)
  if not leaves or not all(isinstance(leaf, (jax.Array, np.ndarray)) and
                           np.issubdtype(leaf.dtype, np.floating) for leaf in leaves):
    raise TypeError(f"--task {spec!r}: params must be an nnx.Module or a non-empty pytree of "
                    "floating-point arrays")
  return params, loss_fn


def _check_batch(batch, global_batch: int, spec: str) -> None:
  leaves = jax.tree.leaves(batch)
  rows = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if not leaves or rows != {global_batch}:
    raise ValueError(f"--task {spec!r}: batch(0) must be a pytree of arrays with "
                     f"{global_batch} rows each (global_batch), got leading sizes "
                     f"{sorted(map(str, rows))}")
