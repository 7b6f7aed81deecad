"""The user-facing text speaks of the product: README, BENCHMARKS.md, docs, result READMEs, --help texts and comments
of the scripts, benchmarks, library, configs and Slurm scripts carry no machine lent for a while, no call budgets,
no sessions of work, no issue numbers, no paths of the machine they were written on, and no names of the tools that
served remote calls. `git grep` over the tracked files finds none; a hit fails with the file, line and what it is.
(tests/ is not user-facing text and is not searched.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
USER_FACING = [
    "README.md",
    "BENCHMARKS.md",
    ":(glob)docs/**/*.md",
    "benchmarks/README.md",
    ":(glob)benchmarks/results/**/README.md",
    "scripts",
    ":(glob)benchmarks/*.py",
    "titanloop",
    "train_configs",
    "slurm",
    "pyproject.toml",
    "experiments",
    "data_pipelines",
    ":(glob)data/*.md",
]
PROCESS_WORDS = {  # Perl regex (git grep -P, case-insensitive) -> what it is
    r"\blent\b": "a machine lent for a while",
    r"\b(gpu|next|this|that|previous|earlier|later) sessions?\b|sessions? of work|gpu_sessions?\b": "sessions of work",
    r"call budget|--budget-s|\bbudget_s\b|\d+ s budget": "call budgets",
    r"device tool|carry \[": "the remote-call tool",
    r"shared/GPU\.md|\.\./shared/|/work/|/tmp/t211|/root/out": "paths of the machine it was written on",
    r"\bissue #?\d+|\bissues #?\d+\s*(,|and)": "an issue number",
    r"gpu_session\.py|gpu_procs|plan_vs_gpu": "a tool of remote calls",
}


def process_word_hits(pattern: str, root: Path = ROOT) -> list[str]:
    proc = subprocess.run(
        ["git", "grep", "-n", "-I", "-i", "-P", pattern, "--", *USER_FACING],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1: no match
    return proc.stdout.splitlines()


@pytest.mark.parametrize("pattern", PROCESS_WORDS)
def test_user_facing_text_speaks_of_the_product(pattern):
    hits = process_word_hits(pattern)
    assert not hits, f"{PROCESS_WORDS[pattern]} in user-facing text:\n" + "\n".join(h[:200] for h in hits[:20])


def test_the_search_finds_what_it_is_for(tmp_path):
    """In a repository of its own: each kind of process text in a tracked doc is found, and product text is not."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "docs").mkdir()
    bad = {
        "docs/a.md": "On a GPU machine lent for a few minutes it runs.",
        "docs/b.md": "That waits for the next session.",
        "docs/c.md": "Run it with --budget-s 540.",
        "docs/d.md": "See shared/GPU.md for the wheels.",
        "docs/e.md": "As summarized in issue 34.",
        "docs/f.md": "Run python scripts/gpu_session.py first.",
        "docs/g.md": "The results come back through the device tool.",
    }
    good = {"README.md": "It issues 3 all-gathers per step; a Slurm session; its per-call overhead; a time budget."}
    for name, text in {**bad, **good}.items():
        (tmp_path / name).write_text(text + "\n")
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    found = {h.split(":")[0] for p in PROCESS_WORDS for h in process_word_hits(p, tmp_path)}
    assert found == set(bad)
