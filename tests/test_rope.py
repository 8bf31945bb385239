"""RoPE scaling equals transformers' for every type (linear, dynamic, yarn, longrope, llama3): the
parsed config, the frequencies and attention factor against `ROPE_INIT_FUNCTIONS`, and the cos/sin
tables against transformers' rotary modules run over a whole sequence. Position-dependent types
follow the engine's rule (layers/rotary.py): longrope and dynamic are compared with transformers at
a sequence of `max_positions` tokens. GGUF metadata as llama.cpp's converter writes it parses to the
same scaling as the HF config it came from.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from tokenmill.config import ConfigFields, RopeScaling, rope_scaling_from_gguf, rope_scaling_from_hf
from tokenmill.errors import CheckpointError, UnsupportedModelError
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

HEAD_DIM = 16
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
LONG = [1.0 + 1.5 * i for i in range(HEAD_DIM // 2)]
PHI3_LONGROPE = dict(SHAPE, original_max_position_embeddings=64,  # Phi-3 keeps it at the top level
                     rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})

# name -> (transformers config class, config.json fields, max_positions the engine builds for)
CASES = {
    "linear": ("LlamaConfig", dict(SHAPE, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), 256),
    "llama3": ("LlamaConfig", dict(SHAPE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), 256),
    "yarn": ("LlamaConfig", dict(SHAPE, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}), 256),
    # DeepSeek-style attention factor from mscale / mscale_all_dim, a custom band, no truncation
    "yarn-mscale": ("LlamaConfig", dict(SHAPE, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}), 256),
    "yarn-attention-factor": ("LlamaConfig", dict(SHAPE, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "attention_factor": 0.8}), 256),
    # old style (Qwen2.5 configs): `rope_scaling` with `type`, rope_theta at the top level
    "yarn-old-style": ("Qwen2Config", dict(SHAPE, rope_theta=1e6, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), 256),
    "dynamic-within": ("LlamaConfig", dict(SHAPE, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), 256),
    "dynamic-beyond": ("LlamaConfig", dict(SHAPE, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), 1024),
    "longrope-short": ("Phi3Config", PHI3_LONGROPE, 64),
    "longrope-long": ("Phi3Config", PHI3_LONGROPE, 256),
}


def _hf_config(case: str) -> transformers.PretrainedConfig:
    cls_name, fields, _ = CASES[case]
    return getattr(transformers, cls_name)(**copy.deepcopy(fields))  # it fills in the dicts it is given


def _hf_tables(config: transformers.PretrainedConfig, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin for one sequence of `num_positions` tokens (its position-dependent
    types choose their frequencies from this length)."""
    module = (Phi3RotaryEmbedding if isinstance(config, transformers.Phi3Config) else LlamaRotaryEmbedding)(config)
    x = torch.zeros(1, num_positions, HEAD_DIM)
    cos, sin = module(x, torch.arange(num_positions)[None])
    return cos[0], sin[0]


def _ours(case: str) -> tuple[RotaryEmbedding, float, RopeScaling | None]:
    _, fields, max_positions = CASES[case]
    theta, scaling = rope_scaling_from_hf(ConfigFields(fields, "config.json"))
    return RotaryEmbedding(HEAD_DIM, max_positions, theta, scaling), theta, scaling


@pytest.mark.parametrize("case", CASES)
def test_config_json_as_transformers_writes_it_parses_the_same(case):
    """The hub file's form and transformers 5's `rope_parameters` rewrite of it give one scaling."""
    _, fields, _ = CASES[case]
    assert rope_scaling_from_hf(ConfigFields(_hf_config(case).to_dict(), "saved")) == \
        rope_scaling_from_hf(ConfigFields(fields, "hub"))


