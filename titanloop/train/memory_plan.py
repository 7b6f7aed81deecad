"""Per-GPU memory plan of a training config at its world size, measured on fake tensors.

One rank of the run is simulated on the fake process group of the dry run (titanloop.train.dry_run): the
model is built on the meta device and parallelized exactly as the trainer does (engine.parallelize), then
turned into FakeTensors (no memory), and one optimizer step of the trainer's own code runs on it under
torch's FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker): forward T loops + the per-loop objective
and engine.backward for two micro-batches (loop.accumulate_gradients, the trainer's own code; so the
gradient-accumulation state is included), then engine.step (clip + optimizer); after a first step of one
micro-batch, so the peak includes the optimizer state. The tracker records every tensor's storage by category
(sharded and unsharded parameters, gradients, optimizer state, activations, temporaries, collective buffers) and
the peak over the step. Nothing here is a formula of the model's shape.

Limits: fake tensors on this machine run the CPU kernels' shapes. Attention is planned as causal attention with
a fused kernel (flash on GPU, SDPA's flash kernel on CPU: O(S) saved state) or, with `attention="math"`, as the
unfused math kernel (the [S, S] scores are materialized); document masking (varlen on GPU) is planned as
causal attention, whose memory is the same. CUDA-allocator fragmentation and the NCCL/CUDA context (~1-3 GB on
an H100) are not in the tensors; `fits` keeps `reserve_gb` (default 4 GB) free for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from titanloop.config_errors import require
from titanloop.model.attention import rope_cos_sin
from titanloop.model.config import LoopLMConfig
from titanloop.model.looplm import DecoderLayer
from titanloop.parallel.activation_checkpoint import live_loops
from titanloop.data.loader import micro_batches_per_rank
from titanloop.parallel.comm_count import count_collective_bytes
from titanloop.train.config import TrainConfig
from titanloop.train.engines import FSDP2Engine, build_lr_schedulers, build_optimizer, init_weights, parallelize
from titanloop.train.loop import accumulate_gradients, max_norm
from titanloop.train.startup import TrainState, build_model, param_dtype

GB = 1e9
DEFAULT_GPU_MEM_GB = 80.0  # the H100 80 GB the stage configs are sized for, where no CUDA device says otherwise
# tracker category -> the plan's row
_ROWS = {
    "Sharded Param": "parameters (sharded)",
    "Unsharded Param": "parameters (gathered)",
    "Sharded Grad": "gradients (sharded)",
    "Unsharded Grad": "gradients (gathered)",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries (backward, CE chunks)",
    "All Gather": "all-gather buffers",
    "Reduce Scatter": "reduce-scatter buffers",
    "Buffer": "buffers",
    "Inputs": "inputs",
}


@dataclass
class MemoryPlan:
    world_size: int
    n_loops: int
    backward_loops: int  # loops with a graph: n_loops, or the last loop_sampler.backprop_loops under truncation
    rows: dict[str, int]  # bytes per row at the peak of the step
    peak: int  # bytes
    gpu_mem_gb: float
    reserve_gb: float
    attention: str
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak / GB + self.reserve_gb <= self.gpu_mem_gb

    @property
    def verdict(self) -> str:
        need = self.peak / GB + self.reserve_gb
        return (
            f"peak {self.peak / GB:.1f} GB + {self.reserve_gb:.0f} GB reserve = {need:.1f} GB "
            f"{'fits' if self.fits else 'does NOT fit'} in {self.gpu_mem_gb:.0f} GB per GPU"
        )

    def text(self) -> str:
        lines = [
            f"memory plan per GPU (rank 0 of {self.world_size}, T={self.n_loops}"
            + (f" (backward through the last {self.backward_loops})" if self.backward_loops < self.n_loops else "")
            + f", {self.attention} attention; measured on fake tensors):"
        ]
        for name, value in self.rows.items():
            if value:
                lines.append(f"  {name:36s} {value / GB:8.2f} GB")
        act = self.rows.get("activations", 0)
        lines.append(f"  {'activations per loop (average)':36s} {act / self.backward_loops / GB:8.2f} GB")
        lines.append(f"  {'peak':36s} {self.peak / GB:8.2f} GB")
        lines.extend(f"  note: {n}" for n in self.notes)
        lines.append(f"  {self.verdict}")
        return "\n".join(lines)


def local_gpu() -> tuple[str, float] | None:
    """(name, total memory in GB) of this machine's first CUDA device; None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / GB


