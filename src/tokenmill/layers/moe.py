"""The sparse mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router (`gate`, a Linear to one logit per expert) picks `top_k` experts for each token; each expert
is a GatedMLP, and a token's output is the routing-weighted sum of its experts' outputs, plus (as
Qwen2-MoE has) a shared expert that every token passes through, scaled by sigmoid(shared_expert_gate).

One step's tokens are routed at once, with no loop over tokens: the (token, slot) pairs are sorted by
expert, so each expert that received tokens runs once on its gathered rows (a quantized expert runs
its kernel on just those rows), and the weighted rows are added into their tokens' outputs:

    experts [T, k]  --flatten, stable sort-->  pairs grouped by expert: e0 e0 e0 | e2 | e5 e5 ...
    expert e: y = experts[e](x[tokens of its pairs]) * weights of its pairs;  out.index_add_(tokens, y)

On a CPU with every expert quantized (backend auto), the whole block runs as one C call instead
(kernels.sparse_moe, from the plan this block builds: the same steps, routing included, with no
Python between experts), in the layer loop and in the decode stack alike, so both give the same
bits; the PyTorch steps above are its reference (`forward_native`).

Checkpoints come with experts in several forms (`expert_tensors` turns each into per-expert 2-D
tensors under this module's names, which the loader's `stacked_params` route into `gate_up_proj`):

    per expert, HF names          experts.{e}.gate_proj.weight / up_proj / down_proj (Qwen-MoE, and
                                  what transformers 5 `save_pretrained` writes by default)
    per expert, Mixtral names     experts.{e}.w1.weight (gate) / w3 (up) / w2 (down)
    fused, transformers 5         experts.gate_up_proj [E, 2I, H] ([gate | up] rows), experts.down_proj
                                  [E, H, I] (`save_pretrained(save_original_format=False)`)
    stacked, llama.cpp GGUF       ffn_gate_exps / ffn_up_exps / ffn_down_exps [E, rows, cols], which a
                                  model file names experts.gate_proj / up_proj / down_proj, read with
                                  `GGUFCheckpoint.load_stacked` so that each expert stays quantized
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.checkpoint import GGUFBlocks, split_rows
from tokenmill.layers.linear import Linear
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.op import KernelOp, backend_generation

ROUTINGS = ("mixtral", "qwen_moe")

Weight = torch.Tensor | GGUFBlocks


class SparseMoE(KernelOp):
    """residual + moe(norm(x)) for x [T, hidden].

    `routing` names the model's router:
      "mixtral"   softmax over the k largest logits; the weights stay float32, as Mixtral scales
                  the expert outputs in float32
      "qwen_moe"  softmax over all experts in float32, the k largest probabilities, divided by their
                  sum when `norm_topk_prob` (the config field of that name: Qwen3-MoE checkpoints set
                  it, Qwen1.5/2-MoE do not); the weights are cast to the activations' dtype
    Both pick the top k of the float32 softmax, as transformers does: Mixtral's softmax over the
    chosen logits is the renormalized softmax over all of them, and ranking the same values breaks
    ties the same way.

    `shared_expert_intermediate_size` adds Qwen2-MoE's shared expert: `shared_expert` (a GatedMLP)
    scaled by sigmoid(`shared_expert_gate`(x)), a Linear(hidden, 1).
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 routing: str, norm_topk_prob: bool | None = None,
                 shared_expert_intermediate_size: int | None = None, activation: str = "silu"):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r} is not one of {ROUTINGS}")
        if (routing == "qwen_moe") != (norm_topk_prob is not None):
            raise ValueError("norm_topk_prob is required by routing 'qwen_moe' and taken by it alone "
                             "(Mixtral always renormalizes)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} is not in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.routing = routing
        self.renormalize = routing == "mixtral" or bool(norm_topk_prob)
        self.gate = Linear(hidden_size, num_experts, keep_dense=True)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, moe_intermediate_size, activation)
                                     for _ in range(num_experts))
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_expert_intermediate_size is not None:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, activation)
            self.shared_expert_gate = Linear(hidden_size, 1, keep_dense=True)
        # by id(norm): (the norm, its plan), rebuilt when a backend or a weight changes
        self._plans: dict[int, tuple[RMSNorm | None, tuple[kernels.MoEPlan, list[object]] | None]] = {}
        self._plans_generation = -1

    def plan(self, norm: RMSNorm | None) -> tuple[kernels.MoEPlan, list[object]] | None:
        """This block as kernels.h's tm_moe_plan with `norm` as its input norm (and what it points
        into), or None where the C code does not run it: backend torch, an expert or the shared expert
        not quantized (or under tensor parallelism: kernel_weight), biases, a norm pinned to its
        reference. Built once per norm, until a backend or a weight changes (op.invalidate_plans)."""
        if self._plans_generation != backend_generation():
            self._plans, self._plans_generation = {}, backend_generation()
        entry = self._plans.get(id(norm))
        if entry is None or entry[0] is not norm:
            entry = self._plans[id(norm)] = (norm, self._build_plan(norm))
        return entry[1]

    def _build_plan(self, norm: RMSNorm | None) -> tuple[kernels.MoEPlan, list[object]] | None:
        mlps = [*self.experts, *([] if self.shared_expert is None else [self.shared_expert])]
        weights = [(m.gate_up_proj.kernel_weight(), m.down_proj.kernel_weight()) for m in mlps]
        linears = [lin for m in mlps for lin in (m.gate_up_proj, m.down_proj)] + [self.gate]
        if self.shared_expert_gate is not None:
            linears.append(self.shared_expert_gate)
        if (self.backend != "auto" or self.gate.tp.size > 1 or any(w is None for pair in weights for w in pair)
                or any(lin.bias is not None for lin in linears) or (norm is not None and norm.backend != "auto")
                or self.gate.weight.device.type != "cpu"):
            return None
        arrays = [(kernels.WeightPlan * len(weights))(*(w.plan() for w, _ in weights)),
                  (kernels.WeightPlan * len(weights))(*(w.plan() for _, w in weights))]
        gate_up, down = (ctypes.addressof(a) for a in arrays)
        tensors = [self.gate.weight.float().contiguous()]
        if norm is not None:
            tensors.append(norm.weight.float().contiguous())
        shared = {}
        if self.shared_expert is not None:   # the shared expert is the arrays' last entry
            tensors.append(self.shared_expert_gate.weight.float().reshape(-1).contiguous())
            size = ctypes.sizeof(kernels.WeightPlan)
            shared = dict(shared_gate_up=gate_up + self.num_experts * size, shared_down=down + self.num_experts * size,
                          shared_gate=tensors[-1].data_ptr())
        plan = kernels.MoEPlan(gate_up=gate_up, down=down, router=tensors[0].data_ptr(),
                               norm=None if norm is None else tensors[1].data_ptr(),
                               norm_eps=0.0 if norm is None else norm.eps, num_experts=self.num_experts,
                               top_k=self.top_k, renormalize=int(self.renormalize),
                               activation=kernels.gate_code(self.experts[0].activation), **shared)
        return plan, [*arrays, *tensors, *(w for pair in weights for w in pair)]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choices for x [T, hidden] (already normalized): (weights [T, k], experts
        [T, k] int64), each row's experts in decreasing order of weight."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routing == "qwen_moe":
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + moe(norm(x)); x [T, hidden]: the C block where it applies (float32 rows and a
        plan), else forward_native."""
        plan = self.plan(norm) if x.dtype == torch.float32 else None
        if plan is None:
            return self.forward_native(x, norm, residual)
        assert x.dim() == 2 and x.shape[1] == self.gate.weight.shape[1], x.shape
        assert residual is None or residual.shape == x.shape, (residual.shape, x.shape)
        return kernels.sparse_moe(plan[0], x, residual)

    def forward_native(self, x: torch.Tensor, norm: RMSNorm | None = None,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """The PyTorch reference. The norm runs once here (not fused into the projections): the
        router, every expert and the shared expert all read its output."""
        h = x if norm is None else norm(x)
        out = self._routed(h, *self.route(h))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out if residual is None else residual + out

    def _routed(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over each token's k slots of weight * expert(h[token]), one expert call per expert
        that received tokens. Experts are added in increasing order, as transformers adds them."""
        k = experts.shape[1]
        pairs = experts.reshape(-1)
        order = torch.argsort(pairs, stable=True)         # (token, slot) pairs grouped by expert
        tokens = order // k
        pair_weights = weights.reshape(-1)[order, None]
        counts = torch.bincount(pairs, minlength=self.num_experts).tolist()
        out = torch.zeros_like(h)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = tokens[start:start + count]
                y = expert(h[rows]) * pair_weights[start:start + count]
                out.index_add_(0, rows, y.to(out.dtype))
                start += count
        return out


