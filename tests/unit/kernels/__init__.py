"""Tests of the kernels (hvd_sparse/kernels/) against the reference ops."""
