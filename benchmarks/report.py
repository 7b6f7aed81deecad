"""BENCHMARKS.md is generated from the committed benchmark results: one source for every benchmark number.

    python -m benchmarks.report            # rewrite BENCHMARKS.md (and docs' generated blocks) from the jsons
    python -m benchmarks.report --check    # exit 1 if BENCHMARKS.md or a doc's generated block is not what the
                                           #   json says, or a result is older than the code it measures
                                           #   (CI test; KNOWN_STALE excepted)
    python -m benchmarks.report --check --allow-stale  # stale results reported only (while re-measuring)

Staleness: each json records the commit it was measured on ("commit", full hash); MEASURES lists the paths of the
code each benchmark measures. A result is stale when that code behaves differently at its commit and in the working
tree, or when it records no commit. "Behaves differently" is read from a fingerprint that moves do not change
(benchmarks/fingerprint.py): every top-level definition of the measured Python files by its syntax tree, wherever
it sits (docstrings, comments, formatting and import lines do not count), every TOML file by its parsed table and
every shell script by its non-comment lines. Moving a class to another measured module keeps a result fresh;
changing a statement, a default, a config value or a script line makes it stale. Each BENCHMARKS.md section
says "measured at commit X; stale when generated: yes/no"; --check ignores those lines when comparing (they change
with every code change) and prints the current staleness instead.

Docs link to BENCHMARKS.md (or to the json) and do not restate its figures by hand. A doc that shows a result's
rows carries them in a generated block, which this command rewrites from the json (and --check compares):

    <!-- benchmarks.report gpu_throughput: summary; Training matrix -->
    (anything here is replaced by the summary rows and the table whose title starts "Training matrix")
    <!-- /benchmarks.report -->

Result file schema: `benchmarks/results/<name>.json`, one per benchmark (or per topic), a JSON object, written by
the benchmark script itself (its --out; `python benchmarks/run_all.py --results` runs them all at the recorded
sizes). A figure that depends on machine load is min / median / max over repeats, `met` judged on the median:

    {
      "title":   "Checkpoint: async save stall",             # section heading (required)
      "order":   50,                                         # position of the section (optional, default 100;
                                                             #   ties sorted by file name)
      "command": "python benchmarks/checkpoint.py --out benchmarks/results/checkpoint.json",   # (required)
      "date":    "2026-11-22",                               # when it was measured (required)
      "commit":  "f105044...",                               # git commit measured (full hash; see MEASURES)
      "machine": "2-core VM, CPU only, shared",              # where (required)
      "summary": [                                           # rows of the top summary table (may be [])
        {"row": "async save stall / sync save", "measured": 0.119, "target": "<= 0.25", "met": true}
      ],
      "tables":  [                                           # detail tables of the section (may be [])
        {"title": "optional caption", "columns": ["model", "s"], "rows": [["LoopLM", 1.5], ...]}
      ],
      "notes":   ["markdown paragraph", ...],                # (optional)
      "result":  {...}                                       # the script's own JSON output (optional, not rendered)
    }

`measured` is a number or a string; `target` a string such as "<= 0.25", ">= 20x", "= 3" or null; `met` is
true, false or null (no target). When `measured` is a number and `target` is "<= x", ">= x", "< x", "> x"
or "= x" (an optional trailing "x" or "%" is ignored), `met` must equal that comparison: a file whose `met`
contradicts its own numbers is refused. Numbers are rendered as written in the json (floats with up to 4
significant digits unless stored as strings).

GPU results are dated records, `benchmarks/results/gpu/<date>-<device>-<what>.json` (rendered as `gpu/<name>`),
each written on a GPU by its command (`python -m titanloop.checks`, `benchmarks/gpu_throughput.py`,
`benchmarks/looped_vs_dense.py`, `benchmarks/eval_speed.py`) with the device, torch version and commit it was
measured with. Its "kind" field (gpu_check, gpu_throughput, ...) names the code it measures in MEASURES; a newer
measurement is a new record beside the older ones, which stay as what was measured then.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import operator
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.fingerprint import Fingerprinter

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUTPUT = ROOT / "BENCHMARKS.md"
DOCS = ROOT / "docs"

HEADER = """\
# Benchmarks

