"""The sparse mixture-of-experts block (layers/moe.py) against transformers' own MoE blocks.

The claims, each checked below:
- routing: the experts each token picks and their weights == transformers' Mixtral, Qwen3-MoE
  (renormalized top k) and Qwen2-MoE (not renormalized, plus a shared expert) routers;
- outputs == transformers' blocks at float32 tolerance, with the norm and residual folded in, also
  on a batch built so that some experts get no token, one token, or many;
- quantized experts (each expert's kernel on just its rows) == the dense block holding the
  dequantized weights, within the kernel's tolerance; the C block (kernels.sparse_moe) == the
  PyTorch steps, a row alone == its row in a batch bit for bit;
- checkpoints: every form found for the experts (per expert with HF or Mixtral names, transformers'
  fused 3-D tensors, llama.cpp's stacked GGUF tensors) loads into the same block; a stacked
  quantized GGUF tensor splits per expert into blocks (no dequantizing) that equal its dequantized
  slices, and those experts run quantized.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from tokenmill.checkpoint import GGUFBlocks, GGUFCheckpoint
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import SparseMoE, expert_tensors
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.op import set_backend
from tokenmill.layers.quant import QuantWeight, kernel_available, quantize
from tokenmill.models.loader import fill_parameters, weight_forms

HIDDEN, MOE_INTERMEDIATE, SHARED_INTERMEDIATE, NUM_EXPERTS, TOP_K = 64, 64, 96, 8, 2
KINDS = ("mixtral", "qwen3_moe", "qwen2_moe")

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="the C kernel cannot be built here")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def hf_config(kind: str, **model_fields) -> transformers.PretrainedConfig:
    if kind == "mixtral":
        return transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=MOE_INTERMEDIATE,
                                          num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, **model_fields)
    fields = dict(hidden_size=HIDDEN, moe_intermediate_size=MOE_INTERMEDIATE, num_experts=NUM_EXPERTS,
                  num_experts_per_tok=TOP_K, **model_fields)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(norm_topk_prob=True, **fields)
    return transformers.Qwen2MoeConfig(norm_topk_prob=False, shared_expert_intermediate_size=SHARED_INTERMEDIATE,
                                       **fields)


def hf_block(kind: str, seed: int = 0) -> nn.Module:
    """transformers' MoE block of `kind` with random weights (float32, eval mode)."""
    module = {"mixtral": transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock,
              "qwen3_moe": transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
              "qwen2_moe": transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock}[kind]
    block = module(hf_config(kind))
    randomize(block, seed)
    return block.eval()


def randomize(model: nn.Module, seed: int) -> None:
    """Matrices ~ N(0, 0.2) (router logits spread over a few units), vectors ~ U(0.8, 1.2), as
    tests/tiny_models.py makes them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.2, generator=generator)
            else:
                param.uniform_(0.8, 1.2, generator=generator)


def our_block(kind: str) -> SparseMoE:
    return SparseMoE(HIDDEN, MOE_INTERMEDIATE, NUM_EXPERTS, TOP_K,
                     routing="mixtral" if kind == "mixtral" else "qwen_moe",
                     norm_topk_prob={"mixtral": None, "qwen3_moe": True, "qwen2_moe": False}[kind],
                     shared_expert_intermediate_size=SHARED_INTERMEDIATE if kind == "qwen2_moe" else None)


class Holder(nn.Module):
    """A model around one block, as the loader sees a model (`stacked_params`, `ignored_tensors`)."""

    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    ignored_tensors: list[str] = []

    def __init__(self, mlp: SparseMoE):
        super().__init__()
        self.mlp = mlp


def load(kind: str, named_tensors, quantization: str = "none") -> SparseMoE:
    """Our block filled by the loader from checkpoint tensors named under `mlp.`, each passed
    through `expert_tensors` as a model file does."""
    holder = Holder(our_block(kind))
    pairs = [pair for name, tensor in named_tensors for pair in expert_tensors(name, tensor)]
    fill_parameters(holder, iter(pairs), len(pairs), "test", False, quantization)
    return holder.mlp


def from_hf(kind: str, block: nn.Module) -> SparseMoE:
    """Our block holding a transformers block's weights (its in-memory form: fused 3-D experts)."""
    return load(kind, [(f"mlp.{name}", t) for name, t in block.state_dict().items()])


