"""The implementation of :mod:`jaxcomm.compress` (private: import that module)."""
