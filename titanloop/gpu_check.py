"""`python -m titanloop.gpu_check` (or scripts/gpu_check.sh): one acceptance check of the fast path on a CUDA
machine with 1-8 GPUs, ending in a PASS/FAIL table; exit status 0 only if every check passes.

Checks, in order:
  flash-attn      flash_attn imports (the fused kernels; `pip install 'titanloop[gpu]'`)
  varlen          document-masked attention (flash_attn_varlen_func via titanloop.model.attention) vs dense
                  masked SDPA in fp32: max abs error <= VARLEN_TOL
  bf16 loss       the same LoopLM's loss with bf16 vs fp32 parameters: relative difference <= BF16_RTOL
  compile         inductor-compiled decoder layers: no new graphs when T changes (2 -> 4 -> 8 -> 3)
  train T=4, T=8  `torchrun -m titanloop.train` on all local GPUs (FSDP2, bf16 params, fp32 reduce, compile,
                  document masking): 50 steps each; prints tokens/s/GPU and MFU (FLOPs from
                  LoopLMConfig.flops_per_token, every loop counted) and the peak memory
  memory plan     each training run's peak GPU memory (torch.cuda.max_memory_allocated, logged by the trainer as
                  max_mem_gib) vs the memory plan of the same config at the same world size
                  (titanloop.train.memory_plan, what `--dry-run --memory-plan` prints): within MEMORY_PLAN_RTOL

The model is the Ouro 1.4B shape when the smallest free GPU memory allows it, else a smaller shape
(`pick_model`). Without CUDA it prints one line and exits 1. Only the logic that needs no GPU is tested here
(tests/test_gpu_check.py); this module has never been run on a GPU in this repository's CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from titanloop.model.config import LoopLMConfig, preset

VARLEN_TOL = 2e-2  # bf16 kernels vs fp32 reference, unit-variance inputs
BF16_RTOL = 2e-2
MEMORY_PLAN_RTOL = 0.15  # the plan's stated accuracy (tests/test_memory_plan.py checks it on CPU)
STEPS = 50
GIB = 1024 ** 3
# (preset, overrides) from the largest down; bytes per parameter of training state per GPU (fp32 master + Adam
# moments, sharded over GPUs) plus a fixed activation allowance, see `pick_model`.
SHAPES = [("ouro-1.4b", {}), ("ouro-1.4b", {"n_layers": 12}), ("ouro-1.4b", {"n_layers": 4}), ("debug-small", {})]
ACTIVATION_ALLOWANCE = 16 * GIB


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not applicable / a hook (never counted as a pass)
    detail: str


def no_cuda_message() -> str | None:
    """The one line printed without CUDA, or None when CUDA is available."""
    import torch

    if torch.cuda.is_available():
        return None
    return ("gpu_check: no CUDA device (torch.cuda.is_available() is False): run it on a machine with NVIDIA "
            "GPUs and a CUDA build of torch")


def state_bytes(cfg: LoopLMConfig, n_gpus: int) -> float:
    """Training state per GPU: fp32 params + grads + two Adam moments (16 B/param), sharded by FSDP2, plus the
    looped stack held unsharded in bf16 (reshard_looped='never')."""
    looped = cfg.layer_params() * (cfg.n_layers + cfg.n_coda_layers)
    return 16 * cfg.param_count() / n_gpus + 2 * looped


def pick_model(free_bytes: float, n_gpus: int) -> tuple[str, dict]:
    """The largest shape in SHAPES whose training state plus ACTIVATION_ALLOWANCE fits in `free_bytes`."""
    for name, overrides in SHAPES:
        if state_bytes(preset(name, **overrides), n_gpus) + ACTIVATION_ALLOWANCE <= free_bytes:
            return name, overrides
    return SHAPES[-1]


def throughput(rows: list[dict], cfg: LoopLMConfig, seq_len: int, n_gpus: int, n_loops: int,
               peak_flops: float) -> tuple[float, float]:
    """(tokens/s/GPU, MFU) from metrics.jsonl rows of a run, skipping the first logged step (compilation)."""
    rows = [r for r in rows if r["step"] > 1] or rows
    tok_s = sum(r["tokens_per_s"] for r in rows) / len(rows)
    mfu = tok_s * cfg.flops_per_token(seq_len, n_loops=n_loops) / (peak_flops * n_gpus)
    return tok_s / n_gpus, mfu


TRAIN_CONFIG = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"


def train_args(run_dir: Path, name: str, overrides: dict, n_loops: int, seq_len: int, n_gpus: int) -> list[str]:
    """Overrides of TRAIN_CONFIG for one gpu_check training run (also what its memory plan is computed for)."""
    args = ["--model.vocab_size", "49152", "--training.run_dir", str(run_dir), "--training.steps", str(STEPS),
            "--training.seq_len", str(seq_len), "--training.micro_batch_size", "1", "--training.global_batch_size",
            str(n_gpus), "--model.preset", name, "--model.n_loops", str(n_loops), "--loop_sampler.n_loops",
            str(n_loops), "--parallelism.compile", "true", "--metrics.log_freq", "5", "--metrics.wandb", "off",
            "--checkpoint.enable", "false"]
    for key, value in overrides.items():
        args += [f"--model.{key}", str(value)]
    return args


def memory_plan_check(label: str, measured_gib: float | None, planned_gib: float | None) -> Check:
    """Measured peak vs planned peak (GiB): PASS within MEMORY_PLAN_RTOL of the plan."""
    if measured_gib is None or planned_gib is None:
        return Check(label, False, f"missing: measured {measured_gib}, planned {planned_gib}")
    rel = measured_gib / planned_gib - 1
    return Check(label, abs(rel) <= MEMORY_PLAN_RTOL,
                 f"measured {measured_gib:.2f} GiB, planned {planned_gib:.2f} GiB ({100 * rel:+.0f}%, "
                 f"tol {100 * MEMORY_PLAN_RTOL:.0f}%)")


def planned_peak_gib(config: Path, args: list[str], n_gpus: int) -> float:
    """The memory plan's peak (GiB per GPU) of `config` + `args` at `n_gpus` ranks (fake backend, meta tensors)."""
    from titanloop.train.config import load_config
    from titanloop.train.dry_run import dry_run

    cfg = load_config(config, args, world_size=n_gpus)
    return dry_run(cfg, n_gpus, memory_plan=True).memory_plan.peak / GIB


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    for c in checks:
        verdict = "n/a" if c.ok is None else ("PASS" if c.ok else "FAIL")
        lines.append(f"{c.name:<{width}}  {verdict:<6}  {c.detail}")
    return "\n".join(lines)


