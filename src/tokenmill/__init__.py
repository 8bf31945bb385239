"""tokenmill: a readable LLM inference engine for GGUF and Hugging Face models on CPU or CUDA.

    from tokenmill import LLM, SamplingParams
    llm = LLM()                       # the embedded default model (SmolLM2-135M-Instruct, GGUF)
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=32, temperature=0))
    print(out[0].outputs[0].text)
"""

import gc

# Importing torch and the engine creates some 270 thousand objects (modules, classes, functions)
# that live as long as the process. The cyclic collector would walk all of them several times on the
# way (full collections: a tenth of a cold start) and again in every full collection after; so it is
# paused for the imports and, once they succeeded, what exists then is frozen (gc.freeze: never
# walked again; still freed by reference counting, but cycles among those objects, the caller's
# included, are no longer collected: the imports' own cyclic garbage, under 1 MiB, stays;
# gc.unfreeze() undoes it). The collector is then left enabled or not, as the caller had it.
_collecting = gc.isenabled()
gc.disable()
try:
    from tokenmill.errors import CheckpointError, TokenmillError, UnsupportedModelError
    from tokenmill.hub import default_model_path
    from tokenmill.llm import LLM
    from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from tokenmill.sampling import SamplingParams
    from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
finally:
    if _collecting:
        gc.enable()
gc.freeze()   # (reached only when the imports succeeded)
del _collecting, gc

__all__ = [
    "LLM",
    "CheckpointError",
    "CompletionOutput",
    "IncrementalDetokenizer",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "Tokenizer",
    "TokenmillError",
    "UnsupportedModelError",
    "default_model_path",
    "load_tokenizer",
]
__version__ = "0.1.0"
