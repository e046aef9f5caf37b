"""The run's configuration: one node's YAML, OLMo-style, as typed sections (`TrainConfig` and the sections in it).

Each section is a dataclass of `spes.schema` (a file is read with OmegaConf for `${...}` interpolation and
`--section.key=value` overrides, then checked key by key: unknown keys with a "did you mean" hint, wrong types
with the key, the value and the expected type, numbers against their ranges). Cross-field consistency (head sizes,
expert ownership, batch divisibility) is checked in `TrainConfig.__post_init__`, before any work starts.

Every key of the first SPES implementation's configs is accepted. The few that change nothing here
(`INERT_KEYS`) are named together in one warning at start. Where one of its files leaves a key out, the default
is its default (`using_spes: false` first; tests/test_migrating.py checks all of its files), and `${...}` resolves
against the defaults as OLMo's schema does.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from omegaconf import OmegaConf

from spes.schema import (
    ConfigError,
    Range,
    Section,
    checked_overrides,
    from_dict,
    from_file_and_overrides,
    override_to_dotlist,
    read_mapping,
)

RunMode = Literal["centralized", "spes", "diloco"]
"""What a node does: train alone, train its experts under SPES, or train everything for DiLoCo averaging."""

MODE_TITLES: dict[RunMode, str] = {"centralized": "centralized", "spes": "SPES", "diloco": "DiLoCo"}
"""How logs and summaries name each mode, so a baseline's output never reads as a SPES run's."""

CodecName = Literal["fp32", "bf16", "int8", "sparse"]
"""The codecs of `spes.sync.codecs.registry` by name, so an unknown `spes_config.codec` is refused as the config loads
(the registry needs torch; tests/sync/codecs/test_registry.py holds the two lists equal)."""
CODECS: tuple[str, ...] = typing.get_args(CodecName)


def _f(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None, lt: float | None = None) -> Any:
    """A dataclass field with a default, a one-line doc (shown by `--help`) and, for a number, its range."""
    metadata = {"doc": doc, **({"range": Range(ge, gt, lt)} if (ge, gt, lt) != (None, None, None) else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def is_host_port(addr: str) -> bool:
    """`host:port`, `1.2.3.4:50051` or `[::1]:50051`: what gRPC dials without guessing a port."""
    return re.fullmatch(r"\[?[\w.:-]+\]?:\d+", addr) is not None


def _sub(cls: type, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc})


@dataclass(kw_only=True)
class ModelConfig(Section):
    """The OLMoE-style decoder (see `spes.model`)."""

    KEY: ClassVar[str] = "model."

    d_model: int = _f(768, "hidden size", ge=1)
    n_heads: int = _f(12, "attention heads", ge=1)
    n_kv_heads: int | None = _f(None, "key/value heads for grouped-query attention (default: n_heads)", ge=1)
    n_layers: int = _f(12, "decoder blocks", ge=1)
    mlp_hidden_size: int | None = _f(None, "MLP hidden size; each SwiGLU expert is mlp_hidden_size / 2 wide", ge=2)
    mlp_ratio: int = _f(4, "mlp_hidden_size = mlp_ratio * d_model when mlp_hidden_size is not set", ge=1)
    weight_tying: bool = _f(False, "tie input embedding and LM head (must be false: untied, as in OLMoE)")
    alibi: bool = _f(False, "ALiBi positions (not supported: RoPE is used)")
    rope: bool = _f(True, "rotary position embeddings (must be true)")
    rope_theta: float = _f(10000.0, "RoPE base frequency", gt=0)
    flash_attention: bool = _f(False, "inert: attention always uses torch scaled_dot_product_attention")
    attention_dropout: float = _f(0.0, "dropout on attention probabilities", ge=0, lt=1)
    attention_layer_norm: bool = _f(False, "QK-norm: RMSNorm on queries and keys")
    attention_layer_norm_with_affine: bool = _f(True, "learnable scale in the QK-norm")
    attention_layer_norm_over_head: bool = _f(False, "QK-norm per head (Qwen3) instead of over all heads (OLMoE)")
    include_bias: bool = _f(False, "biases in linear layers (must be false)")
    block_type: Literal["moe"] = _f("moe", "decoder block type")
    layer_norm_type: Literal["rms"] = _f("rms", "normalization (RMSNorm)")
    layer_norm_eps: float = _f(1e-5, "RMSNorm epsilon", gt=0)
    layer_norm_with_affine: bool = _f(True, "learnable RMSNorm scale")
    bias_for_layer_norm: bool = _f(False, "bias in norms (must be false)")
    activation_type: Literal["swiglu"] = _f("swiglu", "expert activation")
    residual_dropout: float = _f(0.0, "dropout on residual branches", ge=0, lt=1)
    embedding_dropout: float = _f(0.0, "dropout on embeddings", ge=0, lt=1)
    max_sequence_length: int = _f(
        2048, "training sequence length in tokens (a window of L tokens trains L - 1 predictions)", ge=2
    )
    vocab_size: int = _f(50280, "tokenizer vocabulary size", ge=1)
    embedding_size: int | None = _f(None, "rows of the embedding/LM head (>= vocab_size; padded for speed)")
    eos_token_id: int = _f(0, "end-of-document token id", ge=0)
    pad_token_id: int = _f(1, "padding token id", ge=0)
    init_device: str | None = _f(None, "inert: models are built on the meta device and materialized")
    init_fn: Literal["normal"] = _f("normal", "weight init: truncated normal")
    init_std: float = _f(0.02, "init standard deviation", gt=0)
    init_cutoff_factor: float | None = _f(3.0, "truncate init at +-cutoff * std (null: no truncation)", gt=0)
    using_custom_moe_impl: bool = _f(False, "inert: spes always uses its own MoE")
    moe_log_expert_assignment: bool = _f(False, "log tokens per expert with the training metrics")
    moe_top_k: int = _f(2, "experts per token")
    moe_num_experts: int = _f(8, "experts per MoE layer", ge=1)
    moe_dropless: bool = _f(True, "dropless routing (must be true)")
    moe_mlp_impl: str = _f("sparse", "inert: megablocks MLP kind; see moe_backend")
    moe_backend: Literal["auto", "torch", "grouped_mm", "megablocks"] = _f(
        "auto",
        "expert compute: auto (grouped_mm on CUDA sm80+, else torch), torch (sort + per-expert matmul), grouped_mm, "
        "megablocks (GPU only)",
    )
    moe_zloss_weight: float = _f(0.001, "router z-loss weight", ge=0)
    moe_loss_weight: float = _f(0.01, "load-balancing loss weight", ge=0)
    moe_normalize_expert_weights: float | bool | None = _f(
        None, "renormalize the top-k routing weights (p-norm; true means p=1, weights sum to 1)", gt=0
    )
    clip_qkv: float | None = _f(None, "inert when null (OLMo's q/k/v clamp is not implemented: null only)")
    moe_shared_expert: bool = _f(False, "inert when false (OLMo's always-on shared expert is not implemented)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_hidden_size is None:
            self.mlp_hidden_size = self.mlp_ratio * self.d_model
        if self.embedding_size is None:
            self.embedding_size = self.vocab_size
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _require(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            self.d_model,
            f"must be divisible by model.n_heads={self.n_heads}",
            given=("model.n_heads",),
        )
        _require(
            self.n_heads % self.n_kv_heads == 0,
            "model.n_kv_heads",
            self.n_kv_heads,
            f"must divide model.n_heads={self.n_heads}",
            given=("model.n_heads",),
        )
        _require(
            (self.d_model // self.n_heads) % 2 == 0,
            "model.d_model",
            self.d_model,
            "head size d_model / n_heads must be even for RoPE",
            given=("model.n_heads",),
        )
        _require(
            self.mlp_hidden_size % 2 == 0,
            "model.mlp_hidden_size",
            self.mlp_hidden_size,
            "must be even (each expert is mlp_hidden_size / 2 wide)",
        )
        _require(
            self.embedding_size >= self.vocab_size,
            "model.embedding_size",
            self.embedding_size,
            f"must be >= model.vocab_size={self.vocab_size}",
            given=("model.vocab_size",),
        )
        for key in ("eos_token_id", "pad_token_id"):
            _require(
                getattr(self, key) < self.vocab_size,
                f"model.{key}",
                getattr(self, key),
                f"must be a token id below model.vocab_size={self.vocab_size} (the tokenizer's)",
                given=("model.vocab_size",),
            )
        _require(
            1 <= self.moe_top_k <= self.moe_num_experts,
            "model.moe_top_k",
            self.moe_top_k,
            f"must be in [1, moe_num_experts={self.moe_num_experts}]",
            given=("model.moe_num_experts",),
        )
        self._check_supported()

    def _check_supported(self) -> None:
        """Refuse the reference keys whose features the OLMoE-style model of spes does not have."""
        for key, ok in (
            ("clip_qkv", self.clip_qkv is None),
            ("moe_shared_expert", not self.moe_shared_expert),
            ("weight_tying", not self.weight_tying),
            ("alibi", not self.alibi),
            ("rope", self.rope),
            ("include_bias", not self.include_bias),
            ("bias_for_layer_norm", not self.bias_for_layer_norm),
            ("moe_dropless", self.moe_dropless),
        ):
            _require(
                ok, f"model.{key}", getattr(self, key), "is not supported by the OLMoE-style model of spes (remove it)"
            )

    @property
    def expert_hidden_size(self) -> int:
        """Width F of one SwiGLU expert (the reference config family uses mlp_hidden_size / 2)."""
        assert self.mlp_hidden_size is not None
        return self.mlp_hidden_size // 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def normalize_expert_weights_p(self) -> float | None:
        """The p of the top-k weight renormalization, or None for none."""
        value = self.moe_normalize_expert_weights
        if value is None or value is False:
            return None
        return 1.0 if value is True else float(value)


@dataclass(kw_only=True)
class OptimizerConfig(Section):
    KEY: ClassVar[str] = "optimizer."

    name: Literal["adamw"] = _f("adamw", "optimizer")
    learning_rate: float = _f(4e-4, "peak learning rate", ge=0)
    eps: float = _f(1e-8, "AdamW epsilon", gt=0)
    weight_decay: float = _f(0.1, "decoupled weight decay", ge=0)
    decay_norm_and_bias: bool = _f(False, "apply weight decay to norm weights")
    decay_embeddings: bool = _f(False, "apply weight decay to embeddings")
    betas: list[float] = _f([0.9, 0.95], "AdamW betas")
    metrics_log_interval: int | None = _f(None, "inert: optimizer metrics are logged every log_interval steps")

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optimizer.betas",
            self.betas,
            "must be two numbers in [0, 1)",
        )


@dataclass(kw_only=True)
class SchedulerConfig(Section):
    KEY: ClassVar[str] = "scheduler."

    name: Literal["cosine_with_warmup", "linear_with_warmup", "constant"] = _f(
        "cosine_with_warmup", "learning-rate schedule"
    )
    units: Literal["steps", "tokens"] = _f("steps", "unit of t_warmup and t_max")
    t_warmup: int = _f(100, "linear warm-up length", ge=0)
    t_max: int | None = _f(None, "schedule length (default: the run's max_duration)", ge=1)
    alpha_f: float = _f(0.1, "final learning rate as a fraction of the peak", ge=0)
    warmup_min_lr: float | None = _f(
        None, "learning rate at step 0 of the warm-up (null: 10% of the peak, as OLMo)", ge=0
    )


@dataclass(kw_only=True)
class TokenizerConfig(Section):
    KEY: ClassVar[str] = "tokenizer."

    identifier: str = _f(
        "data/default/tokenizer",
        "tokenizer directory, tokenizer.json or Hugging Face Hub id (local cache first, see spes.hub)",
    )
    truncate_direction: str = _f("right", "inert")


@dataclass(kw_only=True)
class InstanceFilterConfig(Section):
    """OLMo's repetition filter: a window holding a token period repeated too often is left out of the loss."""

    KEY: ClassVar[str] = "data.instance_filter."

    repetition_max_period: int = _f(13, "longest period (in tokens) checked for repeats")
    repetition_min_period: int = _f(1, "shortest period (in tokens) checked for repeats", ge=1)
    repetition_max_count: int = _f(32, "a window with this many consecutive repeats of one period is filtered", ge=2)

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(
            self.repetition_max_period >= self.repetition_min_period,
            "data.instance_filter.repetition_max_period",
            self.repetition_max_period,
            f"must be >= repetition_min_period={self.repetition_min_period}",
            given=("data.instance_filter.repetition_min_period",),
        )


