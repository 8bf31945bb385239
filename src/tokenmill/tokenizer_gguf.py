"""Rebuilding the tokenizer a GGUF file describes, so that it tokenizes exactly as llama.cpp does.

A GGUF carries no `tokenizer.json`: it stores the vocabulary (`tokenizer.ggml.tokens`, scores, token
types, merges) and names the algorithm (`tokenizer.ggml.model`) and, for byte-level BPE, the
pre-tokenizer (`tokenizer.ggml.pre`). llama.cpp (`src/llama-vocab.cpp`) gives these names their
meaning; this module maps each onto HF `tokenizers` components:

    "gpt2"    byte-level BPE: Split(regex) for each of llama.cpp's pre-tokenizer regexes, in order,
              then ByteLevel; the file's merges
    "gemma4"  BPE on raw UTF-8 with spaces as "▁" and <0xXX> byte fallback
    "llama"   SentencePiece BPE: "▁" for spaces (and a "▁" prefix), merges derived from the token
              scores (llama.cpp merges the adjacent pair whose joined token scores highest),
              <0xXX> byte fallback
    "bert"    WordPiece: llama.cpp stores "##x" as "x" and word starts as "▁x"; we undo that

Control, user-defined and unknown tokens (after llama.cpp's own fix-ups, e.g. "<|im_end|>" is
forced to control) become added tokens, matched whole in the input text before anything else, as
llama.cpp's special-token partition does. End-of-generation ids follow llama.cpp's EOG rules.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import IntEnum
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from tokenmill.errors import CheckpointError, UnsupportedModelError

logger = logging.getLogger(__name__)

SPACE_MARK = "\u2581"  # "▁", SentencePiece's visible space


# Token kinds, numbered as GGUF's tokenizer.ggml.token_type (gguf.TokenType).
class Kind(IntEnum):
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes of llama.cpp's llm_tokenizer_bpe, applied in order: each one splits every
# piece the previous ones produced into matches and the text between them ("isolated").
# ---------------------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
    r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
# Non-ASCII characters are escaped: several here (e.g. U+1FD3, U+212A, U+F900) are ones Unicode
# normalization would silently replace, changing the ranges.
_CJK = "\u4e00-\u9fa5"
_KANA = "\u3040-\u309f\u30a0-\u30ff"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-z"
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    r"\s?[!-/:-~" "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    f"[{_CJK}\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
_ASCII_PUNCT_WORD = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    f"[{_CJK}{_KANA}]+",
    _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_SPARK2_5 = (
    r"\p{N}{1,3}",
    f"[{_CJK}{_KANA}]+",
    _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
    r"\p{N}",
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_YOUTU = (
    "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
    f"\ufe30-\ufe4f]+|[\u3105-\u312f]+|[{_CJK}{_KANA}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    rf"{_CONTRACTIONS}?|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_LLM[4], r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)
_BLOOM = r" ?[^(\s|.,!?" "\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
# llama.cpp rewrites "uppercase letter" as "letter that is not a-z" (and lowercase likewise).
_NOT_LOWER = r"((?=[\p{L}])([^a-z]))"
_NOT_UPPER = r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_LOWER}*{_NOT_UPPER}+|[^\r\n\p{{L}}\p{{N}}]?{_NOT_LOWER}+{_NOT_UPPER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_LOWER}*{_NOT_UPPER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_LOWER}+{_NOT_UPPER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GRANITE_EMB_MULTI = (
    rf"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}\p{{M}}])([^a-z]))*((?=[\p{{L}}\p{{M}}])([^A-Z]))+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}\p{{M}}])([^a-z]))+((?=[\p{{L}}\p{{M}}])([^A-Z]))*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TINY_AYA = (
    r"\d{1,3}(?=(?:\d{3})*\b)",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# llama.cpp implements Kimi-K2's splitter in C++ (unicode_regex_split_custom_kimi_k2); this is the
# regex it implements, from Kimi's tokenization_kimi.py (Oniguruma supports the `&&` intersections).
_KIMI_K2 = (
    r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_AFMOE = (
    # llama.cpp's C++ "AFMoE_digits" splitter: a digit run is cut into a leading 1-2 digits (its
    # length mod 3) and then groups of three; as a regex, a 1-3 digit match followed by whole triples.
    r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
    "[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
    "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
    _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
_SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_EXAONE_MOE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
_MINICPM5 = (
    r"\p{N}{1,3}",
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CHAMELEON = (
    r"<sentinel:[0-9]+>",
    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    r"([\t\n]|    |  )",
    r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]",
    _GPT2,
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_LINES = r"[^\n]+|[\n]+"


@dataclass(frozen=True)
class PreTokenizer:
    """What a `tokenizer.ggml.pre` name means to llama.cpp."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a pre-tokenized word that is itself a token is taken whole
    add_bos: bool = False  # llama.cpp's default for tokenizer.ggml.add_bos_token
    byte_level: bool = True  # False: raw UTF-8 tokens with <0xXX> byte fallback (SentencePiece-like)
    escape_whitespace: bool = False  # spaces become "▁" before splitting
    no_bos: bool = False  # llama.cpp drops the default BOS id
    force_bos: bool = False  # BOS is added whatever tokenizer.ggml.add_bos_token says


