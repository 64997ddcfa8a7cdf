"""Tests of hvd_sparse/comm."""