def gpu_memory_gb(requested: float | None = None) -> tuple[float, str]:
    """The memory per GPU a plan is judged against, and where it came from: `requested` (--gpu-mem-gb) when given,
    else this machine's CUDA device (its total memory), else DEFAULT_GPU_MEM_GB."""
    if requested is not None:
        return requested, "--gpu-mem-gb"
    gpu = local_gpu()
    if gpu is not None:
        return gpu[1], f"{gpu[0]}, this machine's GPU"
    return DEFAULT_GPU_MEM_GB, "no GPU here: the default, an H100's 80 GB; --gpu-mem-gb sets another"


def _fake_run(cfg: TrainConfig, mesh, engine):
    """The slice of startup.Run that loop.accumulate_gradients reads."""

    return types.SimpleNamespace(cfg=cfg, mesh=mesh, engine=engine, state=TrainState(step=1), jsrr_generator=None)


@contextlib.contextmanager
def _untracked_sharding_propagation(tracker):
    """Leave out of `tracker` the tensors DTensor makes to propagate tensor metadata (ShardingPropagator's fake
    arguments). The tracker means to skip them (it compares the active fake mode with the one at its entry), but
    the plan runs under a fake mode of its own, so they looked like real allocations: every first call of an op
    on new shapes, and on torch 2.11 every in-place foreach op of the optimizer. The 1.4B plan's peak was its
    optimizer step at 6x the parameters' bytes of optimizer memory (the real step has 3x: two moments and one
    temporary): 45.9 GB planned vs 30.1 GB measured on an H100. Without the private hook (another torch) nothing
    is patched."""
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    inner = getattr(propagator, "_propagate_tensor_meta_non_cached", None)
    if inner is None:
        yield
        return
    track = tracker._track

    def untracked(*args, **kwargs):
        tracker._track = lambda reftype, t: None
        try:
            return inner(*args, **kwargs)
        finally:
            tracker._track = track

    propagator._propagate_tensor_meta_non_cached = untracked
    try:
        yield
    finally:
        del propagator._propagate_tensor_meta_non_cached  # the class's method again


def _peak_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """torch's FSDPMemTracker keeping only the peak of the whole rank, which is all a plan reads.

    The stock tracker updates the peak of every module that is running after every op: it walks all the
    modules it has seen (hundreds at the 1.4B shape) and dereferences each one's weak reference, which asks
    the activation-checkpoint wrapper for a missing attribute through two `__getattr__` fallbacks. That walk was
    about 40% of a 1.4B plan's time (profiled on torch 2.14.1; torch 2.11's method is the same). The peak of
    the rank is updated exactly as torch does it, so the plan's bytes are unchanged."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    class PeakTracker(FSDPMemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)  # {category: bytes}, as torch's deepcopy

    return PeakTracker(model, optimizer)


class _PassProgress:
    """measure_step's progress lines: the pass about to run, the time so far and the time left at the mean pass."""

    def __init__(self, report: Callable[[str], None] | None, total: int):
        self.report, self.total, self.done, self.t0 = report, total, 0, time.perf_counter()

    def start(self, step: int) -> None:
        if self.report is None:
            return
        line = f"memory plan: forward-backward pass {self.done + 1} of {self.total} (optimizer step {step + 1} of 2)"
        if self.done:
            spent = time.perf_counter() - self.t0
            line += f"; {spent:.0f} s so far, about {spent / self.done * (self.total - self.done):.0f} s left"
        self.report(line)
        self.done += 1


