"""Tests of the benchmark scripts in scripts/ (their bookkeeping and verdicts, not the library)."""
