"""Tests of the kernels (kernels/, installed as hvd_sparse.kernels) against the reference ops."""
