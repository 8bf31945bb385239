"""Benchmarks: each prints a table and writes JSON, with a peer measured in the same run."""

import argparse
import math


def positive_int(text: str) -> int:
    """An argparse type for a count or a length: an integer >= 1, refused when the flags are read
    (a 0 would otherwise fail, or mean something else, once the benchmark has loaded its model)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type for a time limit: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value
