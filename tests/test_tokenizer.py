"""The tokenizer against independent references, one per kind of vocabulary.

- the default model's GGUF (byte-level BPE, "smollm" pre-tokenizer) vs transformers' own GGUF
  tokenizer conversion;
- a SentencePiece BPE model trained here, written as a llama.cpp-style vocab-only GGUF, vs
  sentencepiece itself;
- a byte-level BPE and a WordPiece model trained with `tokenizers`, written as GGUFs the way
  llama.cpp's converter does, vs the trained tokenizer / transformers' BertTokenizerFast;
- the streaming detokenizer vs plain decode, chat templates, HF folders and load errors.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Callable
from pathlib import Path

import gguf
import jinja2.sandbox
import pytest
import sentencepiece as spm
from test_real_models import gemma3_gguf  # noqa: F401 - a fixture (the real Gemma 3 file, where installed)
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.errors import CheckpointError, TokenmillError, UnsupportedModelError
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from tokenmill.tokenizer_gguf import PRE_TOKENIZERS

CORPUS = [
    "", " ", "Hello world", "The quick brown fox jumps over the lazy dog.",
    "1234567", "hello 1234567", "3.14159", "1,000,000", "x²³ ½ ⅓ ٣٤٥ १२३",
    "I'm", "don't", "WE'LL", "they've 'quoted' it's",
    "\n\n\n", "  leading", "trailing   ", "\ttab\tseparated\t", "a\r\nb", "mixed \n \t whitespace  \n", "     ",
    "你好，世界！这是一个测试。", "日本語のテキスト", "한국어 텍스트", "café naïve résumé", "e\u0301 a\u0300 combining",
    "مرحبا بالعالم", "שלום עולם", "Привет, мир", "Ελληνικά", "हिन्दी", "ไทย",
    "emoji 😀🎉👍🏽", "family 👨‍👩‍👧‍👦 flag 🇺🇸 heart ❤️", "math ∑∫√∞ ≠ ≤",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b) { c[i] = d->e; }", '<div class="x">&amp;</div>',
    "URL: https://example.com/path?q=1&r=2", "snake_case camelCase CONSTANT_CASE", "!!!???...", "a" * 60,
]  # fmt: skip
SPECIAL_CORPUS = [
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more", "<|im_end|><|im_end|>",
    " <|im_start|> spaced <|im_end|> ",
]  # fmt: skip
# Text a small model was trained on (the SentencePiece, BPE and WordPiece references below).
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.", "Hello world, hello tokenizer!",
    "I'm sure we'll see; don't worry.", "café naïve résumé", "你好，世界！", "def f(x):\n    return x + 1",
    "numbers 1234567 3.14159 1,000,000", "Привет, мир", "Ελληνικά", "emoji 😀 party 🎉",
    "    indented code block", "tabs\tand\nnewlines\n\n",
] * 20  # fmt: skip
# Strings whose characters get split over several byte tokens.
MULTIBYTE = ["emoji 😀🎉 family 👨‍👩‍👧 日本語 naïve ✓ 𝕏", "你好，世界！", "🇺🇸🇯🇵 ÀÉÎ", "Ω≈ç√∫˜µ≤≥÷ 🤖"]


def write_gguf(path: Path, fill: Callable[[gguf.GGUFWriter], None], arch: str = "llama") -> Path:
    """A vocab-only GGUF file holding whatever `fill` adds."""
    writer = gguf.GGUFWriter(str(path), arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------
# The default model (SmolLM2-135M-Instruct GGUF) vs transformers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(default_gguf_path: Path) -> Tokenizer:
    return load_tokenizer(default_gguf_path)


@pytest.fixture(scope="module")
def smol_reference(default_gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


# transformers builds the SmolLM2 tokenizer from a GGUF with the plain GPT-2 regex: it ignores
# tokenizer.ggml.pre = "smollm", for which llama.cpp first splits off every \p{N} character (as
# SmolLM2's own tokenizer.json does with Digits(individual_digits=True)). SmolLM2's vocabulary has
# no multi-digit tokens, so ASCII digits come out the same, but " ½" is one piece for transformers
# and " ", "½" for llama.cpp. On these strings transformers is wrong and we do not follow it.
TRANSFORMERS_MISSES_DIGIT_SPLIT = {"x²³ ½ ⅓ ٣٤٥ १२३"}


def test_default_model_matches_transformers(smol, smol_reference):
    for text in CORPUS + SPECIAL_CORPUS:
        ids = smol.encode(text, add_special_tokens=False)
        if text not in TRANSFORMERS_MISSES_DIGIT_SPLIT:
            assert ids == smol_reference.encode(text, add_special_tokens=False), text
        for skip in (False, True):
            assert smol.decode(ids, skip) == smol_reference.decode(ids, skip_special_tokens=skip), text
        if not any(s in text for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")):
            assert smol.decode(ids) == text  # byte-level BPE round-trips exactly


def test_default_model_splits_digits_like_llama_cpp(smol, smol_reference):
    """Against SmolLM2's original pre-tokenizer (the one llama.cpp's "smollm" regexes reproduce)."""
    original = HFTokenizer.from_str(smol_reference.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in CORPUS + SPECIAL_CORPUS:
        assert smol.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False).ids
    for text in TRANSFORMERS_MISSES_DIGIT_SPLIT:  # the documented disagreement is real
        assert smol.encode(text, add_special_tokens=False) != smol_reference.encode(text, add_special_tokens=False)


def test_default_model_special_tokens(smol, smol_reference):
    assert smol.vocab_size == 49152
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id) == (1, 2, 2)
    # llama.cpp's end-of-generation set for this file: EOS "<|im_end|>" (2), "<|endoftext|>" (0) by its
    # text, and "<reponame>" (4), which llama.cpp takes for the fill-in-the-middle repo token.
    assert smol.eos_token_ids == {0, 2, 4}
    assert [smol.id_to_token(i) for i in (0, 1, 2, 4)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<reponame>"]
    assert smol.id_to_token(smol.encode(" the", add_special_tokens=False)[0]) == "Ġthe"
    assert smol.is_special(1) and smol.is_special(0) and not smol.is_special(28120)
    # tokenizer.ggml.add_bos_token is false in this file: no BOS, like the transformers reference
    text = "<|im_start|>user\nhi<|im_end|>"
    assert smol.encode(text) == smol.encode(text, add_special_tokens=False) == smol_reference.encode(text)
    assert smol.encode(text)[0] == 1 and smol.encode(text)[-1] == 2  # special text parsed as one token
    with pytest.raises(TokenmillError, match="outside the vocabulary"):
        smol.id_to_token(49152)


def test_chat_template_default_model(smol, smol_reference):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert smol.apply_chat_template(messages) == expected
    assert smol_reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    assert smol.apply_chat_template(messages, tokenize=True) == smol.encode(expected, add_special_tokens=False)
    assert smol.apply_chat_template(messages, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )


# ---------------------------------------------------------------------------------------------
# SentencePiece ("llama") vocabulary vs sentencepiece
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> tuple[spm.SentencePieceProcessor, Path]:
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT), model_writer=proto, model_type="bpe", vocab_size=480,
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        # llama.cpp's SPM tokenizer takes the text as it is: no NFKC, no whitespace squeezing
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())

    def token_type(i: int) -> int:  # as llama.cpp's converter (convert_hf_to_gguf.py, _create_vocab_sentencepiece)
        for test, kind in ((sp.is_unknown, 2), (sp.is_control, 3), (sp.is_unused, 5), (sp.is_byte, 6)):
            if test(i):
                return kind
        return 1

    def fill(w: gguf.GGUFWriter) -> None:
        n = sp.get_piece_size()
        w.add_tokenizer_model("llama")
        w.add_token_list([sp.id_to_piece(i) for i in range(n)])
        w.add_token_scores([sp.get_score(i) for i in range(n)])
        w.add_token_types([token_type(i) for i in range(n)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    return sp, write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", fill)


def test_sentencepiece_gguf_matches_sentencepiece(spm_model):
    sp, path = spm_model
    tok = load_tokenizer(path)
    assert any(sp.is_byte(i) for i in tok.encode("日本語 🤖", add_special_tokens=False))  # byte fallback in use
    for text in CORPUS + TRAINING_TEXT[:12]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids), text
        assert tok.encode(text) == [1, *ids]  # llama.cpp adds BOS to SentencePiece vocabularies by default
    assert tok.eos_token_ids == {2}
    assert tok.decode(tok.encode("hi"), skip_special_tokens=True) == "hi"
    assert tok.decode(tok.encode("hi")) == "<s> hi"


def test_sentencepiece_gguf_special_tokens_like_llama_cpp(spm_model):
    """llama.cpp matches control-token text, and gives the text after it its own "▁" prefix."""
    sp, path = spm_model
    tok = load_tokenizer(path)
    assert tok.encode("<s>hi</s> x", add_special_tokens=False) == [1, *sp.encode("hi"), 2, *sp.encode(" x")]
    with pytest.raises(TokenmillError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------------------------
# Byte-level BPE ("gpt2") with another pre-tokenizer, and the pre-tokenizer table
# ---------------------------------------------------------------------------------------------

BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory) -> tuple[HFTokenizer, Path]:
    """A GPT-2 style tokenizer trained here, and its GGUF with tokenizer.ggml.pre = "gpt-2"."""
    reference = HFTokenizer(models.BPE())
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's own regex inside
    reference.decoder = decoders.ByteLevel()
    reference.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(
        vocab_size=500, special_tokens=BPE_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    ))  # fmt: skip
    spec = json.loads(reference.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in BPE_SPECIALS else 1 for t in tokens])
        w.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)

    return reference, write_gguf(tmp_path_factory.mktemp("bpe") / "bpe.gguf", fill, arch="gpt2")


def test_byte_level_gguf_matches_trained_tokenizer(byte_bpe):
    reference, path = byte_bpe
    tok = load_tokenizer(path)
    for text in CORPUS + SPECIAL_CORPUS:
        ids = tok.encode(text)
        assert ids == reference.encode(text).ids, text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids, True) == reference.decode(ids, skip_special_tokens=True)
    # EOS, plus "<|im_end|>" by its text
    assert tok.eos_token_ids == {0, reference.token_to_id("<|im_end|>")}


def test_every_pre_tokenizer_compiles_and_keeps_all_text():
    sample = "Hello WORLDs don't 1234567 你好 x²! <tag>  ΐ K 豈 ,.!?…。 \n\n\tend  "
    assert len(PRE_TOKENIZERS) >= 90
    for name, pre in PRE_TOKENIZERS.items():
        pieces = _split(pre.regexes, sample)
        assert "".join(pieces) == sample and all(pieces), name


def _split(regexes: tuple[str, ...], text: str) -> list[str]:
    splitter = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes])
    return [piece for piece, _ in splitter.pre_tokenize_str(text)]


def test_pre_tokenizer_regexes_split_as_llama_cpp():
    # worked out by hand from llama.cpp's llama3 regex: contractions, a letter run with one leading
    # non-letter, digits in threes, punctuation runs, newline runs, spaces before a word left alone
    assert _split(PRE_TOKENIZERS["llama3"].regexes, "I'm HERE's 1234567  don't\n\n x!?") == [
        "I", "'m", " HERE", "'s", " ", "123", "456", "7", " ", " don", "'t", "\n\n", " x", "!?",
    ]  # fmt: skip
    digits = {
        "smollm": ["a", " ", "1", "2", "3", "4", "5"],  # \p{N} first, one digit each
        "qwen2": ["a", " ", "1", "2", "3", "4", "5"],
        "llama-bpe": ["a", " ", "123", "45"],
        "deepseek-v3": ["a", " ", "123", "45"],
        "gpt-2": ["a", " 12345"],
        "superbpe": ["a ", "12", "345"],  # groups of three from the right
        "afmoe": ["a", " ", "12", "345"],
    }
    for name, expected in digits.items():
        assert _split(PRE_TOKENIZERS[name].regexes, "a 12345") == expected, name
    assert PRE_TOKENIZERS["llama3"].ignore_merges and PRE_TOKENIZERS["llama3"].add_bos
    assert not PRE_TOKENIZERS["smollm"].add_bos


def _tiny_vocab(model: str, tokens: list[str], types: list[int], merges: list[str], **ids: int):
    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(model)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        for name, tid in ids.items():
            w.add_uint32(f"tokenizer.ggml.{name}", tid)

    return fill


def test_end_of_generation_and_token_kinds_follow_llama_cpp(tmp_path):
    """Hand-checked against llama_vocab::impl::load's rules."""
    tokens = [
        "a",
        "b",
        "ab",
        "<|return|>",
        "<|call|>",
        "<|end|>",
        "<|channel|>",
        "<|fim_pad|>",
        "<think>",
        "<|im_end|>",
    ]
    types = [1, 1, 1, 3, 3, 3, 3, 1, 4, 1]  # "<|fim_pad|>" and "<|im_end|>" mislabeled normal
    fill = _tiny_vocab("gpt2", tokens, types, ["a b"], eos_token_id=3)
    tok = load_tokenizer(write_gguf(tmp_path / "eog.gguf", fill, arch="gpt2"))
    # EOS, "<|call|>" and "<|im_end|>" by text, "<|fim_pad|>" as the FIM pad token; "<|end|>" is not one
    # when "<|return|>" and "<|call|>" exist (gpt-oss), and it and "<|channel|>" are always rendered
    assert tok.eos_token_ids == {3, 4, 7, 9}
    assert [i for i in range(len(tokens)) if tok.is_special(i)] == [3, 4, 7, 9]
    assert tok.encode("ab<think>b<|im_end|><|fim_pad|>") == [2, 8, 1, 9, 7]  # all matched whole
    assert tok.decode([0, 6, 5, 8, 3, 9], skip_special_tokens=True) == "a<|channel|><|end|><think>"


