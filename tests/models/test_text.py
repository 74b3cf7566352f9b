"""The character-level corpus is the stdlib's own source, split by file, and the model learns."""

import os

import numpy as np
import pytest

from models import text

from fit_helpers import adam_losses


@pytest.fixture(scope="module")
def corpus():
  return text.load_corpus()


def test_split_is_by_file_deterministic_and_complete(corpus):
  train_files, held_files = corpus.files
  assert not set(train_files) & set(held_files)
  every = [os.path.basename(p) for p in text.stdlib_files()]
  assert sorted(train_files + held_files) == every and len(held_files) == -(-len(every) // 10)
  assert held_files[0] == every[0] and held_files[1] == every[10]
  assert len(corpus.train) + len(corpus.held_out) == sum(
      os.path.getsize(p) for p in text.stdlib_files())
  again = text.load_corpus()
  np.testing.assert_array_equal(again.held_out, corpus.held_out)


def test_windows_predict_the_next_byte(corpus):
  inputs, targets = text.windows(corpus.train, np.array([0, 5]), 4)
  np.testing.assert_array_equal(inputs[1], corpus.train[5:9])
  assert targets[1] == corpus.train[9]
  a, _ = text.sample_windows(corpus.train, 8, 16, seed=3)
  b, _ = text.sample_windows(corpus.train, 8, 16, seed=3)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (8, 16) and a.dtype == np.int32


def test_bad_split_is_refused(tmp_path):
  with pytest.raises(ValueError, match="held_out_every"):
    text.load_corpus(held_out_every=1)
  (tmp_path / "only.py").write_text("x = 1\n")
  with pytest.raises(ValueError, match="at least 2"):
    text.load_corpus(directory=str(tmp_path))


def test_char_mlp_learns_python(corpus):
  graphdef, params = text.init_char_mlp(context=8, embed=8, hidden=(64,), seed=0)
  loss_fn = text.next_byte_loss(graphdef)
  batch = text.sample_windows(corpus.train, 512, 8, seed=0)
  assert float(loss_fn(params, batch)) == pytest.approx(np.log(256), rel=0.05)
  assert adam_losses(loss_fn, params, batch, steps=60)[-1] < 3.5  # from 5.5 nats: it picked up the byte statistics of Python


def test_transformer_task_predicts_every_next_byte_with_a_finite_loss():
  import jax
  import numpy as np

  from benchmarks.scan.tasks import TASKS
  task = TASKS["transformer"]("quick", 4, 2, 0)
  tokens, targets = task.batch(1)
  assert tokens.shape == targets.shape == (4, 32)
  np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])  # targets are inputs shifted
  loss = float(jax.jit(task.loss_fn)(task.params, task.batch(0)))
  assert np.isfinite(loss) and abs(loss - np.log(256)) < 1.0  # about uniform at init
