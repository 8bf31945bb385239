"""Benchmarks: each prints a table and writes JSON, with a peer measured in the same run."""