def measure_step(
    cfg: TrainConfig,
    mesh,
    param_dtype: torch.dtype,
    *,
    micro_batches: int = 2,
    attention: str = "fused",
    fake: bool = True,
    comm_bytes: dict | None = None,
    first_micro_batches: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, int]:
    """Peak bytes by tracker category over two optimizer steps of `cfg` on this rank: `first_micro_batches`, then
    `micro_batches` with the optimizer state the first step created.

    fake=True: FakeTensors on the current (usually fake) process group: nothing is allocated.
    fake=False: the same step on real tensors (used to check the tracker against a real run).
    progress: called with a line before each forward-backward pass (the dry run prints them: a 1.4B plan takes a
    minute on a small CPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    require(
        cfg.objective.jsrr_weight == 0,
        "objective.jsrr_weight",
        cfg.objective.jsrr_weight,
        "0 for the memory plan: JSRR's power iteration runs the loop outside the model's forward, which torch's "
        "FSDP memory tracker cannot follow; plan the run without it and keep a loop's activations of headroom",
    )
    # Planned eager: Dynamo does not trace under the tracker's dispatch mode (it used to fall back to eager
    # silently; with the layers' fullgraph=True it raises)
    cfg = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, compile=False))
    t = cfg.training
    n_loops = cfg.loop_sampler.bounds()[1]
    if mesh.device.type == "cpu":  # FakeTensors tell "cpu" from "cpu:0"; FSDP2 puts CPU parameters on "cpu"
        mesh = dataclasses.replace(mesh, device=torch.device("cpu"))
    # float8 (if on) as on GPUs on fake tensors; emulated on a real CPU step
    model = parallelize(
        cfg.engine_settings(), build_model(cfg), mesh, param_dtype, device_type="cuda" if fake else None
    )
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    kernel = sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()
    with mode:
        if fake:
            model.to_empty(device=mesh.device)
        else:
            init_weights(model, mesh.device)
        optimizers = build_optimizer(cfg.optimizer, model, mesh.dims.tp, "cuda" if fake else mesh.device_type)
        lr_schedulers = build_lr_schedulers(cfg.lr_scheduler, t.steps, optimizers)
        engine = FSDP2Engine(model, optimizers, lr_schedulers)
        run = _fake_run(cfg, mesh, engine)
        run.tracker = tracker = _peak_tracker(model, optimizers.optimizers[0])
        batch = {
            "input_ids": torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long),
            "labels": torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long),
            # two documents a row, as packed data has: the document mask is built as a real batch builds it
            "doc_ids": (torch.arange(t.seq_len) >= t.seq_len // 2).long().expand(t.micro_batch_size, -1),
        }
        tracker.track_inputs((batch["input_ids"],))
        passes = _PassProgress(progress, first_micro_batches + micro_batches)
        with tracker, kernel, _untracked_sharding_propagation(tracker) if fake else contextlib.nullcontext():
            # The second step runs with the optimizer state the first one created; it holds everything the first
            # one does and that state, so the first needs only one micro-batch (at two micro-batches, one of the
            # plan's four forward-backward passes is saved; the plans of benchmarks/memory_plan.py are unchanged to
            # the byte)
            for step, n_micro in enumerate((first_micro_batches, micro_batches)):
                counting = count_collective_bytes() if step == 1 else contextlib.nullcontext()

                def before_micro_batch(step=step):
                    tracker.reset_mod_stats()  # per-module stats only
                    passes.start(step)

                with counting as nbytes:
                    # the trainer's own step (titanloop.train.loop), without the loss all-reduce and callbacks
                    accumulate_gradients(
                        run, itertools.repeat(batch), n_loops, n_micro, before_micro_batch=before_micro_batch
                    )
                    engine.step(max_norm(cfg))
                if comm_bytes is not None and nbytes is not None:
                    comm_bytes.update(nbytes)
        snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


def plan_memory(
    cfg: TrainConfig,
    mesh,
    *,
    gpu_mem_gb: float = 80.0,
    reserve_gb: float = 4.0,
    attention: str = "fused",
    progress: Callable[[str], None] | None = None,
) -> MemoryPlan:
    """The plan of `cfg` for rank 0 of `mesh` (the dry run's fake mesh), as on the GPUs the run is meant for.
    `progress` gets a line per phase (measure_step's passes, compile's probe, the total)."""
    require(
        cfg.parallelism.engine == "fsdp2",
        "parallelism.engine",
        cfg.parallelism.engine,
        "'fsdp2' for --memory-plan (it measures the FSDP2 step; DeepSpeed ZeRO is not planned)",
    )
    # Document masking is planned as causal attention (same memory with varlen / flash varlen). Fake tensors
    # run the CUDA varlen path's forward only (with a ShapeEnv for the data-dependent cu_seqlens); its backward
    # needs a real CUDA context (tests/test_model_attention_varlen.py), and the CPU kernels differ.
    planned = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, doc_masking=False))
    ramp = cfg.training.batch_ramp()
    accum = micro_batches_per_rank(
        ramp.end if ramp else cfg.training.global_batch_size, cfg.training.micro_batch_size, mesh.dp_world
    )  # the trainer's count at full batch
    start = time.perf_counter()
    snap = measure_step(
        planned, mesh, param_dtype(cfg, "cuda"), micro_batches=min(2, accum), attention=attention, progress=progress
    )
    rows = {row: snap.get(key, 0) for key, row in _ROWS.items()}
    n_loops = cfg.loop_sampler.bounds()[1]
    notes = []
    if cfg.float8.recipe != "off":
        gathered = "float8" if cfg.float8.recipe == "tensorwise" else "bf16"
        notes.append(
            f"float8 {cfg.float8.recipe}: measured with torchao's float8 casts and matmuls on fake tensors "
            f"({gathered} weights gathered, high-precision inputs saved for backward)"
        )
    peak = snap.get("Total", sum(rows.values()))
    if cfg.parallelism.compile:
        if progress is not None:
            progress("memory plan: what compile saves, measured on one real decoder layer")
        saving = compiled_saving_bytes(cfg)
        if saving is not None and saving <= rows.get("activations", 0):
            rows["activations"] -= saving
            peak -= saving
            notes.append(
                f"compiled: {saving / GB:.2f} GB fewer saved activations than eager execution (what "
                "torch.compile's partition of one decoder layer keeps for backward, measured, x the layer calls "
                "live at the peak)"
            )
        elif saving is None:
            notes.append(
                "planned eager: torch.compile usually lowers activation memory (fused elementwise ops); its saving "
                "is not modeled for tensor parallelism, prelude/coda layers or this AC policy"
            )
        else:  # e.g. a frozen trunk (gate training), whose layers save little for backward
            notes.append(
                f"planned eager: compile's modeled saving ({saving / GB:.2f} GB) exceeds the planned activations "
                f"({rows.get('activations', 0) / GB:.2f} GB), so the layers save less than the model assumes; the "
                "eager figure is kept"
            )
    if progress is not None:
        progress(f"memory plan: done in {time.perf_counter() - start:.0f} s")
    backward = cfg.loop_sampler.graph_loops(n_loops)
    if backward < n_loops:
        notes.append(
            f"truncated backpropagation through depth: {n_loops - backward} loop(s) run without a graph, "
            f"{backward} keep activations for backward"
        )
    return MemoryPlan(mesh.world_size, n_loops, backward, rows, peak, gpu_mem_gb, reserve_gb, attention, notes)


# ----- what compile changes --------------------------------------------------------------------------------------
# The fake-tensor step above runs eagerly (Dynamo does not trace under the tracker), so the plan subtracts what a
# compiled decoder layer saves less than an eager one, measured on one real layer. On one H100 (6326f59, ouro-1.4b,
# T = 4, one 4K sequence) the eager plan was within 0.1% of an eager run's peak, and the plan less this saving within
# 0.4% of both compiled bf16 runs' (per-loop AC and none); benchmarks/results/*-plan-vs-peak.json.
COMPILE_PROBE_SEQ = (256, 512)  # two short sequences: the slope between them is the per-token cost
_PER_TOKEN: dict[tuple, tuple[float, float]] = {}  # (shape, dtype, float8 recipe) -> layer_saved_bytes_per_token


def compiled_saving_bytes(cfg: TrainConfig) -> int | None:
    """compile_saving_bytes of `cfg` with its layer's per-token saving measured here (once per shape, dtype and
    float8 recipe in this process); 0 without compile, None where the saving is not modeled."""
    if not cfg.parallelism.compile:
        return 0
    calls = compiled_layer_calls(cfg)
    if not calls:  # not modeled (None), or no layer call saves anything (0): no probe to run
        return calls
    model = cfg.model.shape(cfg.loop_sampler.bounds()[1])
    dtype = param_dtype(cfg, "cuda")
    key = (repr(model), dtype, cfg.float8.recipe)
    if key not in _PER_TOKEN:
        _PER_TOKEN[key] = layer_saved_bytes_per_token(model, dtype, float8=cfg.float8.recipe)
    return compile_saving_bytes(cfg, _PER_TOKEN[key])


def _float8_layer(layer: torch.nn.Module, recipe: str) -> None:
    """Swap `layer`'s linears for torchao's Float8Linear as the trainer does (titanloop.parallel.float8), emulated
    so that it runs on any device, and without the float8 all-gather (which changes how FSDP gathers weights, not
    what the layer saves for backward)."""
    from torchao.float8 import convert_to_float8_training

    # beside torchao's import: only a float8 run's plan needs either (titanloop.parallel.float8 names the trainer's
    # filter and config)
    from titanloop.parallel.float8 import _converts, float8_config

    config = dataclasses.replace(float8_config(recipe, emulate=True), enable_fsdp_float8_all_gather=False)
    convert_to_float8_training(layer, module_filter_fn=_converts, config=config)


class _PartitionSeen(Exception):
    """Raised by the compile-saving probe's partition function once it has read the partition (see below)."""