@pytest.mark.parametrize("case", CASES)
def test_inv_freq_and_attention_factor_equal_transformers(case):
    rope, theta, scaling = _ours(case)
    assert scaling is not None and scaling.rope_type == case.split("-")[0]
    # transformers' seq_len: the engine's context for the position-dependent types, its default otherwise
    seq_len = rope.max_positions if case.startswith(("dynamic", "longrope")) else None
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling.rope_type](_hf_config(case), "cpu", seq_len=seq_len)
    torch.testing.assert_close(rope_inv_freq(HEAD_DIM, theta, scaling, rope.max_positions), inv_freq)
    torch.testing.assert_close(rope.inv_freq, inv_freq)
    assert scaling.attention_scaling == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_tables_and_rotation_equal_transformers(case):
    rope, _, scaling = _ours(case)
    n = rope.max_positions
    cos, sin = _hf_tables(_hf_config(case), n)
    half = HEAD_DIM // 2
    # transformers' module computes the dynamic base from a tensor length, in float32, where its init
    # function (which rope_inv_freq equals exactly, above) uses float64: frequencies one float32
    # rounding apart, angles up to ~1e3 rad, so cos/sin ~1e-4 apart at the last positions
    tolerance = {"atol": 1e-4, "rtol": 0} if case == "dynamic-beyond" else {}
    torch.testing.assert_close(rope.cos, cos, **tolerance)
    torch.testing.assert_close(rope.sin, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), **tolerance)
    if scaling.attention_scaling != 1.0:  # the factor is in the tables, not left at 1
        assert rope.cos[0, 0].item() == pytest.approx(scaling.attention_scaling)

    q = torch.randn(n, 4, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(n)
    ours = apply_rotary(q, *rope(positions))
    theirs, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(ours, theirs[0].transpose(0, 1), **({"atol": 1e-3, "rtol": 0} if tolerance else {}))


def test_longrope_switches_factors_past_the_original_length():
    """The same Phi-3 config: short factors for a 64-token model, long ones for 256 (both cases above
    match transformers; here they also differ from each other, so neither is the other by accident)."""
    short, _, _ = _ours("longrope-short")
    long, _, _ = _ours("longrope-long")
    assert short.cos.shape == (64, HEAD_DIM) and long.cos.shape == (256, HEAD_DIM)
    assert not torch.allclose(short.inv_freq, long.inv_freq)
    assert not torch.allclose(short.cos, long.cos[:64])


def test_dynamic_within_the_original_length_is_plain_rope():
    rope, theta, _ = _ours("dynamic-within")
    plain = RotaryEmbedding(HEAD_DIM, rope.max_positions, theta, None)
    assert torch.equal(rope.cos, plain.cos) and torch.equal(rope.sin, plain.sin)
    beyond, _, _ = _ours("dynamic-beyond")
    assert not torch.allclose(beyond.cos[:256], plain.cos)


def test_top_level_original_length_wins_as_in_transformers():
    fields = dict(SHAPE, original_max_position_embeddings=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})
    _, scaling = rope_scaling_from_hf(ConfigFields(fields, "config.json"))
    assert scaling.original_max_position_embeddings == 32
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**copy.deepcopy(fields)), "cpu")
    torch.testing.assert_close(rope_inv_freq(HEAD_DIM, 10000.0, scaling), inv_freq)
    # nowhere given: max_position_embeddings (transformers' default)
    del fields["original_max_position_embeddings"], fields["rope_parameters"]["original_max_position_embeddings"]
    assert rope_scaling_from_hf(ConfigFields(fields, "c"))[1].original_max_position_embeddings == 256


def test_default_rope_has_no_scaling():
    assert rope_scaling_from_hf(ConfigFields(dict(SHAPE, rope_theta=5e5), "c")) == (5e5, None)
    assert rope_scaling_from_hf(ConfigFields(dict(SHAPE, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}), "c")) == (1e6, None)


