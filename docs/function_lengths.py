"""Prints the longest functions of a package: total lines, and lines without the docstring.

Usage: python docs/function_lengths.py [PACKAGE_DIR] [COUNT] [--code]
(``--code`` sorts by the lines without the docstring).
"""

import ast
import pathlib
import sys


def lengths(root: pathlib.Path) -> list[tuple[int, int, str, str]]:
  """``(total lines, lines without the docstring, file:line, name)`` of every function."""
  rows = []
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        total = node.end_lineno - node.lineno + 1
        first = node.body[0]
        has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                   and isinstance(first.value.value, str))
        doc = first.end_lineno - first.lineno + 1 if has_doc else 0
        rows.append((total, total - doc, f"{path}:{node.lineno}", node.name))
  return rows


def main(argv: list[str]) -> None:
  args = [a for a in argv if a != "--code"]
  root = pathlib.Path(args[0] if args else "jaxcomm")
  count = int(args[1]) if len(args) > 1 else 10
  rows = sorted(lengths(root), key=lambda row: row[1 if "--code" in argv else 0], reverse=True)
  print(" total  code  function")
  for total, code, where, name in rows[:count]:
    print(f"{total:6d} {code:5d}  {name:28s} {where}")


if __name__ == "__main__":
  main(sys.argv[1:])
