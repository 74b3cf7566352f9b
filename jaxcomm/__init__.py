"""jaxcomm: topology-aware compressed collective communication for JAX."""

from jaxcomm.topology import make_mesh

__version__ = "0.1.0"

__all__ = ["make_mesh"]