def _pre(*regexes: str, **flags: bool) -> PreTokenizer:
    return PreTokenizer(tuple(regexes), **flags)


_LLAMA3_PRE = _pre(_LLAMA3, ignore_merges=True, add_bos=True)
_GPT2_PRE = _pre(_GPT2)
_STARCODER_PRE = _pre(*_STARCODER)
_QWEN2_PRE = _pre(_QWEN2)
_DEEPSEEK3_PRE = _pre(*_DEEPSEEK3)
_GPT4O_PRE = _pre(_GPT4O)
_BLOOM_PRE = _pre(_BLOOM)
_GEMMA4_PRE = _pre(_LINES, byte_level=False, escape_whitespace=True, force_bos=True)
_GPT2_NAMES = [
    "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert",
    "exaone4", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion", "granite-docling",
]  # fmt: skip

# Every name llama.cpp's llama_vocab::impl::load accepts for tokenizer.ggml.pre (llama.cpp master,
# 2026), grouped as it groups them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _pre(*_DEFAULT),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
        _LLAMA3_PRE,
    ),
    "dbrx": _pre(_LLAMA3),
    "smaug-bpe": _pre(_LLAMA3),
    "glm4": _pre(_LLAMA3, no_bos=True),
    "chatglm-bpe": _pre(_LLAMA3, no_bos=True),
    "minicpm5": _pre(*_MINICPM5, ignore_merges=True),
    "jais-2": _pre(_JAIS2),
    "deepseek-llm": _pre(*_DEEPSEEK_LLM),
    "deepseek-coder": _pre(*_DEEPSEEK_CODER),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"], _DEEPSEEK3_PRE),
    "spark2_5": _pre(*_SPARK2_5),
    "youtu": _pre(*_YOUTU, ignore_merges=True),
    "falcon": _pre(*_FALCON),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
        _STARCODER_PRE,
    ),
    **dict.fromkeys(_GPT2_NAMES, _GPT2_PRE),
    # llama.cpp forces BOS on for Gemma4 (ggml-org/llama.cpp#21500), not for Sarvam
    **dict.fromkeys(["gemma4", "granite-embed-multi-311m"], _GEMMA4_PRE),
    "sarvam-moe": _pre(_LINES, byte_level=False, escape_whitespace=True),
    "whitespace": _pre(r"\S+", byte_level=False),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"],
        _QWEN2_PRE,
    ),
    "qwen35": _pre(_QWEN35),
    "viking": _pre(_BLOOM, r"\p{N}"),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], _BLOOM_PRE),
    "tekken": _pre(_TEKKEN, ignore_merges=True, add_bos=True),
    "chameleon": _pre(*_CHAMELEON, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_PRE),
    "granite-embed-multi-97m": _pre(_GRANITE_EMB_MULTI, ignore_merges=True),
    **dict.fromkeys(["tiny_aya", "cohere2moe"], _pre(*_TINY_AYA)),
    "superbpe": _pre(r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], _pre(_BAILINGMOE)),
    "seed-coder": _pre(_SEED_CODER),
    "kimi-k2": _pre(_KIMI_K2),
    "ufakzeka": _pre(_UFAKZEKA),
    "grok-2": _pre(_QWEN2),
    "afmoe": _pre(*_AFMOE),
    "laguna": _pre(_LINES, _QWEN2),
    "exaone-moe": _pre(_EXAONE_MOE),
}