def _caused_by(e: BaseException | None, kind: type) -> bool:
    """Whether `e` or an exception it was raised from or during is a `kind` (Dynamo wraps a backend's exception)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def layer_saved_bytes_per_token(
    model: LoopLMConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", float8: str = "off"
) -> tuple[float, float]:
    """Bytes one decoder-layer call keeps for its backward, per token: (eager, compiled). Eager counts the distinct
    storages autograd saves (saved-tensor hooks; the weights and the layer's input left out, they exist anyway).
    Compiled counts the tensors that inductor's partition of the layer's joint graph (min-cut rematerialization,
    as `torch.compile` uses) passes from the forward to the backward, besides the layer's own inputs, read from the
    partition itself: neither graph is compiled or run (running them in bf16 on a CPU took ~280 s of the 1.4B
    plan's ~490 s; reading the partition takes ~5 s). Real tensors of one layer at COMPILE_PROBE_SEQ tokens; the
    slope between the two cancels weight-sized terms. Plain causal attention, as the plan models document masking.
    `float8` (a recipe): the layer's linears in float8, whose compiled forward saves float8 casts where the bf16
    layer saves bf16 inputs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    torch.manual_seed(0)
    layer = DecoderLayer(model).to(device=device, dtype=dtype)
    if float8 != "off":
        _float8_layer(layer, float8)
    kept = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def eager(x, cos, sin) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in kept and ptr != x.untyped_storage().data_ptr():
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x, cos, sin)
        return sum(seen.values())

    def compiled(x, cos, sin) -> int:
        saved: list[int] = []

        def partition(joint, joint_inputs, **kw):  # the backward's placeholders: what the forward saves, gradients
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kw)
            nodes = [n for n in bw.graph.nodes if n.op == "placeholder"]
            vals = [n.meta.get("val") for n in nodes if not n.name.startswith(("primals_", "tangents_"))]
            saved.append(sum(v.untyped_storage().nbytes() for v in vals if isinstance(v, torch.Tensor)))
            raise _PartitionSeen  # the partition is all the probe needs: neither graph is compiled or run

        backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)
        torch._dynamo.reset()
        try:
            torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)(x, cos, sin)
        except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's exception; anything else is re-raised
            if not _caused_by(e, _PartitionSeen):
                raise
        finally:
            torch._dynamo.reset()
        if not saved:
            raise RuntimeError("the compile-saving probe saw no partition of the layer (torch.compile fell back?)")
        return saved[-1]

    counts = {}
    for seq in COMPILE_PROBE_SEQ:
        x = torch.randn(1, seq, model.hidden_size, device=device, dtype=dtype, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(seq, device=device), model.head_dim, model.rope_theta, dtype)
        counts[seq] = (eager(x, cos, sin), compiled(x, cos, sin))
    (e1, c1), (e2, c2) = (counts[s] for s in COMPILE_PROBE_SEQ)
    span = COMPILE_PROBE_SEQ[1] - COMPILE_PROBE_SEQ[0]
    return (e2 - e1) / span, (c2 - c1) / span


