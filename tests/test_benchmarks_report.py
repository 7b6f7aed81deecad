"""BENCHMARKS.md is generated from benchmarks/results/*.json and must be up to date with it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _report(*args):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.report", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_benchmarks_md_matches_committed_results():
    proc = _report("--check")
    assert proc.returncode == 0, proc.stderr


def _write(tmp_path, **over):
    res = tmp_path / "results"
    res.mkdir(exist_ok=True)
    data = {
        "title": "T",
        "command": "python benchmarks/x.py",
        "date": "2026-11-23",
        "machine": "cpu",
        "summary": [{"row": "ratio", "measured": 0.3, "target": "<= 0.25", "met": False}],
        "tables": [{"columns": ["a", "b"], "rows": [[1, 2.5]]}],
        **over,
    }
    (res / "x.json").write_text(json.dumps(data))
    return res


def test_generator_detects_stale_markdown(tmp_path):
    res = _write(tmp_path)
    out = tmp_path / "B.md"
    assert _report("--results", str(res), "--out", str(out)).returncode == 0
    text = out.read_text()
    assert "| ratio ([x](#x)) | 0.3 | <= 0.25 | no |" in text and "| 1 | 2.5 |" in text
    out.write_text(text.replace("0.3", "0.2"))  # someone edited a number by hand
    proc = _report("--results", str(res), "--out", str(out), "--check")
    assert proc.returncode == 1 and "out of date" in proc.stderr


def test_generator_refuses_met_that_contradicts_the_numbers(tmp_path):
    res = _write(tmp_path, summary=[{"row": "stall", "measured": 0.484, "target": "<= 0.25", "met": True}])
    proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: benchmark result x.json: summary[0] ('stall') says met=True but measured 0.484 vs target "
        "'<= 0.25' gives False"
    ]


def test_generator_refuses_ragged_tables(tmp_path):
    res = _write(tmp_path, tables=[{"columns": ["a", "b"], "rows": [[1]]}])
    proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"))
    assert proc.returncode == 2 and "tables[0] row 0 does not have 2 cells" in proc.stderr


def _git_repo(tmp_path):
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    def commit(msg="c"):
        git("add", "-A")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", msg)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    return commit


def test_staleness_follows_the_measured_paths_since_the_recorded_commit(tmp_path):
    from benchmarks.report import render, staleness

    commit = _git_repo(tmp_path)
    (tmp_path / "measured.py").write_text("x = 1\n")
    (tmp_path / "other.py").write_text("y = 1\n")
    measures = {"x": ["measured.py"]}
    data = {"title": "T", "command": "c", "date": "2026-11-25", "machine": "cpu", "commit": commit("measured")}
    assert staleness("x", data, tmp_path, measures) == (False, "no measured code changed since")
    (tmp_path / "other.py").write_text("y = 2\n")  # not measured by x
    assert not staleness("x", data, tmp_path, measures)[0]
    (tmp_path / "measured.py").write_text("x = 2\n")  # the measured code changed (even uncommitted)
    assert staleness("x", data, tmp_path, measures) == (True, "changed since: measured.py:x")
    assert staleness("x", {**data, "commit": None}, tmp_path, measures) == (True, "the result records no commit")
    assert staleness("y", data, tmp_path, measures)[0]  # a result without listed paths counts as stale
    text = render([("x", data)], tmp_path, measures)
    assert f"Measured at commit {data['commit'][:10]}; stale when generated" in text
    assert "yes (changed since: measured.py:x)" in text
    # a folder with an excluded file (git pathspec, as the benchmarks exclude the demo's config and task generators)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "used.py").write_text("u = 1\n")
    (tmp_path / "pkg" / "demo_only.py").write_text("d = 1\n")
    data = {**data, "commit": commit("pkg")}
    measures = {"x": ["pkg/", ":(exclude)pkg/demo_only.py"]}
    (tmp_path / "pkg" / "demo_only.py").write_text("d = 2\n")
    assert not staleness("x", data, tmp_path, measures)[0]
    (tmp_path / "pkg" / "used.py").write_text("u = 2\n")
    assert staleness("x", data, tmp_path, measures) == (True, "changed since: pkg/used.py:u")


def test_staleness_ignores_moves_comments_and_formatting_but_not_behaviour(tmp_path):
    """A pure move of code keeps a result fresh; a changed statement, default or config value makes it stale."""
    from benchmarks.report import staleness

    commit = _git_repo(tmp_path)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        '"""Module a."""\nimport math\n\n\ndef f(x):\n    """Doc."""\n    return math.sqrt(x) + 1\n\n\n'
        "class C:\n    lr: float = 3e-4\n"
    )
    (pkg / "b.py").write_text("def g():\n    return 2\n")
    (pkg / "run.toml").write_text("[training]\nsteps = 10  # short\n")
    (pkg / "run.sh").write_text("#!/bin/bash\n#SBATCH --nodes=2\n# a comment\necho hi\n")
    measures = {"x": ["pkg/"]}
    data = {"title": "T", "command": "c", "date": "2026-11-25", "machine": "cpu", "commit": commit()}
    # moved: class C to b.py with its import, new docstrings and comments, reformatted, the toml re-laid out
    (pkg / "a.py").write_text(
        '"""Module a, reworded."""\nfrom math import sqrt  # moved import\nimport math\n\n\n'
        'def f(x):\n    """Another doc."""\n    # a comment\n    return (math.sqrt(x)\n            + 1)\n'
    )
    (pkg / "b.py").write_text("def g():\n    return 2\n\n\nclass C:\n    lr: float = 3e-4  # the LR\n")
    (pkg / "run.toml").write_text("# header\n[training]\nsteps    = 10\n")
    (pkg / "run.sh").write_text("#!/bin/bash\n#SBATCH --nodes=2\n# another comment\n  echo hi\n")
    assert staleness("x", data, tmp_path, measures) == (False, "no measured code changed since")
    # a plain new definition (a function, a method, a constant under a new name) runs nowhere until a changed unit
    # names it: still fresh
    (pkg / "b.py").write_text(
        "def g():\n    return 2\n\n\ndef h():\n    return 3\n\n\nK = (1, 2)\n\n\n"
        "class C:\n    lr: float = 3e-4\n\n    def extra(self):\n        return 1\n"
    )
    assert staleness("x", data, tmp_path, measures) == (False, "no measured code changed since")
    # a plain definition removed (or moved out of the measured paths) that no measured code names: still fresh
    (pkg / "b.py").write_text("def g():\n    return 2\n")
    (pkg / "a.py").write_text("import math\n\n\ndef f(x):\n    return math.sqrt(x) + 1\n")
    assert staleness("x", data, tmp_path, measures) == (False, "no measured code changed since")
    # ... but one that measured code still names (now imported from elsewhere) counts
    (pkg / "a.py").write_text("import math\nfrom outside import C\n\n\ndef f(x):\n    return math.sqrt(x) + 1\n")
    stale, why = staleness("x", data, tmp_path, measures)
    assert stale and why.endswith(".py:C"), why  # (the label of the removed side: where C sat at the commit)
    (pkg / "a.py").write_text("import math\n\n\ndef f(x):\n    return math.sqrt(x) + 1\n")
    g_and_c = "def g():\n    return 2\n\n\nclass C:\n    lr: float = 3e-4\n"
    for path, text, label in [
        ("b.py", "def g():\n    return 2\n\n\nclass C:\n    lr: float = 1e-3\n", "pkg/b.py:C.lr"),  # a default
        ("b.py", g_and_c + "\n\ndef g():\n    return 5\n", "pkg/b.py:g"),  # a new definition shadowing g
        ("b.py", g_and_c + "\n\n@register\ndef plugin():\n    return 1\n", "pkg/b.py:plugin"),  # registers itself
        ("b.py", g_and_c + "\nsetup()\n", "pkg/b.py:expr"),  # a module-level call
        # a rename: fresh while nothing calls it, stale once a caller does (the caller changed)
        ("a.py", "import math\n\n\ndef f(x):\n    return math.sqrt(x) + g2()\n", "pkg/a.py:f"),
        ("a.py", "def f(x):\n    return x + 1\n", "pkg/a.py:f"),  # a statement
        ("run.toml", "[training]\nsteps = 11\n", "pkg/run.toml"),  # a config value
        ("run.sh", "#!/bin/bash\n#SBATCH --nodes=4\necho hi\n", "pkg/run.sh"),  # a Slurm directive
    ]:
        before = (pkg / path).read_text()
        (pkg / path).write_text(text)
        stale, why = staleness("x", data, tmp_path, measures)
        assert stale and label in why, (path, why)
        (pkg / path).write_text(before)
    assert not staleness("x", data, tmp_path, measures)[0]


def test_every_committed_result_is_fresh_or_known_stale():
    """The check that keeps every published number measured on today's code: a result older than the code it
    measures fails CI unless it is on KNOWN_STALE (with its reason, printed)."""
    from benchmarks.report import KNOWN_STALE, MEASURES, RESULTS

    assert {p.stem for p in RESULTS.glob("*.json")} <= set(MEASURES)
    assert {json.loads(p.read_text())["kind"] for p in (RESULTS / "gpu").glob("*.json")} <= set(MEASURES)
    assert {k for k in KNOWN_STALE if "*" not in k} <= set(MEASURES)
    proc = _report("--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)


def test_check_fails_on_a_stale_result_unless_known(tmp_path, monkeypatch):
    import benchmarks.report as report

    res = _write(tmp_path, commit="0" * 40)  # a commit this repository does not have: stale
    out = tmp_path / "B.md"
    monkeypatch.setattr(report, "MEASURES", {**report.MEASURES, "x": ["benchmarks/x.py"]})
    assert report.main(["--results", str(res), "--out", str(out)]) == 0
    assert report.main(["--results", str(res), "--out", str(out), "--check"]) == 1
    assert report.main(["--results", str(res), "--out", str(out), "--check", "--allow-stale"]) == 0
    monkeypatch.setattr(report, "KNOWN_STALE", {"x": "needs a GPU"})
    assert report.main(["--results", str(res), "--out", str(out), "--check"]) == 0


def _doc(tmp_path, block_body="stale text\n", parts="summary; Rates"):
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    doc = docs / "guide.md"
    doc.write_text(
        f"# Guide\n\nbefore\n\n<!-- benchmarks.report x: {parts} -->\n{block_body}"
        "<!-- /benchmarks.report -->\n\nafter\n"
    )
    return docs, doc


def test_doc_blocks_are_generated_from_the_json_and_checked(tmp_path):
    """A doc's generated block gets the json's rows; a hand edit inside it, or a json that changed since, fails
    --check; the text around the block is kept."""
    res = _write(tmp_path, tables=[{"title": "Rates (per GPU)", "columns": ["a", "b"], "rows": [[1, 2.5]]}])
    docs, doc = _doc(tmp_path)
    args = ["--results", str(res), "--out", str(tmp_path / "B.md"), "--docs", str(docs)]
    assert _report(*args).returncode == 0
    text = doc.read_text()
    assert text.startswith("# Guide\n\nbefore\n\n<!-- benchmarks.report x: summary; Rates -->\n")
    assert text.endswith("<!-- /benchmarks.report -->\n\nafter\n") and "stale text" not in text
    assert "| ratio | 0.3 | <= 0.25 | no |" in text and "Rates (per GPU)\n\n| a | b |\n|---|---|\n| 1 | 2.5 |" in text
    assert "(../results/x.json)" in text  # the link is relative to the doc
    assert _report(*args, "--check", "--allow-stale").returncode == 0

    doc.write_text(text.replace("| 1 | 2.5 |", "| 1 | 2.4 |"))  # someone edited a number by hand
    proc = _report(*args, "--check", "--allow-stale")
    assert proc.returncode == 1 and f"a generated block of {doc} is out of date" in proc.stderr
    assert _report(*args).returncode == 0 and doc.read_text() == text  # regenerated

    _write(tmp_path, tables=[{"title": "Rates (per GPU)", "columns": ["a", "b"], "rows": [[1, 3.5]]}])
    assert _report(*args, "--check", "--allow-stale").returncode == 1  # the json moved on, the doc did not


def test_doc_blocks_refuse_what_they_cannot_render(tmp_path):
    res = _write(tmp_path, tables=[{"title": "Rates", "columns": ["a"], "rows": [[1]]}])
    for body, parts, error in [
        ("", "summary; Speeds", "'Speeds' starts 0 table titles of x.json, not one (its tables: 'Rates')"),
        ("", "summary", None),
    ]:
        docs, doc = _doc(tmp_path, body, parts)
        proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"), "--docs", str(docs))
        if error is None:
            assert proc.returncode == 0, proc.stderr
        else:
            assert proc.returncode == 2 and proc.stderr.strip() == f"error: guide.md line 5: {error}"
    doc.write_text("<!-- benchmarks.report nope: summary -->\n<!-- /benchmarks.report -->\n")
    proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"), "--docs", str(docs))
    assert proc.returncode == 2 and "guide.md line 1: no result nope.json" in proc.stderr
    doc.write_text("<!-- benchmarks.report x: summary -->\nno end\n")
    proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"), "--docs", str(docs))
    assert proc.returncode == 2 and "guide.md line 1: generated block has no closing" in proc.stderr
    assert doc.read_text() == "<!-- benchmarks.report x: summary -->\nno end\n"  # nothing written on an error


def test_other_results_never_rewrite_the_real_docs(tmp_path):
    """With --results elsewhere and no --docs, docs/ is neither read nor written (a test's results would
    otherwise replace the real tables)."""
    before = (ROOT / "docs" / "scaling.md").read_text()
    assert "from [`benchmarks/results/gpu/2026-11-28-h100-throughput.json`]" in before  # the real block
    res = _write(tmp_path)
    assert _report("--results", str(res), "--out", str(tmp_path / "B.md")).returncode == 0
    assert (ROOT / "docs" / "scaling.md").read_text() == before
