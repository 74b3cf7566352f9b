"""Per-leaf compressor choice by parameter path pattern and size."""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from jaxcomm._src.compress.base import Compressor
from jaxcomm._src.validation import check_int_range

# Leaves that are cheap to send and sensitive to noise stay at full precision by default:
# biases, normalization parameters (LayerNorm/BatchNorm/RMSNorm scale and bias), embeddings
# (sparse rows that top-k and sign handle badly).
FULL_PRECISION_PATTERNS = (
    r"bias",
    r"norm|(^|/)(ln|bn)(_?\d+)?(/|$)|(^|/)scale$",
    r"embed",
)


class Rule(NamedTuple):
  """A user rule: leaves whose path matches ``pattern`` (``re.search``) use ``compressor``.

  Attributes:
    pattern: a regular expression searched in the leaf path, e.g. ``'attention/.*kernel'``.
    compressor: the compressor for those leaves; ``None`` for full precision.
  """
  pattern: str
  compressor: Compressor | None


def path_string(path: Sequence[Any]) -> str:
  """A pytree key path as ``'a/b/0/kernel'`` (dict keys, attribute names, sequence indices)."""
  parts = []
  for entry in path:
    for attribute in ("key", "name", "idx"):
      if hasattr(entry, attribute):
        parts.append(str(getattr(entry, attribute)))
        break
    else:
      parts.append(str(entry))
  return "/".join(parts)


class CompressionPolicy(NamedTuple):
  """Which compressor each gradient leaf uses. Build it with :func:`policy`.

  Attributes:
    default: compressor of the leaves no rule keeps at full precision.
    rules: user rules, checked first, the first match wins.
    min_bytes: leaves smaller than this many bytes are sent at full precision.
    full_precision: patterns (``re.search``, case-insensitive) kept at full precision after
      the user rules.
  """
  default: Compressor | None
  rules: tuple[Rule, ...]
  min_bytes: int
  full_precision: tuple[str, ...]

  def choose(self, path: str, shape: tuple[int, ...], dtype: Any) -> Compressor | None:
    """The compressor of one leaf (``None``: full precision)."""
    for rule in self.rules:
      if re.search(rule.pattern, path, re.IGNORECASE):
        return rule.compressor
    if int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize < self.min_bytes:
      return None
    if any(re.search(pattern, path, re.IGNORECASE) for pattern in self.full_precision):
      return None
    return self.default

  def assign(self, tree) -> list[Compressor | None]:
    """One choice per leaf of ``tree`` (arrays or ``ShapeDtypeStruct``), in ``jax.tree.leaves``
    order. (A list, not a pytree: a :class:`~jaxcomm.Compressor` is itself a tuple.)"""
    return [self.choose(path_string(path), tuple(leaf.shape), leaf.dtype)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]

  def describe(self, tree) -> dict[str, str]:
    """``{path: compressor name or 'full precision'}``, to log what the policy decided."""
    return {path_string(path): "full precision" if choice is None else choice.name
            for (path, _), choice in zip(jax.tree_util.tree_leaves_with_path(tree),
                                         self.assign(tree))}


def policy(default: Compressor | None, *, rules: Sequence[tuple[str, Compressor | None]] = (),
           min_bytes: int = 64 * 1024,
           full_precision: Sequence[str] = FULL_PRECISION_PATTERNS) -> CompressionPolicy:
  """Chooses a compressor per parameter leaf from its path and size.

  For each leaf, in order: the first user rule whose pattern matches the path wins; else a
  leaf under ``min_bytes`` is sent at full precision (its payload would be dominated by
  per-message overhead and it costs little dense); else a leaf matching a ``full_precision``
  pattern (biases, norms, embeddings by default) is sent at full precision; else ``default``.
  Paths look like ``'params/Dense_0/kernel'`` (:func:`path_string`).

  Args:
    default: compressor of all other leaves, e.g. ``jaxcomm.topk(0.01)``.
    rules: ``(pattern, compressor or None)`` pairs, checked first.
    min_bytes: byte size below which a leaf is sent at full precision, >= 0.
    full_precision: path patterns kept at full precision (pass ``()`` to compress them).

  Returns:
    A :class:`CompressionPolicy`; ``policy.assign(params)`` lists the choices per leaf.

  Example:
    >>> p = policy(topk(0.01), rules=[(r"attention", quantize(8))])  # doctest: +SKIP
    >>> p.describe(params)  # doctest: +SKIP
  """
  if default is not None and not isinstance(default, Compressor):
    raise TypeError(f"default must be a jaxcomm.Compressor or None, got {default!r}.")
  checked = []
  for rule in rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
            and (rule[1] is None or isinstance(rule[1], Compressor))):
      raise TypeError(f"rules must be (pattern, Compressor or None) pairs, got {rule!r}.")
    re.compile(rule[0])
    checked.append(Rule(*rule))
  min_bytes = check_int_range("min_bytes", min_bytes, 0)
  for pattern in full_precision:
    if not isinstance(pattern, str):
      raise TypeError(f"full_precision must hold regular expressions, got {pattern!r}.")
    re.compile(pattern)
  return CompressionPolicy(default=default, rules=tuple(checked), min_bytes=min_bytes,
                           full_precision=tuple(full_precision))
