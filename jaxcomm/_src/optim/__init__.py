"""The implementation of :mod:`jaxcomm.optim` (private: import that module)."""