def test_gemma4_style_vocabulary(tmp_path):
    """Raw UTF-8 BPE with spaces as "▁", <0xXX> byte fallback, and the BOS llama.cpp forces on."""
    tokens = ["<pad>", "<eos>", "<bos>", "\u2581", "a", "b", "\u2581a", "\u2581ab", "\n", "<0x63>"]
    fill = _tiny_vocab("gemma4", tokens, [3, 3, 3, 1, 1, 1, 1, 1, 1, 6], ["\u2581 a", "\u2581a b"], bos_token_id=2)
    tok = load_tokenizer(write_gguf(tmp_path / "gemma4.gguf", fill, arch="gemma4"))
    assert tok.encode("a b\nc") == [2, 4, 3, 5, 8, 9]  # "c" is not a token: its byte is
    assert tok.encode(" ab", add_special_tokens=False) == [7]
    assert tok.decode([2, 4, 3, 5, 8, 9], skip_special_tokens=True) == "a b\nc"
    assert tok.eos_token_ids == {1}  # "<eos>" by its text


# ---------------------------------------------------------------------------------------------
# WordPiece ("bert") vs transformers' BertTokenizerFast
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer_side = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    trainer_side.normalizer = normalizers.BertNormalizer(lowercase=True)
    trainer_side.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer_side.train_from_iterator(
        TRAINING_TEXT, trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    )
    vocab = trainer_side.get_vocab()
    reference = BertTokenizerFast(vocab=vocab, do_lower_case=True)
    folder = tmp_path_factory.mktemp("bert")
    reference.save_pretrained(folder)
    tokens = sorted(vocab, key=vocab.__getitem__)
    types = [3 if t in specials else 1 for t in tokens]

    def fill(w: gguf.GGUFWriter) -> None:
        # llama.cpp's converter (BertModel.set_vocab): "##x" -> "x", other non-control tokens -> "▁x"
        w.add_tokenizer_model("bert")
        spelled = [
            t if k == 3 else t[2:] if t.startswith("##") else "\u2581" + t for t, k in zip(tokens, types, strict=True)
        ]
        w.add_token_list(spelled)
        w.add_token_types(types)
        gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(w)  # [CLS] as BOS, [SEP], flags

    return reference, write_gguf(folder / "bert.gguf", fill, arch="bert")


