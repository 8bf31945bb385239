"""Benchmarks: each prints a table and writes JSON, with a peer measured in the same run."""

import argparse
import math
import os
from pathlib import Path


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


def output_file(text: str) -> str:
    """An argparse type for --output: a path a file can be written at (its folder made now),
    checked when the flags are read; a folder or an unwritable path failed only once the benchmark
    had run, and its results were lost."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot make the folder of {text}: {e.strerror}") from None
    if not os.access(path.parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    return text
