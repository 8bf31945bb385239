"""Mapping GGUF tensor names (llama.cpp's `blk.{i}.attn_q.weight`) onto Hugging Face names."""

from __future__ import annotations

import re

NameTable = list[tuple[re.Pattern[str], str]]


def gguf_name_table(names: dict[str, str]) -> NameTable:
    """Compile {gguf_name: hf_name} where "{i}" stands for the layer index in both."""
    return [(re.compile(re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), h) for g, h in names.items()]


def map_gguf_name(name: str, table: NameTable) -> str | None:
    for pattern, hf in table:
        m = pattern.match(name)
        if m:
            return hf.replace("{i}", m.group(1)) if m.groups() else hf
    return None
