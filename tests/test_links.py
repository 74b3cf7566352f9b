"""Link specs: validation, presets and lookup by name."""

import math

import pytest

from jaxcomm import links
from jaxcomm.links import Link


def test_presets_have_the_documented_numbers():
  expected = {
      "nvlink4": (450e9, 3.4e-6), "pcie5": (64e9, 5.7e-6), "ib-hdr": (25e9, 14e-6),
      "100gbe": (12.5e9, 25e-6), "10gbe": (1.25e9, 30e-6), "1gbe": (0.125e9, 50e-6),
  }
  assert {name: (p.bandwidth_bytes_per_s, p.latency_s)
          for name, p in links.PRESETS.items()} == expected
  # 200 Gbit/s and 100/10/1 Gbit/s are these many bytes per second.
  assert links.IB_HDR.bandwidth_bytes_per_s == 200e9 / 8
  assert links.ETHERNET_1G.bandwidth_bytes_per_s == 1e9 / 8


@pytest.mark.parametrize("name, preset", [
    ("100gbe", links.ETHERNET_100G), ("100GbE", links.ETHERNET_100G),
    ("IB_HDR", links.IB_HDR), ("ib hdr", links.IB_HDR), ("NVLink-4", links.NVLINK4),
    ("pcie5", links.PCIE5), ("10gbe", links.ETHERNET_10G), ("1GBE", links.ETHERNET_1G),
])
def test_lookup_ignores_case_and_separators(name, preset):
  assert links.link(name) is preset


@pytest.mark.parametrize("name", ["400gbe", "", 100])
def test_unknown_name_lists_the_known_ones(name):
  with pytest.raises(ValueError, match="known links: nvlink4, pcie5, ib-hdr, 100gbe, 10gbe, 1gbe"):
    links.link(name)


def test_alpha_beta():
  fast = Link("x", bandwidth_bytes_per_s=4e9, latency_s=2e-6)
  assert fast.alpha == 2e-6
  assert fast.beta == 0.25e-9


def test_integers_are_stored_as_floats():
  spec = Link("x", 10, 0)
  assert spec == ("x", 10.0, 0.0)
  assert isinstance(spec.bandwidth_bytes_per_s, float)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(bandwidth_bytes_per_s=0.0), ValueError, r"bandwidth_bytes_per_s must be > 0, got 0\.0"),
    (dict(bandwidth_bytes_per_s=-5.0), ValueError, r"bandwidth_bytes_per_s must be > 0, got -5\.0"),
    (dict(bandwidth_bytes_per_s=math.inf), ValueError, r"bandwidth_bytes_per_s must be finite"),
    (dict(bandwidth_bytes_per_s=math.nan), ValueError, r"bandwidth_bytes_per_s must be finite"),
    (dict(bandwidth_bytes_per_s="fast"), TypeError, r"bandwidth_bytes_per_s must be a real number, got 'fast'"),
    (dict(latency_s=-1e-6), ValueError, r"latency_s must be >= 0, got -1e-06"),
    (dict(latency_s=True), TypeError, r"latency_s must be a real number, got True"),
    (dict(name=""), ValueError, r"name must be a non-empty string"),
])
def test_bad_specs_name_the_parameter_and_value(kwargs, error, message):
  arguments = dict(name="x", bandwidth_bytes_per_s=1e9, latency_s=1e-6) | kwargs
  with pytest.raises(error, match=message):
    Link(**arguments)


def test_replace_is_validated():
  with pytest.raises(ValueError, match="latency_s must be >= 0"):
    links.NVLINK4._replace(latency_s=-1.0)
  assert links.NVLINK4._replace(latency_s=0.0).latency_s == 0.0


def test_shared_by_splits_the_bandwidth():
  shared = links.ETHERNET_1G.shared_by(8)
  assert shared == Link("1gbe/8", 0.125e9 / 8, 50e-6)
  assert links.ETHERNET_1G.shared_by(1) is links.ETHERNET_1G
  with pytest.raises(ValueError, match="devices must be an int >= 1, got 0"):
    links.ETHERNET_1G.shared_by(0)
