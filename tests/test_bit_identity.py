"""benchmarks.bit_identity: equal trees pass, a one-ulp difference is caught."""

import pathlib

import numpy as np
import pytest

from benchmarks import bit_identity

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_compare_catches_one_ulp_and_accepts_equal_nans():
  a = np.array([1.0, np.nan, -3.0], np.float32)
  assert bit_identity.compare([a], [a.copy()]) == (True, 0.0)
  b = a.copy()
  b[2] = np.nextafter(b[2], np.float32(0))
  same, worst = bit_identity.compare([a], [b])
  assert not same and 0 < worst < 1e-6


def test_this_checkout_against_itself_is_bit_identical(capsys):
  status = bit_identity.main(["--methods", "sign-ef", "--steps", "2",
                              "--tree", f"self={ROOT}"])
  printed = capsys.readouterr().out
  assert status == 0
  assert "sign-ef: bit-identical to self after 2 steps: True" in printed


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0", "--tree", "before=."], "--steps must be >= 1, got 0"),
    ([], "give exactly one --tree LABEL=PATH to compare with, got 0"),
    (["--tree", "a=.", "--tree", "b=."], "give exactly one --tree LABEL=PATH to compare with, got 2"),
])
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    bit_identity.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err