def run_hf(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x[None])[0]


def counted_batch(moe: SparseMoE, hf: nn.Module) -> tuple[torch.Tensor, list[int]]:
    """Inputs whose routing is fixed by construction: the router reads logit e from input feature e
    (in both blocks), every token puts expert 0 first, and the second choices give expert 1 one
    token, expert 2 three, expert 3 two and experts 4-7 none. Returns (x [6, hidden], tokens per
    expert)."""
    router = torch.zeros(NUM_EXPERTS, HIDDEN)
    router[:, :NUM_EXPERTS] = torch.eye(NUM_EXPERTS)
    moe.gate.weight.data.copy_(router)
    hf.gate.weight.data.copy_(router)
    second = [1, 2, 2, 2, 3, 3]
    x = torch.randn(len(second), HIDDEN)
    x[:, :NUM_EXPERTS] = torch.rand(len(second), NUM_EXPERTS) * 2 - 1   # losing logits in [-1, 1)
    x[:, 0] = 4.0
    x[torch.arange(len(second)), second] = torch.linspace(2.0, 3.0, len(second))
    return x, [6, 1, 3, 2, 0, 0, 0, 0]


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x {scale:.3g}"


# ------------------------------------------------------------------------------------ routing, outputs


@pytest.mark.parametrize("kind", KINDS)
def test_routing_equals_transformers(kind):
    hf = hf_block(kind)
    moe = from_hf(kind, hf)
    x = torch.randn(33, HIDDEN)
    weights, experts = moe.route(x)
    with torch.no_grad():
        _, hf_weights, hf_experts = hf.gate(x)
    assert experts.shape == (33, TOP_K) and len(experts.flatten().unique()) == NUM_EXPERTS
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
    if kind == "qwen2_moe":  # not renormalized: the chosen probabilities sum to less than 1
        assert (weights.sum(-1) < 0.999).all()
    else:
        torch.testing.assert_close(weights.sum(-1), torch.ones(33))
    # Mixtral scales in float32 whatever the activations; Qwen casts the weights to them
    weights_bf16, experts_bf16 = moe.to(torch.bfloat16).route(x.bfloat16())
    assert weights_bf16.dtype == (torch.float32 if kind == "mixtral" else torch.bfloat16)
    assert experts_bf16.dtype == torch.int64


@pytest.mark.parametrize("kind", KINDS)
def test_forward_equals_transformers(kind):
    hf = hf_block(kind)
    moe = from_hf(kind, hf)
    norm = RMSNorm(HIDDEN, 1e-6)
    norm.weight.data.uniform_(0.8, 1.2)
    x, residual = torch.randn(17, HIDDEN) * 3, torch.randn(17, HIDDEN)
    expected = run_hf(hf, x)
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe(x, norm=norm, residual=residual), residual + run_hf(hf, norm(x)),
                               rtol=1e-5, atol=1e-5)
    assert moe(x[:0]).shape == (0, HIDDEN)
    # bfloat16: the same experts, and outputs within bfloat16 rounding of transformers'
    hf.to(torch.bfloat16)
    moe.to(torch.bfloat16)
    xb = x.bfloat16()
    assert torch.equal(moe.route(xb)[1], hf.gate(xb)[2])
    out = moe(xb)
    assert out.dtype == torch.bfloat16
    assert_close_rel(out, run_hf(hf, xb), 2**-8)


