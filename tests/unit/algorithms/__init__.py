"""One test module per method module of hvd_sparse/algorithms."""
