"""On-disk layout of a run's checkpoints, atomic publishing, retention and integrity checks.

    <run_dir>/<folder>/
        step-00001000/            a published checkpoint (complete: it was renamed into place)
            .metadata             DCP metadata (tensor shapes/dtypes/locations; read with a restricted unpickler)
            __<rank>_<i>.distcp   DCP tensor data written by each rank
            titanloop.json        global state (data, schedule, counters, config, stage) + file manifest
        latest                    one line, the name of the newest published checkpoint (atomic replace)
        .staging-step-00001100-<id>/   a save in progress; never loaded, deleted on the next start

Publishing is `rename(staging, step-N)` followed by replacing `latest`, both atomic on POSIX filesystems,
done by rank 0 only after every rank finished writing. A crash at any point leaves either the previous
checkpoint as the newest complete one, or the new one complete and published.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

from titanloop.checkpoint.errors import CheckpointError

MANIFEST = "titanloop.json"
LATEST = "latest"
STAGING_PREFIX = ".staging-"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def published_steps(root: Path) -> list[int]:
    """Steps of the published checkpoints under root, ascending (staging leftovers excluded)."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(root: Path) -> int | None:
    """The step named by `latest` if it is a published checkpoint, else the newest published one, else None.

    The fallback covers a crash between the rename and the pointer update (the new dir is complete).
    """
    steps = published_steps(root)
    if not steps:
        return None
    pointer = root / LATEST
    if pointer.is_file():
        m = _STEP_DIR.match(pointer.read_text().strip())
        if m and int(m.group(1)) in steps and int(m.group(1)) == steps[-1]:
            return int(m.group(1))
    return steps[-1]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write text to path via a temporary file, fsync and rename: readers see the old or the new content."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def file_record(path: Path, checksum: bool) -> dict:
    rec = {"bytes": path.stat().st_size}
    if checksum:
        rec["crc32"] = file_crc32(path)
    return rec


def publish(root: Path, staging: Path, step: int, manifest: dict) -> Path:
    """Rank 0, after every rank finished writing: manifest, rename into place, then point `latest` at it."""
    write_atomic(staging / MANIFEST, json.dumps(manifest, indent=1, allow_nan=True))
    final = root / step_dir_name(step)
    if final.exists():  # a previous attempt at this step (e.g. a resumed run saving the same step again)
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(root)
    write_atomic(root / LATEST, final.name + "\n")
    return final


def apply_retention(root: Path, keep_latest_k: int, keep_every: int) -> list[int]:
    """Delete published checkpoints other than the newest `keep_latest_k` (0: keep all) and the multiples of
    `keep_every`."""
    steps = published_steps(root)
    keep = set(steps[-keep_latest_k:]) if keep_latest_k > 0 else set(steps)
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    removed = [s for s in steps if s not in keep]
    for s in removed:
        shutil.rmtree(root / step_dir_name(s), ignore_errors=True)
    return removed


def clean_staging(root: Path) -> list[str]:
    """Delete leftovers of saves that never published (crashed or killed mid-save)."""
    if not root.is_dir():
        return []
    gone = []
    for p in root.iterdir():
        if p.name.startswith(STAGING_PREFIX) or (p.name.startswith(f".{LATEST}.tmp-")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def read_manifest(ckpt: Path) -> dict:
    path = ckpt / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"checkpoint file {path} is unreadable or corrupt ({type(e).__name__}: {e}); "
            f"delete {ckpt} to resume from an older checkpoint"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != 1 or "files" not in manifest:
        raise CheckpointError(
            f"checkpoint file {path} is not a titanloop v1 manifest; delete {ckpt} to resume from an older checkpoint"
        )
    return manifest


def crc_share(manifest: dict, rank: int, world: int) -> set[str]:
    """The files whose crc32 `rank` of `world` checks before a load: the manifest's files, largest first, dealt
    round-robin, so each rank reads about 1/world of the checkpoint's bytes."""
    files = sorted(manifest["files"], key=lambda n: (-manifest["files"][n]["bytes"], n))
    return {name for i, name in enumerate(files) if i % world == rank}


def verify_files(ckpt: Path, manifest: dict, crc_of: set[str] | None = None) -> None:
    """Every file the manifest lists exists with its size, and those in `crc_of` (default: all) with their crc32;
    one-line error naming the first bad file."""
    hint = f"delete {ckpt} to resume from an older checkpoint"
    for name, rec in sorted(manifest["files"].items()):
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing; {hint}")
        size = path.stat().st_size
        if size != rec["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered: {size} bytes, expected {rec['bytes']}; {hint}"
            )
        if "crc32" in rec and (crc_of is None or name in crc_of) and file_crc32(path) != rec["crc32"]:
            raise CheckpointError(f"checkpoint file {path} is corrupt (crc32 mismatch); {hint}")