@pytest.mark.parametrize("kind", KINDS)
def test_experts_with_no_one_and_many_tokens(kind):
    hf = hf_block(kind)
    moe = from_hf(kind, hf)
    x, counts = counted_batch(moe, hf)
    _, experts = moe.route(x)
    assert torch.bincount(experts.flatten(), minlength=NUM_EXPERTS).tolist() == counts
    torch.testing.assert_close(moe(x), run_hf(hf, x), rtol=1e-5, atol=1e-5)
    # each token alone gives its row of the batch (to the float rounding of a dense matmul's blocking)
    alone = torch.cat([moe(x[i:i + 1]) for i in range(len(x))])
    torch.testing.assert_close(alone, moe(x), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_quantized_experts_equal_dense_dequantized_block(kind, bits):
    """Each expert's projections (and the shared expert's) quantized; transformers' block holds the
    dequantized values; the router stays dense in both."""
    hf = hf_block(kind)
    moe = from_hf(kind, hf)
    x, counts = counted_batch(moe, hf)
    mlps = list(moe.experts) + ([moe.shared_expert] if moe.shared_expert is not None else [])
    quantize_experts(moe, bits)
    with torch.no_grad():
        for e, expert in enumerate(moe.experts):
            hf.experts.gate_up_proj[e] = expert.gate_up_proj.qweight.dequantize()
            hf.experts.down_proj[e] = expert.down_proj.qweight.dequantize()
        if kind == "qwen2_moe":
            shared = moe.shared_expert
            gate, up = shared.gate_up_proj.qweight.dequantize().chunk(2)
            hf.shared_expert.gate_proj.weight.copy_(gate)
            hf.shared_expert.up_proj.weight.copy_(up)
            hf.shared_expert.down_proj.weight.copy_(shared.down_proj.qweight.dequantize())
    assert all(linear.weight is None for mlp in mlps for linear in (mlp.gate_up_proj, mlp.down_proj))
    _, experts = moe.route(x)
    assert torch.bincount(experts.flatten(), minlength=NUM_EXPERTS).tolist() == counts
    assert_close_rel(moe(x), run_hf(hf, x), 1e-3)
    y = torch.randn(11, HIDDEN)  # random routing too
    assert_close_rel(moe(y), run_hf(hf, y), 1e-3)


def quantize_experts(moe: SparseMoE, bits: int) -> None:
    """Every expert's projections (and the shared expert's) quantized; the router stays dense."""
    for mlp in list(moe.experts) + ([moe.shared_expert] if moe.shared_expert is not None else []):
        for linear in (mlp.gate_up_proj, mlp.down_proj):
            linear.set_quantized(QuantWeight(quantize(linear.weight.data, bits), torch.float32))


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_c_block_equals_the_pytorch_steps(kind, bits):
    """With quantized experts the block runs as one C call (kernels.sparse_moe: routing, the experts
    grouped, the weighted sum, the shared expert, the norm and the residual): == forward_native (the
    PyTorch steps with the same quantized kernels per expert) on a batch whose experts get zero, one
    and many tokens and on random routing; each row alone == its row of the batch, bit for bit."""
    hf = hf_block(kind)
    moe = from_hf(kind, hf)
    quantize_experts(moe, bits)
    x, counts = counted_batch(moe, hf)
    norm = RMSNorm(HIDDEN, 1e-6)
    norm.weight.data.uniform_(0.8, 1.2)
    assert moe.plan(norm) is not None and moe.plan(None) is not None
    # 40 rows: some expert gets more than 8 (moe.c then runs each expert's matmuls on every thread;
    # a row alone runs the experts as one-thread tasks): the same bits either way
    for rows in (x, torch.randn(11, HIDDEN), torch.randn(40, HIDDEN)):
        residual = torch.randn_like(rows)
        for args in ((None, None), (norm, residual)):
            got, want = moe(rows, *args), moe.forward_native(rows, *args)
            assert_close_rel(got, want, 1e-5)
            alone = torch.cat([moe(rows[i:i + 1], *(a if a is None or a is norm else a[i:i + 1] for a in args))
                               for i in range(len(rows))])
            assert torch.equal(alone, got)
    _, experts = moe.route(x)
    assert torch.bincount(experts.flatten(), minlength=NUM_EXPERTS).tolist() == counts
    # moe.c runs the experts as one-thread tasks when there are at least as many as threads, else
    # each expert's matmuls on every thread: 16 and 1 threads take the two ways, with the same bits.
    # (Rows no call has seen yet, 16 threads first: scratch memory the allocator hands back must not
    # already hold their results, or a path that skipped work would still look right.)
    z = torch.randn(6, HIDDEN)
    saved = torch.get_num_threads()
    try:
        outputs = []
        for threads in (16, 1):
            torch.set_num_threads(threads)
            outputs.append(moe(z, norm, z))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(outputs[0], outputs[1])
    set_backend(moe, "torch", SparseMoE)   # pinned to its reference: no plan
    assert moe.plan(norm) is None
    assert torch.equal(moe(x, norm), moe.forward_native(x, norm))


@needs_kernel
def test_a_dense_shared_expert_keeps_the_pytorch_steps():
    """The C block needs every expert quantized: with the shared expert left dense, the block has no
    plan and runs its PyTorch steps (the quantized experts still run their kernel)."""
    moe = from_hf("qwen2_moe", hf_block("qwen2_moe"))
    shared = moe.shared_expert
    moe.shared_expert = None
    quantize_experts(moe, 8)
    moe.shared_expert = shared
    assert moe.plan(None) is None
    x = torch.randn(5, HIDDEN)
    assert torch.equal(moe(x), moe.forward_native(x))


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="routing"):
        SparseMoE(HIDDEN, MOE_INTERMEDIATE, NUM_EXPERTS, TOP_K, routing="deepseek")
    with pytest.raises(ValueError, match="norm_topk_prob"):
        SparseMoE(HIDDEN, MOE_INTERMEDIATE, NUM_EXPERTS, TOP_K, routing="mixtral", norm_topk_prob=True)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        SparseMoE(HIDDEN, MOE_INTERMEDIATE, NUM_EXPERTS, TOP_K, routing="qwen_moe")
    with pytest.raises(ValueError, match="top_k"):
        SparseMoE(HIDDEN, MOE_INTERMEDIATE, NUM_EXPERTS, NUM_EXPERTS + 1, routing="mixtral")
    with pytest.raises(ValueError, match="3-D"):
        expert_tensors("mlp.experts.down_proj", torch.zeros(HIDDEN, MOE_INTERMEDIATE))