# Texts llama.cpp treats as end of generation wherever they occur in a vocabulary.
EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
])  # fmt: skip
# Fill-in-the-middle tokens llama.cpp also stops on (found by id key, else by text).
_FIM_EOG = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
# gpt-oss: tokens llama.cpp always renders, even when skipping special tokens.
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass
class TokenizerParts:
    """Everything `Tokenizer` needs, read from one checkpoint."""

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: frozenset[int]
    pad_token_id: int | None
    chat_template: str | None


@dataclass
class _Vocab:
    """The token list with llama.cpp's per-token kinds, plus where it came from (for errors)."""

    path: Path
    tokens: list[str]
    kinds: list[Kind]
    scores: list[float]
    ids: dict[str, int]

    def find(self, text: str) -> int | None:
        return self.ids.get(text)


def gguf_tokenizer_parts(metadata: Mapping[str, Any], path: Path) -> TokenizerParts:
    """Build the tokenizer of a GGUF file from its metadata (`GGUFCheckpoint.metadata`)."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise CheckpointError(f"{path} has no tokenizer (metadata key tokenizer.ggml.model is missing)")
    if model not in ("gpt2", "gemma4", "llama", "bert"):
        known = "gpt2, gemma4, llama (SentencePiece), bert (WordPiece)"
        if model in ("no_vocab", "none", "t5", "rwkv", "plamo2", "hybriddna", "whitespace"):
            raise UnsupportedModelError(
                f"{path}: tokenizer.ggml.model {model!r} is a llama.cpp tokenizer tokenmill does not "
                f"implement (supported: {known})"
            )
        raise CheckpointError(f"{path}: unknown tokenizer.ggml.model {model!r} (supported: {known})")
    vocab = _read_vocab(metadata, path)
    if model == "llama":
        return _spm_parts(metadata, vocab)
    if model == "bert":
        return _wordpiece_parts(metadata, vocab)
    if model == "gemma4":
        return _bpe_parts(metadata, vocab, "gemma4", gemma4=True)
    return _bpe_parts(metadata, vocab, metadata.get("tokenizer.ggml.pre"), gemma4=False)


# ---------------------------------------------------------------------------------------------
# Reading the vocabulary and the special token ids
# ---------------------------------------------------------------------------------------------


def _read_vocab(metadata: Mapping[str, Any], path: Path) -> _Vocab:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{path}: metadata key tokenizer.ggml.tokens is missing or empty")
    n = len(tokens)
    kinds_raw = metadata.get("tokenizer.ggml.token_type") or [Kind.NORMAL] * n
    scores = metadata.get("tokenizer.ggml.scores") or [0.0] * n
    for key, values in (("tokenizer.ggml.token_type", kinds_raw), ("tokenizer.ggml.scores", scores)):
        if len(values) < n:
            raise CheckpointError(f"{path}: {key} has {len(values)} entries for {n} tokens")
    # llama.cpp renames empty tokens, and treats a type it does not know as "undefined" (normal here).
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    by_value = {k.value: k for k in Kind}   # (types llama.cpp does not know: normal)
    kinds = [by_value.get(k, Kind.NORMAL) for k in kinds_raw[:n]]
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if ids.setdefault(t, i) != i:
            raise CheckpointError(f"{path}: tokenizer.ggml.tokens has {t!r} twice (ids {ids[t]} and {i})")
    return _Vocab(path, tokens, kinds, [float(s) for s in scores[:n]], ids)


def _special_id(metadata: Mapping[str, Any], vocab: _Vocab, key: str, default: int | None) -> int | None:
    """A special token id as llama.cpp reads it: the default unless the file sets one in range."""
    n = len(vocab.tokens)
    if default is not None and default >= n:
        default = None
    value = metadata.get(key)
    if value is None:
        return default
    if not 0 <= int(value) < n:
        logger.warning("%s: %s = %s is outside the vocabulary of %d; using %s", vocab.path, key, value, n, default)
        return default
    return int(value)


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key)
    return default if value is None else bool(value)


@dataclass
class _Specials:
    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None
    sep: int | None
    add_bos: bool
    add_eos: bool
    eog: frozenset[int]


def _read_specials(
    metadata: Mapping[str, Any],
    vocab: _Vocab,
    *,
    bos: int | None,
    eos: int | None,
    unk: int | None,
    pad: int | None,
    sep: int | None,
    add_bos: bool,
    add_eos: bool,
    force_add_bos: bool = False,
) -> _Specials:
    """Special ids, add-BOS/EOS flags and the end-of-generation set, as llama_vocab::impl::load.

    Also applies llama.cpp's kind fix-ups to `vocab.kinds` (end-of-generation texts become control).
    """

    def get(key: str, default: int | None) -> int | None:
        return _special_id(metadata, vocab, key, default)

    bos_id, eos_id = get("tokenizer.ggml.bos_token_id", bos), get("tokenizer.ggml.eos_token_id", eos)
    add_bos = force_add_bos or _flag(metadata, "tokenizer.ggml.add_bos_token", add_bos)
    add_eos = _flag(metadata, "tokenizer.ggml.add_eos_token", add_eos)
    for flag, tid, what in ((add_bos, bos_id, "bos"), (add_eos, eos_id, "eos")):
        if flag and tid is None:
            raise CheckpointError(
                f"{vocab.path}: tokenizer.ggml.add_{what}_token is true but tokenizer.ggml.{what}_token_id is not set"
            )
    return _Specials(
        bos=bos_id,
        eos=eos_id,
        unk=get("tokenizer.ggml.unknown_token_id", unk),
        pad=get("tokenizer.ggml.padding_token_id", pad),
        sep=get("tokenizer.ggml.seperator_token_id", sep),  # sic: llama.cpp's key is spelled so
        add_bos=add_bos,
        add_eos=add_eos,
        eog=_end_of_generation(metadata, vocab, eos_id),
    )


def _end_of_generation(metadata: Mapping[str, Any], vocab: _Vocab, eos: int | None) -> frozenset[int]:
    """llama.cpp's special_eog_ids: EOS, EOT, EOM, FIM pad/repo/sep, and known end-of-turn texts."""
    eog: set[int] = set()

    def mark(tid: int) -> None:
        eog.add(tid)
        vocab.kinds[tid] = Kind.CONTROL  # llama.cpp makes these control tokens, whatever the file says

    for key, texts in _FIM_EOG.items():
        tid = _special_id(metadata, vocab, key, None)
        if tid is None:  # llama.cpp looks the token up by its text (lowest id here)
            tid = min((i for t in texts if (i := vocab.find(t)) is not None), default=None)
        if tid is not None:
            mark(tid)
    for text in EOG_TEXTS:
        if (tid := vocab.find(text)) is not None:
            mark(tid)
    for tid in (eos, _special_id(metadata, vocab, "tokenizer.ggml.eot_token_id", None),
                _special_id(metadata, vocab, "tokenizer.ggml.eom_token_id", None)):  # fmt: skip
        if tid is not None:
            eog.add(tid)
    texts = {vocab.tokens[t] for t in eog}
    end = vocab.find("<|end|>")
    if end in eog and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        # gpt-oss / solar-open: "<|end|>" ends a message, not the generation
        eog.discard(end)
        vocab.kinds[end] = Kind.USER_DEFINED
    eos_s = vocab.find("</s>")
    if eos_s in eog and "<|tool_response>" in texts:  # gemma4: "</s>" is ordinary text there
        eog.discard(eos_s)
        vocab.kinds[eos_s] = Kind.NORMAL
    for text in _ALWAYS_RENDERED:
        if (tid := vocab.find(text)) is not None:
            vocab.kinds[tid] = Kind.USER_DEFINED
    return frozenset(eog)


