"""The dense baseline of benchmarks/gpu_throughput.py: torchtitan's own trainer and Llama-3 model, run by torchrun.

This module is the benchmark's harness, not part of titanloop. It lets `torchtitan.train.main()` (torchtitan 0.3.0's
real entry point: its ConfigManager, `Trainer`, Llama-3 model, FSDP2, compile, AdamW, metrics) train a Llama-style
model of the looped stack's width on a machine with no network and no torchtitan test assets:

    torchrun --standalone --nproc_per_node=1 benchmarks/torchtitan_dense.py      # spec in $TITANLOOP_DENSE_SPEC

What the harness provides, because torchtitan's defaults need files or packages that are not there:
  * `llama3_titanloop_width` (the config function passed to torchtitan as `--module benchmarks.torchtitan_dense
    --config llama3_titanloop_width`): a Trainer.Config built from the JSON spec in $TITANLOOP_DENSE_SPEC (see
    `DenseSpec`). torchtitan suppresses `model_spec` from its command line and its llama3 flavors are fixed
    functions, so the shape travels in the environment.
  * `SyntheticTokenizer`: a tokenizer without files (the dataloader is the only user of a tokenizer here).
  * `SyntheticTextLoader`: an in-memory dataloader of titanloop's `synthetic_text` rows (the stream the titanloop
    runs of the benchmark train on, with the same documents), yielding torchtitan's batch format: input ids and
    per-document positions (torchtitan derives its document mask from positions restarting at 0) and labels.
  * `JsonlMetrics`: torchtitan's MetricsProcessor, unchanged, whose logger also writes every logged step's
    metrics (tps, tflops, mfu(%), memory, torchtitan's FLOPs per token) to a JSONL file.
  * `install_import_stand_ins()`: `import torchtitan.trainer` imports torchdata, tokenizers, HF datasets and
    tensorboard at module level, for code paths this run never takes (HF data loading, HF tokenizer files,
    tensorboard logging). Where one of them is not installed (the offline GPU machine has none of them), a
    stand-in module takes its place whose classes and functions raise ImportError if ever used.
  * `install_torch_compat()`: what torchtitan 0.3.0 uses that torch 2.11 (the GPU machine's) lacks: two names and
    one keyword argument.
  * On a machine without CUDA (the benchmark's --smoke run): titanloop's CPU shim (titanloop.train.cpu_shim) and a
    CPU memory monitor that reports zeros, since torchtitan's asks the device module for CUDA memory statistics.

The loss is torchtitan's plain CrossEntropyLoss, not the ChunkedLossWrapper of its llama3 configs: on torch 2.11
the chunked loss fails in backward (FSDP2's unit [norm, lm_head] frees the final norm's unsharded weight before the
backward that needs it; "The tensor has a non-zero number of elements, but its data is not allocated yet").
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPEC_ENV = "TITANLOOP_DENSE_SPEC"
CONFIG_MODULE = "benchmarks.torchtitan_dense"
CONFIG_FUNCTION = "llama3_titanloop_width"

# module -> names that torchtitan imports from it at module level (see install_import_stand_ins)
STAND_INS: dict[str, tuple[str, ...]] = {
    "torchdata": (),
    "torchdata.stateful_dataloader": ("StatefulDataLoader",),
    "tokenizers": ("AddedToken", "Tokenizer"),
    "datasets": ("Dataset", "IterableDataset", "load_dataset", "interleave_datasets"),
    "datasets.distributed": ("split_dataset_by_node",),
    "torch.utils.tensorboard": ("SummaryWriter",),
}


@dataclass
class DenseSpec:
    """What the dense run trains (the JSON in $TITANLOOP_DENSE_SPEC); defaults: Ouro-1.4B's width."""

    dump_folder: str
    metrics_jsonl: str
    n_layers: int = 30
    dim: int = 2048
    n_heads: int = 16
    ffn_hidden_size: int = 5632
    vocab_size: int = 49152
    rope_theta: float = 10000.0
    seq_len: int = 4096
    local_batch_size: int = 1
    steps: int = 10
    lr: float = 1e-3
    warmup_steps: int = 10
    compile: bool = True
    activation_checkpoint: str = "none"  # none | full | selective (torchtitan's policies)
    # flex: torchtitan's llama3 default (document mask from positions); varlen: needs FA3 on Hopper
    # (flash_attn_interface); sdpa: plain causal SDPA, no document mask (the CPU smoke run: FlexAttention has no
    # backward on CPU)
    attn_backend: str = "flex"
    cuda_graphs: bool = False  # torchtitan's fwd+bwd CUDA graph (its default is on; titanloop has none)
    optimizer_implementation: str = "fused"  # torchtitan's default
    spmd_backend: str = "spmd_types"  # torchtitan's default; partial_dtensor: as titanloop's FSDP2 mesh
    seed: int = 0
    max_doc_len: int = 256  # titanloop's synthetic_text default
    motif_vocab: int = 0

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> "DenseSpec":
        text = os.environ.get(SPEC_ENV)
        if not text:
            raise RuntimeError(f"{SPEC_ENV} is not set: benchmarks/gpu_throughput.py sets it to a DenseSpec JSON")
        return cls(**json.loads(text))