# ---------------------------------------------------------------------------------------- checkpoints

# Checkpoint projection names -> the GatedMLP's names (which `stacked_params` fuse into gate_up_proj).
_PROJECTIONS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PER_EXPERT = re.compile(r"(?P<prefix>.*\.)?experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight")
_STACKED = re.compile(r"(?P<prefix>.*\.)?experts\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?")


def expert_tensors(name: str, tensor: Weight | Sequence[Weight]) -> list[tuple[str, Weight]]:
    """One checkpoint tensor of a SparseMoE as (name, 2-D weight) pairs under SparseMoE's names.

    `name` is the tensor's full name with the MoE module's own name already in place (a Mixtral hub
    checkpoint's `block_sparse_moe.` is the model file's to rename). Recognized, under `{prefix}`:
      `{prefix}experts.{e}.{gate_proj|up_proj|down_proj|w1|w3|w2}.weight`   one expert's matrix
      `{prefix}experts.{gate_up_proj|gate_proj|up_proj|down_proj}[.weight]` all experts stacked: a
          3-D tensor [E, rows, cols], or the list of its E matrices (`GGUFCheckpoint.load_stacked`,
          quantized ones as their blocks); gate_up_proj holds [gate | up] rows
      `{prefix}shared_expert_gate.weight` as a 1-D [hidden] tensor (llama.cpp's
          ffn_gate_inp_shexp may be stored so): made [1, hidden]
    Any other tensor comes back unchanged, so a model file can pass every tensor through this.
    """
    if m := _PER_EXPERT.fullmatch(name):
        proj = _PROJECTIONS.get(m["proj"])
        if proj is None:
            return [(name, tensor)]   # not an expert projection: the loader reports it as unused
        return [(f"{m['prefix'] or ''}experts.{m['e']}.{proj}.weight", tensor)]
    if m := _STACKED.fullmatch(name):
        prefix, proj = m["prefix"] or "", m["proj"]
        if isinstance(tensor, torch.Tensor) and tensor.dim() != 3:
            raise ValueError(f"{name}: stacked experts need a 3-D tensor [experts, rows, cols], "
                             f"got shape {tuple(tensor.shape)}")
        matrices = list(tensor.unbind(0) if isinstance(tensor, torch.Tensor) else tensor)
        pairs = []
        for e, w in enumerate(matrices):
            if proj == "gate_up_proj":
                gate, up = split_rows(w, [w.shape[0] // 2] * 2)
                pairs += [(f"{prefix}experts.{e}.gate_proj.weight", gate), (f"{prefix}experts.{e}.up_proj.weight", up)]
            else:
                pairs.append((f"{prefix}experts.{e}.{proj}.weight", w))
        return pairs
    if (name == "shared_expert_gate.weight" or name.endswith(".shared_expert_gate.weight")) \
            and isinstance(tensor, torch.Tensor) and tensor.dim() == 1:
        return [(name, tensor[None])]
    return [(name, tensor)]

