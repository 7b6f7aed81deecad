"""Profiling (titanloop.train.profiling): a configured window writes one torch.profiler trace per rank that parses
as a chrome/perfetto trace (2 CPU ranks through the real trainer); the CUDA-only memory snapshots (window and
out-of-memory) with a fake allocator."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from titanloop.train.config import load_config
from titanloop.train.profiling import Profiling, memory_summary

from launch import DEBUG, train


class FakeCudaMemory:
    def __init__(self):
        self.calls, self.observer = [], None

    def record(self, max_entries):
        self.calls.append(("record", max_entries))

    def stop(self):
        self.calls.append(("stop",))

    def snapshot(self):
        frames = [
            {"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "titanloop/model/looplm.py", "line": 42, "name": "forward"},
        ]
        return {
            "segments": [
                {
                    "total_size": 3 << 20,
                    "blocks": [
                        {"size": 2 << 20, "state": "active_allocated", "frames": frames},
                        {"size": 1 << 20, "state": "inactive", "frames": []},
                    ],
                }
            ]
        }

    def peaks(self):
        return 5 << 30, 6 << 30

    def on_oom(self, fn):
        self.observer = fn


def fake_run(tmp_path: Path, device_type: str):
    cfg = load_config(
        DEBUG,
        [
            "--profiling.enable",
            "true",
            "--profiling.start_step",
            "3",
            "--profiling.steps",
            "2",
            "--training.run_dir",
            str(tmp_path),
        ],
    )
    return SimpleNamespace(
        cfg=cfg, mesh=SimpleNamespace(rank=1, device_type=device_type), state=SimpleNamespace(step=1, exit_code=None)
    )


def test_cuda_memory_snapshots_with_a_fake_allocator(tmp_path, capsys):
    run, memory = fake_run(tmp_path, "cuda"), FakeCudaMemory()
    cb = Profiling(run, cuda_memory=memory)
    cb.pre_train(run)
    assert memory.calls == [("record", 100000)] and memory.observer is not None
    cb._dump(tmp_path / "profiles" / "step_3")  # what the end of the window writes after the trace
    # the file is the allocator's snapshot as pickle.dump writes it (compared as bytes: the repository never unpickles)
    written = (tmp_path / "profiles" / "step_3" / "rank1_memory_snapshot.pickle").read_bytes()
    assert written == pickle.dumps(memory.snapshot())
    summary = (tmp_path / "profiles" / "step_3" / "rank1_memory_summary.txt").read_text()
    assert "peak allocated 5.000 GiB" in summary and "titanloop/model/looplm.py:42 forward" in summary
    assert "0.002 GiB live in 1 blocks" in summary
    memory.observer(0, 7 << 20, 0, 0)  # the allocator's out-of-memory callback
    assert (tmp_path / "profiles" / "oom" / "rank1_memory_snapshot.pickle").is_file()
    assert "ran out of CUDA memory (asked 7.0 MiB)" in capsys.readouterr().out
    cb.close()
    assert memory.calls[-1] == ("stop",)


def test_memory_snapshot_is_skipped_off_cuda(tmp_path, capsys):
    run = fake_run(tmp_path, "cpu")
    run.mesh.rank = 0
    cb = Profiling(run, cuda_memory=FakeCudaMemory())
    assert cb.memory is None and "CUDA only" in capsys.readouterr().out
    assert "largest live blocks" in memory_summary({}, (0, 0))


@pytest.mark.slow
def test_profiler_window_writes_one_trace_per_rank(tmp_path):
    overrides = {
        "training.steps": 4,
        "metrics.wandb": "off",
        "profiling.enable": True,
        "profiling.start_step": 2,
        "profiling.steps": 2,
    }
    assert "steps 2-3 traced to" in train(tmp_path, overrides).stdout
    traces = sorted((tmp_path / "profiles" / "step_2").glob("rank*_trace.json"))
    assert [t.name for t in traces] == ["rank0_trace.json", "rank1_trace.json"]
    for t in traces:
        trace = json.loads(t.read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any("aten::mm" in n or "aten::addmm" in n for n in names), sorted(names)[:20]
        assert any("allreduce" in n.lower() or "all_reduce" in n.lower() for n in names)  # the loss all-reduce
        # one span per traced step, named as torch's scheduled profiler names them (trace readers cut on them)
        assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#2", "ProfilerStep#3"}
