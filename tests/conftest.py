"""Test configuration: 8 simulated CPU devices and XLA's classic CPU emitters, set before the
JAX backend starts."""
import importlib.metadata
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is compile-bound. XLA's new CPU fusion emitters make each compilation about a
# quarter slower here than the classic emitters, whose results are the same (mesh_scan's
# fp32, topk-ef, onebit-adam and demo: losses and bytes bit-identical). Subprocesses (mesh_scan,
# multi-process jobs) inherit the flag. Only on the jaxlib it was measured on: an XLA that
# no longer knows a flag aborts at start.
if (importlib.metadata.version("jaxlib").startswith("0.10.")
    and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_use_fusion_emitters=false").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