def test_wordpiece_gguf_matches_bert_tokenizer(wordpiece):
    reference, path = wordpiece
    tok = load_tokenizer(path)
    for text in [*CORPUS, "Hello [MASK] world [SEP]", "ÀÉÎÕÜ Ñandú", "Straße ĞÜŞ"]:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        assert ids[0] == reference.cls_token_id and ids[-1] == reference.sep_token_id
        assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert tok.bos_token_id == reference.cls_token_id


# ---------------------------------------------------------------------------------------------
# Incremental detokenization
# ---------------------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool, prompt: list[int] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.step(ids[start : start + size]))
        start += size
    return [*deltas, detok.flush()]


def _chunkings(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    randomly = []
    while sum(randomly) < n:
        randomly.append(min(rng.randint(1, 4), n - sum(randomly)))
    return [[1] * n, randomly, [n]]


@pytest.mark.parametrize("which", ["smol", "spm"])
def test_incremental_detokenizer_matches_decode(which, request):
    if which == "smol":
        tok, special = request.getfixturevalue("smol"), "<|im_start|>"
    else:
        tok, special = load_tokenizer(request.getfixturevalue("spm_model")[1]), "<s>"
    partial_tokens = 0
    for n, text in enumerate(MULTIBYTE + [f"{special}{MULTIBYTE[0]}{special} tail"]):
        ids = tok.encode(text, add_special_tokens=False)
        partial_tokens += sum("\ufffd" in tok.decode([i]) for i in ids)
        for skip in (True, False):
            full = tok.decode(ids, skip_special_tokens=skip)
            for chunks in _chunkings(len(ids), seed=n):
                deltas = _stream(tok, ids, chunks, skip)
                assert "".join(deltas) == full
                assert not any("\ufffd" in d for d in deltas)  # never a half character
    assert partial_tokens > 10  # characters really were split over byte tokens


@pytest.mark.parametrize("which", ["smol", "spm", "gemma3"])
def test_token_bytes_are_what_each_token_adds_to_the_text(which, request):
    """token_bytes (llama.cpp's token_to_piece; a logprob's OpenAI `bytes`): joined, the tokens of a
    text give its UTF-8 bytes (after the space SentencePiece puts before a text, where the vocabulary
    does), also where a character is split over tokens; token_text is their text. decode([id]) alone
    cannot: it gives U+FFFD for part of a character, and SentencePiece's "▁the" as "the"."""
    if which == "smol":
        tok, prefix = request.getfixturevalue("smol"), b""
    elif which == "spm":
        tok, prefix = load_tokenizer(request.getfixturevalue("spm_model")[1]), b" "
    else:   # (a real file, where the package is installed; no space before a text)
        tok, prefix = load_tokenizer(request.getfixturevalue("gemma3_gguf")), b""
    split = spaced = 0
    for text in CORPUS + TRAINING_TEXT + MULTIBYTE:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.token_bytes(i) for i in ids]
        assert b"".join(pieces) == (prefix + text.encode() if text else b""), text
        if ids:
            assert tok.token_bytes(ids[0], first=True) + b"".join(pieces[1:]) == text.encode(), text
        assert [tok.token_text(i) for i in ids] == [p.decode("utf-8", errors="replace") for p in pieces]
        split += sum("\ufffd" in tok.decode([i]) for i in ids)
        spaced += sum(p.startswith(b" ") and not tok.decode([i]).startswith(" ")
                      for p, i in zip(pieces, ids, strict=True))
    assert split > 0   # characters were split over tokens
    assert (spaced > 10) == (which == "spm")   # and SentencePiece's decode dropped leading spaces
    special = tok.eos_token_id
    assert tok.token_text(special) == tok.decode([special]) and tok.token_bytes(tok.vocab_size + 5) == b""


