"""Which replica serves a request (`tokenmill serve --data-parallel-size N`): by prefix-cache
affinity, unless the load is out of balance (SGLang's cache-aware router, in outline).

Each replica's engine caches the KV blocks of the prompts it ran. The router cannot see those
caches, so it keeps an approximation: per replica, the prompt texts it sent there, as chained
hashes of fixed-size character chunks (a flattened trie: the key of chunk i depends on every
character before it), each replica's entries in LRU order and bounded. A request goes to the
replica whose entries match the longest prefix of its text, when that prefix is at least
`cache_threshold` of the text; otherwise (nothing much cached anywhere) to the least loaded
replica. When the load is out of balance (the busiest replica has more than `balance_abs` requests
above the idlest and more than `balance_rel` times its count), affinity gives way to load.

Text, not tokens: the front end does not tokenize (the replicas do), and a shared text prefix is
a shared token prefix up to the last chunk boundary.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

CHUNK_CHARS = 32
DEFAULT_MAX_ENTRIES = 1 << 16          # per replica: 2M characters of prompts remembered
DEFAULT_CACHE_THRESHOLD = 0.5
DEFAULT_BALANCE_ABS = 8
DEFAULT_BALANCE_REL = 1.5


def chunk_keys(text: str) -> list[bytes]:
    """The chained key of each whole chunk of `text`."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        # (surrogatepass: a lone surrogate from the client's JSON is hashed too; the replica refuses it)
        chunk = text[start:start + CHUNK_CHARS].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixIndex:
    """One replica's remembered prompt prefixes (LRU, at most `max_entries` chunks)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.max_entries = max_entries
        self.entries: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: list[bytes]) -> int:
        """How many leading chunks of `keys` are remembered."""
        n = 0
        for key in keys:
            if key not in self.entries:
                break
            n += 1
        return n

    def insert(self, keys: list[bytes]) -> None:
        for key in keys:
            self.entries[key] = None
            self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()


@dataclass(frozen=True)
class Choice:
    replica: int
    reason: str          # "cache" (prefix affinity), "load" (least loaded)
    matched_chars: int   # of the text, found in the chosen replica's index


class CacheAwareRouter:
    def __init__(self, num_replicas: int, cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
                 balance_abs: int = DEFAULT_BALANCE_ABS, balance_rel: float = DEFAULT_BALANCE_REL,
                 max_entries: int = DEFAULT_MAX_ENTRIES):
        self.indexes = [PrefixIndex(max_entries) for _ in range(num_replicas)]
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def choose(self, text: str, loads: dict[int, int]) -> Choice:
        """The replica for a request with prompt `text`, among `loads` (replica -> requests in flight
        there; the replicas in rotation). Remembers the text as cached there."""
        if not loads:
            raise ValueError("no replica in rotation")
        keys = chunk_keys(text)
        least = min(loads, key=lambda r: (loads[r], len(self.indexes[r].entries), r))
        busiest = max(loads.values())
        imbalanced = busiest - loads[least] > self.balance_abs and busiest > self.balance_rel * loads[least]
        matched = {r: self.indexes[r].match(keys) for r in loads}
        best = max(loads, key=lambda r: (matched[r], -loads[r], -r))
        if not imbalanced and text and matched[best] * CHUNK_CHARS >= self.cache_threshold * len(text):
            choice = Choice(best, "cache", matched[best] * CHUNK_CHARS)
        else:
            choice = Choice(least, "load", matched[least] * CHUNK_CHARS)
        self.indexes[choice.replica].insert(keys)
        return choice

    def forget(self, replica: int) -> None:
        """The replica restarted: its cache is empty."""
        self.indexes[replica].clear()
