"""docs/api.md documents every public name and is regenerated from the current docstrings."""

import importlib.util
import pathlib

import jaxcomm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _generator():
  spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_api_reference_is_complete_and_current():
  text = (ROOT / "docs" / "api.md").read_text()
  for name in jaxcomm.__all__:
    assert f"## `jaxcomm.{name}` (" in text, name
  assert text == _generator().render(), "docs/api.md is out of date: run python docs/gen_api.py"
