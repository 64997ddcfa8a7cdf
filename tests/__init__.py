"""hvd_sparse's tests: unit/ mirrors the package, multiproc/ starts real Horovod jobs, scripts/
checks the benchmark scripts, and reference/ holds the independent implementations they compare
against."""