def _added_tokens(metadata: Mapping[str, Any], vocab: _Vocab) -> list[AddedToken]:
    """Control, unknown and user-defined tokens: matched whole in the input, before anything else.

    Control and unknown ones are special (left out by decode(skip_special_tokens=True)); user-defined
    ones are always rendered, as in llama.cpp. A few models get llama.cpp's whitespace stripping.
    """
    name = str(metadata.get("general.name", "")).lower()
    pre = str(metadata.get("tokenizer.ggml.pre", ""))
    arch = str(metadata.get("general.architecture", ""))
    rstrip: set[str] = set()
    lstrip: set[str] = set()
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
    ):
        lstrip.add("<mask>")
    elif "phi-3" in name or "phi3" in name:
        rstrip = {t for t, k in zip(vocab.tokens, vocab.kinds, strict=True) if k in _MATCHED_WHOLE}
        rstrip -= {"<unk>", "<s>", "<|endoftext|>"}
    elif "modern-bert" in name:
        lstrip.add("[MASK]")
    return [
        AddedToken(t, special=k is not Kind.USER_DEFINED, normalized=False, lstrip=t in lstrip, rstrip=t in rstrip)
        for t, k in zip(vocab.tokens, vocab.kinds, strict=True)
        if k in _MATCHED_WHOLE
    ]


