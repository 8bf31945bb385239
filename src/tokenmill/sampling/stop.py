"""Stop strings over streamed text: emit what is safe, hold back what might start a stop string.

Application logic, fed with detokenized deltas outside the model loop. A stop string may arrive
split over several deltas ("<|e" + "nd|>"), so text that could be the beginning of one is held
back until the next delta settles it; a stop string is therefore never emitted unless
`include_stop_str_in_output` is set (then nothing needs holding back: the stop string is part of
the output anyway).

Which stop string wins: the one whose occurrence is completed first in the text, i.e. the first
one a token-by-token stream would see; among occurrences completed at the same character, the
one that starts earliest. This makes the output independent of how the text is split into
deltas, and matches vLLM, which checks stop strings as each token arrives.
"""

from __future__ import annotations

from tokenmill.sampling.params import SamplingParamsError


class StopStringMatcher:
    """Finds the first stop string in one completion's streamed text."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise SamplingParamsError("stop", f"must contain only non-empty strings, got {stop!r}")
        self._stop = list(stop)
        self._include = include_stop_str_in_output
        self._longest = max((len(s) for s in stop), default=0)
        self._held = ""  # received, not yet emitted: could be the start of a stop string
        self._emitted_tail = ""  # last emitted characters a stop string could still start in
        self.matched: str | None = None
        """The stop string that ended the text, once one has."""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next piece of text; return (text safe to emit now, whether a stop matched).

        On a match, the returned text runs up to the stop string (or through it, with
        include_stop_str_in_output) and whatever follows it is dropped.
        """
        if self.matched is not None:
            raise RuntimeError(f"StopStringMatcher.feed after stop string {self.matched!r} matched")
        offset = len(self._emitted_tail)
        text = self._emitted_tail + self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            return text[offset : start + len(stop) if self._include else start], True
        emit_end = len(text) if self._include else len(text) - self._longest_partial_suffix(text)
        self._held = text[emit_end:]
        if self._include and self._longest > 1:
            self._emitted_tail = text[-(self._longest - 1) :]
        return text[offset:emit_end], False

    def flush(self) -> str:
        """At the end of generation: the held-back text (none is held once a stop matched)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first, then starts first."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
