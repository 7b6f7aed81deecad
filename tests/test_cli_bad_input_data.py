"""Bad input to every data command-line tool (`python -m data_pipelines.*`), as a new user would give it: missing,
empty, binary and non-UTF-8 files, malformed and mistyped JSON lines, existing outputs, wrong tokenizers; tools
with workers run with --workers 2. Each case runs the real command in its own copy of a small directory, under
a timeout (a hang fails), and must exit nonzero with one line naming the problem, print no traceback, and leave
every file that existed before as it was (the directory tree is hashed before and after; a failed run leaves
nothing behind either). The cases run concurrently, so the matrix stays short on two cores.

Further tests: a failed tokenize does not block its rerun; tokenize counts unknown tokens and dropped documents;
--overwrite replaces what it is asked to; --debug / TITANLOOP_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from data_pipelines import tokenize, tokenizer

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 120  # seconds per command (start-up on a busy machine included); a hang fails the case
GOOD = ['{"text": "the quick brown fox"}', '{"text": "jumps over the lazy dog"}']


def _jsonl(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


FILES = {
    "good.jsonl": _jsonl(*GOOD),
    "good.txt": b"the quick brown fox\njumps over the lazy dog\n",
    "empty.txt": b"",
    "empty.jsonl": b"",
    "binary.jsonl": bytes(range(256)) * 4,
    "binary.txt": bytes(range(256)) * 4,
    "nonutf8.txt": b"the quick brown fox\njumps \xff\xfe over\n",
    "nonutf8.jsonl": _jsonl(GOOD[0]) + b'{"text": "b\xffd"}\n',
    "malformed.jsonl": _jsonl(GOOD[0], '{"text": "no closing brace"'),
    "wrongtype.jsonl": _jsonl(GOOD[0], '{"text": 5}'),
    "notext.jsonl": _jsonl(GOOD[0], '{"body": "the text is under another key"}'),
    "notatokenizer.json": b'{"vocab": ["a", "b"]}',
    "file.txt": b"a file that is not a directory\n",
    "taken/keep.txt": b"precious\n",
    "nomanifest/keep.txt": b"a directory without manifest.json\n",
    "badmanifest/manifest.json": bytes(range(256)),
    "badindex/index.json": b"{not json",
    "synth/train/keep.txt": b"precious\n",
    "corpora/shakespeare_char/tokenizer.json": b"{}",
}
# one bad file among good ones: --workers 2 runs them in two processes (the bad one is not the first)
MIXED = ("nonutf8.txt", "malformed.jsonl", "notext.jsonl", "wrongtype.jsonl", "binary.jsonl")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-input")
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    for name in MIXED:
        d = root / f"mixed-{name.split('.')[0]}"
        d.mkdir()
        (d / "a.jsonl").write_bytes(_jsonl(*GOOD))
        (d / f"b{Path(name).suffix}").write_bytes(FILES[name])
        (d / "c.jsonl").write_bytes(_jsonl(*GOOD))
    tokenizer.main(["char", "--out", str(root / "tok.json"), str(root / "good.txt"), str(root / "good.jsonl")])
    # a real tokenizer without an end-of-text token: the wrong tokenizer for tokenize
    vocab = json.loads((root / "tok.json").read_text())
    vocab["added_tokens"] = [t for t in vocab["added_tokens"] if t["content"] != "<|endoftext|>"]
    del vocab["model"]["vocab"]["<|endoftext|>"]
    (root / "noeos.json").write_text(json.dumps(vocab))
    tokenize.main(
        ["--tokenizer", str(root / "tok.json"), "--out", str(root / "set"), "--format", "webdataset"]
        + [str(root / "good.jsonl")]
    )
    return root


def tree(root: Path) -> dict[str, str]:
    """Every path under root -> the sha1 of its bytes ('dir' for a directory)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha1(Path(p).read_bytes()).hexdigest()
    return out