@dataclass(kw_only=True)
class DataConfig(Section):
    KEY: ClassVar[str] = "data."

    paths: list[str] = _f(
        [],
        "token shards: .npy files, globs, directories, http(s) URLs (see url_reads) or a .txt file listing them",
    )
    url_reads: Literal["range", "download"] = _f(
        "range",
        "how shards at http(s) URLs are read: range (OLMo's way: each window a batch needs, by an HTTP range "
        "request) or download (each file once into SPES_DATA_CACHE, then read locally)",
    )
    validation_paths: list[str] = _f([], "held-out shards for in-loop validation loss")
    seed: int | None = _f(
        None,
        "this node's data-order seed (null: the run's `seed`); each node's YAML has its own, e.g. 6198, 7198, ... "
        "as the first implementation's node files",
        ge=0,
    )
    memmap_dtype: str | None = _f(
        None,
        "token dtype (uint16/uint32/uint64): checked against spes shards, read from headerless OLMo files "
        "(default: the shards' own; uint16 for headerless files)",
    )
    num_workers: int = _f(0, "data loader worker processes", ge=0)
    pad_direction: str = _f("right", "inert")
    drop_last: bool = _f(True, "drop the last incomplete global batch of an epoch")
    pin_memory: bool = _f(False, "pin host memory (GPU runs)")
    prefetch_factor: int | None = _f(None, "inert")
    persistent_workers: bool = _f(False, "inert")
    timeout: int = _f(0, "inert")
    instance_filter: InstanceFilterConfig | None = _f(
        None, "leave windows with a long run of a repeated token period out of the loss (null: keep all)"
    )


