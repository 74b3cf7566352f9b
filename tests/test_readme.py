"""The README's quickstart runs as written, and its two set-up commands are what CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_quickstart_runs_and_trains(capsys):
  section = README.split("## Quickstart", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  namespace = {"__name__": "readme_quickstart"}
  exec(compile(code, "README.md:quickstart", "exec"), namespace)
  printed = capsys.readouterr().out
  final_loss = float(re.search(r"loss after 200 steps: ([\d.]+)", printed).group(1))
  inputs, targets = namespace["inputs"], namespace["targets"]
  initial_loss = float(namespace["loss_fn"]({"w": 0 * namespace["params"]["w"],
                                             "b": 0 * namespace["params"]["b"]},
                                            (inputs, targets)))
  assert final_loss < 0.1 * initial_loss
  link = namespace["report"].link_bytes()
  assert 0 < link["host"] < link["local"]


def test_ci_runs_the_readme_test_command():
  commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
  assert len(commands) == 2, commands
  assert "benchmarks.mesh_scan" in commands[0]
  assert "pytest" in commands[1]
  ci = (ROOT / ".ci" / "run").read_text()
  assert "README.md" in ci, "CI must take its test command from the README"


def test_linked_docs_exist():
  links = re.findall(r"\]\((docs/[\w.]+)\)", README)
  assert len(links) >= 5
  for path in links:
    assert (ROOT / path).is_file(), path