_MATCHED_WHOLE = (Kind.CONTROL, Kind.UNKNOWN, Kind.USER_DEFINED)


def _assemble(
    model: models.Model, metadata: Mapping[str, Any], vocab: _Vocab, specials: _Specials, sep_last: bool = False
) -> TokenizerParts:
    """Wrap a model in a tokenizers.Tokenizer with the added tokens and the BOS/EOS template."""
    backend = tokenizers.Tokenizer(model)
    added = _added_tokens(metadata, vocab)
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    first = [specials.bos] if specials.add_bos else []
    last = [specials.eos] if specials.add_eos else []
    if sep_last:
        last.append(specials.sep)
    if first or last:
        names = [f"<tokenmill_{i}>" for i in range(len(first) + len(last))]  # template placeholders
        single = [*names[: len(first)], "$A", *names[len(first) :]]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single),
            special_tokens=list(zip(names, [*first, *last], strict=True)),  # type: ignore[arg-type]
        )
    template = metadata.get("tokenizer.chat_template")
    return TokenizerParts(
        backend=backend,
        bos_token_id=specials.bos,
        eos_token_id=specials.eos,
        eos_token_ids=specials.eog,
        pad_token_id=specials.pad,
        chat_template=template if isinstance(template, str) else None,
    )


# ---------------------------------------------------------------------------------------------
# The three algorithms
# ---------------------------------------------------------------------------------------------


def _bpe_parts(metadata: Mapping[str, Any], vocab: _Vocab, pre_name: str | None, gemma4: bool) -> TokenizerParts:
    if pre_name is None:
        logger.warning("%s: no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer", vocab.path)
        pre_name = "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise CheckpointError(
            f"{vocab.path}: unknown pre-tokenizer tokenizer.ggml.pre = {pre_name!r} "
            f"(known to llama.cpp and tokenmill: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    merges = _bpe_merges(metadata, vocab)
    specials = _read_specials(
        metadata,
        vocab,
        # llama.cpp's (odd) default BOS/EOS for "gpt2" vocabularies is id 11; "gemma4" has none
        bos=None if pre.no_bos or gemma4 else 11,
        eos=None if gemma4 else 11,
        unk=None,
        pad=None,
        sep=None,
        add_bos=pre.add_bos,
        add_eos=False,
        force_add_bos=pre.force_bos,
    )
    model = models.BPE(
        vocab.ids,
        merges,
        ignore_merges=pre.ignore_merges,
        byte_fallback=not pre.byte_level,
        unk_token=None if specials.unk is None else vocab.tokens[specials.unk],
    )
    parts = _assemble(model, metadata, vocab, specials)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    if pre.byte_level:
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        parts.backend.decoder = decoders.ByteLevel()
    else:
        steps = [decoders.ByteFallback(), decoders.Fuse()]
        if pre.escape_whitespace:
            parts.backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
            steps.insert(0, decoders.Replace(SPACE_MARK, " "))
        parts.backend.decoder = decoders.Sequence(steps)
    parts.backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
    return parts


def _bpe_merges(metadata: Mapping[str, Any], vocab: _Vocab) -> list[tuple[str, str]]:
    raw = metadata.get("tokenizer.ggml.merges")
    if not isinstance(raw, list):
        raise CheckpointError(f"{vocab.path}: a BPE tokenizer needs tokenizer.ggml.merges, which is missing")
    merges = []
    for merge in raw:
        cut = merge.find(" ", 1)  # as llama.cpp: the first space after the first character
        left, right = (merge[:cut], merge[cut + 1 :]) if cut > 0 else ("", "")
        # tokenizers requires both halves and the result in the vocabulary; a merge that is not
        # could only ever produce a piece llama.cpp then spells out byte by byte.
        if left in vocab.ids and right in vocab.ids and left + right in vocab.ids:
            merges.append((left, right))
    return merges


