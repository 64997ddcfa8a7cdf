"""Tests of hvd_sparse/engine."""
