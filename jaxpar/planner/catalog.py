"""Models, accelerators and published training configurations the planner knows.

Sizes are from the models' papers and cards; accelerator figures are dense BF16 peak
FLOP/s, HBM bytes, and per-GPU one-direction bandwidth inside a node (NVLink) and
between nodes (the NIC: 400 Gb/s InfiniBand = 50 GB/s on H100). They are the round
numbers the lecture uses, for a rough model, not a benchmark.
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
    """A model's sizes, in reference.ModelConfig's names (d_ff: the dense MLP's width)."""
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab: int
    params: float                 # total parameters
    mlp: str = "swiglu"
    dropout: bool = False         # GPT-3 trained with dropout; Llama does not
    experts: int = 0              # routed experts per MoE layer (0: dense)
    top_k: int = 0
    expert_d_ff: int = 0          # one routed expert's MLP width
    moe_layers: int = 0
    shared_experts: int = 0

    @property
    def expert_params(self) -> float:
        """Parameters of the routed experts (split by ep)."""
        return float(self.moe_layers * self.experts * 3 * self.d_model * self.expert_d_ff)

    @property
    def dense_params(self) -> float:
        return self.params - self.expert_params

    @property
    def active_params(self) -> float:
        """Parameters one token goes through (dense, plus top_k experts per MoE layer)."""
        if not self.experts:
            return self.params
        return self.dense_params + self.moe_layers * self.top_k * 3 * self.d_model * self.expert_d_ff


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accelerator:
    name: str
    memory: float          # bytes of HBM
    flops: float           # dense BF16 peak FLOP/s
    intra: float           # bytes/s per GPU, one direction, inside a node
    inter: float           # bytes/s per GPU, one direction, between nodes
    per_node: int = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Published:
    """A real training's parallel configuration, with where it is published."""
    model: str
    gpu: str
    gpus: int
    seq_len: int
    tokens: float           # global batch, tokens
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    source: str = ""


MODELS = {m.name: m for m in (
    Model(name="gpt3-175b", n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, d_ff=49152, vocab=50257,
          params=175e9, mlp="gelu", dropout=True),
    # Narayanan et al. 2021's largest GPT (table 1): 160 heads of 160, vocab 51,200
    Model(name="megatron-1t", n_layers=128, d_model=25600, n_heads=160, n_kv_heads=160, d_ff=102400, vocab=51200,
          params=1008e9, mlp="gelu", dropout=True),
    Model(name="llama3-8b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab=128256,
          params=8.03e9),
    Model(name="llama3-70b", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab=128256,
          params=70.6e9),
    Model(name="llama3-405b", n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248, vocab=128256,
          params=405.8e9),
    Model(name="deepseek-v3", n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128, d_ff=18432, vocab=129280,
          params=671e9, experts=256, top_k=8, expert_d_ff=2048, moe_layers=58, shared_experts=1),
    Model(name="mixtral-8x7b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab=32000,
          params=46.7e9, experts=8, top_k=2, expert_d_ff=14336, moe_layers=32),
)}

ACCELERATORS = {g.name: g for g in (
    Accelerator(name="a100", memory=80e9, flops=312e12, intra=300e9, inter=25e9),
    Accelerator(name="h100", memory=80e9, flops=989e12, intra=450e9, inter=50e9),
    Accelerator(name="h800", memory=80e9, flops=989e12, intra=200e9, inter=50e9),
    Accelerator(name="h200", memory=141e9, flops=989e12, intra=450e9, inter=50e9),
    Accelerator(name="b200", memory=192e9, flops=2250e12, intra=900e9, inter=100e9),
    Accelerator(name="tpu-v5p", memory=95e9, flops=459e12, intra=100e9, inter=100e9, per_node=4),
)}

PUBLISHED = (
    Published(model="llama3-405b", gpu="h100", gpus=16384, seq_len=8192, tokens=16 * 2**20, tp=8, pp=16, dp=128,
              source="Llama 3 paper (Dubey et al. 2024), table 4"),
    Published(model="llama3-405b", gpu="h100", gpus=8192, seq_len=8192, tokens=16 * 2**20, tp=8, pp=16, dp=64,
              source="Llama 3 paper, table 4"),
    Published(model="llama3-405b", gpu="h100", gpus=16384, seq_len=131072, tokens=16 * 2**20, tp=8, pp=16, dp=8, cp=16,
              source="Llama 3 paper, table 4 (long-context stage)"),
    Published(model="gpt3-175b", gpu="a100", gpus=1536, seq_len=2048, tokens=1536 * 2048, tp=8, pp=16, dp=12,
              source="Narayanan et al. 2021, table 1"),
    Published(model="megatron-1t", gpu="a100", gpus=3072, seq_len=2048, tokens=3072 * 2048, tp=8, pp=64, dp=6,
              source="Narayanan et al. 2021, table 1 (the largest model: dp down to 6, lecture 7.2)"),
    Published(model="deepseek-v3", gpu="h800", gpus=2048, seq_len=4096, tokens=15360 * 4096, tp=1, pp=16, dp=128, ep=64,
              source="DeepSeek-V3 technical report (2024), section 3.2"),
)


def model(name: str) -> Model:
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def accelerator(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]