# ----- import stand-ins ----------------------------------------------------------------------------------------
def _unavailable(module: str, name: str):
    def fail(*args, **kwargs):
        raise ImportError(f"{module}.{name} is a stand-in of benchmarks/torchtitan_dense.py: {module} is not installed")

    return type(name, (), {"__init__": fail}) if name[:1].isupper() else fail


def install_import_stand_ins() -> list[str]:
    """A stand-in module for each of STAND_INS that cannot be imported; returns their names."""
    added = []
    for module, names in STAND_INS.items():
        try:
            importlib.import_module(module)
            continue
        except Exception:  # noqa: BLE001 - not installed, or installed but broken with this torch
            pass
        stand_in = types.ModuleType(module)
        stand_in.__doc__ = f"stand-in of benchmarks/torchtitan_dense.py: {module} is not installed"
        for name in names:
            setattr(stand_in, name, _unavailable(module, name))
        sys.modules[module] = stand_in
        parent, _, child = module.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, stand_in)
        added.append(module)
    return added


# ----- the components torchtitan builds from the config ------------------------------------------------------------
def _components():
    """The harness's torchtitan components (defined once torchtitan is importable)."""
    if "_COMPONENTS" in globals():
        return globals()["_COMPONENTS"]
    import numpy as np
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.metrics import BaseLogger, MetricsProcessor
    from torchtitan.components.tokenizer import BaseTokenizer

    from titanloop.data.synthetic_text import EOS_ID, SyntheticTextSource

    class SyntheticTokenizer(BaseTokenizer):
        """A tokenizer of `vocab_size` ids and no files (nothing is encoded: the data are token ids)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 49152

        def __init__(self, config: Config, *, tokenizer_path: str = ""):
            super().__init__()
            self.vocab_size, self.eos_id = config.vocab_size, EOS_ID

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("SyntheticTokenizer has no text: the benchmark's data are token ids")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("SyntheticTokenizer has no text: the benchmark's data are token ids")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class SyntheticTextLoader(BaseDataLoader):
        """titanloop's synthetic_text rows (seed, row index) for this data-parallel rank, in torchtitan's format:
        ({"input": ids, "positions": per-document positions}, labels), each [local_batch_size, seq_len]."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            seed: int = 0
            max_doc_len: int = 256
            motif_vocab: int = 0

        def __init__(self, config: Config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, **_):
            self.source = SyntheticTextSource(
                seq_len, tokenizer.get_vocab_size(), config.seed, config.max_doc_len, config.motif_vocab
            )
            self.seq_len, self.batch, self.dp_rank, self.dp_world = seq_len, local_batch_size, dp_rank, dp_world_size
            self.next_row = 0

        def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
            while True:
                rows = [self.source.row((self.next_row + i) * self.dp_world + self.dp_rank) for i in range(self.batch)]
                self.next_row += self.batch
                tokens = torch.from_numpy(np.stack([r.tokens for r in rows]))
                doc_ids = torch.from_numpy(np.stack([r.doc_ids for r in rows]))[:, :-1]
                yield {"input": tokens[:, :-1], "positions": document_positions(doc_ids)}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {"next_row": self.next_row}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.next_row = state_dict.get("next_row", 0)

    class JsonlLogger(BaseLogger):
        def __init__(self, path: str):
            self.path = Path(path)
            self.path.parent.mkdir(parents=True, exist_ok=True)

        def log(self, metrics: dict[str, Any], step: int) -> None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    class JsonlMetrics(MetricsProcessor):
        """torchtitan's MetricsProcessor; rank 0 also appends each logged step to `jsonl` (with torchtitan's FLOPs
        per token and peak FLOP/s, the two numbers behind its mfu)."""

        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            jsonl: str = ""

        def _build_metric_logger(self, *, config, **kwargs):
            if config.jsonl and torch.distributed.get_rank() == 0:
                return JsonlLogger(config.jsonl)
            return super()._build_metric_logger(config=config, **kwargs)

        def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            extra = {"num_flops_per_token": self.num_flops_per_token, "gpu_peak_flops": self.gpu_peak_flops}
            super().log(step, global_avg_loss, global_max_loss, grad_norm, {**extra, **(extra_metrics or {})})

    globals()["_COMPONENTS"] = types.SimpleNamespace(
        SyntheticTokenizer=SyntheticTokenizer, SyntheticTextLoader=SyntheticTextLoader, JsonlMetrics=JsonlMetrics
    )
    return globals()["_COMPONENTS"]


