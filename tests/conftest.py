"""Test configuration: 8 simulated CPU devices, set before the JAX backend starts."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
