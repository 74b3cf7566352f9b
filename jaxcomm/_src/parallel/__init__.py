"""The implementation of :mod:`jaxcomm.parallel` (private: import that module)."""