def test_incremental_detokenizer_holds_back_and_flushes_incomplete_bytes(smol):
    ids = smol.encode("你好", add_special_tokens=False)
    first_char = next(k for k in range(1, len(ids) + 1) if smol.decode(ids[:k]) == "你")
    partial = ids[: first_char - 1] if first_char > 1 else None
    assert partial, "expected 你 to take several byte tokens"
    detok = IncrementalDetokenizer(smol)
    assert detok.step(partial) == ""  # nothing while the character is incomplete
    assert detok.flush() == smol.decode(partial) and "\ufffd" in smol.decode(partial)


def test_incremental_detokenizer_uses_prompt_as_context(spm_model):
    tok = load_tokenizer(spm_model[1])
    prompt, output = tok.encode("Hello"), tok.encode("world", add_special_tokens=False)
    # alone, SentencePiece's first "▁world" loses its space; after a prompt it keeps it
    assert "".join(_stream(tok, output, [1] * len(output), True)) == tok.decode(output, True) == "world"
    after_prompt = "".join(_stream(tok, output, [1] * len(output), True, prompt))
    assert after_prompt == " world"
    full, before = tok.decode(prompt + output, True), tok.decode(prompt, True)
    assert full == before + after_prompt


# ---------------------------------------------------------------------------------------------
# Chat templates in the sandbox
# ---------------------------------------------------------------------------------------------