def document_positions(doc_ids):
    """Positions that restart at 0 at every document of each row ([B, S] doc ids -> [B, S] positions): torchtitan's
    document mask (flex and varlen) starts a document wherever the position is 0."""
    import torch

    idx = torch.arange(doc_ids.shape[1]).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - first


# ----- the config function torchtitan's ConfigManager calls --------------------------------------------------------
def llama3_titanloop_width():
    """torchtitan's Trainer.Config for the DenseSpec in $TITANLOOP_DENSE_SPEC: torchtitan's llama3 model (fused QKV,
    SwiGLU, RMSNorm, RoPE) with n_layers layers of the given width, its chunked cross-entropy loss, AdamW (as its
    llama3 configs), FSDP2 over all ranks with bf16 parameters and fp32 reduction (its defaults), compile per
    block + loss, and the harness's tokenizer, dataloader and metrics."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, parallelize_llama
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    s, c = DenseSpec.from_env(), _components()
    head_dim = s.dim // s.n_heads
    model = Llama3Model.Config(
        dim=s.dim,
        vocab_size=s.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=s.vocab_size, embedding_dim=s.dim),
        norm=RMSNorm.Config(normalized_shape=s.dim),
        lm_head=Linear.Config(in_features=s.dim, out_features=s.vocab_size),
        # torchtitan 0.3.0 builds its llama3 flavors with this (private) helper; there is no public one for a shape
        layers=_build_llama3_layers(
            n_layers=s.n_layers,
            dim=s.dim,
            n_heads=s.n_heads,
            hidden_dim=s.ffn_hidden_size,
            rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=s.seq_len, theta=s.rope_theta),
            attn_backend="flex" if s.attn_backend == "sdpa" else s.attn_backend,
        ),
    )
    if s.attn_backend == "sdpa":
        for layer in model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    spec = ModelSpec(
        name="llama3",
        flavor=f"titanloop-width-{s.n_layers}L",
        model=model,
        parallelize_fn=parallelize_llama,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[s.activation_checkpoint]
    optimizer = default_adamw(lr=s.lr)
    optimizer.implementation = s.optimizer_implementation
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=s.dump_folder,
        dump_folder=s.dump_folder,
        tokenizer=c.SyntheticTokenizer.Config(vocab_size=s.vocab_size),
        dataloader=c.SyntheticTextLoader.Config(seed=s.seed, max_doc_len=s.max_doc_len, motif_vocab=s.motif_vocab),
        loss=CrossEntropyLoss.Config(global_vocab_size=s.vocab_size),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=s.warmup_steps, decay_ratio=0.0),
        training=TrainingConfig(
            local_batch_size=s.local_batch_size,
            seq_len=s.seq_len,
            steps=s.steps,
            max_norm=1.0,
            disable_cuda_graphs=not s.cuda_graphs,
        ),
        metrics=c.JsonlMetrics.Config(log_freq=1, jsonl=s.metrics_jsonl, disable_color_printing=True),
        parallelism=ParallelismConfig(spmd_backend=s.spmd_backend),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=ac,
        compile=CompileConfig(enable=s.compile),
        comm=CommConfig(trace_buf_size=0),
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=s.seed, enable_structured_logging=False),
    )


# ----- the torchrun worker ---------------------------------------------------------------------------------------
def _cpu_memory_monitor():
    """torchtitan's DeviceMemoryMonitor asks the device module for CUDA memory statistics; on CPU: zeros."""
    from torchtitan.components import metrics

    class CpuMemoryMonitor:
        device_name = "cpu"

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor


def install_torch_compat() -> list[str]:
    """Names torchtitan 0.3.0 uses that torch 2.11 (the GPU machine's) lacks, added where missing; returns them.

    * `torch.distributed.fsdp.DataParallelMeshDims`, imported at module level by torchtitan.distributed.fsdp and
      .full_dtensor: it only describes mesh axes to fully_shard under the full_dtensor backend (not used here), so
      a placeholder class.
    * `torch.distributed.set_timeout`, which torchtitan's set_pg_timeouts calls after the first step to shorten
      the collectives' timeout: torch 2.11 has the same operation as `distributed_c10d._set_pg_timeout`.
    * `create_block_mask(..., separate_full_blocks=True)`, which torchtitan's document mask (flex attention) passes
      and torch 2.11's `create_block_mask` does not accept (the first H100 run of the benchmark failed on it).
      torch 2.11 always separates the full blocks (its body calls `_convert_mask_to_block_mask` with
      `separate_full_blocks=True`), so a wrapper that accepts `True` and drops it asks for the same mask; `False`
      (torchtitan's batch-invariant mode) has no equivalent there and raises. Installed before torchtitan is
      imported, since torchtitan binds the function by name at import.
    """
    import inspect

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex

    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclass
        class DataParallelMeshDims:
            shard: Any = None
            replicate: Any = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = c10d._set_pg_timeout
        added.append("torch.distributed.set_timeout")
    if "separate_full_blocks" not in inspect.signature(flex.create_block_mask).parameters:
        flex.create_block_mask = _accept_separate_full_blocks(flex.create_block_mask)
        added.append("create_block_mask(separate_full_blocks=True)")
    return added


def _accept_separate_full_blocks(create_block_mask):
    """`create_block_mask` of a torch that always separates full blocks, taking the newer keyword (see above)."""
    import functools

    @functools.wraps(create_block_mask)
    def wrapper(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise NotImplementedError(
                "create_block_mask(separate_full_blocks=False) needs a newer torch than "
                "this one, whose block masks always separate full blocks; turn off torchtitan's batch-invariant mode"
            )
        return create_block_mask(*args, **kwargs)

    return wrapper


def worker_main() -> None:
    """torchtitan.train.main() with this module as the config module (what torchrun runs)."""
    sys.path.insert(0, str(ROOT))
    install_import_stand_ins()
    install_torch_compat()
    import torch
    import torchtitan.train

    if not torch.cuda.is_available():
        from titanloop.train.cpu_shim import use_cpu_if_no_gpu

        use_cpu_if_no_gpu()
        _cpu_memory_monitor()
    Path(DenseSpec.from_env().dump_folder).mkdir(parents=True, exist_ok=True)
    sys.argv = [sys.argv[0], "--module", CONFIG_MODULE, "--config", CONFIG_FUNCTION, *sys.argv[1:]]
    torchtitan.train.main()


if __name__ == "__main__":
    worker_main()