def compiled_layer_calls(cfg: TrainConfig) -> int | None:
    """The decoder-layer calls of one micro-batch whose saved tensors are live at a compiled step's peak: every
    looped layer call without AC; with per-loop AC one loop's layers (its recompute) plus those of the loops it keeps
    (parallelism.ac_kept_loops), all of them once it keeps every loop. None where this is not modeled
    (other AC policies, tensor parallelism, prelude or coda layers). 0 for exit-gate Stage II, whose trunk is frozen
    (titanloop.train.startup): its layer calls save nothing for backward, compiled or not."""
    if cfg.objective.name == "stage2_gate":
        return 0
    n_loops = cfg.loop_sampler.bounds()[1]
    model = cfg.model.shape(n_loops)
    if cfg.parallelism.tp > 1 or model.n_prelude_layers or model.n_coda_layers:
        return None
    graph = cfg.loop_sampler.graph_loops(n_loops)  # truncated backprop: loops without a graph save nothing
    kept = cfg.parallelism.ac_kept_loops - (n_loops - graph)  # AC keeps loops by index; graph loops come last
    loops = live_loops(cfg.parallelism.activation_checkpoint, graph, max(0, kept))
    return None if loops is None else model.n_layers * loops


def compile_saving_bytes(cfg: TrainConfig, per_token: tuple[float, float]) -> int | None:
    """How many bytes fewer a compiled step holds at its peak than the (eager) plan says: compiled_layer_calls x
    the tokens of one micro-batch x what compile saves per token and layer call (layer_saved_bytes_per_token). 0
    when the config does not compile; None where this is not modeled (compiled_layer_calls). float8 runs are
    modeled with the float8 layer's own saving: on the H100 run above, the plan less it was within 5% of both
    recipes' peaks."""
    if not cfg.parallelism.compile:
        return 0
    calls = compiled_layer_calls(cfg)
    if calls is None:
        return None
    eager, compiled = per_token
    return int(calls * cfg.training.micro_batch_size * cfg.training.seq_len * (eager - compiled))