# ------------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert", "fused"])
@pytest.mark.parametrize("kind", KINDS)
def test_transformers_checkpoint_forms_load(kind, original_format, tmp_path):
    """What transformers 5 `save_pretrained` writes: by default each expert's 2-D matrices under the
    hub's names (Mixtral: block_sparse_moe.experts.{e}.w1/w2/w3); with save_original_format=False its
    in-memory 3-D tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I], Mixtral's
    block named mlp). Both load into the block transformers runs."""
    config = hf_config(kind, vocab_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, seed=1)
    model.save_pretrained(tmp_path, save_original_format=original_format)
    saved = load_file(tmp_path / "model.safetensors")
    layer = "model.layers.0."
    block = "block_sparse_moe." if kind == "mixtral" and original_format else "mlp."
    tensors = {name.removeprefix(layer + block): t for name, t in saved.items() if name.startswith(layer + block)}
    if original_format:
        gate, up, down = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        assert tensors[f"experts.7.{gate}.weight"].shape == tensors[f"experts.7.{up}.weight"].shape \
            == (MOE_INTERMEDIATE, HIDDEN)
        assert tensors[f"experts.7.{down}.weight"].shape == (HIDDEN, MOE_INTERMEDIATE)
    else:
        assert tensors["experts.gate_up_proj"].shape == (NUM_EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN)
        assert tensors["experts.down_proj"].shape == (NUM_EXPERTS, HIDDEN, MOE_INTERMEDIATE)
    moe = load(kind, [(f"mlp.{name}", t) for name, t in tensors.items()])
    hf = model.model.layers[0].mlp
    x = torch.randn(13, HIDDEN)
    torch.testing.assert_close(moe.route(x)[1], hf.gate(x)[2])
    torch.testing.assert_close(moe(x), run_hf(hf, x), rtol=1e-5, atol=1e-5)


