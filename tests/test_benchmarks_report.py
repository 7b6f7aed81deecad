"""BENCHMARKS.md is rendered from the dated records in benchmarks/results/, newest first, and must be what they say;
a record's "met" must follow from its numbers; README.md and docs/ quote only figures that are in the record they
cite. Nothing here depends on the code having changed since a record was measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402


def _report(*args):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.report", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_benchmarks_md_docs_and_quoted_figures_match_the_records():
    proc = _report("--check")
    assert proc.returncode == 0, proc.stderr


def test_every_record_names_its_date_commit_machine_and_torch_and_no_machine_path():
    names = [name for name, _ in report.load_results()]  # schema and <date>-<machine>-<what> names checked there
    assert len(names) == len(list(report.RESULTS.glob("*.json")))
    for path in report.RESULTS.rglob("*"):
        if path.suffix in (".json", ".md"):
            text = path.read_text()
            for root in ("/work/", "/tmp/", "/home/", "/root/", "/Users/"):
                assert root not in text, f"{path.name} names a path of the machine it ran on ({root})"


def _record(d, name="2026-11-23-cpu-x", **over):
    d.mkdir(parents=True, exist_ok=True)
    data = {
        "title": "T",
        "command": "python benchmarks/x.py",
        "date": name[:10],
        "commit": "a" * 40,
        "machine": "2-core machine, CPU only",
        "torch": "2.14.1",
        "summary": [{"row": "ratio", "measured": 0.3, "target": "<= 0.25", "met": False}],
        "tables": [{"columns": ["a", "b"], "rows": [[1, 2.5]]}],
        **over,
    }
    (d / f"{name}.json").write_text(json.dumps(data))
    return d


def test_newest_first_with_date_commit_and_machine_beside_every_figure(tmp_path):
    res = _record(tmp_path / "results")
    _record(res, "2026-12-01-h100-y", commit="b" * 40, title="Newer")
    out = tmp_path / "B.md"
    assert _report("--results", str(res), "--out", str(out)).returncode == 0
    text = out.read_text()
    assert text.index("## Newer") < text.index("## T")  # newest first
    row = "| ratio ([2026-11-23-cpu-x](#2026-11-23-cpu-x)) | 0.3 | <= 0.25 | no | 2026-11-23 | aaaaaaaaaa | cpu |"
    assert row in text and "| 1 | 2.5 |" in text
    assert "2026-11-23 · commit aaaaaaaaaa · 2-core machine, CPU only · torch 2.14.1" in text
    out.write_text(text.replace("| 0.3 |", "| 0.2 |"))  # someone edited a number by hand
    proc = _report("--results", str(res), "--out", str(out), "--check")
    assert proc.returncode == 1 and "out of date" in proc.stderr


@pytest.mark.parametrize(
    "over, name, error",
    [
        (
            {"summary": [{"row": "stall", "measured": 0.484, "target": "<= 0.25", "met": True}]},
            "2026-11-23-cpu-x",
            "summary[0] ('stall') says met=True but measured 0.484 vs target '<= 0.25' gives False",
        ),
        ({"tables": [{"columns": ["a", "b"], "rows": [[1]]}]}, "2026-11-23-cpu-x", "tables[0] row 0 does not have 2"),
        ({"torch": ""}, "2026-11-23-cpu-x", "field 'torch' is missing"),
        ({}, "checkpoint", "name it <date>-<machine>-<what>.json"),
        ({"date": "2026-11-24"}, "2026-11-23-cpu-x", "with its date (2026-11-24) first"),
    ],
)
def test_a_record_that_breaks_the_schema_is_refused(tmp_path, over, name, error):
    res = _record(tmp_path / "results", name, **over)
    proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"))
    assert proc.returncode == 2 and error in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_quoted_figure_must_be_in_the_record_it_cites(tmp_path):
    """The guard of README.md and docs/: a link to a record whose text holds a figure passes only when the record
    holds that figure (rounded to the digits quoted; a percentage may be a fraction); a wrong, made-up or
    unsourced-by-a-missing-record figure fails."""
    _record(
        tmp_path / "benchmarks" / "results",
        summary=[{"row": "tokens/s", "measured": 9991.37, "target": None, "met": None}],
        notes=["loss fell from 10.7 to 1.9; MFU 0.325"],
    )
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "guide.md"
    rec = "../benchmarks/results/2026-11-23-cpu-x.json"
    good = f"It ran at [9,991 tokens/s]({rec}), [32.5% MFU]({rec}); the [loss fell 10.7 -> 1.9]({rec}).\n"
    assert report.cited_figure_errors(doc, good) == []
    bad = f"It ran at [9,990 tokens/s]({rec}) and [4.2 GB]({rec}).\n"
    assert report.cited_figure_errors(doc, bad) == [
        f"guide.md line 1: 9,990 is not in the record it cites, {rec}",
        f"guide.md line 1: 4.2 is not in the record it cites, {rec}",
    ]
    missing = "[7 loops](../benchmarks/results/2026-01-01-cpu-gone.json)"
    assert report.cited_figure_errors(doc, missing) == [
        "guide.md line 1: [7 loops] cites ../benchmarks/results/2026-01-01-cpu-gone.json, which does not exist"
    ]


def test_the_real_readme_and_docs_quote_figures_from_their_records():
    """Every figure README.md and docs/*.md quote beside a record link is in that record; and they do quote some
    (the guard is not vacuous)."""
    quoted = 0
    for doc in report.QUOTING:
        assert report.cited_figure_errors(doc) == [], doc
        quoted += sum(len(report.figures(label)) for label, _ in report._FIGURE_LINK.findall(doc.read_text()))
    assert quoted >= 5


def _doc(tmp_path, block_body="old text\n", parts="summary; Rates"):
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    doc = docs / "guide.md"
    doc.write_text(
        f"# Guide\n\nbefore\n\n<!-- benchmarks.report 2026-11-23-cpu-x: {parts} -->\n{block_body}"
        "<!-- /benchmarks.report -->\n\nafter\n"
    )
    return docs, doc


def test_doc_blocks_are_generated_from_the_record_and_checked(tmp_path):
    """A doc's generated block gets the record's rows; a hand edit inside it, or another record under its name,
    fails --check; the text around the block is kept."""
    res = _record(
        tmp_path / "results", tables=[{"title": "Rates (per GPU)", "columns": ["a", "b"], "rows": [[1, 2.5]]}]
    )
    docs, doc = _doc(tmp_path)
    args = ["--results", str(res), "--out", str(tmp_path / "B.md"), "--docs", str(docs)]
    assert _report(*args).returncode == 0
    text = doc.read_text()
    assert text.startswith("# Guide\n\nbefore\n\n<!-- benchmarks.report 2026-11-23-cpu-x: summary; Rates -->\n")
    assert text.endswith("<!-- /benchmarks.report -->\n\nafter\n") and "old text" not in text
    assert "| ratio | 0.3 | <= 0.25 | no |" in text and "Rates (per GPU)\n\n| a | b |\n|---|---|\n| 1 | 2.5 |" in text
    assert "(../results/2026-11-23-cpu-x.json)" in text  # the link is relative to the doc
    assert _report(*args, "--check").returncode == 0

    doc.write_text(text.replace("| 1 | 2.5 |", "| 1 | 2.4 |"))  # someone edited a number by hand
    proc = _report(*args, "--check")
    assert proc.returncode == 1 and f"a generated block of {doc} is out of date" in proc.stderr
    assert _report(*args).returncode == 0 and doc.read_text() == text  # regenerated

    doc.write_text("<!-- benchmarks.report 2026-11-23-cpu-x: Speeds -->\n<!-- /benchmarks.report -->\n")
    proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"), "--docs", str(docs))
    assert proc.returncode == 2 and "'Speeds' starts 0 table titles of 2026-11-23-cpu-x.json" in proc.stderr
    doc.write_text("<!-- benchmarks.report 2026-11-23-cpu-x: summary -->\nno end\n")
    proc = _report("--results", str(res), "--out", str(tmp_path / "B.md"), "--docs", str(docs))
    assert proc.returncode == 2 and "guide.md line 1: generated block has no closing" in proc.stderr
    assert doc.read_text() == "<!-- benchmarks.report 2026-11-23-cpu-x: summary -->\nno end\n"  # nothing written


def test_other_records_never_rewrite_the_real_docs(tmp_path):
    """With --results elsewhere and no --docs, docs/ is neither read nor written."""
    before = (ROOT / "docs" / "scaling.md").read_text()
    assert "<!-- benchmarks.report 2026-11-28-h100-throughput:" in before  # the real block
    res = _record(tmp_path / "results")
    assert _report("--results", str(res), "--out", str(tmp_path / "B.md")).returncode == 0
    assert (ROOT / "docs" / "scaling.md").read_text() == before


def test_a_new_run_adds_a_record_and_never_overwrites_one(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.setattr(report, "RESULTS", tmp_path)
    rec = {"title": "T", "command": "python benchmarks/x.py", "machine": "m", "summary": []}
    first = common.record_path("loss_memory")
    assert first.parent == tmp_path and first.name.endswith(f"-{common.machine_slug()}-loss-memory.json")
    common.write_report(None, "loss_memory", rec)
    second = common.record_path("loss_memory")
    assert second.name == first.name.replace(".json", "-2.json")
    written = json.loads(first.read_text())
    assert {"date", "commit", "torch"} <= set(written) and len(written["commit"]) == 40
    common.write_report(first, "loss_memory", {**rec, "title": "again"})  # an explicit --out that exists
    assert json.loads(first.read_text()) == written and json.loads(second.read_text())["title"] == "again"