@dataclass(kw_only=True)
class FSDPConfig(Section):
    KEY: ClassVar[str] = "fsdp."

    wrapping_strategy: Literal["by_block"] | None = _f("by_block", "FSDP2 fully_shard per decoder block")
    precision: Literal["mixed", "pure", "float"] = _f("mixed", "mixed: bf16 compute, fp32 reduce under amp_bf16")
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = _f(
        "FULL_SHARD", "FULL_SHARD reshards after forward; SHARD_GRAD_OP keeps params gathered"
    )


@dataclass(kw_only=True)
class DDPConfig(Section):
    KEY: ClassVar[str] = "ddp."

    grad_sync_mode: str = _f("batch", "inert")
    find_unused_params: bool = _f(False, "DDP find_unused_parameters")


@dataclass(kw_only=True)
class WandbConfig(Section):
    """Setting this section logs to Weights & Biases (`pip install -e '.[wandb]'`; WANDB_MODE=offline works)."""

    KEY: ClassVar[str] = "wandb."

    name: str | None = _f(None, "W&B run name (default: run_name)")
    project: str | None = _f(None, "W&B project (default: spes)")
    group: str | None = _f(None, "W&B group, e.g. the run name shared by all nodes")
    log_interval: int = _f(1, "log every N-th metrics step (evaluations always)", ge=1)
    entity: str | None = _f(None, "W&B team or user (default: yours)")
    tags: list[str] | None = _f(["watching"], "W&B run tags (OLMo's default: [watching])")


@dataclass(kw_only=True)
class TensorBoardConfig(Section):
    """Setting this section writes TensorBoard event files (`pip install -e '.[tensorboard]'`)."""

    KEY: ClassVar[str] = "tensorboard."

    log_dir: str | None = _f(None, "event file directory (default: <save_folder>/tensorboard)")


@dataclass(kw_only=True)
class SpeedMonitorConfig(Section):
    KEY: ClassVar[str] = "speed_monitor."

    window_size: int = _f(20, "steps averaged for tokens/s", ge=1)