@pytest.mark.parametrize("rope_parameters, error, message", [
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, UnsupportedModelError, r"rope_type 'ntk-by-parts' is not supported"),
    ({"type": "magic", "factor": 2.0}, UnsupportedModelError, r"\(rope_scaling\): type 'magic' is not supported"),
    ({"rope_type": "linear"}, CheckpointError, r"required key 'factor' is missing"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, CheckpointError, r"'factor' is missing"),
    ({"rope_type": "linear", "factor": -2.0}, CheckpointError, r"factor must be a positive number, got -2.0"),
    ({"rope_type": "linear", "factor": "big"}, CheckpointError, r"'factor' must be float"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 64}, CheckpointError, r"high_freq_factor must be greater than low_freq"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, CheckpointError, r"'low_freq_factor' is miss"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, CheckpointError, r"truncate must be true or false"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}, CheckpointError, r"attention_factor must be"),
    ({"rope_type": "longrope", "short_factor": SHORT}, CheckpointError, r"required key 'long_factor' is missing"),
    ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": "x"}, CheckpointError, r"'long_factor' must be"),
    ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG[:3]}, CheckpointError,
     r"long_factor must be as long as short_factor"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, UnsupportedModelError,
     r"partial_rotary_factor 0.5 is not supported"),
])
def test_bad_rope_config_names_the_key(rope_parameters, error, message):
    key = "rope_scaling" if "type" in rope_parameters else "rope_parameters"
    with pytest.raises(error, match=message) as info:
        rope_scaling_from_hf(ConfigFields(dict(SHAPE, **{key: rope_parameters}), "model/config.json"))
    assert str(info.value).startswith("model/config.json")


def test_scaling_values_are_checked_where_built():
    with pytest.raises(CheckpointError, match=r"rope scaling \(linear\): attention_factor .* only for yarn or long"):
        RopeScaling("linear", 2.0, attention_factor=2.0)
    with pytest.raises(CheckpointError, match=r"original_max_position_embeddings must be a positive integer"):
        RopeScaling("yarn", 2.0)
    with pytest.raises(UnsupportedModelError, match=r"rope_type 'xpos' is not supported"):
        RopeScaling("xpos", 2.0)


def test_longrope_factors_must_fit_the_rotary_dimension():
    fields = dict(PHI3_LONGROPE, rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3})
    theta, scaling = rope_scaling_from_hf(ConfigFields(fields, "c"))
    with pytest.raises(CheckpointError, match=r"short_factor has 3 values, the rotary dimension 16 needs 8"):
        RotaryEmbedding(HEAD_DIM, 64, theta, scaling)


# ---- GGUF -----------------------------------------------------------------------------------------

def _gguf(**metadata) -> ConfigFields:
    return ConfigFields({"llama." + k: v for k, v in metadata.items()}, "model.gguf", "llama.")


def _converted(case: str) -> ConfigFields:
    """The rope metadata llama.cpp's converter (TextModel.set_gguf_parameters) writes for a case."""
    _, fields, _ = CASES[case]
    params = dict(fields.get("rope_parameters") or fields.get("rope_scaling"))
    metadata = {"context_length": fields["max_position_embeddings"],
                "rope.freq_base": params.get("rope_theta", fields.get("rope_theta")),
                "rope.scaling.type": params.get("rope_type", params.get("type")),
                "rope.scaling.factor": params["factor"]}
    if metadata["rope.scaling.type"] == "yarn":
        metadata["rope.scaling.original_context_length"] = params["original_max_position_embeddings"]
        for hf_key, gguf_key in (("attention_factor", "yarn_attn_factor"), ("beta_fast", "yarn_beta_fast"),
                                 ("beta_slow", "yarn_beta_slow")):
            if hf_key in params:
                metadata["rope.scaling." + gguf_key] = params[hf_key]
    return _gguf(**metadata)


@pytest.mark.parametrize("case", ["linear", "yarn", "yarn-attention-factor", "yarn-old-style"])
def test_gguf_metadata_parses_as_its_hf_config(case):
    _, fields, _ = CASES[case]
    assert rope_scaling_from_gguf(_converted(case)) == rope_scaling_from_hf(ConfigFields(fields, "config.json"))


def test_gguf_linear_as_llama_cpp_reads_it():
    linear = RopeScaling("linear", 4.0)
    assert rope_scaling_from_gguf(_gguf(**{"rope.freq_base": 1e4, "rope.scaling.factor": 4.0})) == (1e4, linear)
    assert rope_scaling_from_gguf(_gguf(**{"rope.scale_linear": 4.0}))[1] == linear  # the older key
    assert rope_scaling_from_gguf(_gguf(**{"rope.scaling.type": "none", "rope.scaling.factor": 4.0}))[1] is None
    assert rope_scaling_from_gguf(_gguf(**{"rope.scaling.type": "linear", "rope.scaling.factor": 0.0}))[1] is None
    assert rope_scaling_from_gguf(_gguf()) == (10000.0, None)


