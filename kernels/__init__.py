"""Kernels: each op has a pure-JAX reference beside its Pallas kernels."""
