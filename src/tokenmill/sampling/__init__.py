"""Sampling: request parameters, the batched sampler, and stop-string matching for streamed text."""

from tokenmill.sampling.batch import SamplingBatch
from tokenmill.sampling.params import SamplingParams, SamplingParamsError
from tokenmill.sampling.sampler import Sampler, SamplerOutput
from tokenmill.sampling.stop import StopStringMatcher

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "SamplingParamsError",
    "StopStringMatcher",
]