def test_chat_template_sandbox_and_helpers(byte_bpe):
    tok = load_tokenizer(byte_bpe[1])
    hi = [{"role": "user", "content": "<b>&'"}]
    tok.chat_template = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(TokenmillError, match="unsafe") as caught:
        tok.apply_chat_template(hi)
    assert isinstance(caught.value.__cause__, jinja2.sandbox.SecurityError)
    tok.chat_template = "{% if messages|length > 0 %}{{ raise_exception('roles must alternate') }}{% endif %}"
    with pytest.raises(TokenmillError, match="roles must alternate"):
        tok.apply_chat_template(hi)
    tok.chat_template = "{{ bos_token }}{{ messages[0] | tojson }}{{ strftime_now('%Y') | length }}{{ extra }}"
    assert tok.apply_chat_template(hi, extra="!") == '<|endoftext|>{"role": "user", "content": "<b>&\'"}4!'
    tok.chat_template = (
        "{% for m in messages %}\n  {% if m.role == 'user' %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}"
    )
    assert tok.apply_chat_template(hi) == "<b>&'\n"  # trim_blocks and lstrip_blocks, as transformers
    tok.chat_template = "{% generation %}{{ 'marked' }}{% endgeneration %}"  # transformers' tag, rendered as is
    assert tok.apply_chat_template(hi) == "marked"
    tok.chat_template = "{% for %}"
    with pytest.raises(TokenmillError, match="not valid Jinja"):
        tok.apply_chat_template(hi)