def test_expert_tensors_names():
    w = torch.zeros(3, 4)
    assert expert_tensors("model.layers.2.mlp.experts.5.w1.weight", w) == [
        ("model.layers.2.mlp.experts.5.gate_proj.weight", w)]
    assert expert_tensors("mlp.experts.5.w3.weight", w)[0][0] == "mlp.experts.5.up_proj.weight"
    assert expert_tensors("mlp.experts.5.w2.weight", w)[0][0] == "mlp.experts.5.down_proj.weight"
    assert expert_tensors("mlp.experts.5.up_proj.weight", w)[0][0] == "mlp.experts.5.up_proj.weight"
    for name in ("mlp.gate.weight", "mlp.shared_expert.gate_proj.weight", "model.norm.weight"):
        assert expert_tensors(name, w) == [(name, w)]
    fused = torch.arange(2 * 6 * 4.0).view(2, 6, 4)
    pairs = dict(expert_tensors("mlp.experts.gate_up_proj", fused))
    assert list(pairs) == ["mlp.experts.0.gate_proj.weight", "mlp.experts.0.up_proj.weight",
                           "mlp.experts.1.gate_proj.weight", "mlp.experts.1.up_proj.weight"]
    assert torch.equal(pairs["mlp.experts.1.gate_proj.weight"], fused[1, :3])
    assert torch.equal(pairs["mlp.experts.1.up_proj.weight"], fused[1, 3:])
    shared_gate = torch.ones(HIDDEN)  # llama.cpp's ffn_gate_inp_shexp: [hidden]
    assert expert_tensors("mlp.shared_expert_gate.weight", shared_gate)[0][1].shape == (1, HIDDEN)