def exit_status(checks: list[Check]) -> int:
    return 0 if all(c.ok is not False for c in checks) and any(c.ok for c in checks) else 1


# ----- the CUDA checks (not run in CI: no GPU) ------------------------------------------------------------
def _check_flash() -> Check:
    from titanloop.model.attention import flash_available

    return Check("flash-attn", flash_available(), "importable" if flash_available() else "pip install 'titanloop[gpu]'")


def _check_varlen() -> Check:
    import torch

    from titanloop.model import attention as attn

    doc = torch.tensor([[0] * 300 + [1] * 700 + [2] * 24, [0] * 1024], device="cuda")
    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda") for _ in range(3))
    ref = attn.attention(q, k, v, attn.causal_mask(1024, 1024, "cuda", doc))
    mask = attn.document_mask(doc, "auto", torch.bfloat16)
    out = attn.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask).float()
    err = (out - ref).abs().max().item()
    return Check("varlen", mask.kernel == "flash_varlen" and err <= VARLEN_TOL,
                 f"kernel {mask.kernel}, max |err| {err:.2e} (tol {VARLEN_TOL})")


def _check_bf16() -> Check:
    import torch
    import torch.nn.functional as F

    from titanloop.model import LoopLM

    torch.manual_seed(0)
    model = LoopLM(preset("debug-small")).cuda()
    x = torch.randint(0, model.cfg.vocab_size, (4, 512), device="cuda")
    losses = []
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            logits = model.to(dtype)(x, 4, return_logits="last").logits.float()
        losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).item())
    rel = abs(losses[1] - losses[0]) / abs(losses[0])
    return Check("bf16 loss", rel <= BF16_RTOL, f"fp32 {losses[0]:.4f} bf16 {losses[1]:.4f} rel {rel:.1e}")


