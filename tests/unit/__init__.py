"""Unit tests: N simulated ranks in one process, laid out like the hvd_sparse package."""