def write_moe_gguf(path, qtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A GGUF with one layer of Qwen2-MoE experts as llama.cpp stores them: stacked [E, rows, cols]
    expert tensors and shared-expert matrices in `qtype`, the routers F32 (the shared expert's
    [hidden]). Returns the float values written, by GGUF name."""
    rng = np.random.default_rng(seed)
    shapes = {"blk.0.ffn_gate_inp.weight": (NUM_EXPERTS, HIDDEN),
              "blk.0.ffn_gate_exps.weight": (NUM_EXPERTS, MOE_INTERMEDIATE, HIDDEN),
              "blk.0.ffn_up_exps.weight": (NUM_EXPERTS, MOE_INTERMEDIATE, HIDDEN),
              "blk.0.ffn_down_exps.weight": (NUM_EXPERTS, HIDDEN, MOE_INTERMEDIATE),
              "blk.0.ffn_gate_inp_shexp.weight": (HIDDEN,),
              "blk.0.ffn_gate_shexp.weight": (SHARED_INTERMEDIATE, HIDDEN),
              "blk.0.ffn_up_shexp.weight": (SHARED_INTERMEDIATE, HIDDEN),
              "blk.0.ffn_down_shexp.weight": (HIDDEN, SHARED_INTERMEDIATE)}
    values = {name: (rng.standard_normal(shape) * 0.2).astype(np.float32) for name, shape in shapes.items()}
    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    t = gguf.GGMLQuantizationType[qtype]
    for name, v in values.items():
        if "gate_inp" in name:
            writer.add_tensor(name, v)
        elif qtype == "F16":
            writer.add_tensor(name, v.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(v, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


# What a Qwen2-MoE model file maps llama.cpp's names to (the stacked experts keep no `.weight`).
GGUF_NAMES = {"blk.0.ffn_gate_inp.weight": "mlp.gate.weight",
              "blk.0.ffn_gate_exps.weight": "mlp.experts.gate_proj",
              "blk.0.ffn_up_exps.weight": "mlp.experts.up_proj",
              "blk.0.ffn_down_exps.weight": "mlp.experts.down_proj",
              "blk.0.ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
              "blk.0.ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
              "blk.0.ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
              "blk.0.ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}


def gguf_tensors(ckpt: GGUFCheckpoint):
    for name in ckpt.tensor_names():
        stacked = len(ckpt.tensor_shape(name)) == 3
        yield GGUF_NAMES[name], ckpt.load_stacked(name) if stacked else ckpt.load_raw(name)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F16"])
def test_gguf_stacked_experts_split_without_dequantizing(qtype, tmp_path):
    values = write_moe_gguf(tmp_path / "moe.gguf", qtype)
    ckpt = GGUFCheckpoint(tmp_path / "moe.gguf")
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"):
        assert ckpt.tensor_shape(name) == values[name].shape
        experts = ckpt.load_stacked(name)
        dequantized = ckpt.load_tensor(name)  # the whole 3-D tensor, dequantized
        assert len(experts) == NUM_EXPERTS
        for e, w in enumerate(experts):
            if qtype == "F16":
                assert isinstance(w, torch.Tensor) and w.dtype == torch.float32
                assert torch.equal(w, dequantized[e])
            else:
                assert isinstance(w, GGUFBlocks) and w.qtype == qtype and w.data.dtype == torch.uint8
                assert w.shape == values[name].shape[1:]
                assert torch.equal(w.dequantize(), dequantized[e])
        pairs = expert_tensors(GGUF_NAMES[name], experts)
        assert [n for n, _ in pairs] == [GGUF_NAMES[name].replace("experts.", f"experts.{e}.") + ".weight"
                                         for e in range(NUM_EXPERTS)]
    with pytest.raises(Exception, match="not \\[n, rows, columns\\]"):
        ckpt.load_stacked("blk.0.ffn_gate_shexp.weight")


@needs_kernel
@pytest.mark.parametrize(("qtype", "bits"), [("Q8_0", 8), ("Q4_1", 4)])
def test_gguf_experts_load_quantized(qtype, bits, tmp_path):
    """Loaded by the loader in its default mode, each expert holds its own quantized weight (no
    requantizing: the GGUF blocks become the kernel's form exactly); the routers stay F32. The block
    equals the same file loaded dequantized, within the kernel's tolerance."""
    write_moe_gguf(tmp_path / "moe.gguf", qtype)
    ckpt = GGUFCheckpoint(tmp_path / "moe.gguf")
    quantized = load("qwen2_moe", gguf_tensors(ckpt), quantization="auto")
    dense = load("qwen2_moe", gguf_tensors(ckpt), quantization="none")
    assert weight_forms(quantized) == {"dense": 2, f"int{bits}": 2 * NUM_EXPERTS + 2}
    assert weight_forms(dense) == {"dense": 2 * NUM_EXPERTS + 4}
    expert = quantized.experts[5].down_proj
    assert isinstance(expert, Linear) and expert.qweight.out_features == HIDDEN
    dequantized = ckpt.load_tensor("blk.0.ffn_down_exps.weight")[5]
    torch.testing.assert_close(expert.qweight.dequantize(), dequantized, rtol=0, atol=1e-6)
    torch.testing.assert_close(dense.experts[5].down_proj.weight, dequantized, rtol=0, atol=0)
    x = torch.randn(24, HIDDEN)
    _, experts = dense.route(x)
    assert len(experts.unique()) == NUM_EXPERTS
    assert_close_rel(quantized(x), dense(x), 1e-3)
