"""Tests of hvd_sparse/backends: every backend against NumPy."""