def _check_compile() -> Check:
    import torch

    from titanloop.model import LoopLM
    from titanloop.parallel.compile import apply_compile, compiled_graphs

    model = LoopLM(preset("debug-small")).cuda().bfloat16()
    apply_compile(model)
    x = torch.randint(0, model.cfg.vocab_size, (2, 256), device="cuda")
    counts = []
    for t in (2, 4, 8, 3):
        model(x, t).readouts[-1].float().mean().backward()
        counts.append(compiled_graphs())
    return Check("compile", len(set(counts)) == 1, f"graphs after T=2,4,8,3: {counts}")


def _train(n_gpus: int, name: str, overrides: dict, n_loops: int, seq_len: int, workdir: Path) -> list[Check]:
    from titanloop.train.metrics import H100_BF16_PEAK_FLOPS

    run_dir = workdir / f"T{n_loops}"
    args = train_args(run_dir, name, overrides, n_loops, seq_len, n_gpus)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_gpus}",
           "-m", "titanloop.train", "--config", str(TRAIN_CONFIG), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    label = f"train T={n_loops}"
    if proc.returncode != 0:
        return [Check(label, False, f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg = preset(name, **overrides, n_loops=n_loops)
    tok_s, mfu = throughput(rows, cfg, seq_len, n_gpus, n_loops, H100_BF16_PEAK_FLOPS)
    try:
        planned = planned_peak_gib(TRAIN_CONFIG, args, n_gpus)
    except Exception as e:  # noqa: BLE001 - reported as a FAIL row
        return [Check(label, True, f"{tok_s:,.0f} tokens/s/GPU"),
                Check(f"memory plan T={n_loops}", False, f"plan failed: {type(e).__name__}: {e}"[:200])]
    return [Check(label, True, f"{name} {overrides or ''} {tok_s:,.0f} tokens/s/GPU, MFU {100 * mfu:.1f}% "
                               f"(H100 bf16 peak), loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}"),
            memory_plan_check(f"memory plan T={n_loops}", max(r.get("max_mem_gib") or 0 for r in rows) or None,
                              planned)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titanloop.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--skip-train", action="store_true", help="only the single-GPU checks")
    args = parser.parse_args(argv)
    message = no_cuda_message()
    if message:
        print(message)
        return 1
    import torch

    n_gpus = torch.cuda.device_count()
    free = min(torch.cuda.mem_get_info(i)[0] for i in range(n_gpus))
    checks = []
    for fn in (_check_flash, _check_varlen, _check_bf16, _check_compile):
        try:
            checks.append(fn())
        except Exception as e:  # noqa: BLE001 - a failing check is a FAIL row, the others still run
            checks.append(Check(fn.__name__[7:], False, f"{type(e).__name__}: {e}"[:200]))
    if not args.skip_train:
        name, overrides = pick_model(free, n_gpus)
        with tempfile.TemporaryDirectory() as tmp:
            for n_loops in (4, 8):
                checks += _train(n_gpus, name, overrides, n_loops, args.seq_len, Path(tmp))
    print(f"{n_gpus} x {torch.cuda.get_device_name(0)}, smallest free memory {free / GIB:.1f} GiB")
    print(format_table(checks))
    return exit_status(checks)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
