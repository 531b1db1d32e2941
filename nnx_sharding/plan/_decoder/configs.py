"""The decoder's configs: `DecoderConfig` (sizes, choices and the training batch), the
published models' `DECODER_CONFIGS`, and the logical axis rules that shard them."""

from __future__ import annotations

import dataclasses

import jax

from ... import _errors
from ..._moe import check_options
from .attention import ATTENTION
from .context_parallel import CONTEXT_STRATEGIES
from .remat import CUSTOM, REMAT_POLICIES, custom_places

ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu}
"""The MLP's activation functions by name (SwiGLU is ``silu`` with ``gated=True``)."""
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only transformer's sizes and choices, and its training batch.

    Every field can be overridden: ``dataclasses.replace(DECODER_CONFIGS['llama3-8b'],
    layers=4, seq_len=2048)``.

    >>> DECODER_CONFIGS['llama2-7b'].param_count()
    6738415616
    """

    name: str
    vocab: int
    d_model: int
    heads: int
    head_dim: int
    mlp: int
    layers: int
    batch: int = 8
    seq_len: int = 2048
    kv_heads: int | None = None
    """Key and value heads (grouped-query attention); None: as many as ``heads``."""
    gated: bool = True
    """A gated MLP, ``act(x W_gate) * (x W_up) W_down`` (three matrices), else
    ``act(x W_up) W_down``."""
    activation: str = "silu"
    """The MLP's activation, one of `ACTIVATIONS`."""
    tied: bool = False
    """The output head is the embedding matrix, transposed."""
    parallel_block: bool = False
    """Attention and MLP side by side off one norm (``x + attn(n(x)) + mlp(n(x))``)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    param_dtype: str = "float32"
    """The parameters' dtype, and so the optimizer state's."""
    compute_dtype: str = "bfloat16"
    """The matmuls' and the activations' dtype (norms and softmax run in float32)."""
    scan: bool = True
    """Stack the layers' weights and run them with ``nnx.scan``: compilers then build
    one layer, not ``layers`` of them."""
    remat: str = "none"
    """The block's rematerialization policy, a name in `REMAT_POLICIES` or a
    ``'custom:NAME=WHERE,...'`` placement of the named activations (`remat_policy`)."""
    attention: str = "auto"
    """The attention kernel, one of `ATTENTION` (``auto``: the target's, see
    `attention_kernel`)."""
    pipeline_microbatches: int | None = None
    """Under a mesh with a ``stage`` axis, the microbatches `nnx_sharding.pipeline` runs
    the (scanned) layers in; None: as many as the stages, the fewest it takes."""
    pipeline_repeats: int = 1
    """Under a mesh with a ``stage`` axis, the rounds each microbatch makes through the
    stages (1: GPipe; more: the circular schedule)."""
    context_strategy: str = "all_gather"
    """Under a mesh with a ``context`` axis (the sequence split over it), how attention
    sees the whole sequence: one of `CONTEXT_STRATEGIES` (`context_attention`)."""
    vocab_tiles: int = 1
    """The loss's logits computed this many tiles of tokens at a time, each tile's
    rematerialized in the backward pass (MaxText's ``num_vocab_tiling``): the step holds
    one tile's logits instead of the whole batch's, for the head's matmul once more. It
    divides ``seq_len``."""
    experts: int = 0
    """Experts of each layer's mixture-of-experts MLP (`nnx_sharding.moe`); 0: a dense MLP.
    The router's load-balancing loss is not added to the step's loss: what it costs is
    a reduction of the router's probabilities (MaxText's default weight for it is 0)."""
    experts_per_token: int = 2
    """The experts each token goes to (top-k), with ``experts``."""
    expert_mlp: int | None = None
    """Each expert's hidden width; None: ``mlp``."""
    shared_experts: int = 0
    """Shared experts (every token goes through them), as one SwiGLU ``shared_experts ·
    expert_mlp`` wide."""
    capacity_factor: float | None = None
    """The dropping path's capacity factor (`nnx_sharding.MoE`); None: dropless."""

    def __post_init__(self) -> None:
        for field in ("vocab", "d_model", "heads", "head_dim", "mlp", "layers", "batch",
                      "seq_len"):  # fmt: skip
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(_errors.decoder_bad_size(field, value))
        if (
            not isinstance(self.vocab_tiles, int)
            or self.vocab_tiles < 1
            or (self.seq_len % self.vocab_tiles)
        ):
            raise ValueError(_errors.decoder_vocab_tiles(self.vocab_tiles, self.seq_len))
        for field in ("pipeline_microbatches", "pipeline_repeats", "expert_mlp"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(_errors.decoder_bad_size(field, value))
        if self.kv_heads is not None:
            if not isinstance(self.kv_heads, int) or self.kv_heads < 1:
                raise ValueError(_errors.decoder_bad_size("kv_heads", self.kv_heads))
            if self.heads % self.kv_heads:
                raise ValueError(_errors.decoder_bad_kv_heads(self.kv_heads, self.heads))
        self._check_experts()
        choices = {
            "activation": list(ACTIVATIONS),
            "param_dtype": DTYPES,
            "compute_dtype": DTYPES,
            "remat": list(REMAT_POLICIES),
            "attention": ATTENTION,
            "context_strategy": CONTEXT_STRATEGIES,
        }
        if isinstance(self.remat, str) and self.remat.startswith(CUSTOM):
            custom_places(self.remat)  # checked here, the choices below are the names
            choices.pop("remat")
        for field, allowed in choices.items():
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(_errors.decoder_bad_choice("DecoderConfig", field, value, allowed))

    def _check_experts(self) -> None:
        for field in ("experts", "shared_experts"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(_errors.decoder_bad_size(field, value))
        if not self.experts:
            return
        check_options(
            self.experts, self.experts_per_token, self.capacity_factor, seq=self.seq_len,
            owner=("DecoderConfig", "experts_per_token"),
        )  # fmt: skip

    @property
    def moe_mlp(self) -> int:
        """Each expert's hidden width: ``expert_mlp``, else ``mlp``."""
        return self.mlp if self.expert_mlp is None else self.expert_mlp

    @property
    def kv(self) -> int:
        """Key and value heads: ``kv_heads``, else ``heads``."""
        return self.heads if self.kv_heads is None else self.kv_heads

    def param_count(self, *, active: bool = False) -> int:
        """Parameters, counted from the sizes: embedding (and head unless tied), per
        layer q, k, v, o, the MLP's 2 or 3 matrices (with experts: the router, every
        expert's 3 and the shared experts') and 1 or 2 norm scales, the final norm.
        ``active``: those a token uses (the router, its ``experts_per_token`` experts
        and the shared ones, not the other experts).

        >>> c = DECODER_CONFIGS['mixtral-8x7b']
        >>> round(c.param_count() / 1e9, 2), round(c.param_count(active=True) / 1e9, 2)
        (46.7, 12.88)
        """
        d = self.d_model
        attention = 2 * d * self.heads * self.head_dim + 2 * d * self.kv * self.head_dim
        if self.experts:
            used = self.experts_per_token if active else self.experts
            mlp = d * self.experts + 3 * d * self.moe_mlp * (used + self.shared_experts)
        else:
            mlp = (3 if self.gated else 2) * d * self.mlp
        block = attention + mlp + (1 if self.parallel_block else 2) * d
        return (1 if self.tied else 2) * self.vocab * d + self.layers * block + d

    def model_flops(self) -> float:
        """The training FLOPs of one step, all devices together, as MaxText counts
        them: ``6·N·tokens`` (N every parameter, embeddings included; with experts the
        active ones, `param_count`: the router and the top-k experts' matmuls, as
        MaxText counts an MoE step, capacity ignored) plus causal
        attention, ``6·heads·layers·head_dim·seq²·batch`` (the ``12·…`` of
        ``QKᵀ`` and ``PV``, forward and backward, halved for the mask). Per device:
        this divided by the device count.

        >>> c = DECODER_CONFIGS['tiny']
        >>> c.model_flops() == 6 * c.param_count() * 8 * 64 + 6 * 4 * 2 * 32 * 64**2 * 8
        True
        """
        tokens = self.batch * self.seq_len
        attention = 6 * self.heads * self.layers * self.head_dim * self.seq_len**2 * self.batch
        return float(6 * self.param_count(active=True) * tokens + attention)


_LLAMA3 = {"vocab": 128256, "kv_heads": 8, "rope_theta": 500000.0, "seq_len": 8192}
_LEGACY = {"gated": False, "activation": "gelu", "norm_eps": 1e-6, "scan": False}
_MIXTRAL = {"experts_per_token": 2, "rope_theta": 1e6, "seq_len": 4096}
_QWEN3_MOE = {"experts": 128, "experts_per_token": 8, "rope_theta": 1e6, "norm_eps": 1e-6,
              "seq_len": 4096}  # fmt: skip

DECODER_CONFIGS: dict[str, DecoderConfig] = {
    c.name: c
    for c in (
        DecoderConfig("tiny", 512, 128, 4, 32, 512, 2, batch=8, seq_len=64, **_LEGACY),
        DecoderConfig("1b", 32000, 2048, 16, 128, 8192, 18, batch=8, seq_len=512, **_LEGACY),
        DecoderConfig(
            "1b-wide", 32000, 4096, 32, 128, 16384, 4, batch=8, seq_len=512, **_LEGACY
        ),  # fmt: skip
        DecoderConfig("llama2-7b", 32000, 4096, 32, 128, 11008, 32, seq_len=4096),
        DecoderConfig(
            "llama3-8b", d_model=4096, heads=32, head_dim=128, mlp=14336, layers=32, **_LLAMA3
        ),  # fmt: skip
        DecoderConfig(
            "llama3-70b", d_model=8192, heads=64, head_dim=128, mlp=28672, layers=80, **_LLAMA3
        ),  # fmt: skip
        DecoderConfig(
            "llama3-405b", d_model=16384, heads=128, head_dim=128, mlp=53248, layers=126, **_LLAMA3
        ),  # fmt: skip
        DecoderConfig(
            "maxtext-32b",
            32768,
            10240,
            32,
            256,
            32768,
            32,
            activation="relu",
            gated=False,
            tied=True,
            parallel_block=True,
        ),  # fmt: skip
        DecoderConfig(
            "mixtral-8x7b",
            32000,
            4096,
            32,
            128,
            14336,
            32,
            kv_heads=8,
            experts=8,
            **_MIXTRAL,
        ),  # fmt: skip
        DecoderConfig(
            "mixtral-8x22b",
            32768,
            6144,
            48,
            128,
            16384,
            56,
            kv_heads=8,
            experts=8,
            **_MIXTRAL,
        ),  # fmt: skip
        DecoderConfig(
            "qwen3-30b-a3b", 151936, 2048, 32, 128, 768, 48, kv_heads=4, **_QWEN3_MOE
        ),  # fmt: skip
        DecoderConfig(
            "qwen3-235b-a22b", 151936, 4096, 64, 128, 1536, 94, kv_heads=4, **_QWEN3_MOE
        ),  # fmt: skip
    )
}
"""The named configs. Published models, with their published dimensions: ``llama2-7b``
(6.74B parameters), ``llama3-8b`` (8.03B), ``llama3-70b`` (70.6B), ``llama3-405b``
(405.9B); ``maxtext-32b``, MaxText's synthetic 32B of its v5p runs (32.55B: width 10240,
32 heads of 256, a two-matrix ReLU MLP of 32768, attention and MLP in parallel, tied
embeddings of 32768). Mixtures of experts (every layer's MLP, top-k routed SwiGLU
experts; `DecoderConfig.param_count` counts them all, ``active=True`` those a token
uses): ``mixtral-8x7b`` (46.70B, 12.88B active: 8 experts of 14336, top 2),
``mixtral-8x22b`` (140.6B, 39.2B active; MaxText's vocabulary of 32768),
``qwen3-30b-a3b`` (30.5B, 3.35B active: 128 experts of 768, top 8) and
``qwen3-235b-a22b`` (235.1B, 22.2B active: 128 of 1536, top 8); dropless unless
``capacity_factor`` is set, Qwen3's query and key norms left out. For sizing
(``python -m nnx_sharding aot``'s, unrolled, a GELU two-matrix MLP): ``tiny`` (docs,
tests), ``1b`` (1.04B, 18 layers of width 2048) and ``1b-wide`` (1.07B, 4 layers of
width 4096: compiles several times faster)."""

LOGICAL_AXES = {
    "layers": "stage",
    "experts": "expert",
    "batch": "data",
    "embed": "data",
    "heads": "model",
    "mlp": "model",
    "vocab": "model",
}
"""Logical axis -> mesh axis for ``python -m nnx_sharding aot``: FSDP shards the
``embed`` dimension of every matrix over ``data`` (and the batch with it), tensor
parallelism splits heads, MLP units and the vocabulary over ``model``; the stacked layers
go over ``stage`` and a Mixture-of-Experts layer's experts over ``expert`` where the mesh
has them."""

DECODER_RULES: tuple[tuple[str, str | None], ...] = (
    ("layers", "stage"),
    ("experts", "expert"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
    ("expert_mlp", "model"),
    ("embed", None),
)
"""The parameters' logical axes for `plan`'s ``rules``: tensor parallelism splits query
heads, key/value heads (named ``kv_heads`` under grouped-query attention, ``heads``
without it), MLP units and the vocabulary over ``model``; pipeline parallelism splits
the stacked layers over ``stage``; expert parallelism splits a Mixture-of-Experts layer's
stacked experts (``experts``) over ``expert``, tensor parallelism each expert's MLP units
(``expert_mlp``) over ``model``; FSDP picks each Variable's largest dimension itself."""