@dataclass(kw_only=True)
class SpesConfig(Section):
    """Where this node sits in the SPES run and how it talks to the parameter server."""

    KEY: ClassVar[str] = "spes_config."
    RENAMED: ClassVar[dict[str, str]] = {"wire_dtype": "codec"}

    num_peers: int = _f(4, "nodes in the run", ge=1)
    peer_id: int = _f(0, "this node, in [0, num_peers)")
    num_train_experts_per_node: int = _f(2, "k: peer p owns experts [p*k, (p+1)*k) of every MoE layer", ge=1)
    sync_steps: int = _f(100, "local steps between synchronizations", ge=1)
    server_addr: str = _f("127.0.0.1:50051", "parameter server host:port")
    using_decayed_aux_loss: bool = _f(False, "scale own experts' load-balancing counts 0.7 -> 1.0 over 20% of training")
    decayed_factor_update_steps: int = _f(
        500, "refresh interval of the decayed load-balancing factor (1.0 before it)", ge=1
    )
    quant_non_local_trainable_experts: bool = _f(False, "inert (the first implementation read it and did nothing)")
    codec: CodecName = _f(
        "fp32",
        "how tensors travel (run-wide: the server and every node; spes.sync.codecs): fp32 or bf16 values; int8 = "
        "int8 deltas against the last global model every node holds, with error feedback (~1/4 of fp32's bytes); "
        "sparse = per chunk the top-k of those deltas in a few bits (codec_settings: chunk, topk, bits; ~1/100)",
    )
    codec_settings: dict = _f(
        {}, "the codec's settings (int8: block; sparse: chunk, topk, bits); missing ones take the codec's defaults"
    )
    data_plane: Literal["auto", "grpc", "tcp"] = _f(
        "auto",
        "tensor payloads: auto = the raw-TCP data plane when the server advertises one (--data_port) "
        "and it answers from this node, else gRPC; grpc = always gRPC; tcp = require the data plane",
    )
    token_file: str | None = _f(None, "file holding the run's shared secret (or env SPES_TOKEN)")
    run_id: str | None = _f(
        None,
        "join the run with this id though this node holds no checkpoint of it (a replacement or late node; the id "
        "is in the server's log and `python -m spes.status`); null: a fresh node starts a new run, a resumed one "
        "continues its checkpoint's",
    )
    tls_ca: str | None = _f(None, "CA certificate to verify the server (enables TLS)")
    tls_cert: str | None = _f(None, "client certificate for mutual TLS")
    tls_key: str | None = _f(None, "client key for mutual TLS")
    rpc_timeout_s: float = _f(120.0, "deadline of one RPC", gt=0)
    round_timeout_s: float = _f(3600.0, "longest wait for the other peers to finish a round", gt=0)
    max_retries: int = _f(
        8, "retries of a failed RPC (exponential backoff with jitter; 8 ride out a ~90 s server restart)", ge=0
    )
    eval_after_sync: bool = _f(
        True,
        "also evaluate the merged global model right after a sync (overlap_sync: once a round lands) on eval steps",
    )
    overlap_sync: bool = _f(
        False,
        "train on while a round is in flight: upload a snapshot at the sync step and apply the round's global model "
        "overlap_steps later with the local progress made since (theta <- global + theta_now - theta_snapshot)",
    )
    overlap_steps: int | None = _f(
        None,
        "with overlap_sync: steps from a sync step to the one that applies its round, 0..sync_steps / "
        "overlap_fragments (null: that most)",
    )
    overlap_fragments: int = _f(
        1,
        "with overlap_sync: cut the model into F fragments of whole decoder blocks and synchronize one every "
        "sync_steps / F steps (each still every sync_steps), so a round moves 1/F of the bytes and lands "
        "sync_steps / F steps later (Streaming DiLoCo); the last step syncs everything. Run-wide, divides sync_steps",
    )
    overlap_correction: float = _f(
        1.0,
        "with overlap_sync: share of a landing round's correction applied, theta <- theta_now + c * (global - "
        "theta_snapshot), in (0, 1]; 1 is the rule above, 0.5 damps the late correction (less loss at long delays)",
    )

    @property
    def round_interval(self) -> int:
        """Steps between two rounds: `sync_steps`, or `sync_steps / overlap_fragments` with fragments."""
        return self.sync_steps // self.overlap_fragments

    @property
    def overlap_delay(self) -> int:
        """Steps from a sync step to the one at which its round is applied: `overlap_steps`, else `round_interval`."""
        return self.round_interval if self.overlap_steps is None else self.overlap_steps


@dataclass(kw_only=True)
class ServerSection(Section):
    """The parameter server's run settings (`python -m spes.server RUN.yaml` reads them; a node ignores them).

    The run's layout is not repeated here: peers, experts per block and the mode are the nodes' own
    (`spes_config.num_peers`, `spes_config.num_train_experts_per_node`, `using_spes`/`using_dilico`). The defaults
    below are the only ones: the server, `spes.launch` and the scripts all read them from here.
    """

    KEY: ClassVar[str] = "server."

    merge_interval: int = _f(
        500, "SPES expert-merging warm-up on rounds whose step is a multiple of this (<= 0: never)"
    )
    merge_alpha_start: float = _f(0.01, "merge strength at step 0, decayed linearly to 0 at merge_decay_steps", ge=0)
    merge_decay_steps: int = _f(10000, "step at which the merge strength reaches 0", gt=0)
    merge_topk: int = _f(4, "most similar other experts each expert is pulled towards", ge=1)
    outer_optimizer: Literal["none", "nesterov"] = _f(
        "none",
        "DiLoCo outer step: none = the global model is the mean of the uploads (the paper's baseline); "
        "nesterov = Nesterov SGD on (previous global - mean)",
    )
    outer_lr: float = _f(0.7, "DiLoCo outer learning rate (nesterov)", gt=0)
    outer_momentum: float = _f(0.9, "DiLoCo outer Nesterov momentum", ge=0, lt=1)
    round_timeout_s: float = _f(3600.0, "seconds after a round's first upload after which it has timed out", gt=0)
    dead_peer_policy: Literal["wait", "quorum"] = _f(
        "wait",
        "at the timeout, wait: fail the waiting nodes naming the missing ones; quorum: close the round with "
        "the nodes that arrived (a missing owner's experts keep their last value)",
    )
    min_peers: int | None = _f(None, "fewest nodes a quorum round needs (null: a majority)", ge=1)


