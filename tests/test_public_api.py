"""The top level is small; every name that left it resolves in its namespace."""

import types
import warnings

import pytest

import jaxcomm

NAMESPACES = {name for name in jaxcomm.__all__
              if isinstance(getattr(jaxcomm, name), types.ModuleType)}


def test_the_top_level_has_about_thirty_names_besides_its_namespaces():
  names = set(jaxcomm.__all__) - NAMESPACES
  assert len(names) <= 30, sorted(names)
  assert len(jaxcomm.__all__) == len(set(jaxcomm.__all__))
  assert all(hasattr(jaxcomm, name) for name in jaxcomm.__all__)


@pytest.mark.parametrize("name", sorted(jaxcomm._MOVED))
def test_a_moved_name_warns_and_is_the_object_of_its_namespace(name):
  home = getattr(jaxcomm, jaxcomm._MOVED[name])
  assert name not in jaxcomm.__all__ and hasattr(home, name)
  with pytest.warns(DeprecationWarning, match=f"jaxcomm.{name} moved to jaxcomm."):
    moved = getattr(jaxcomm, name)
  assert moved is getattr(home, name)


def test_unknown_names_raise_attribute_error_without_a_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
      jaxcomm.no_such_thing  # noqa: B018


def test_the_cost_model_projection_and_powersgd_projection_no_longer_share_a_name():
  assert "project" not in jaxcomm.__all__
  assert jaxcomm.costmodel.project is not jaxcomm.compress.project
