"""What every benchmark sends: token-id prompts of exact lengths cut from one fixed text, request
lengths drawn with a seed, and the batch-1 prompt sets. Every engine of a run gets the same ids.

Each prompt starts with its own tag ("Request 3: ", "Prefill 512 1: "), so no two prompts share a
KV block and no prefix cache can answer one prompt from another (nor one run from the last).
"""

from __future__ import annotations

import random
from typing import Any

from tokenmill.errors import TokenmillError

TEXT = (
    "The history of computing is a story of people who wanted to calculate faster than they could by hand. "
    "From the abacus to mechanical calculators, from punched cards to transistors, every generation built "
    "tools that made the previous one look slow. Charles Babbage designed an engine of brass gears that "
    "would have printed its own tables, and Ada Lovelace wrote that it might one day compose music. A "
    "century later, rooms full of vacuum tubes computed artillery tables and broke codes, while engineers "
    "replaced the tubes one by one as they burned out. The transistor made machines smaller and cheaper; "
    "the integrated circuit put thousands of them on a chip, and then millions, and then billions. Each "
    "step changed who could use a computer: first governments, then banks and universities, then offices, "
    "then homes, and finally pockets. Software grew alongside the hardware, from hand-wired programs to "
    "assembly, compilers, operating systems and networks that tied the world together. Today a phone holds "
    "more memory than every computer of the nineteen sixties combined, and people ask it questions in plain "
    "language. "
)


def check_range(name: str, lo_hi: list[int]) -> tuple[int, int]:
    """A --*-len-range flag's (MIN, MAX), refused unless 1 <= MIN <= MAX."""
    lo, hi = lo_hi
    if not 1 <= lo <= hi:
        raise TokenmillError(f"{name}: need 1 <= MIN <= MAX, got {lo} {hi}")
    return lo, hi


def make_lengths(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int],
                 seed: int) -> list[tuple[int, int]]:
    """(input_len, output_len) per request, each uniform in its inclusive range."""
    rng = random.Random(seed)
    return [(rng.randint(*input_range), rng.randint(*output_range)) for _ in range(num_requests)]


def make_prompts(tokenizer: Any, input_lens: list[int], seed: int, tag: str = "Request") -> list[list[int]]:
    """Token-id prompts of exactly `input_lens[i]` tokens: a per-request tag, then the fixed text
    from a random offset (the chained block hashes then differ from the first block on)."""
    stream = tokenizer.encode(TEXT * (2 + max(input_lens) // 100), add_special_tokens=False)
    period = len(tokenizer.encode(TEXT, add_special_tokens=False))
    if len(stream) < period + max(input_lens):
        raise ValueError(f"bench text too short for a {max(input_lens)}-token prompt")
    rng = random.Random(seed + 1)
    prompts = []
    for i, n in enumerate(input_lens):
        offset = rng.randrange(period)
        ids = tokenizer.encode(f"{tag} {i}: ", add_special_tokens=False) + stream[offset:offset + n]
        prompts.append(ids[:n])
    return prompts


def batch1_prompts(tokenizer: Any, prefill_lens: list[int], decode_prompt_len: int, repeats: int,
                   seed: int) -> dict[str, Any]:
    """The prompts of `batch1.measure`: a fresh one per repeat of each prefill length and of the
    decode run, and one warm-up prompt of each length (first-call costs stay out of the timings)."""
    return {
        "prefill_prompts": {str(n): make_prompts(tokenizer, [n] * repeats, seed, tag=f"Prefill {n}")
                            for n in prefill_lens},
        "decode_prompts": make_prompts(tokenizer, [decode_prompt_len] * repeats, seed, tag="Decode"),
        "warmup_prompts": make_prompts(tokenizer, sorted({*prefill_lens, decode_prompt_len}), seed, tag="Warm-up"),
    }


def pad_token_id(tokenizer: Any) -> int:
    """The id transformers pads batches with: the tokenizer's pad token, else its first EOS, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return (tokenizer.eos_token_ids or [0])[0]


def context_for(longest: int) -> int:
    """Context tokens for sequences of up to `longest` tokens: a margin of 16, in whole 256-token
    units (the size llama.cpp's -c gets, and tokenmill's KV pool matches)."""
    return -(-(longest + 16) // 256) * 256