Generated by `python -m benchmarks.report` from `benchmarks/results/*.json` (do not edit by hand: edit or
regenerate the json, then rerun the generator; a test fails when this file is out of date). Each section
names the command that produced its json, the date and the machine, the commit it was measured at, and whether
the code it measures (benchmarks/report.py MEASURES) has changed since: "stale: yes" means the figures describe
older code. Moved code, comments and formatting do not count as a change (benchmarks/fingerprint.py).
`python -m benchmarks.report --check` (a CI test) fails on a stale result unless it is on the KNOWN_STALE list
in benchmarks/report.py, which names why it was not re-measured; every check prints that list.
Every json is written by its benchmark script (no hand transcription): `python benchmarks/run_all.py --results`
re-measures all of them at their recorded sizes (or `--only NAME ...`), then `python -m benchmarks.report`
regenerates this file.

Every ratio compares titanloop with a baseline measured in the same run on the same machine. Timed candidates
alternate within each round, after warm-up; figures that depend on machine load are min / median / max over
the rounds, and "met" is judged on the median. Absolute times on the shared CPU VM are
noise. GPU figures come from the dated GPU records (`benchmarks/results/gpu/`), each naming its device and the torch
that measured it; the GPU records so far were measured with torch 2.11, while the project pins torch 2.14.1.
"""

_REQUIRED = {"title": str, "command": str, "date": str, "machine": str}

# Results allowed to be stale, each with why it was not re-measured (printed by every --check). Keep it short.
_UNCHANGED_FIGURES = (
    "since it was measured the trainer changed only in the MFU's peak (now the device's), its startup line, the "
    "memory plan's GPU memory and --fit-ac, the lm-eval adapter's refusal of --device cuda without a GPU, and the "
    "one torchrun command builder (the same command line); what this result measures reads none of them"
)
KNOWN_STALE: dict[str, str] = {
    # a name, or a pattern (fnmatch) of record names
    "gpu/*": "a dated GPU record: what its commit measured on its device and torch (2.11), kept as measured; a new "
    "run of its command adds a new record",
    **dict.fromkeys(
        ["communication", "document_masking", "memory_plan", "checkpoint_verify", "network_per_step", "engine_parity"],
        _UNCHANGED_FIGURES,
    ),
    **dict.fromkeys(
        ["data_loader", "data_locality"],
        "since it was measured only a note of benchmarks/data_loader.py changed its wording (no issue number); the "
        "code measured is the same",
    ),
}

# The code each result measures (repository paths; a folder covers everything under it), by result file stem.
# A result is stale when any of these changed since the commit it records.
_MODEL = ["titanloop/model/"]
# Code that only the README demo's kind of run executes: its config and the synthetic task generators (compose,
# mano, ...). Of the benchmarks only document_masking trains on them (the demo's config and task), so the others
# exclude these paths (git pathspec) and a change to the demo or a task stales document_masking alone.
_DEMO_ONLY = [":(exclude)train_configs/demo.toml", ":(exclude)titanloop/data/synthetic_tasks.py"]
# The eval CLI's own module runs only under `python -m titanloop.eval`, which no benchmark calls (the trainer's
# validation uses titanloop.eval's library modules, which stay measured).
_EVAL_CLI = [":(exclude)titanloop/eval/__main__.py"]
# The acceptance check (python -m titanloop.checks) runs the trainer; nothing the trainer runs imports it.
_CHECKS = [":(exclude)titanloop/checks/"]
# The memory plan's module runs only in the dry run's --memory-plan (titanloop.train.dry_run calls plan_memory; no
# trainer code calls into it), so results that launch the trainer do not measure it; the three that plan or call
# its measure_step measure _TRAINER_AND_PLAN.
_PLAN = "titanloop/train/memory_plan.py"
_TRAINER_AND_PLAN = ["titanloop/", "train_configs/", *_DEMO_ONLY, *_EVAL_CLI, *_CHECKS]
_TRAINER = [*_TRAINER_AND_PLAN, f":(exclude){_PLAN}"]  # benchmarks that launch the trainer
MEASURES: dict[str, list[str]] = {
    "activation_checkpointing": [
        "benchmarks/activation_checkpointing.py",
        "benchmarks/common.py",
        *_MODEL,
        "titanloop/objectives/",
        "titanloop/parallel/activation_checkpoint.py",
    ],
    "checkpoint": ["benchmarks/checkpoint.py", "titanloop/checkpoint/", *_MODEL],
    "checkpoint_verify": ["benchmarks/checkpoint_verify.py", *_TRAINER],
    "communication": ["benchmarks/communication.py", "benchmarks/common.py", *_TRAINER],
    "compile_speed": ["benchmarks/compile_speed.py", "benchmarks/common.py", *_MODEL, "titanloop/parallel/compile.py"],
    "data_loader": ["benchmarks/data_loader.py", "titanloop/data/", *_MODEL, *_DEMO_ONLY],
    "data_locality": ["benchmarks/data_loader.py", "titanloop/data/", *_DEMO_ONLY],
    "document_masking": [
        "benchmarks/document_masking.py",
        "titanloop/",
        "train_configs/",
        *_EVAL_CLI,
        *_CHECKS,
        f":(exclude){_PLAN}",
    ],
    "engine_parity": ["benchmarks/engine_parity.py", *_TRAINER],
    "loop_efficiency": ["benchmarks/loop_efficiency.py", "benchmarks/common.py", *_MODEL, "titanloop/objectives/"],
    "loss_memory": ["benchmarks/loss_memory.py", "benchmarks/common.py", *_MODEL, "titanloop/objectives/"],
    "memory_plan": ["benchmarks/memory_plan.py", "slurm/", *_TRAINER_AND_PLAN],
    "network_per_step": ["benchmarks/network_per_step.py", "slurm/", *_TRAINER_AND_PLAN],
    "scaling_on_paper": ["benchmarks/scaling_on_paper.py", "benchmarks/common.py", "titanloop/model/config.py"],
    # the kinds of the dated GPU records (benchmarks/results/gpu/): the command that wrote each and the trainer
    "gpu_check": ["titanloop/checks/", "scripts/gpu_check.sh", "titanloop/", "train_configs/", *_DEMO_ONLY],
    "gpu_eval": ["titanloop/", "train_configs/", *_DEMO_ONLY],
    "gpu_throughput": ["benchmarks/gpu_throughput.py", "titanloop/", "train_configs/", *_DEMO_ONLY],
    "looped_vs_dense": [
        "benchmarks/looped_vs_dense.py",
        "benchmarks/torchtitan_dense.py",
        "titanloop/",
        "train_configs/",
    ],
    "eval_speed": ["benchmarks/eval_speed.py", *_MODEL, "titanloop/eval/"],
    "plan_vs_peak": [_PLAN, "titanloop/train/dry_run.py"],
    # nanoGPT's side runs from the user's checkout; titanloop's is the trainer, the config and the data pipeline
    "nanogpt": ["benchmarks/nanogpt.py", "data_pipelines/", "data/", *_TRAINER],
}
_STALE_LINE = re.compile(r"^Measured at commit .*$", re.M)


def staleness(name: str, data: dict, repo: Path = ROOT, measures: dict | None = None) -> tuple[bool, str]:
    """(stale, one-line reason) of result `name`: the fingerprint of the code it measures at its recorded commit
    against the working tree of `repo` (benchmarks.fingerprint: moves, comments and formatting do not count)."""
    paths = (MEASURES if measures is None else measures).get(data.get("kind", name))
    commit = data.get("commit")
    if not paths:
        return True, f"no code paths listed for {name!r} in benchmarks/report.py MEASURES"
    if not isinstance(commit, str) or not commit:
        return True, "the result records no commit"
    try:
        changed = _fingerprinter(repo).changed(commit, paths)
    except LookupError as e:
        if _shallow(repo):
            return False, f"not judged: commit {commit[:10]} is outside this shallow clone (git fetch --unshallow)"
        return True, f"git cannot compare with commit {commit[:10]} ({e})"
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return True, f"changed since: {', '.join(changed[:3])}{more}"
    return False, "no measured code changed since"


_FINGERPRINTERS: dict[Path, Fingerprinter] = {}


def _fingerprinter(repo: Path) -> Fingerprinter:
    """One per repository and process: the units of a commit's files are read and parsed once for all results."""
    repo = Path(repo).resolve()
    if repo not in _FINGERPRINTERS:
        _FINGERPRINTERS[repo] = Fingerprinter(repo)
    return _FINGERPRINTERS[repo]


