"""Models and data sets used by the tests and benchmarks."""
