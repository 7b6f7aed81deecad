"""Atomic, reshardable, optionally asynchronous checkpoints of a training run; auto-resume.

    ckpt = Checkpointer(cfg, run_dir, states={"model": model, "optimizer": opt, "lr_scheduler": sched,
                                              "dataloader": loader, "train_state": train_state},
                        config=resolved_config_dict, stage="stage1a")
    start = ckpt.load_latest() or 0      # None: nothing to resume (a fresh run)
    for step in range(start + 1, total + 1):
        train_step()
        ckpt.maybe_save(step)            # every cfg.interval steps; also publishes a finished async save
    ckpt.save(total, sync=True); ckpt.close()

Each save: every rank writes its DCP shards into `.staging-step-N/` (the training thread only pays for the
copy to CPU when async), computes crc32 of its own files; once all ranks are done, rank 0 writes the
manifest, renames the folder to `step-N/`, points `latest` at it and applies retention. See layout.py for
the directory layout and state.py for what is stored how.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from titanloop.checkpoint import layout
from titanloop.checkpoint.config import CheckpointConfig
from titanloop.checkpoint.errors import CheckpointError
from titanloop.checkpoint.preemption import collective_device
from titanloop.checkpoint.safe_reader import load_dcp, read_dcp_metadata
from titanloop.checkpoint.state import (
    ModelState,
    OptimizerState,
    join_state,
    restore_rng_state,
    rng_state_tensors,
    split_state,
    tensor_paths,
)

log = logging.getLogger("titanloop.checkpoint")


def _copy_atomic(x, memo, non_blocking=False):  # called as (x, memo), or with non_blocking by some torch versions
    return x


def stager_copies_classes(stager: DefaultStager) -> DefaultStager:
    """Let DCP's stager copy class objects as they are, as torch 2.14's does; call it before every staging.

    A DTensor's copy goes through its __reduce_ex__, whose arguments hold classes (its placements' types), and
    the stager copies a class through the `type` entry of its dispatch table, read without a default. torch
    2.11's DefaultStager empties that table (StateDictStager.close()) after every staging, so its second async
    save of an FSDP2 model raised KeyError: <class 'type'> (the H100 preemption run, 2026-11-28, at step 10
    after saving step 5). This puts back every entry the table was built with, plus `type` where even that
    lacked it. torch 2.14 neither empties the table nor lacks the entry, so there it changes nothing.
    """
    inner = getattr(stager, "_state_dict_stager", None)
    dispatch = getattr(inner, "_deepcopy_dispatch", None)
    if isinstance(dispatch, dict):
        built = getattr(inner, "_titanloop_dispatch", None)
        if built is None:  # the first call, on the table as the stager built it
            built = {**dispatch}
            built.setdefault(type, _copy_atomic)
            inner._titanloop_dispatch = built
        for cls, copier in built.items():
            dispatch.setdefault(cls, copier)
    return stager


@dataclass
class _PendingSave:
    step: int
    staging: Path
    manifest: dict  # everything but the file records, captured when the save started
    writer: Future  # resolves to {file name: record} for this rank's files once DCP finished writing
    started: float


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Checkpointer:
    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir,
        states: dict,
        *,
        config: dict | None = None,
        stage: str | None = None,
        trained_depth: dict | None = None,
    ):
        self.cfg = cfg
        self.root = Path(run_dir) / cfg.folder
        self.rank, self.world = _dist()
        self.distributed = self.world > 1 or (dist.is_available() and dist.is_initialized())
        self.states = self._wrap(states)
        self.config, self.stage = config, stage
        self.trained_depth = trained_depth  # the loop count trained at (titanloop.family.trained_depth)
        self.async_mode = cfg.mode == "async" or (cfg.mode == "auto" and torch.cuda.is_available())
        # DCP's async save runs its collectives in a background thread: give it its own gloo group so it
        # never interleaves with the training collectives on the default group.
        self._save_group = dist.new_group(backend="gloo") if (self.async_mode and self.distributed) else None
        # One stager for the whole run: it keeps the CPU copy buffers (pinned on CUDA) between saves, so an
        # async save stalls the loop only for a memcpy into memory that is already mapped.
        self._stager = stager_copies_classes(
            DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        )
        self._pending: _PendingSave | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self.last_saved_step: int | None = None
        self.last_save_stall_s = 0.0  # training-thread time of the most recent save call
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            gone = layout.clean_staging(self.root)
            if gone:
                log.warning("removed unfinished checkpoint save(s) %s in %s", gone, self.root)
        self._barrier()

    # ----- wiring ---------------------------------------------------------------------------------
    @staticmethod
    def _wrap(states: dict) -> dict:
        """Bare modules/optimizers become FQN-keyed DCP states; everything else must have state_dict()."""
        model = states.get("model")
        out = {}
        for name, obj in states.items():
            if isinstance(obj, nn.Module):
                obj = ModelState(obj)
            elif isinstance(obj, torch.optim.Optimizer) and type(obj).state_dict is torch.optim.Optimizer.state_dict:
                # (containers such as torchtitan's OptimizersContainer bring their own FQN state_dict)
                if not isinstance(model, nn.Module):
                    raise CheckpointError(
                        f"checkpoint state {name!r} is a bare optimizer: pass the model as "
                        "states['model'] (an nn.Module) or an object with state_dict()"
                    )
                obj = OptimizerState(model, obj)
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise CheckpointError(
                    f"checkpoint state {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict()"
                )
            out[name] = obj
        return out

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _all_true(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    # ----- save -----------------------------------------------------------------------------------
    def maybe_save(self, step: int) -> bool:
        """Call at every step boundary (all ranks): publishes a finished async save; saves every `interval`."""
        if not self.cfg.enable:
            return False
        self._poll_pending()
        if step % self.cfg.interval == 0 and step != self.last_saved_step:
            self.save(step)
            return True
        return False

    def save(self, step: int, sync: bool | None = None) -> None:
        """Save the current state as step `step` (all ranks). sync=True blocks until it is published."""
        if not self.cfg.enable:
            return
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time; publishes the previous one
        use_async = self.async_mode if sync is None else not sync
        staging = self.root / f"{layout.STAGING_PREFIX}{layout.step_dir_name(step)}"
        tensors: dict[str, torch.Tensor] = {}
        skeletons = {name: split_state(obj.state_dict(), name, tensors) for name, obj in self.states.items()}
        tensors.update(rng_state_tensors(self.rank))
        manifest = {
            "format": 1,
            "step": step,
            "world_size": self.world,
            "stage": self.stage,
            "config": self.config,
            "trained_depth": self.trained_depth,
            "states": skeletons,
            "saved_at": time.time(),
        }
        json.dumps(manifest, allow_nan=True)  # fail now, on every rank, if a state is not JSON-serializable
        writer = FileSystemWriter(staging, sync_files=True)
        if use_async:
            stager_copies_classes(self._stager)  # torch 2.11 empties its table after each staging
            upload = dcp.async_save(
                tensors, storage_writer=writer, process_group=self._save_group, async_stager=self._stager
            )
            written = self._executor.submit(self._finish_rank_files, upload, staging)
        else:
            dcp.save(tensors, storage_writer=writer)
            written = Future()
            written.set_result(self._finish_rank_files(None, staging))
        self._pending = _PendingSave(step, staging, manifest, written, t0)
        self.last_saved_step = step
        if not use_async:
            self.wait()
        self.last_save_stall_s = time.perf_counter() - t0

    def _finish_rank_files(self, upload: Future | None, staging: Path) -> dict:
        """Runs after this rank's DCP write: size (and crc32) of the files this rank wrote."""
        if upload is not None:
            upload.result()
        mine = sorted(staging.glob(f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            mine.append(staging / ".metadata")
        return {p.name: layout.file_record(p, self.cfg.checksums) for p in mine}

    def _poll_pending(self) -> None:
        """Publish the in-flight async save if every rank has finished writing it (one tiny all_reduce)."""
        if self._pending is not None and self._all_true(self._pending.writer.done()):
            self._publish()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is written and published on every rank."""
        if self._pending is not None:
            self._pending.writer.result()
            self._barrier()
            self._publish()

    def _publish(self) -> None:
        p, self._pending = self._pending, None
        files = p.writer.result()  # raises here if this rank's write failed
        if self.distributed:
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, files)
            files = {k: v for d in gathered for k, v in d.items()}
        if self.rank == 0:
            final = layout.publish(self.root, p.staging, p.step, {**p.manifest, "files": files})
            removed = layout.apply_retention(self.root, self.cfg.keep_latest_k, self.cfg.keep_every)
            log.info(
                "checkpoint step %d published at %s in %.2fs%s",
                p.step,
                final,
                time.perf_counter() - p.started,
                f"; removed steps {removed}" if removed else "",
            )
        self._barrier()  # nobody proceeds (or exits) before the checkpoint is published

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        self._stager.close()

    # ----- load -----------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return layout.latest_step(self.root)

    def load_latest(self) -> int | None:
        """Resume from the newest published checkpoint; returns its step, or None for a fresh run."""
        if not self.cfg.enable:
            return None
        step = self.latest_step()
        agreed = self._broadcast_int(-1 if step is None else step)
        if agreed < 0:
            return None
        self.load(agreed)
        return agreed

    def _broadcast_int(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=collective_device())
        dist.broadcast(t, src=0)
        return int(t.item())

    def load(self, step: int) -> dict:
        """Load checkpoint `step` into the live states (any world size); returns its manifest."""
        ckpt = self.root / layout.step_dir_name(step)
        manifest = layout.read_manifest(ckpt)
        self.verify(ckpt, manifest)
        metadata = read_dcp_metadata(ckpt / ".metadata").state_dict_metadata
        saved_world = int(manifest["world_size"])

        targets: dict[str, torch.Tensor] = {}
        live = {}  # the current state dicts: shapes to check, in-place load targets
        for name, obj in self.states.items():
            if name not in manifest["states"]:
                raise CheckpointError(f"checkpoint {ckpt} has no state {name!r} (it has {sorted(manifest['states'])})")
            live_tensors: dict[str, torch.Tensor] = {}
            live[name] = obj.state_dict()
            split_state(live[name], name, live_tensors)
            for path in tensor_paths(manifest["states"][name]):
                targets[path] = self._target(path, live_tensors.get(path), metadata, ckpt)
            missing = sorted(set(live_tensors) - set(targets))
            if missing and name == "model":  # (optimizer state may legitimately lack never-updated params)
                raise CheckpointError(
                    f"checkpoint {ckpt} lacks tensor {missing[0]!r} of the current {name} "
                    f"({len(missing)} missing): it was saved from another model"
                )
        rng_prefix = f"rng/rank{self.rank}/"
        has_rng = self.rank < saved_world
        if has_rng:
            for path in metadata:
                if path.startswith(rng_prefix):
                    targets[path] = self._target(path, None, metadata, ckpt)
        load_dcp(targets, ckpt)

        for name, obj in self.states.items():
            loaded = join_state(manifest["states"][name], targets)
            if name != "model" and isinstance(loaded, dict) and isinstance(live[name], dict):
                # e.g. optimizer state of parameters that had no gradient yet when saved: keep the fresh one
                loaded = {**live[name], **loaded}
            obj.load_state_dict(loaded)
        if has_rng:
            restore_rng_state(targets, self.rank)
        elif self.rank == 0 or self.rank == saved_world:
            log.warning(
                "checkpoint was saved by %d ranks, now %d: ranks >= %d keep their fresh RNG seeding",
                saved_world,
                self.world,
                saved_world,
            )
        self.last_saved_step = step
        log.info("resumed from %s (saved by %d ranks, loaded on %d)", ckpt, saved_world, self.world)
        return manifest

    def verify(self, ckpt: Path, manifest: dict) -> None:
        """Before a load: every rank checks that all files exist with their sizes, and the crc32 of its share of
        them (layout.crc_share: ~1/world of the bytes each), in parallel; then every rank raises the same
        one-line error if any rank found a bad file."""
        error = None
        try:
            layout.verify_files(ckpt, manifest, layout.crc_share(manifest, self.rank, self.world))
        except CheckpointError as e:
            error = str(e)
        if self.distributed:
            errors: list = [None] * self.world
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e), None)
        if error:
            raise CheckpointError(error)

    @staticmethod
    def _target(path: str, live: torch.Tensor | None, metadata: dict, ckpt: Path) -> torch.Tensor:
        """The tensor DCP loads `path` into: the live one (in place, keeps sharding) or a fresh one."""
        md = metadata.get(path)
        if md is None:
            raise CheckpointError(
                f"checkpoint {ckpt} is inconsistent: tensor {path!r} is listed in "
                f"{layout.MANIFEST} but not in .metadata"
            )
        if not hasattr(md, "size"):  # titanloop saves only tensors to DCP: a pickled entry is never read
            raise CheckpointError(
                f"checkpoint {ckpt} stores {path!r} as a non-tensor (pickled) entry where a tensor "
                "is expected: refusing to load it"
            )
        if live is None:
            return torch.empty(md.size, dtype=md.properties.dtype)
        if tuple(live.shape) != tuple(md.size):
            raise CheckpointError(
                f"checkpoint {ckpt} has tensor {path!r} of shape {tuple(md.size)}, the current "
                f"model has {tuple(live.shape)}: it was saved from a model of another shape"
            )
        return live
