"""benchmarks.lm_variants: the ``sign-ef`` and ``topk-ef`` variants build what their keys name."""

import types

import pytest

import jaxcomm
from benchmarks import lm_variants
from benchmarks.scan import projection

SHAPES = [(256, 64), (64, 256), (64,)]
SETTING = types.SimpleNamespace(topk_density=0.01)


def _bytes(method) -> float:
  return method.project(SETTING, SHAPES, 2, 4).slow_bytes


def test_sign_chunk_variant_costs_per_chunk_scales():
  """``sign-ef@chunk=64`` projects the bytes of ``sign(64)``: more than one scale per tensor."""
  chunked = lm_variants.variant("sign-ef@chunk=64")
  expected = projection.hierarchical(SHAPES, 2, 4, jaxcomm.sign(64), "gather").slow_bytes
  assert _bytes(chunked) == expected
  assert _bytes(chunked) > _bytes(lm_variants.variant("sign-ef"))


def test_topk_bound_variant_sends_topk_bytes():
  """A bounded top-k variant sends top-k's payload (the wrapping adds no bytes)."""
  expected = projection.hierarchical(SHAPES, 2, 4, jaxcomm.topk(0.01), "gather").slow_bytes
  assert _bytes(lm_variants.variant("topk-ef@bound=1")) == expected


@pytest.mark.parametrize("name", ["sign-ef@density=0.1", "topk-ef@chunk=64"])
def test_unknown_key_raises(name):
  with pytest.raises(ValueError, match="unknown key"):
    lm_variants.variant(name)


def test_embedding_chunk_variant_has_no_projection():
  """The cost model has no leaf paths, so a per-leaf policy variant projects nothing (mesh_scan
  then skips its large-model projection instead of costing the wrong compressor)."""
  assert lm_variants.variant("sign-ef@embed_chunk=64").project is None
