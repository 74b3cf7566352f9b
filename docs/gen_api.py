"""Writes docs/api.md: the API reference of every name in ``jaxcomm.__all__``, from docstrings.

Run from the repository root: ``python docs/gen_api.py`` (``--check`` exits 1 when
docs/api.md is out of date instead of writing it).
"""

from __future__ import annotations

import inspect
import os
import sys
import textwrap
import types

import jaxcomm

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api.md")


def _signature(obj) -> str:
  try:
    return str(inspect.signature(obj))
  except (TypeError, ValueError):
    return "(...)"


def _doc(obj) -> str:
  return inspect.cleandoc(inspect.getdoc(obj) or "(no docstring)")


def _summary(obj) -> str:
  if isinstance(obj, types.UnionType):
    return "type: " + " | ".join(f"``{arg.__name__}``" for arg in obj.__args__)
  if not (inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj)):
    text = repr(obj).replace("\n", " ")
    return f"constant: ``{text if len(text) <= 80 else text[:77] + '...'}``"
  return _doc(obj).split("\n\n")[0].replace("\n", " ")


def _kind(obj) -> str:
  if inspect.ismodule(obj):
    return "module"
  if inspect.isclass(obj):
    return "class"
  return "function"


def _defined_in(module) -> list[str]:
  """A module without ``__all__``: its functions and classes, in the order they are defined."""
  return [name for name, obj in vars(module).items()
          if (inspect.isfunction(obj) or inspect.isclass(obj))
          and obj.__module__ == module.__name__]


def _module_section(name: str, module) -> list[str]:
  lines = [f"## `jaxcomm.{name}` (module)", "", _doc(module), ""]
  public = [n for n in getattr(module, "__all__", _defined_in(module)) if not n.startswith("_")]
  if public:
    lines += ["| name | summary |", "| --- | --- |"]
    for member in public:
      summary = _summary(getattr(module, member)).replace("|", "\\|")
      lines.append(f"| `{name}.{member}` | {summary} |")
    lines.append("")
  return lines


def _object_section(name: str, obj) -> list[str]:
  return [f"## `jaxcomm.{name}` ({_kind(obj)})", "", "```python",
          f"jaxcomm.{name}{_signature(obj)}", "```", "", _doc(obj), ""]


def render() -> str:
  """The whole of docs/api.md."""
  names = sorted(jaxcomm.__all__, key=lambda n: (inspect.ismodule(getattr(jaxcomm, n)), n.lower()))
  lines = ["# API reference", "",
           textwrap.fill(f"Every public name of jaxcomm {jaxcomm.__version__} "
                         "(`jaxcomm.__all__`): functions and classes first, then modules. "
                         "Generated from the docstrings by `python docs/gen_api.py`; do not "
                         "edit by hand.", 96), "", "| name | kind | summary |",
           "| --- | --- | --- |"]
  for name in names:
    obj = getattr(jaxcomm, name)
    anchor = f"jaxcomm{name}-{_kind(obj)}".lower()
    lines.append(f"| [`{name}`](#{anchor}) | {_kind(obj)} | "
                 f"{_summary(obj).replace('|', chr(92) + '|')} |")
  lines.append("")
  for name in names:
    obj = getattr(jaxcomm, name)
    lines += _module_section(name, obj) if inspect.ismodule(obj) else _object_section(name, obj)
  return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
  text = render()
  if "--check" in argv:
    with open(PATH) as handle:
      current = handle.read()
    if current != text:
      print("docs/api.md is out of date: run python docs/gen_api.py", file=sys.stderr)
      return 1
    return 0
  with open(PATH, "w") as handle:
    handle.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
