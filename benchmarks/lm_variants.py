"""mesh_scan with parametrized variants of DeMo, SparseLoCo and compress_updates: the runs
behind docs/algorithms.md ("On the GPT quality task") and docs/quality.md (section 8).

A method name ``BASE@key=value@key=value`` is the registry method ``BASE`` built with those
keyword arguments, e.g. ``demo@topk=8@beta=0.99`` or ``sparseloco-h8@density=0.015625@beta=0.9``
(``sparseloco-hH``: ``H`` is the period; keys: ``density``, ``bits``, ``beta``, ``alpha``,
``chunk``, ``block``, ``positions``; for ``demo``: ``beta``, ``chunk``, ``topk``, ``sign``,
``weight_decay``;
``compress-updates``, :func:`jaxcomm.optim.compress_updates` of AdamW: ``topk`` (fraction),
``sign``, ``feedback``, ``debias`` (``True``: :func:`jaxcomm.optim.host_adamw` with
``host_variance=True``); ``topk-ef``, top-k in front of AdamW
(:func:`jaxcomm.compressed_allreduce`, gather): ``feedback``, ``bound`` (residuals capped at
``bound`` times the input's norm: :func:`jaxcomm.compress.error_feedback`); ``sign-ef``, scaled sign in
front of AdamW (gather): ``feedback``, ``chunk`` (elements per scale), ``embed_chunk``
(``chunk`` for the embedding only, through :func:`jaxcomm.policy`; no large-model
projection)). Every other
flag is mesh_scan's; the variants are registered for this process only, so the registry that
the tests scan stays as it is::

  python -m benchmarks.lm_variants --profile lm --steps 300 --timed-steps 50 --models gpt \\
      --methods fp32,demo@topk=8,demo@topk=8@beta=0.99 --out /tmp/q_demo
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import optax

import jaxcomm
from benchmarks import mesh_scan
from benchmarks.scan import methods

_DEMO = {"beta": float, "chunk": int, "topk": int, "sign": lambda v: v == "True",
         "weight_decay": float}
_COMPRESS_UPDATES = {"topk": float, "sign": lambda v: v == "True", "rsign": float,
                     "feedback": str, "debias": lambda v: v == "True"}
_TOPK_EF = {"feedback": str, "bound": float}
_SIGN_EF = {"feedback": str, "chunk": int, "embed_chunk": int}
_SPARSELOCO = {"density": float, "bits": int, "beta": float, "alpha": float, "chunk": int,
               "block": int, "positions": str}


def _kwargs(name: str, types: dict) -> dict:
  """``{key: value}`` of the ``@key=value`` parts of ``name``, typed by ``types``."""
  result = {}
  for part in name.split("@")[1:]:
    key, _, value = part.partition("=")
    if key not in types:
      raise ValueError(f"{name!r}: unknown key {key!r}; choose from {', '.join(types)}")
    result[key] = types[key](value)
  return result


def variant(name: str) -> methods.Method:
  """The :class:`~benchmarks.scan.methods.Method` a ``BASE@key=value...`` name describes."""
  base = name.split("@")[0]
  if base == "demo":
    kw = {"weight_decay": 1e-4, "chunk": 64, "topk": 32, **_kwargs(name, _DEMO)}
    return methods.Method(
        name, f"DeMo with {kw}", lambda s: jaxcomm.demo(s.lr, **kw),
        functools.partial(methods._demo_project, chunk=kw["chunk"], topk=kw["topk"]))
  if base.startswith("sparseloco-h"):
    period = int(base.removeprefix("sparseloco-h"))
    kw = {"density": 1 / 32, "bits": 2, "chunk": 4096, **_kwargs(name, _SPARSELOCO)}
    return methods.Method(
        name, f"SparseLoCo, period {period}, {kw}",
        lambda s: jaxcomm.sparseloco(optax.adamw(s.lr), period, **kw),
        methods._sparseloco_project(period, kw["density"], kw["bits"], kw["chunk"],
                                    kw.get("block"), kw.get("positions", "fixed")),
        make_step=jaxcomm.optim.local_training_step, device_local=True, comm_every=period)
  if base == "compress-updates":
    kw = _kwargs(name, _COMPRESS_UPDATES)
    return _compress_updates(name, kw.get("feedback", "residual"), **{
        key: kw[key] for key in ("topk", "sign", "rsign", "debias") if key in kw})
  if base == "topk-ef":
    kw = _kwargs(name, _TOPK_EF)
    if "bound" in kw:
      return methods._compressed(
          name, f"top-k across hosts, gather, residuals bounded at {kw['bound']:g}",
          lambda s: jaxcomm.compress.error_feedback(jaxcomm.topk(s.topk_density),
                                                    bound=kw["bound"]),
          strategy="gather", feedback="none")
    feedback = kw.get("feedback", True)
    return methods._compressed(name, f"top-k across hosts, gather, feedback={feedback!r}",
                               lambda s: jaxcomm.topk(s.topk_density), strategy="gather",
                               feedback=feedback)
  if base == "sign-ef":
    kw = {"feedback": True, **_kwargs(name, _SIGN_EF)}
    chunk = kw.get("chunk")
    summary = f"scaled sign (chunk {chunk}) across hosts, gather, feedback={kw['feedback']!r}"
    if "embed_chunk" in kw:
      chosen = jaxcomm.policy(
          jaxcomm.sign(chunk), rules=[("embedding", jaxcomm.sign(kw["embed_chunk"]))],
          min_bytes=0, full_precision=())
      return methods.Method(
          name, f"{summary}, the embedding with chunk {kw['embed_chunk']}",
          lambda s: methods._adamw(jaxcomm.compressed_allreduce(
              chosen, feedback=kw["feedback"], seed=s.seed), s), None)  # gather for sign
    return methods._compressed(name, summary, lambda s: jaxcomm.sign(chunk), strategy="gather",
                               feedback=kw["feedback"])
  raise ValueError(f"{name!r}: variants exist for demo, sparseloco-hH, compress-updates, "
                   "topk-ef and sign-ef")


def _compress_updates(name: str, feedback: str, topk: float | None = None, sign: bool = False,
                      rsign: float | None = None, debias: bool = False):
  """AdamW per host, its updates compressed across hosts with error feedback
  (:func:`jaxcomm.optim.compress_updates`): top-k of a ``topk`` fraction, scaled sign, the
  scaled sign of a shared random ``rsign`` fraction (a new subset each step, no indices
  sent), or full precision; with ``debias`` the host's second moment corrected to the global
  mean's (:func:`jaxcomm.optim.host_adamw`, ``host_variance=True``)."""
  if topk:
    make = lambda: jaxcomm.topk(topk)  # noqa: E731
  elif rsign:
    make = lambda: jaxcomm.compress.compose(  # noqa: E731
        jaxcomm.randomk(rsign, scale=False), jaxcomm.sign())
  else:
    make = jaxcomm.sign if sign else (lambda: None)
  strategy = None if make() is None else "gather"

  def project(setting, shapes, hosts, local):
    return methods.projection.hierarchical(shapes, hosts, local, make(), strategy)

  return methods.Method(
      name, "AdamW per host, updates compressed across hosts with error feedback",
      lambda s: jaxcomm.optim.compress_updates(
          (jaxcomm.optim.host_adamw if debias else optax.adamw)(s.lr), make(),
          feedback=feedback, host_variance=debias, strategy=strategy, seed=s.seed), project)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  names = argv[argv.index("--methods") + 1].split(",") if "--methods" in argv else []
  for name in names:
    if name not in methods.REGISTRY:
      methods.register(variant(name))
  mesh_scan.ALL_METHODS = tuple(methods.REGISTRY)
  return mesh_scan.main(argv)


if __name__ == "__main__":
  sys.exit(main())