def test_gguf_yarn_attention_factors():
    yarn = {"context_length": 256, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 64}
    plain = rope_scaling_from_gguf(_gguf(**yarn))[1]
    assert plain.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    # rope.scaling.attn_factor multiplies yarn's own, as in llama.cpp
    scaled = rope_scaling_from_gguf(_gguf(**yarn, **{"rope.scaling.attn_factor": 0.5}))[1]
    assert scaled.attention_scaling == pytest.approx(0.5 * plain.attention_scaling)
    # yarn_log_multiplier is mscale_all_dim with mscale 1 (llama.cpp), i.e. transformers' ratio
    logged = rope_scaling_from_gguf(_gguf(**yarn, **{"rope.scaling.yarn_log_multiplier": 0.5}))[1]
    assert logged.attention_scaling == pytest.approx((0.1 * math.log(4.0) + 1) / (0.05 * math.log(4.0) + 1))
    # the original length defaults to the context length, as llama.cpp's n_ctx_orig_yarn
    del yarn["rope.scaling.original_context_length"]
    assert rope_scaling_from_gguf(_gguf(**yarn))[1].original_max_position_embeddings == 256


@pytest.mark.parametrize("metadata, message", [
    ({"rope.scaling.type": "su"}, r"'llama.rope.scaling.type' 'su' is not supported"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": "x"}, r"'llama.rope.scaling.factor' must be float"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "context_length": 256,
      "rope.scaling.yarn_ext_factor": 0.5}, r"llama.rope.scaling.yarn_ext_factor 0.5 is not supported"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "rope.scaling.attn_factor": 0.5},
     r"llama.rope.scaling.attn_factor 0.5 is supported with yarn or longrope scaling only"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "context_length": 256,
      "rope.scaling.yarn_beta_fast": -1.0}, r"model.gguf: rope scaling \(yarn\): beta_fast must be a positive"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, r"required key 'llama.context_length' is missing"),
])
def test_bad_gguf_rope_metadata_names_the_key(metadata, message):
    with pytest.raises(CheckpointError, match=message):
        rope_scaling_from_gguf(_gguf(**metadata))


@pytest.mark.parametrize("case", ["longrope-short", "longrope-long"])
def test_gguf_longrope_factors_come_as_tensors(case):
    """Phi-3 as llama.cpp converts it: longrope type, lengths and the attention factor as metadata, the
    factors as rope_factors_long / rope_factors_short tensors handed to the rotary embedding."""
    _, _, max_positions = CASES[case]
    metadata = _gguf(**{"context_length": 256, "rope.freq_base": 10000.0, "rope.scaling.type": "longrope",
                        "rope.scaling.original_context_length": 64,
                        "rope.scaling.attn_factor": math.sqrt(1 + math.log(256 / 64) / math.log(64))})
    theta, scaling = rope_scaling_from_gguf(metadata)
    rope = RotaryEmbedding(HEAD_DIM, max_positions, theta, scaling)
    for name, factors in (("rope_factors_short.weight", SHORT), ("rope_factors_long.weight", LONG)):
        with pytest.raises(CheckpointError, match=r"must pass both .* to set_longrope_factors"):
            rope(torch.arange(4))
        rope.set_longrope_factors(name, torch.tensor(factors))
    cos, sin = _hf_tables(_hf_config(case), max_positions)
    torch.testing.assert_close(rope.cos, cos)
    torch.testing.assert_close(rope.sin[:, HEAD_DIM // 2:], sin[:, HEAD_DIM // 2:])


def test_longrope_factors_need_longrope_scaling():
    rope = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None)
    with pytest.raises(CheckpointError, match=r"rope_factors_long.weight needs longrope rope scaling \(this mod"):
        rope.set_longrope_factors("rope_factors_long.weight", torch.tensor(LONG))
    with pytest.raises(CheckpointError, match=r"'rope_freqs.weight' is not a longrope factor tensor"):
        rope.set_longrope_factors("rope_freqs.weight", torch.tensor(LONG))
