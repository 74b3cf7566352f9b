"""The implementation of :mod:`jaxcomm.collectives` (private: import that module)."""