# ---------------------------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------------------------


def test_hf_folder(byte_bpe, tmp_path):
    from transformers import AutoTokenizer

    backend = HFTokenizer.from_str(byte_bpe[0].to_str())
    im_start, im_end = backend.token_to_id("<|im_start|>"), backend.token_to_id("<|im_end|>")
    plain = backend.encode("hello world").ids
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", im_start)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": [
            {"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
            {"name": "tool_use", "template": "tools"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (im_start, im_end)
    assert tok.eos_token_ids == {0, 2, im_end}
    # BOS from tokenizer.json's post-processor, as transformers does
    assert (
        tok.encode("hello world") == AutoTokenizer.from_pretrained(tmp_path).encode("hello world") == [im_start, *plain]
    )
    assert tok.encode("hello world", add_special_tokens=False) == plain
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"  # the "default" template

    # Explicit add_bos_token / add_eos_token replace the post-processor (what transformers 4's Llama and
    # Gemma tokenizers did and 5's TokenizersBackend.update_post_processor does; 5.24 ignores the flags
    # for this tokenizer class).
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(config | {"add_bos_token": False, "add_eos_token": True})
    )
    assert load_tokenizer(tmp_path).encode("hello world") == [*plain, im_end]

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "eos_token"}))
    no_eos = load_tokenizer(tmp_path)
    assert (no_eos.eos_token_id, no_eos.eos_token_ids) == (0, {0, 2})  # generation_config.json's first

    (tmp_path / "chat_template.jinja").write_text("jinja file wins")
    assert load_tokenizer(tmp_path).apply_chat_template([]) == "jinja file wins"


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_load_errors_name_the_file_and_field(tmp_path, byte_bpe):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.gguf")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"folder has no tokenizer\.json"):
        load_tokenizer(tmp_path / "folder")

    no_tokenizer = write_gguf(tmp_path / "weights-only.gguf", lambda w: None)
    with pytest.raises(CheckpointError, match=r"weights-only\.gguf has no tokenizer.*tokenizer\.ggml\.model"):
        load_tokenizer(no_tokenizer)

    def vocab(model: str, pre: str | None = None, tokens=("a", "b", "ab")) -> Callable[[gguf.GGUFWriter], None]:
        def fill(w: gguf.GGUFWriter) -> None:
            w.add_tokenizer_model(model)
            if pre:
                w.add_tokenizer_pre(pre)
            w.add_token_list(list(tokens))
            w.add_token_merges(["a b"])
            w.add_eos_token_id(0)

        return fill

    cases = [
        ("unknown-model.gguf", vocab("spm-v9"), r"unknown-model\.gguf.*tokenizer\.ggml\.model 'spm-v9'"),
        ("unknown-pre.gguf", vocab("gpt2", "mystery"), r"unknown-pre\.gguf.*tokenizer\.ggml\.pre = 'mystery'"),
        ("duplicate.gguf", vocab("gpt2", "gpt-2", ("a", "b", "a")), r"duplicate\.gguf.*'a' twice"),
        ("no-merges.gguf", lambda w: (w.add_tokenizer_model("gpt2"), w.add_token_list(["a"])), r"ggml\.merges"),
    ]  # fmt: skip
    for name, fill, message in cases:
        with pytest.raises(CheckpointError, match=message):
            load_tokenizer(write_gguf(tmp_path / name, fill))
    with pytest.raises(UnsupportedModelError, match="'rwkv'"):
        load_tokenizer(write_gguf(tmp_path / "rwkv.gguf", vocab("rwkv")))
    assert load_tokenizer(write_gguf(tmp_path / "ok.gguf", vocab("gpt2", "gpt-2"))).encode("ab") == [2]
