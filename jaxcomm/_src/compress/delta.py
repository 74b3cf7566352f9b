"""Delta compression: send the compressed change to what the receivers already hold.

A sender and every receiver keep the same *reference* ``x_hat`` of the sender's value (CHOCO's
public copy). Each round the sender sends ``q = C(x - x_hat)`` and both sides add the decoded
``D(q)`` to ``x_hat``. Where consecutive values are close (parameters between steps, slowly
changing gradients) the difference is small, so a coarse compressor loses little of ``x``; and
what one round leaves out stays in ``x - x_hat`` and is sent later, as error feedback does. A
receiver that needs only a weighted sum of its senders' references (a gossip neighbourhood, a
mean) keeps that sum, updated by the same weighted sum of the decoded differences, instead of
one reference per sender.

Bytes per round: the compressor's payload for the difference, ``c`` (e.g. ``d`` for int8,
``ceil(d/8) + 4`` for scaled sign), instead of ``4 d`` for the float32 value.
"""

from __future__ import annotations

import jax

from jaxcomm._src.compress.base import Compressor, Payload


def delta_encode(compressor: Compressor, x: jax.Array, reference: jax.Array,
                 key: jax.Array) -> tuple[Payload, jax.Array, jax.Array]:
  """The sender's side of one round.

  Args:
    compressor: a stateless compressor.
    x: the value to send, any float shape.
    reference: ``x_hat``, the receivers' copy of this sender's value, ``x``'s shape.
    key: PRNG key of a stochastic compressor.

  Returns:
    ``(payload, decoded, new_reference)``: what is sent, its decoded difference ``D(q)``
    (float32, ``x``'s shape; receivers add it, weighted, to their sums) and
    ``x_hat + D(q)``, the reference every receiver now holds.
  """
  payload, _ = compressor.encode(x - reference, (), key)
  decoded = compressor.decode(payload, x.shape)
  return payload, decoded, reference + decoded
