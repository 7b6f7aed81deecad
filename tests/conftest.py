import json
import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class _Hostile:
    """A pickled object whose unpickling runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _refresh_manifest(ckpt) -> None:
    """What an attacker does after editing a checkpoint's files: make the manifest's sizes and crc32 match."""
    from titanloop.checkpoint import layout

    manifest = json.loads((ckpt / layout.MANIFEST).read_text())
    manifest["files"] = {p.name: layout.file_record(p, True) for p in sorted(ckpt.iterdir())
                         if p.name != layout.MANIFEST}
    (ckpt / layout.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def hostile():
    """Crafting malicious checkpoints: payload(marker) pickles into code that creates `marker`;
    refresh_manifest(step_dir) makes titanloop.json's file records match the edited files."""
    return SimpleNamespace(payload=_Hostile, refresh_manifest=_refresh_manifest)