@dataclass(kw_only=True)
class TrainConfig(Section):
    """One node's run."""

    run_name: str = _f("spes", "name of the run")
    seed: int = _f(6198, "model init and dropout seed (and the data order's when data.seed is unset)", ge=0)
    dry_run: bool = _f(
        False,
        "build the node (data, model, optimizer, checkpoint), check its run spec and evaluators, and stop before "
        "training (nothing is written, the server is not contacted)",
    )
    no_pre_train_checkpoint: bool = _f(True, "skip the checkpoint at step 0")
    compile: dict | bool | None = _f(
        None,
        "torch.compile each decoder block and fused_loss's head: true, or {mode, fullgraph, dynamic, backend}; "
        "false: eager; null: {dynamic: false} on a CUDA GPU, eager elsewhere",
    )
    fused_loss: bool | None = _f(
        None,
        "compute the LM head and the loss a chunk of tokens at a time, each chunk's gradient with its loss: "
        "the batch's logits never exist whole (most of the activation memory at a large vocabulary); null: true on "
        "a CUDA GPU, false elsewhere",
    )
    softmax_auxiliary_loss: bool = _f(False, "add a z-loss on the output logits")
    auxiliary_loss_multiplier: float = _f(1e-4, "weight of the output-logit z-loss", ge=0)
    using_spes: bool = _f(
        False, "synchronize with a SPES parameter server (false, the first implementation's default: centralized)"
    )
    using_dilico: bool = _f(False, "DiLoCo/FedAvg baseline: train everything, server averages everything")
    load_path: str | None = _f(None, "checkpoint directory to start from")
    reset_optimizer_state: bool = _f(
        False,
        "with load_path: load the weights but a fresh optimizer; unless reset_trainer_state, the learning rate warms "
        "up again from 0 over scheduler.t_warmup steps to the schedule's (OLMo's bolt-on warm-up)",
    )
    reset_trainer_state: bool = _f(
        False, "with load_path: leave out its trainer state (step, tokens, data position, RNG): start at step 0"
    )
    restore_dataloader: bool = _f(
        True, "with load_path: continue its data order where it stopped; false: from the start (and, as OLMo, step 0)"
    )
    try_load_latest_save: bool = _f(
        False,
        "resume from save_folder's latest checkpoint when there is one, else start from load_path (or "
        "fresh): what a requeued job wants (--resume=auto)",
    )
    max_duration: str | int = _f("1000st", "training length: steps ('1000st' or 1000) or tokens ('2e9T')")
    stop_at: int | None = _f(None, "stop at this step even if max_duration is larger", ge=1)
    global_train_batch_size: int = _f(512, "sequences per optimizer step on this node (all ranks)", gt=0)
    device_train_microbatch_size: int = _f(8, "sequences per forward/backward on one rank", gt=0)
    device_eval_batch_size: int = _f(8, "sequences per validation forward", gt=0)
    precision: Literal["fp32", "amp_bf16"] = _f("amp_bf16", "amp_bf16: bf16 autocast with fp32 master weights")
    distributed_strategy: Literal["single", "ddp", "fsdp"] | None = _f(
        "single", "how the node's ranks share work (launched with torchrun)"
    )
    fsdp: FSDPConfig = _sub(FSDPConfig, "FSDP2 settings")
    ddp: DDPConfig = _sub(DDPConfig, "DDP settings")
    activation_checkpointing: Literal["whole_layer", "fine_grained", "one_in_two", "one_in_four"] | bool | None = _f(
        None, "recompute activations: whole_layer, fine_grained (attention + experts), one_in_N layers"
    )
    max_grad_norm: float | None = _f(1.0, "clip the global gradient norm (null: no clipping)", gt=0)
    max_grad_norm_ratio: float | None = _f(
        None, "inert when null (OLMo's adaptive clipping is not implemented: null only)"
    )
    skip_nonfinite_steps: int = _f(
        0,
        "skip the update of up to this many steps in a row whose loss or gradient norm is NaN/inf (0: stop at "
        "the first, naming the step)",
        ge=0,
    )
    eval_interval: int | None = _f(None, "steps between validation-loss evaluations (null: none)", ge=1)
    eval_subset_num_batches: int = _f(-1, "validation batches per evaluation (-1: all)")
    save_folder: str = _f("output/${run_name}", "where checkpoints and metrics go")
    save_overwrite: bool = _f(
        False,
        "a fresh start (not a resume) into a save_folder already holding a run's checkpoints or metrics is refused "
        "unless true; true replaces them",
    )
    save_interval: int | None = _f(1000, "steps between (sharded under FSDP) checkpoints (null: none)", ge=1)
    save_interval_ephemeral: int | None = _f(
        None, "inert when null (OLMo's ephemeral checkpoints are not implemented: null only)"
    )
    save_num_checkpoints_to_keep: int = _f(-1, "keep this many recent checkpoints (-1: all)")
    sharded_checkpointer: str | None = _f(None, "inert: torch.distributed.checkpoint is used")
    save_interval_unsharded: int | None = _f(None, "steps between unsharded (single-file) checkpoints", ge=1)
    save_num_unsharded_checkpoints_to_keep: int = _f(-1, "keep this many unsharded checkpoints (-1: all)")
    log_interval: int = _f(1, "steps between console/JSONL metric lines", ge=1)
    gen1_gc_interval: int | None = _f(
        1,
        "steps between generation-1 garbage collections, Python's automatic collection off while training (as "
        "OLMo: an automatic one pauses a step at a moment of its own on each rank); null: automatic collection",
        ge=1,
    )
    time_limit: float | None = _f(None, "seconds of training after which the node saves and stops (null: none)", gt=0)
    torch_profiling: bool = _f(
        False,
        "profile training steps 7-9 of this process with torch.profiler (as OLMo): a table of operators in the log, "
        "a Chrome trace in save_folder/profiler/ (main rank)",
    )
    model: ModelConfig = _sub(ModelConfig, "the model")
    optimizer: OptimizerConfig = _sub(OptimizerConfig, "the optimizer")
    scheduler: SchedulerConfig = _sub(SchedulerConfig, "the learning-rate schedule")
    tokenizer: TokenizerConfig = _sub(TokenizerConfig, "the tokenizer")
    data: DataConfig = _sub(DataConfig, "training and validation data")
    wandb: WandbConfig | None = _f(None, "Weights & Biases logging (null: off; metrics.jsonl is always written)")
    tensorboard: TensorBoardConfig | None = _f(None, "TensorBoard event files (null: off)")
    speed_monitor: SpeedMonitorConfig = _sub(SpeedMonitorConfig, "throughput logging")
    evaluators: list[dict] = _f(
        [],
        "downstream tasks every eval_interval steps via lm-eval: "
        "[{label: piqa, type: downstream, limit: 200}, ...] (see spes.evaluators)",
    )
    spes_config: SpesConfig = _sub(SpesConfig, "SPES node settings")
    server: ServerSection = _sub(
        ServerSection,
        "the parameter server's run settings (merge warm-up, DiLoCo outer "
        "optimizer, dead peers), read by `python -m spes.server RUN.yaml`",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        # NOTE: the shell leaves --save_folder=~/runs as written: training wrote into a folder named ~ where it ran,
        # while preflight checked the home folder's disk
        self.save_folder = os.path.expanduser(self.save_folder)
        self.load_path = None if self.load_path is None else os.path.expanduser(self.load_path)
        check_mode(self.using_spes, self.using_dilico)
        self._check_supported()
        self._check_batches_and_duration()
        if self.sync_enabled:
            self._check_sync()
        if self.mode == "spes":
            self._check_ownership()

    def _check_supported(self) -> None:
        """Refuse OLMo trainer features that spes does not have when set: ignoring them would train otherwise, or
        keep fewer checkpoints, than the file says."""
        _require(
            self.max_grad_norm_ratio is None,
            "max_grad_norm_ratio",
            self.max_grad_norm_ratio,
            "is not supported (OLMo's adaptive clipping): remove it; max_grad_norm clips the global gradient norm",
        )
        _require(
            self.save_interval_ephemeral is None,
            "save_interval_ephemeral",
            self.save_interval_ephemeral,
            "is not supported (OLMo's ephemeral checkpoints): remove it; save_interval with "
            "save_num_checkpoints_to_keep bounds the checkpoints kept",
        )

    def _check_batches_and_duration(self) -> None:
        """Batch sizes that divide, a duration of at least one step, counts that keep something."""
        _require(
            self.global_train_batch_size % self.device_train_microbatch_size == 0,
            "global_train_batch_size",
            self.global_train_batch_size,
            f"must be divisible by device_train_microbatch_size={self.device_train_microbatch_size}",
            given=("device_train_microbatch_size",),
        )
        for key in (
            "eval_subset_num_batches",
            "save_num_checkpoints_to_keep",
            "save_num_unsharded_checkpoints_to_keep",
        ):
            count = getattr(self, key)
            _require(count == -1 or count >= 1, key, count, "must be -1 (all) or >= 1")
        _require(self.duration_steps >= 1, "max_duration", self.max_duration, "must be at least one step")

    def _check_sync(self) -> None:
        """The node's `spes_config` (peers, server address, the round schedule, overlap) and `server.min_peers`."""
        s = self.spes_config
        _require(
            0 <= s.peer_id < s.num_peers,
            "spes_config.peer_id",
            s.peer_id,
            f"must be in [0, num_peers={s.num_peers})",
            given=("spes_config.num_peers",),
        )
        _require(
            is_host_port(s.server_addr),
            "spes_config.server_addr",
            s.server_addr,
            "must be host:port",
        )
        _require(
            s.overlap_fragments >= 1 and s.sync_steps % s.overlap_fragments == 0,
            "spes_config.overlap_fragments",
            s.overlap_fragments,
            f"must be >= 1 and divide sync_steps={s.sync_steps}: a fragment's round comes every sync_steps / F steps",
            given=("spes_config.sync_steps",),
        )
        _require(
            s.overlap_sync or s.overlap_fragments == 1,
            "spes_config.overlap_fragments",
            s.overlap_fragments,
            "needs spes_config.overlap_sync=true: fragments are for rounds that overlap training",
            given=("spes_config.overlap_sync",),
        )
        _require(
            0 <= s.overlap_delay <= s.round_interval,
            "spes_config.overlap_steps",
            s.overlap_steps,
            f"must be in [0, {s.round_interval}] (sync_steps / overlap_fragments): a round must land before the "
            "next one is uploaded",
            given=("spes_config.sync_steps", "spes_config.overlap_fragments"),
        )
        _require(
            0.0 < s.overlap_correction <= 1.0,
            "spes_config.overlap_correction",
            s.overlap_correction,
            "must be in (0, 1]: the share of each round's correction a node applies (0 would never sync)",
        )
        _require(
            self.server.min_peers is None or self.server.min_peers <= s.num_peers,
            "server.min_peers",
            self.server.min_peers,
            f"must be <= spes_config.num_peers={s.num_peers}",
            given=("spes_config.num_peers",),
        )

    def _check_ownership(self) -> None:
        """SPES: the outer optimizer is off and every expert has an owning peer."""
        m, s = self.model, self.spes_config
        check_outer_optimizer(self.server, self.mode)
        k = s.num_train_experts_per_node
        # NOTE: peer p owns [p*k, min((p+1)*k, E)); every expert needs an owner, while peers past the last
        # block (P*k > E, as in the upcycled 9B run: 8 experts, 8 peers x 2) train only the shared parameters.
        _require(
            s.num_peers * k >= m.moe_num_experts,
            "model.moe_num_experts",
            m.moe_num_experts,
            f"has experts no peer owns: num_peers={s.num_peers} x num_train_experts_per_node={k} "
            f"covers only {s.num_peers * k} (e.g. set num_train_experts_per_node="
            f"{math.ceil(m.moe_num_experts / s.num_peers)})",
            given=("spes_config.num_peers", "spes_config.num_train_experts_per_node"),
        )

    @property
    def mode(self) -> RunMode:
        """The run's mode, derived once from the two booleans users know (`using_spes`, `using_dilico`)."""
        if self.using_dilico:
            return "diloco"
        return "spes" if self.using_spes else "centralized"

    @property
    def sync_enabled(self) -> bool:
        """Whether this node meets a parameter server (SPES or the DiLoCo baseline)."""
        return self.mode != "centralized"

    @property
    def num_peers(self) -> int:
        """Nodes in the run (`spes_config.num_peers`; 1 for a centralized run)."""
        return self.spes_config.num_peers if self.sync_enabled else 1

    @property
    def data_seed(self) -> int:
        """This node's data-order seed: `data.seed`, else `seed` (the first implementation's rule: no per-peer
        offset is added; each node's YAML, or its launcher, gives the node its own)."""
        return self.data.seed if self.data.seed is not None else self.seed

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step of this node consumes (all ranks)."""
        return self.global_train_batch_size * self.model.max_sequence_length

    @property
    def duration_steps(self) -> int:
        """`max_duration` in steps (tokens are converted with the global batch): where the run ends."""
        amount, unit = parse_duration(self.max_duration)
        return amount if unit == "steps" else math.ceil(amount / self.tokens_per_step)

    @property
    def max_steps(self) -> int:
        """Where this launch stops: `duration_steps`, capped by `stop_at`."""
        steps = self.duration_steps
        return min(steps, self.stop_at) if self.stop_at is not None else steps

    def on_device(self, kind: str) -> TrainConfig:
        """This config with the defaults that depend on the device settled: `compile` and `fused_loss` left null
        mean, on a CUDA GPU, per-block compile with static shapes and the chunked head (the fastest variant of the
        1B node measured, with the least memory: bench/results/bench_gpu_head.json), and elsewhere eager with whole
        logits (compiling takes minutes on a CPU; a small vocabulary's logits are cheap)."""
        cuda = kind == "cuda"
        return dataclasses.replace(
            self,
            compile=({"dynamic": False} if cuda else False) if self.compile is None else self.compile,
            fused_loss=cuda if self.fused_loss is None else self.fused_loss,
        )

    def owned_experts(self) -> tuple[int, int] | None:
        """The expert range [lo, hi) this node trains, or None when it trains every expert."""
        if not self.using_spes or self.using_dilico:
            return None
        k, p, e = self.spes_config.num_train_experts_per_node, self.spes_config.peer_id, self.model.moe_num_experts
        return min(p * k, e), min((p + 1) * k, e)

    @property
    def experts_per_block(self) -> int:
        """Experts per ownership block (the YAML's `num_train_experts_per_node`) under SPES; all of them otherwise,
        where the model is stored as one block."""
        owned = self.owned_experts()
        return self.spes_config.num_train_experts_per_node if owned is not None else self.model.moe_num_experts


# Keys that are accepted for compatibility with the first implementation's configs but change nothing.
INERT_KEYS = frozenset(
    {
        "max_grad_norm_ratio",
        "save_interval_ephemeral",
        "sharded_checkpointer",
        "model.flash_attention",
        "model.init_device",
        "model.using_custom_moe_impl",
        "model.moe_mlp_impl",
        "model.clip_qkv",
        "model.moe_shared_expert",
        "spes_config.quant_non_local_trainable_experts",
        "optimizer.metrics_log_interval",
        "tokenizer.truncate_direction",
        "data.pad_direction",
        "data.prefetch_factor",
        "data.persistent_workers",
        "data.timeout",
        "ddp.grad_sync_mode",
    }
)


NODE_SEED_STRIDE = 1000


def node_data_seed(base_seed: int, peer_id: int) -> int:
    """The `data.seed` a launcher gives node `peer_id` when one YAML serves every node: `base + 1000 * peer_id`.

    The first implementation's node files and launch scripts use these seeds (6198, 7198, 8198, 9198); the trainer
    itself reads its `data.seed` as given (`TrainConfig.data_seed`), so a launcher passes it as an override.
    """
    return base_seed + NODE_SEED_STRIDE * peer_id


def run_data_seed(cfg: TrainConfig, node: int) -> int:
    """The `data.seed` of node `node` of the run whose node `spes_config.peer_id` the YAML `cfg` is: that node's own
    `data_seed`, the others' from the base it implies (`data_seed - 1000 * peer_id`): launched from node_1.yaml
    (7198), node 0 reads in the order of 6198 as the run's node 0 does, not of 7198 (node 1's)."""
    own, peer = cfg.data_seed, cfg.spes_config.peer_id
    if node == peer:
        return own
    if own < NODE_SEED_STRIDE * peer:
        raise ConfigError(
            f"config key 'data.seed' = {own} of spes_config.peer_id={peer} implies no seed for node {node} "
            f"(it is not {NODE_SEED_STRIDE} * {peer} + a run's seed): launch from node 0's YAML, or give the node its "
            "data.seed",
            "data.seed",
        )
    return node_data_seed(own - NODE_SEED_STRIDE * peer, node)


def check_mode(using_spes: bool, using_dilico: bool) -> None:
    """Refuse `using_dilico` without `using_spes`: one key asks for a parameter server and the other for none, and
    reading either as the winner would train a baseline other than the one the file names."""
    _require(
        using_spes or not using_dilico,
        "using_dilico",
        using_dilico,
        "asks for the DiLoCo baseline, which meets a parameter server, but using_spes is false (no server): set "
        "using_spes=true for DiLoCo (as configs/diloco_1b does), or using_dilico=false for centralized training",
        given=("using_spes",),
    )


def check_outer_optimizer(server: ServerSection, mode: RunMode) -> None:
    """Refuse an outer optimizer the round would not apply: the outer step is DiLoCo's, a SPES round has none."""
    _require(
        server.outer_optimizer == "none" or mode == "diloco",
        "server.outer_optimizer",
        server.outer_optimizer,
        f"applies to DiLoCo runs only (using_dilico: true) and this run is {mode}: set server.outer_optimizer=none",
        given=("using_dilico", "using_spes"),
    )


def _require(ok: bool, key: str, value: Any, what: str, *, given: tuple[str, ...] = ()) -> None:
    """Refuse `key`'s `value` unless `ok`; `given`: the other keys the check reads (an override of one is blamed)."""
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r} {what}", key, given)


_DURATION = re.compile(r"^\s*([0-9.eE+]+)\s*(st|T|ep)?\s*$")


def parse_duration(value: str | int) -> tuple[int, Literal["steps", "tokens"]]:
    """`1000`/`'1000st'` -> (1000, 'steps'); `'2e9T'` -> (2000000000, 'tokens'). A refusal (another unit, a
    fraction of a step or token) carries its key, so a value from the command line is blamed on the override."""
    if isinstance(value, int):
        return value, "steps"
    match = _DURATION.match(str(value))
    try:
        amount = float(match.group(1)) if match and match.group(2) != "ep" else math.nan
    except ValueError:  # what the pattern lets through but is no number ('1.2.3st')
        amount = math.nan
    _require(math.isfinite(amount), "max_duration", value, "must be steps ('1000st') or tokens ('2e9T')")
    whole = "must be a whole number of steps or tokens ('1000st', '2e9T')"
    _require(amount.is_integer(), "max_duration", value, whole)
    return int(amount), "tokens" if match and match.group(2) == "T" else "steps"


# ---------------------------------------------------------------------------------------------------------------
# Loading: YAML + overrides -> plain dict -> checked dataclasses.


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> tuple[TrainConfig, list[str]]:
    """Load a run config from YAML plus `--section.key=value` overrides.

    Returns the config and the list of inert keys the user set (for one warning at start).
    """
    where = f"{path}" if path is not None else "config"
    raw = read_mapping(TrainConfig, path, overrides, where)
    if "save_folder" not in raw:
        raw["save_folder"] = f"output/{raw.get('run_name', 'spes')}"
    inert = sorted(k for k in _flat_keys(raw) if k in INERT_KEYS)
    return from_file_and_overrides(TrainConfig, raw, where, overrides), inert


SYNC_SECTIONS = ("spes_config", "server", "using_spes", "using_dilico")
"""What a parameter server started without the run's YAML takes from its command line (`load_sync_sections`)."""


def load_sync_sections(overrides: list[str] | tuple[str, ...] = ()) -> tuple[SpesConfig, ServerSection, RunMode]:
    """The `spes_config` and `server:` sections and the mode from `--key=value` overrides alone, for a server started
    without the run's YAML: it knows no model, so only these keys apply (ConfigError naming any other)."""
    dotlist = [override_to_dotlist(o) for o in overrides]
    for item in dotlist:
        if item.split("=", 1)[0].split(".")[0] not in SYNC_SECTIONS:
            raise ConfigError(
                f"command line (--{item}): without the run's YAML only --spes_config.*, --server.*, --using_spes and "
                "--using_dilico apply; give the run's YAML first (python -m spes.server RUN.yaml ...)"
            )
    dotlist = checked_overrides(TrainConfig, dotlist)
    raw = OmegaConf.to_container(OmegaConf.from_dotlist(dotlist))
    assert isinstance(raw, dict)
    spes = from_dict(SpesConfig, raw.get("spes_config", {}), where="command line", prefix="spes_config.")
    server = from_dict(ServerSection, raw.get("server", {}), where="command line", prefix="server.")
    using_spes, using_dilico = raw.get("using_spes", True), raw.get("using_dilico", False)
    check_mode(using_spes, using_dilico)
    mode: RunMode = "diloco" if using_dilico else "spes" if using_spes else "centralized"
    check_outer_optimizer(server, mode)
    return spes, server, mode


def _flat_keys(d: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in d.items():
        keys.append(f"{prefix}{k}")  # NOTE: a YAML key may be a number; from_dict then names it as unknown
        if isinstance(v, dict) and f"{prefix}{k}" not in INERT_KEYS:
            keys.extend(_flat_keys(v, f"{prefix}{k}."))
    return keys


LAUNCH_KEYS = (
    "load_path",
    "try_load_latest_save",
    "save_overwrite",
    "dry_run",
    "spes_config.server_addr",
    "spes_config.run_id",
)
"""Keys that say how a process was started, not what the run is: a resume sets them anew (`spes.launch` gives its
peers the server's new port and the run's id at each resume)."""


def changed_settings(saved: Mapping[str, Any], now: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`key: old -> new` for each setting of `now` (a `to_dict` config) whose value `saved` (a checkpoint's
    config) holds otherwise, sections by dotted key, `LAUNCH_KEYS` left out; a key `saved` lacks (an earlier
    spes) is not a change."""
    changes = []
    for key, value in now.items():
        if key not in saved or f"{prefix}{key}" in LAUNCH_KEYS:
            continue
        if isinstance(value, Mapping) and isinstance(saved[key], Mapping):
            changes += changed_settings(saved[key], value, f"{prefix}{key}.")
        elif saved[key] != value:
            changes.append(f"{prefix}{key}: {saved[key]!r} -> {value!r}")
    return changes


def passed_over(cfg: TrainConfig) -> str | None:
    """The note for a resume of save_folder when load_path names other weights (read only by a fresh start): OLMo
    passes over them without a word. Here, not in `spes.node`, because `spes.train` notes it before torch."""
    if cfg.load_path is None or Path(cfg.load_path).resolve() == Path(cfg.save_folder).resolve():
        return None
    return f"note: resuming save_folder {cfg.save_folder}; load_path {cfg.load_path} is not read"
