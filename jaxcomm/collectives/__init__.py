"""Allreduce strategies over named mesh axes."""

from jaxcomm.collectives.hierarchical import hierarchical_allreduce

__all__ = ["hierarchical_allreduce"]
