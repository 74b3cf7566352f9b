"""jaxcomm's implementation. Private: import the public modules of :mod:`jaxcomm`."""