def _shallow(repo: Path) -> bool:
    proc = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=repo, capture_output=True, text=True)
    return proc.stdout.strip() == "true"


_TARGET = re.compile(r"^\s*(<=|>=|<|>|=)\s*([-+0-9.eE]+)\s*[x%]?\s*$")
_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "=": operator.eq}


class ResultError(ValueError):
    """A benchmark result file that does not follow the schema (one line: file and what is wrong)."""


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: ""}[v]
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def expected_met(measured, target) -> bool | None:
    """The comparison `measured <target>` when both are machine-readable, else None."""
    if isinstance(measured, bool) or not isinstance(measured, (int, float)) or not isinstance(target, str):
        return None
    m = _TARGET.match(target)
    return None if m is None else _OPS[m.group(1)](measured, float(m.group(2)))


def validate(path: Path, data) -> dict:
    """The parsed result of `path`, checked against the schema; ResultError naming the file otherwise."""
    where = f"benchmark result {path.name}"
    if not isinstance(data, dict):
        raise ResultError(f"{where}: expected a JSON object, got {type(data).__name__}")
    for key, typ in _REQUIRED.items():
        if not isinstance(data.get(key), typ) or not data[key]:
            raise ResultError(f"{where}: field {key!r} is missing or not a non-empty {typ.__name__}")
    for i, row in enumerate(data.get("summary", [])):
        if not isinstance(row, dict) or not {"row", "measured"} <= set(row):
            raise ResultError(f"{where}: summary[{i}] needs 'row' and 'measured' (and 'target', 'met')")
        want = expected_met(row["measured"], row.get("target"))
        if want is not None and row.get("met") is not want:
            raise ResultError(
                f"{where}: summary[{i}] ({row['row']!r}) says met={row.get('met')} but measured "
                f"{row['measured']} vs target {row['target']!r} gives {want}"
            )
    for i, table in enumerate(data.get("tables", [])):
        cols = table.get("columns") if isinstance(table, dict) else None
        rows = table.get("rows") if isinstance(table, dict) else None
        if not isinstance(cols, list) or not isinstance(rows, list):
            raise ResultError(f"{where}: tables[{i}] needs 'columns' (list) and 'rows' (list of lists)")
        bad = [j for j, r in enumerate(rows) if not isinstance(r, list) or len(r) != len(cols)]
        if bad:
            raise ResultError(f"{where}: tables[{i}] row {bad[0]} does not have {len(cols)} cells")
    if not isinstance(data.get("notes", []), list):
        raise ResultError(f"{where}: 'notes' must be a list of markdown paragraphs")
    return data


