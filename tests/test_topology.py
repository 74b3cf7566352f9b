"""make_mesh: shapes, axis types and errors."""

import jax
import pytest
from jax.sharding import AxisType

import jaxcomm


def test_simulated_hosts_split_local_devices_contiguously():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  assert dict(mesh.shape) == {"host": 2, "local": 4}
  assert [d.id for d in mesh.devices[1]] == [4, 5, 6, 7]
  assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_defaults_and_custom_names_and_types():
  assert dict(jaxcomm.make_mesh().shape) == {"host": 1, "local": 8}
  assert dict(jaxcomm.make_mesh(local=2).shape) == {"host": 4, "local": 2}
  mesh = jaxcomm.make_mesh(hosts=8, axis_names=("dcn", "ici"), axis_types=AxisType.Explicit)
  assert dict(mesh.shape) == {"dcn": 8, "ici": 1}
  assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"hosts": 3}, ValueError, "hosts \\* local must equal"),
    ({"hosts": 2, "local": 2}, ValueError, "must equal the number of devices \\(8\\)"),
    ({"hosts": 0}, ValueError, "hosts must be >= 1"),
    ({"local": 2.5}, TypeError, "local must be a positive int"),
    ({"axis_names": ("a", "a")}, ValueError, "axis_names"),
    ({"axis_types": "auto"}, TypeError, "axis_types"),
])
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxcomm.make_mesh(**kwargs)


def test_subset_of_devices():
  mesh = jaxcomm.make_mesh(hosts=2, devices=jax.devices()[:4])
  assert dict(mesh.shape) == {"host": 2, "local": 2}
