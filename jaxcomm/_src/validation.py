"""Argument checks shared by the whole package: each raises ``TypeError`` or ``ValueError``
naming the parameter, the value it got and what is allowed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import warnings

import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_float_input(x: jax.Array, name: str = "x") -> None:
  """Raises ``TypeError`` unless ``x`` is float32, bfloat16 or float16 (checked at trace time)."""
  if jnp.dtype(x.dtype) not in {jnp.dtype(d) for d in FLOAT_DTYPES}:
    raise TypeError(
        f"{name} must be a float32, bfloat16 or float16 array, got dtype {x.dtype}. "
        "Integer or boolean leaves have no gradient to compress: cast them or leave them "
        "out of the gradient pytree.")


def check_float_tree(tree, name: str) -> None:
  """:func:`check_float_input` on every leaf of a pytree, naming the leaf by its path
  (``grads['dense']['kernel']``)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    check_float_input(leaf, f"{name}{jax.tree_util.keystr(path)}")


def check_fraction(name: str, value: float) -> float:
  """Validates a fraction in (0, 1] at construction time."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
    raise TypeError(f"{name} must be a float in (0, 1], got {value!r}.")
  if not 0.0 < float(value) <= 1.0:
    raise ValueError(f"{name} must be in (0, 1], got {value}.")
  return float(value)


def check_int_range(name: str, value: int, low: int, high: int | None = None) -> int:
  """Validates an int in ``[low, high]`` (no upper bound when ``high`` is None)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {value!r}.")
  if value < low or (high is not None and value > high):
    allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
    raise ValueError(f"{name} must be {allowed}, got {value}.")
  return int(value)


def check_dtype(name: str, value: Any, allowed: tuple[Any, ...]) -> jnp.dtype:
  """Validates a dtype argument against an allowed list."""
  try:
    dtype = jnp.dtype(value)
  except TypeError as error:
    raise TypeError(f"{name} must be a dtype, got {value!r}.") from error
  if dtype not in {jnp.dtype(d) for d in allowed}:
    names = ", ".join(jnp.dtype(d).name for d in allowed)
    raise ValueError(f"{name} must be one of {names}; got {dtype.name}.")
  return dtype


def check_float(name: str, value: float, *, minimum: float = 0.0, inclusive: bool = False) -> float:
  """Validates a finite float above ``minimum`` (or equal to it when ``inclusive``)."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
    raise TypeError(f"{name} must be a float, got {value!r}.")
  value = float(value)
  if not np.isfinite(value) or value < minimum or (value == minimum and not inclusive):
    bound = ">=" if inclusive else ">"
    raise ValueError(f"{name} must be a finite float {bound} {minimum:g}, got {value}.")
  return value


def check_unit_interval(name: str, value: float) -> float:
  """Validates a float in ``[0, 1)``: a decay rate, a momentum, a mixing weight."""
  value = check_float(name, value, minimum=0.0, inclusive=True)
  if value >= 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {value}.")
  return value


def check_bool(name: str, value: Any) -> bool:
  """Validates a bool flag at construction time."""
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be a bool, got {value!r}.")
  return value


def check_learning_rate(name: str, value: Any) -> Callable[[jax.Array], Any]:
  """A learning rate as a schedule of the 0-based step: an optax schedule (any callable) as
  it is, a finite float ``> 0`` as a constant."""
  if callable(value):
    return value
  rate = check_float(name, value)
  return lambda count: rate


def renamed(new: str, value: Any, old: str, old_value: Any) -> Any:
  """The value of keyword ``new``, or of its former name ``old`` with a DeprecationWarning
  naming ``new`` (kept for one release); ``None`` means not passed.

  Raises:
    TypeError: both were passed.
  """
  if old_value is None:
    return value
  if value is not None:
    raise TypeError(f"{old} was renamed {new}: pass {new} only, got both.")
  warnings.warn(f"{old}= is deprecated: use {new}=", DeprecationWarning, stacklevel=3)
  return old_value