def _spm_parts(metadata: Mapping[str, Any], vocab: _Vocab) -> TokenizerParts:
    specials = _read_specials(metadata, vocab, bos=1, eos=2, unk=0, pad=None, sep=None, add_bos=True, add_eos=False)
    model = models.BPE(
        vocab.ids,
        _spm_merges(vocab),
        byte_fallback=True,
        unk_token=None if specials.unk is None else vocab.tokens[specials.unk],
    )
    parts = _assemble(model, metadata, vocab, specials)
    backend = parts.backend
    escape = normalizers.Replace(" ", SPACE_MARK)
    # llama.cpp puts the space before every piece of text that starts the input or follows a special
    # token; tokenizers normalizes each piece between added tokens separately, so Prepend does that.
    if _flag(metadata, "tokenizer.ggml.add_space_prefix", True):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), escape])
        strip = [decoders.Strip(" ", 1, 0)]
    else:
        backend.normalizer = escape
        strip = []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return parts


def _spm_merges(vocab: _Vocab) -> list[tuple[str, str]]:
    """Merges equivalent to llama.cpp's SPM tokenizer, best first.

    llama.cpp repeatedly joins the adjacent pair of symbols whose concatenation is a token with the
    highest score. As BPE merges: every split of a token into two tokens, ranked by the score of the
    whole token (ties by id; llama.cpp breaks exact score ties by position instead).
    """
    # Control and unknown tokens are cut out of the text before this runs, and byte tokens come only
    # from byte fallback: none of them is merged into or from.
    kinds = (Kind.NORMAL, Kind.USER_DEFINED, Kind.UNUSED)
    mergeable = {t for t, k in zip(vocab.tokens, vocab.kinds, strict=True) if k in kinds}
    candidates = []
    for token in mergeable:
        tid = vocab.ids[token]
        cuts = [cut for cut in range(1, len(token)) if token[:cut] in mergeable and token[cut:] in mergeable]
        candidates += [(-vocab.scores[tid], tid, cut) for cut in cuts]
    candidates.sort()
    return [(vocab.tokens[tid][:cut], vocab.tokens[tid][cut:]) for _, tid, cut in candidates]


def _wordpiece_parts(metadata: Mapping[str, Any], vocab: _Vocab) -> TokenizerParts:
    specials = _read_specials(metadata, vocab, bos=101, eos=None, unk=100, pad=0, sep=102, add_bos=True, add_eos=False)
    # llama.cpp's WPM tokenizer always wraps the text in BOS ([CLS]) ... SEP, whatever the flags say.
    for tid, key in ((specials.bos, "bos_token_id"), (specials.sep, "seperator_token_id"),
                     (specials.unk, "unknown_token_id")):  # fmt: skip
        if tid is None:
            raise CheckpointError(f"{vocab.path}: a WordPiece (bert) tokenizer needs tokenizer.ggml.{key}")
    specials.add_bos, specials.add_eos = True, False
    # Undo llama.cpp's spelling: word starts "▁x" -> "x", continuations "x" -> "##x". Tokens matched
    # whole (control, ...) keep the text llama.cpp matches them by.
    respelled = [
        t if k in _MATCHED_WHOLE else t[1:] if t.startswith(SPACE_MARK) else "##" + t
        for t, k in zip(vocab.tokens, vocab.kinds, strict=True)
    ]
    ids: dict[str, int] = {}
    for tid, token in enumerate(respelled):
        if ids.setdefault(token, tid) != tid:
            raise CheckpointError(f"{vocab.path}: tokens {ids[token]} and {tid} are the same WordPiece token {token!r}")
    vocab = replace(vocab, tokens=respelled, ids=ids)
    # llama.cpp has no per-word length limit (tokenizers' default is 100 characters)
    model = models.WordPiece(ids, unk_token=respelled[specials.unk], max_input_chars_per_word=1 << 30)
    parts = _assemble(model, metadata, vocab, specials, sep_last=True)
    lowercase = _flag(metadata, "tokenizer.ggml.normalizer.lowercase", True)
    parts.backend.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=True,
        lowercase=lowercase,
        strip_accents=_flag(metadata, "tokenizer.ggml.normalizer.strip_accents", lowercase),
    )
    parts.backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    parts.backend.decoder = decoders.WordPiece()
    return parts