def load_results(results_dir: Path = RESULTS) -> list[tuple[str, dict]]:
    out = []
    for path in [*sorted(results_dir.glob("*.json")), *sorted((results_dir / "gpu").glob("*.json"))]:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ResultError(f"benchmark result {path.name}: not valid JSON ({e})") from None
        out.append(
            (path.stem if path.parent == results_dir else f"{path.parent.name}/{path.stem}", validate(path, data))
        )
    return sorted(out, key=lambda nd: (nd[1].get("order", 100), nd[0]))


def _table(columns: list, rows: list) -> list[str]:
    lines = ["| " + " | ".join(map(str, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return lines


def _titled_table(t: dict) -> list[str]:
    """A result's table as markdown lines (its title first, when it has one), followed by a blank line."""
    return ([t["title"], ""] if t.get("title") else []) + _table(t["columns"], t["rows"]) + [""]


def measured_commit(name: str, repo: Path = ROOT) -> str | None:
    """The commit a benchmark writing result `name` measures now (HEAD), for its json's "commit". Measure committed
    code: with uncommitted changes under MEASURES[name] the result is stale from the start (a warning says so)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "diff", "--name-only", "HEAD", "--", *MEASURES.get(name, ["."])],
        cwd=repo,
        capture_output=True,
        text=True,
    ).stdout.split()
    if dirty:
        print(
            f"warning: uncommitted changes in {', '.join(dirty[:3])}: {name}.json records commit {head[:10]} "
            f"and will read as stale; commit the code, then measure",
            file=sys.stderr,
        )
    return head or None


def anchor(name: str) -> str:
    """The section's link target in BENCHMARKS.md (a dated record's "gpu/" becomes "gpu-")."""
    return name.replace("/", "-")


def known_stale(name: str) -> str | None:
    """Why result `name` is allowed to be stale (KNOWN_STALE, by name or pattern), or None."""
    return next((why for key, why in KNOWN_STALE.items() if fnmatch.fnmatchcase(name, key)), None)


def _head(repo: Path = ROOT) -> str:
    proc = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=repo, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def render(results: list[tuple[str, dict]], repo: Path = ROOT, measures: dict | None = None) -> str:
    lines = [HEADER, "## Summary", ""]
    summary = [
        [f"{r['row']} ([{name}](#{anchor(name)}))", r["measured"], r.get("target") or "", r.get("met")]
        for name, d in results
        for r in d.get("summary", [])
    ]
    lines += _table(["row", "measured", "target", "met"], summary) + [""]
    for name, d in results:
        lines += [
            f'<a id="{anchor(name)}"></a>',
            "",
            f"## {d['title']}",
            "",
            f"`{d['command']}` · {d['date']} · {d['machine']}"
            + f" · [`benchmarks/results/{name}.json`](benchmarks/results/{name}.json)",
            "",
        ]
        stale, why = staleness(name, d, repo, measures)
        commit = d.get("commit")
        lines += [
            f"Measured at commit {commit[:10] if commit else 'unknown'}; stale when generated (at "
            f"{_head(repo)}): {'yes' if stale else 'no'} ({why}).",
            "",
        ]
        for t in d.get("tables", []):
            lines += _titled_table(t)
        for note in d.get("notes", []):
            lines += [note, ""]
    return "\n".join(lines).rstrip() + "\n"


# A generated block in a doc: the opening line names a result and what of it to show ("summary", or a table by the
# start of its title), ";"-separated; everything up to the closing line is rewritten from the json.
_BLOCK_OPEN = re.compile(r"^<!-- benchmarks\.report (?P<name>[\w/-]+): (?P<parts>.+?) -->$")
_BLOCK_CLOSE = "<!-- /benchmarks.report -->"


def _doc_block(doc: Path, line_no: int, name: str, parts: str, results: dict, results_dir: Path) -> list[str]:
    where = f"{doc.name} line {line_no}"
    if name not in results:
        raise ResultError(f"{where}: no result {name}.json for its generated block (known: {', '.join(results)})")
    d = results[name]
    rel = os.path.relpath(results_dir / f"{name}.json", doc.parent)
    lines = [
        f"Generated by `python -m benchmarks.report` from [`benchmarks/results/{name}.json`]({rel}) "
        f"({d['machine']}; commit {(d.get('commit') or 'unknown')[:10]}, {d['date']}). Do not edit: edits are "
        "overwritten, and CI's `--check` fails on them.",
        "",
    ]
    for part in (p.strip() for p in parts.split(";")):
        if part == "summary":
            rows = [[r["row"], r["measured"], r.get("target") or "", r.get("met")] for r in d.get("summary", [])]
            lines += _table(["row", "measured", "target", "met"], rows) + [""]
            continue
        tables = [t for t in d.get("tables", []) if (t.get("title") or "").startswith(part)]
        if len(tables) != 1:
            titles = "; ".join(repr(t.get("title") or "") for t in d.get("tables", []))
            raise ResultError(
                f"{where}: {part!r} starts {len(tables)} table titles of {name}.json, not one (its tables: {titles})"
            )
        lines += _titled_table(tables[0])
    return lines[:-1]


def render_docs(results: list[tuple[str, dict]], docs_dir: Path, results_dir: Path = RESULTS) -> dict[Path, str]:
    """{doc: its text with every generated block rewritten from the results}, only for the docs under `docs_dir`
    whose text that changes (the out-of-date ones; each doc is read once)."""
    by_name = dict(results)
    out = {}
    for doc in sorted(docs_dir.glob("*.md")):
        old = doc.read_text()
        src = old.split("\n")
        text, i, found = [], 0, False
        while i < len(src):
            text.append(src[i])
            m = _BLOCK_OPEN.match(src[i])
            if m is None:
                i += 1
                continue
            found = True
            end = next((j for j in range(i + 1, len(src)) if src[j] == _BLOCK_CLOSE), None)
            if end is None:
                raise ResultError(f"{doc.name} line {i + 1}: generated block has no closing {_BLOCK_CLOSE}")
            text += _doc_block(doc, i + 1, m["name"], m["parts"], by_name, results_dir) + [_BLOCK_CLOSE]
            i = end + 1
        new = "\n".join(text)
        if found and new != old:
            out[doc] = new
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if BENCHMARKS.md or a doc's generated block is out of date",
    )
    p.add_argument(
        "--allow-stale",
        action="store_true",
        help="with --check: report stale results without failing (while re-measuring); CI runs without it",
    )
    p.add_argument("--results", type=Path, default=RESULTS, help="directory of result json files")
    p.add_argument("--out", type=Path, default=OUTPUT, help="markdown file to write or check")
    p.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="directory of docs whose generated blocks to rewrite or check (default: docs/ with the default "
        "--results, none with other results, so that they never overwrite the real docs)",
    )
    a = p.parse_args(argv)
    docs_dir = a.docs or (DOCS if a.results == RESULTS else None)
    try:
        results = load_results(a.results)
        text = render(results)
        docs = render_docs(results, docs_dir, a.results) if docs_dir else {}  # the out-of-date ones
    except ResultError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.check:
        stale = [(name, why) for name, d in results for is_stale, why in [staleness(name, d)] if is_stale]
        failing = [(name, why) for name, why in stale if known_stale(name) is None]
        for name, why in stale:
            known = f"; known: {known_stale(name)}" if known_stale(name) else ""
            print(f"stale: {name}.json ({why}{known})")
        print(
            f"{len(stale)} of {len(results)} result(s) stale, {len(stale) - len(failing)} of them on KNOWN_STALE"
            + (" (reported only: --allow-stale)" if a.allow_stale else "")
        )
        if failing and not a.allow_stale:
            print(
                f"error: {', '.join(n + '.json' for n, _ in failing)} older than the code they measure: re-measure "
                "(python benchmarks/run_all.py --results --only NAME ...), then python -m benchmarks.report",
                file=sys.stderr,
            )
        if not a.out.is_file() or _STALE_LINE.sub("", a.out.read_text()) != _STALE_LINE.sub("", text):
            print(
                f"error: {a.out} is out of date with {a.results}; regenerate it: python -m benchmarks.report",
                file=sys.stderr,
            )
            return 1
        for doc in docs:
            print(
                f"error: a generated block of {doc} is out of date with {a.results} (or was edited by hand); "
                "regenerate it: python -m benchmarks.report",
                file=sys.stderr,
            )
        if docs:
            return 1
        return 1 if failing and not a.allow_stale else 0
    a.out.write_text(text)
    print(f"wrote {a.out} from {len(list(a.results.glob('*.json')))} result file(s)")
    for doc, new in docs.items():
        doc.write_text(new)
        print(f"rewrote the generated blocks of {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