def run_cli(module: str, argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if k != "TITANLOOP_DEBUG"}
    env.update({"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **extra})
    try:
        return subprocess.run(
            [sys.executable, "-m", module, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        return subprocess.CompletedProcess(e.cmd, "timeout", "", err)


T = ["--tokenizer", "tok.json", "--format", "webdataset"]  # webdataset: no mosaicml-streaming import, faster
TOKENIZE = {
    "missing-input": ([*T, "--out", "out", "nope.jsonl"], "nope.jsonl does not exist"),
    "empty-corpus": ([*T, "--out", "out", "empty.txt"], "hold no text"),
    "empty-jsonl": ([*T, "--out", "out", "--workers", "2", "empty.jsonl", "empty.txt"], "hold no text"),
    "binary-workers2": ([*T, "--out", "out", "--workers", "2", "mixed-binary"], "b.jsonl line 1 is not JSON"),
    "non-utf8-workers2": ([*T, "--out", "out", "--workers", "2", "mixed-nonutf8"], "b.txt is not UTF-8 text: line 2"),
    "malformed-json-workers2": ([*T, "--out", "out", "--workers", "2", "mixed-malformed"], "line 2 is not JSON"),
    "no-text-key-workers2": ([*T, "--out", "out", "--workers", "2", "mixed-notext"], "line 2 has no key 'text'"),
    "wrong-type-workers2": ([*T, "--out", "out", "--workers", "2", "mixed-wrongtype"], "'text' is a JSON int"),
    "holdout-count-pass-workers2": (
        [*T, "--out", "out", "--holdout", "0.1", "--holdout-out", "val", "--workers", "2", "mixed-malformed"],
        "line 2 is not JSON",
    ),
    "existing-output": ([*T, "--out", "taken", "good.jsonl"], "--out taken is not empty"),
    "existing-shard-set": ([*T, "--out", "set", "good.jsonl"], "--out set is not empty"),
    "existing-holdout-output": (
        [*T, "--out", "out", "--holdout", "0.5", "--holdout-out", "set", "good.jsonl"],
        "--holdout-out set is not empty",
    ),
    "out-is-a-file": ([*T, "--out", "file.txt", "good.jsonl"], "--out file.txt is a file"),
    "overwrite-of-a-foreign-directory": (
        [*T, "--out", "taken", "--overwrite", "good.jsonl"],
        "keep.txt, which is not part of a shard set",
    ),
    "holdout-out-is-out-resolved": (
        [*T, "--out", "./s/x", "--holdout", "0.1", "--holdout-out", "s/x", "good.jsonl"],
        "--holdout-out s/x is --out ./s/x",
    ),
    "holdout-leaves-no-tokens": (
        [*T, "--out", "out", "--holdout", "0.999999", "--holdout-out", "val", "good.jsonl"],
        "leaves --out out with 0 tokens",
    ),
    "tokenizer-without-eos": (["--tokenizer", "noeos.json", "--out", "out", "good.jsonl"], "eos_token"),
    "tokenizer-not-a-tokenizer": (
        ["--tokenizer", "notatokenizer.json", "--out", "out", "good.jsonl"],
        "not a tokenizer",
    ),
    "tokenizer-binary": (["--tokenizer", "binary.txt", "--out", "out", "good.jsonl"], "not a text file"),
    "bad-workers": ([*T, "--out", "out", "--workers", "0", "good.jsonl"], "--workers 0 is invalid"),
}
TOKENIZER = {
    "char-missing-input": (["char", "--out", "t.json", "nope.txt"], "nope.txt does not exist"),
    "char-empty": (["char", "--out", "t.json", "empty.txt"], "hold no text"),
    "bpe-empty": (["bpe", "--vocab-size", "300", "--out", "t.json", "empty.txt"], "hold no text"),
    "char-binary": (["char", "--out", "t.json", "binary.txt"], "binary.txt is not UTF-8 text: line 2"),
    "char-non-utf8-jsonl": (["char", "--out", "t.json", "nonutf8.jsonl"], "nonutf8.jsonl line 2 is not UTF-8"),
    "char-malformed-json": (["char", "--out", "t.json", "malformed.jsonl"], "line 2 is not JSON"),
    "char-wrong-type": (["char", "--out", "t.json", "wrongtype.jsonl"], "line 2: 'text' is a JSON int"),
    "char-existing-output": (["char", "--out", "file.txt", "good.txt"], "--out file.txt exists"),
    "char-out-new-directory": (["char", "--out", "newdir/", "good.txt"], "--out newdir/ is a directory"),
    "char-out-under-a-file": (["char", "--out", "file.txt/t.json", "good.txt"], "file.txt is a file"),
    "bpe-negative-min-frequency": (
        ["bpe", "--vocab-size", "300", "--min-frequency", "-1", "--out", "t.json", "good.txt"],
        "--min-frequency -1 is invalid",
    ),
    "gpt2-binary-encoder": (
        ["gpt2", "--encoder", "binary.txt", "--vocab-bpe", "good.txt", "--out", "t.json"],
        "--encoder binary.txt is not UTF-8",
    ),
    "gpt2-mismatched-encoder": (
        ["gpt2", "--encoder", "tok.json", "--vocab-bpe", "good.txt", "--out", "t.json"],
        "--encoder tok.json has no <|endoftext|>",
    ),
    "gpt2-missing-merges": (
        ["gpt2", "--encoder", "tok.json", "--vocab-bpe", "nope.bpe", "--out", "t.json"],
        "--vocab-bpe nope.bpe is not a file",
    ),
}
STATS = {
    "missing": (["nope"], "nope does not exist"),
    "a-file": (["file.txt"], "file.txt is a file"),
    "no-manifest": (["nomanifest"], "manifest.json: missing"),
    "binary-manifest": (["badmanifest"], "the manifest cannot be read"),
    "json-is-the-manifest": (["set", "--json", "set/manifest.json", "--overwrite"], "never overwritten"),
    "json-is-the-manifest-by-another-path": (
        ["set", "--json", "./set/../set/manifest.json"],
        "never overwritten",
    ),
    "json-exists": (["set", "--json", "file.txt"], "--json file.txt exists"),
    "json-is-a-directory": (["set", "--json", "taken"], "--json taken is a directory"),
}
CORPORA = {
    "out-is-a-file": (["--out", "file.txt", "shakespeare_char"], "--out file.txt is a file"),
    "unknown-corpus": (["--out", "corpora", "nope"], "corpus 'nope' is unknown"),
    "partly-built": (["--out", "corpora", "shakespeare_char"], "partly built"),
}
MANIFEST = {
    "missing-root": (["nope", "--format", "mds", "--tokenizer", "tok.json"], "nope is not a directory"),
    "malformed-index": (["badindex", "--format", "mds", "--tokenizer", "tok.json"], "not an MDS index.json"),
    "existing-manifest": (["set", "--format", "webdataset", "--tokenizer", "tok.json"], "exists"),
    "not-a-tokenizer": (["taken", "--format", "mds", "--tokenizer", "notatokenizer.json"], "not a tokenizer"),
}
SYNTHETIC = {
    "existing-output": (["--task", "addition", "--out", "synth", "--train-docs", "5"], "synth/train is not empty"),
    "out-is-a-file": (["--task", "addition", "--out", "file.txt", "--train-docs", "5"], "file.txt is a file"),
    "bad-option": (["--task", "addition", "--out", "s", "--option", "n_digits"], "expected key=value"),
}
SAMPLE_CORPUS = {
    "existing-output": (["--out", "taken", "--docs", "5"], "--out taken is not empty"),
    "out-is-a-file": (["--out", "file.txt", "--docs", "5"], "--out file.txt is a file"),
}
MATRIX = {
    "data_pipelines.tokenize": TOKENIZE,
    "data_pipelines.tokenizer": TOKENIZER,
    "data_pipelines.stats": STATS,
    "data_pipelines.corpora": CORPORA,
    "data_pipelines.manifest": MANIFEST,
    "data_pipelines.synthetic": SYNTHETIC,
    "data_pipelines.sample_corpus": SAMPLE_CORPUS,
}


@pytest.fixture(scope="module")
def results(base, tmp_path_factory) -> dict:
    """Every case of the matrix, run concurrently, each in its own copy of `base`:
    (module, case) -> (completed process, tree before, tree after)."""
    root = tmp_path_factory.mktemp("cases")

    def one(module: str, case: str, argv: list[str]):
        cwd = root / f"{module.split('.')[-1]}-{case}"
        shutil.copytree(base, cwd)
        before = tree(cwd)
        proc = run_cli(module, argv, cwd)
        return (module, case), (proc, before, tree(cwd))

    jobs = [(m, c, argv) for m, cases in MATRIX.items() for c, (argv, _) in cases.items()]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(lambda j: one(*j), jobs))


def check(results, module: str, case: str) -> None:
    proc, before, after = results[(module, case)]
    needle = MATRIX[module][case][1]
    assert proc.returncode != "timeout", f"{module} {case}: no exit within {TIMEOUT} s; stderr: {proc.stderr[-2000:]}"
    assert proc.returncode != 0, f"{module} {case}: exit 0; stderr: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, f"{module} {case}: a traceback:\n{proc.stderr[-3000:]}"
    lines = proc.stderr.strip().splitlines()
    assert lines and needle in lines[-1], f"{module} {case}: {needle!r} not in the last line of:\n{proc.stderr[-2000:]}"
    assert "error" in lines[-1]
    assert after == before, f"{module} {case}: files changed: {set(after.items()) ^ set(before.items())}"


@pytest.mark.parametrize("case", TOKENIZE)
def test_tokenize_bad_input(results, case):
    check(results, "data_pipelines.tokenize", case)


@pytest.mark.parametrize("case", TOKENIZER)
def test_tokenizer_bad_input(results, case):
    check(results, "data_pipelines.tokenizer", case)


@pytest.mark.parametrize("case", STATS)
def test_stats_bad_input(results, case):
    check(results, "data_pipelines.stats", case)


@pytest.mark.parametrize("case", CORPORA)
def test_corpora_bad_input(results, case):
    check(results, "data_pipelines.corpora", case)


@pytest.mark.parametrize("case", MANIFEST)
def test_manifest_bad_input(results, case):
    check(results, "data_pipelines.manifest", case)


@pytest.mark.parametrize("case", SYNTHETIC)
def test_synthetic_bad_input(results, case):
    check(results, "data_pipelines.synthetic", case)


@pytest.mark.parametrize("case", SAMPLE_CORPUS)
def test_sample_corpus_bad_input(results, case):
    check(results, "data_pipelines.sample_corpus", case)


def test_every_data_command_in_the_docs_is_in_the_matrix():
    docs = (REPO / "README.md").read_text() + (REPO / "docs" / "data.md").read_text()
    named = set(re.findall(r"python -m (data_pipelines\.\w+)", docs))
    assert named and named <= set(MATRIX), f"not in the bad-input matrix: {named - set(MATRIX)}"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_failed_tokenize_does_not_block_its_rerun(base, tmp_path, workers):
    """The first run fails on line 2 of one file (after the part of the file before it was written) and removes
    what it wrote; fixing the file and running the same command again works."""
    shutil.copytree(base / "mixed-malformed", tmp_path / "in")
    argv = ["--tokenizer", str(base / "tok.json"), "--out", "out", "--workers", workers, "--format", "webdataset"]
    argv.append("in")
    first = run_cli("data_pipelines.tokenize", argv, tmp_path)
    assert first.returncode == 1 and "line 2 is not JSON" in first.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "in" / "b.jsonl").write_bytes(_jsonl(*GOOD))
    again = run_cli("data_pipelines.tokenize", argv, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["documents"] == 6


def test_tokenize_counts_unknown_tokens_and_dropped_documents(base, tmp_path):
    """A null text and an empty text are dropped and counted; characters the tokenizer lacks are counted as
    unknown tokens, with a warning."""
    lines = ['{"text": "the fox"}', '{"text": null}', '{"text": ""}', '{"text": "the ZZZ fox"}', '{"text": "QQ"}']
    (tmp_path / "in.jsonl").write_bytes(_jsonl(*lines))
    argv = ["--tokenizer", str(base / "tok.json"), "--out", "out", "--format", "webdataset", "in.jsonl"]
    proc = run_cli("data_pipelines.tokenize", argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dropped 2 documents (1 with a null text, 1 with fewer than --min-tokens 1 tokens)" in proc.stderr
    assert "; 5 unknown tokens" in proc.stderr  # Z, Z, Z, Q, Q are not in the tokenizer
    assert "warning: 5 unknown tokens in 2 documents" in proc.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["documents"] == 3


def test_overwrite_replaces_what_it_is_asked_to(base, tmp_path):
    """--overwrite replaces a shard set (tokenize), a tokenizer file and a statistics file; stats --json next to
    a set leaves its manifest readable."""
    shutil.copytree(base / "set", tmp_path / "set")
    old = json.loads((tmp_path / "set" / "manifest.json").read_text())
    tok = str(base / "tok.json")
    argv = [
        "--tokenizer",
        tok,
        "--out",
        "set",
        "--format",
        "webdataset",
        "--overwrite",
        str(base / "mixed-notext/a.jsonl"),
    ]
    proc = run_cli("data_pipelines.tokenize", argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    new = json.loads((tmp_path / "set" / "manifest.json").read_text())
    assert new["inputs"] != old["inputs"] and new["documents"] == 2
    (tmp_path / "stats.json").write_text("old")
    proc = run_cli("data_pipelines.stats", ["set", "--json", "stats.json", "--overwrite"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "stats.json").read_text())["documents"] == 2
    assert run_cli("data_pipelines.stats", ["set", "--verify"], tmp_path).returncode == 0
    argv = ["char", "--out", "stats.json", "--overwrite", str(base / "good.txt")]
    proc = run_cli("data_pipelines.tokenizer", argv, tmp_path)
    assert proc.returncode == 0 and "char" in proc.stderr


def test_debug_shows_the_traceback(base, tmp_path):
    for extra, env in ((["--debug"], None), ([], {"TITANLOOP_DEBUG": "1"})):
        argv = ["char", "--out", str(tmp_path / "t.json"), str(base / "wrongtype.jsonl"), *extra]
        proc = run_cli("data_pipelines.tokenizer", argv, tmp_path, env=env)
        assert proc.returncode != 0 and "Traceback" in proc.stderr and "InputError" in proc.stderr


DYING_WORKER = """
import argparse, os, sys
from data_pipelines import tokenize
from data_pipelines.cli import InputError

def job(n):
    if n == 1:
        os._exit(3)  # as a worker killed by the kernel's out-of-memory killer would
    return n

try:
    tokenize._run_pool(argparse.Namespace(workers=2), [0, 1, 2], ["a.jsonl", "b.jsonl", "c.jsonl"], None, job)
except InputError as e:
    sys.exit(f"error: {e}")
"""


def test_a_worker_that_dies_ends_the_run_naming_its_file(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", DYING_WORKER],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 1 and "input b.jsonl: the worker process tokenizing it died" in proc.stderr
