"""Real text in: plain-text and JSON-lines documents, the tokenizer command (BPE, character, GPT-2), the held-out
split, the committed corpora, and each tokenizer through training, held-out scoring and `generate --prompt`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipelines import corpora, tokenize, tokenizer
from data_pipelines.readers import TextSplit, read_documents
from titanloop.data.shard_format import MANIFEST, Manifest
from titanloop.data.tokenizer import load_tokenizer

from launch import train
from test_data_pipelines import read_set

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
SHAKESPEARE = DATA / "tinyshakespeare.txt"
WIKITEXT_TEST = DATA / "wikitext-2" / "test.txt"
GPT2 = ["--encoder", str(DATA / "gpt2/encoder.json"), "--vocab-bpe", str(DATA / "gpt2/vocab.bpe")]


def test_committed_text_is_the_published_bytes():
    import hashlib

    for line in (DATA / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


def documents(shard) -> list[list[int]]:
    """The token ids of each document of a decoded shard (EOS included)."""
    d = shard.doc_starts
    return [[int(t) for t in shard.tokens[d[i] : d[i + 1]]] for i in range(len(d) - 1)]


def texts(path, split):
    return [text for text, _, _ in read_documents(str(path), text_split=TextSplit.parse(split))]


def test_plain_text_splits_by_each_documented_rule(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one\ntwo\n\n\nthree\n = Title = \nfour\n = = Sub = = \nfive\n")
    assert texts(f, "file") == [f.read_text()]
    assert texts(f, "line") == ["one", "two", "three", " = Title = ", "four", " = = Sub = = ", "five"]
    assert texts(f, "paragraph") == ["one\ntwo", "three\n = Title = \nfour\n = = Sub = = \nfive"]
    starts = texts(f, "start=^ = [^=].* = $")  # a document starts at each article title, not at a section
    assert starts == ["one\ntwo\n\n\nthree", " = Title = \nfour\n = = Sub = = \nfive"]
    with pytest.raises(ValueError, match="expected one of"):
        TextSplit.parse("sentences")
    with pytest.raises(ValueError, match="does not compile"):
        TextSplit.parse("start=(")


def test_wikitext_articles_are_documents():
    docs = texts(WIKITEXT_TEST, corpora.WIKITEXT_ARTICLE)
    assert len(docs) == 62 and docs[0].startswith(" = Robert <unk> = \n")
    assert all(d.lstrip().startswith("= ") and not d.lstrip().startswith("= =") for d in docs)


def build(kind, out, *args):
    tokenizer.main([kind, *args, "--out", str(out)])
    return load_tokenizer(str(out))


def test_character_tokenizer_numbers_characters_as_nanogpt(tmp_path):
    tok = build("char", tmp_path / "char.json", str(SHAKESPEARE))
    text = SHAKESPEARE.read_text()
    chars = sorted(set(text))
    assert tok.get_vocab_size() == len(chars) + 2 == 67  # the 65 characters, <|endoftext|>, <unk>
    assert [tok.token_to_id(c) for c in chars] == list(range(65))
    assert tok.encode("First Citizen:", add_special_tokens=False).ids == [chars.index(c) for c in "First Citizen:"]
    assert tok.decode(tok.encode(text[:5000]).ids) == text[:5000]
    assert tok.encode("é").ids == [tok.token_to_id("<unk>")]


def test_gpt2_tokenizer_counts_tinyshakespeare_as_gpt2_does(tmp_path):
    """nanoGPT's data/shakespeare example counts 301,966 and 36,059 GPT-2 tokens for the same 90/10 split."""
    tok = build("gpt2", tmp_path / "gpt2.json", *GPT2)
    text = SHAKESPEARE.read_text()
    cut = int(len(text) * 0.9)
    train_ids = tok.encode(text[:cut], add_special_tokens=False).ids
    assert (len(train_ids), len(tok.encode(text[cut:], add_special_tokens=False).ids)) == (301966, 36059)
    assert train_ids[:4] == [5962, 22307, 25, 198]  # "First", " Citizen", ":", "\n"
    assert tok.encode("<|endoftext|>").ids == [50256] and tok.get_vocab_size() == 50257


def test_bpe_tokenizer_has_the_asked_vocabulary_and_encodes_any_text(tmp_path):
    tok = build("bpe", tmp_path / "bpe.json", "--vocab-size", "600", str(SHAKESPEARE))
    assert tok.get_vocab_size() == 600 and tok.token_to_id("<|endoftext|>") is not None
    odd = "naïve café ☃ 東京\ttabs"
    assert tok.decode(tok.encode(odd).ids) == odd  # byte-level: nothing is unknown
    text = SHAKESPEARE.read_text()[:20000]
    assert len(tok.encode(text).ids) < 0.6 * len(text)  # it learned merges from the corpus


@pytest.mark.parametrize(
    "argv, message",
    [
        (["char", "--out", "{out}", "{missing}"], "does not exist"),
        (["bpe", "--vocab-size", "100", "--out", "{out}", "{text}"], "too small"),
        (["char", "--doc-split", "words", "--out", "{out}", "{text}"], "expected one of"),
        (["char", "--out", "{existing}", "{text}"], "exists"),
    ],
)
def test_tokenizer_command_refuses_bad_input_in_one_line(tmp_path, argv, message):
    existing = tmp_path / "existing.json"
    existing.write_text("{}")
    subs = {"out": tmp_path / "t.json", "missing": tmp_path / "nope.txt", "text": SHAKESPEARE, "existing": existing}
    cmd = [sys.executable, "-m", "data_pipelines.tokenizer", *[a.format(**subs) for a in argv]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode != 0 and message in proc.stderr.strip().splitlines()[-1]
    assert existing.read_text() == "{}" and not (tmp_path / "t.json").exists()  # nothing written, nothing lost


def test_holdout_split_cuts_the_corpus_as_nanogpt_does(tmp_path):
    tok_path = tmp_path / "char.json"
    tok = build("char", tok_path, str(SHAKESPEARE))
    tokenize.main(
        ["--tokenizer", str(tok_path), "--out", str(tmp_path / "train"), "--holdout", "0.1"]
        + ["--holdout-out", str(tmp_path / "val"), str(SHAKESPEARE)]
    )
    text = SHAKESPEARE.read_text()
    cut = int(len(text) * 0.9)  # 1,003,854 characters train, 111,540 are held out
    eos = tok.token_to_id("<|endoftext|>")
    for where, part in (("train", text[:cut]), ("val", text[cut:])):
        m, shards = read_set(str(tmp_path / where))
        tokens = [int(t) for s in shards for t in s.tokens]
        assert tokens[-1] == eos and tok.decode(tokens[:-1]) == part
        assert m.documents == 1 and m.tokens == len(part) + 1
    assert Manifest.from_json((tmp_path / "val" / MANIFEST).read_text(), "val").source == "train-holdout"


def test_holdout_split_spans_files_and_documents(tmp_path):
    """Three files of JSON lines and text: the last 30% of the characters, cut inside the straddling document."""
    (tmp_path / "in").mkdir()
    docs = [f"document {i} " + "x" * (10 * i) for i in range(12)]
    (tmp_path / "in/a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:6]))
    (tmp_path / "in/b.txt").write_text("\n".join(docs[6:]) + "\n")
    tok_path = tmp_path / "char.json"
    tok = build("char", tok_path, str(tmp_path / "in"))
    tokenize.main(
        ["--tokenizer", str(tok_path), "--out", str(tmp_path / "train"), "--holdout", "0.3", "--doc-split", "line"]
        + ["--holdout-out", str(tmp_path / "val"), "--workers", "2", str(tmp_path / "in")]
    )
    stream = "".join(docs)
    keep = int(0.7 * len(stream))
    got = {}
    for where in ("train", "val"):
        _, shards = read_set(str(tmp_path / where))
        got[where] = [tok.decode(documents(s)[i][:-1]) for s in shards for i in range(len(s.doc_starts) - 1)]
    assert "".join(got["train"]) == stream[:keep] and "".join(got["val"]) == stream[keep:]
    assert len(got["train"]) + len(got["val"]) == len(docs) + 1  # one document was cut in two


@pytest.mark.parametrize("argv", [["--holdout", "1.5", "--holdout-out", "v"], ["--holdout", "0.1"]])
def test_tokenize_refuses_a_bad_holdout(tmp_path, argv):
    with pytest.raises(SystemExit) as e:
        tokenize.parse_args(["--tokenizer", "t.json", "--out", str(tmp_path / "o"), *argv, str(SHAKESPEARE)])
    assert e.value.code == 2 and not (tmp_path / "o").exists()


def test_corpora_build_once_and_refuse_a_partial_build(tmp_path, capsys):
    p = corpora.build("shakespeare_char", str(tmp_path))
    assert load_tokenizer(p["tokenizer"]).get_vocab_size() == 67
    manifests = {s: Manifest.from_json(Path(p[s], MANIFEST).read_text(), s) for s in ("train", "val")}
    assert manifests["train"].tokens == 1003854 + 1 and manifests["val"].tokens == 111540 + 1
    corpora.build("shakespeare_char", str(tmp_path))
    assert "already built" in capsys.readouterr().err
    os.remove(Path(p["val"], MANIFEST))
    with pytest.raises(SystemExit, match="partly built"):
        corpora.build("shakespeare_char", str(tmp_path))


TINY = {
    "model.preset": "debug-tiny",
    "model.n_layers": 1,
    "model.max_seq_len": 32,
    "training.steps": 30,
    "training.seq_len": 32,
    "training.micro_batch_size": 4,
    "training.global_batch_size": 4,
    "optimizer.lr": 3e-3,
    "lr_scheduler.warmup_steps": 5,
    "loop_sampler.n_loops": 2,
    "metrics.log_freq": 10,
    "checkpoint.enable": True,
    "checkpoint.interval": 30,
    "validation.enable": True,
    "validation.freq": 30,
    "validation.steps": 0,
    "validation.batch_size": 64,
    "data.kind": "mds",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_each_tokenizer_trains_scores_and_generates(tmp_path, kind):
    """Shards of the tokenizer's text -> torchrun -m titanloop.train (validation on the whole held-out set) ->
    titanloop.eval sweep on the held-out shard set (the same loss) -> generate --prompt (text back)."""
    text = tmp_path / "text.txt"
    text.write_text(SHAKESPEARE.read_text()[:60000])
    extra = {"char": [], "bpe": ["--vocab-size", "400"], "gpt2": GPT2}
    tok = build(kind, tmp_path / "tok.json", *extra[kind], *([str(text)] if kind != "gpt2" else []))
    tokenize.main(
        ["--tokenizer", str(tmp_path / "tok.json"), "--out", str(tmp_path / "train"), "--holdout", "0.1"]
        + ["--holdout-out", str(tmp_path / "val"), str(text)]
    )
    vocab = tok.get_vocab_size()
    shards = lambda where: {"tokenizer": str(tmp_path / "tok.json"), "sources": [{"path": str(tmp_path / where)}]}  # noqa: E731
    held = {"kind": "mds", **shards("val")}
    run = train(
        tmp_path / "run",
        {**TINY, "model.vocab_size": vocab, "data.tokenizer": shards("train")["tokenizer"]}
        | {"data.sources": shards("train")["sources"], "validation.data": held},
        nproc=1,
    )
    assert run.by_step[30]["val/loss/loop_2"] < run.by_step[1]["loss"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ckpt = str(tmp_path / "run" / "checkpoints")
    sweep = [sys.executable, "-m", "titanloop.eval", "sweep", ckpt, "--data", str(tmp_path / "val"), "--seq-len"]
    sweep += ["32", "--batch-size", "64", "--loops", "2", "--no-diagnostics", "--out", str(tmp_path / "eval")]
    subprocess.run(sweep, cwd=REPO, env=env, check=True, capture_output=True)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["depth_sweep"]["points"][0]["loss"] == pytest.approx(run.by_step[30]["val/loss/loop_2"], rel=1e-5)
    gen = [sys.executable, "-m", "titanloop.eval", "generate", ckpt, "--prompt", "ROMEO:", "--max-new-tokens", "24"]
    proc = subprocess.run(gen, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) > len("ROMEO:")
    assert json.loads(proc.stderr.strip().splitlines()[-1])["new_tokens"] >= 1
    # the HF export carries the run's tokenizer.json; generate finds it there and writes the same text
    hf = tmp_path / "hf"
    export = [sys.executable, "-m", "titanloop.interchange", "export", "--checkpoint", ckpt, "--out", str(hf)]
    subprocess.run(export, cwd=REPO, env=env, check=True, capture_output=True)
    assert (hf / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    again = subprocess.run([*gen[:4], str(hf), *gen[5:]], cwd=REPO, env=env, check=True, capture_output=True, text=True)
    assert again.stdout == proc.stdout


def test_a_held_out_set_scored_whole_reads_every_window_once(tmp_path):
    """whole_set_batches (validation.steps = 0, `titanloop.eval --data <shard set>`): every token of the set is a
    target exactly once, in order."""
    from titanloop.data import DataConfig
    from titanloop.data.shards import whole_set_batches
    from titanloop.train.config import load_config
    from titanloop.config_errors import ConfigError

    (tmp_path / "t.txt").write_text(SHAKESPEARE.read_text()[:3000])
    tok = build("char", tmp_path / "c.json", str(tmp_path / "t.txt"))
    tokenize.main(["--tokenizer", str(tmp_path / "c.json"), "--out", str(tmp_path / "s"), str(tmp_path / "t.txt")])
    stream = tok.encode(SHAKESPEARE.read_text()[:3000]).ids + [tok.token_to_id("<|endoftext|>")]
    cfg = DataConfig(kind="mds", sources=[{"path": str(tmp_path / "s")}])
    batches = whole_set_batches(cfg, seq_len=64, vocab_size=67, batch_size=7)
    labels = [int(t) for b in batches for row in b["labels"] for t in row]
    assert labels == stream[1 : 1 + (len(stream) - 1) // 64 * 64]
    assert [len(b["labels"]) for b in batches][:-1] == [7] * (len(batches) - 1)
    with pytest.raises(ConfigError, match="0, the whole set, is for shard sets"):
        load_config(REPO / "train_configs/debug.toml", ["--validation.enable", "true", "--validation.steps", "0"])


@pytest.mark.slow
@pytest.mark.parametrize("config", ["nanogpt_shakespeare_char.toml", "nanogpt_shakespeare_gpu.toml"])
def test_nanogpt_configs_train_on_the_committed_text(tmp_path, config):
    """Both nanoGPT-shape configs start from the committed corpus (data_pipelines.corpora, data/shards) and score
    the whole validation split; the GPU one (dropout 0.2) here on the CPU, uncompiled, at a small batch."""
    corpora.build("shakespeare_char")
    small = {"training.steps": 4, "validation.freq": 4, "metrics.log_freq": 1, "checkpoint.enable": False}
    if "gpu" in config:  # on the CPU: uncompiled, small batches, 8 held-out rows (the char config scores them all)
        small |= {"parallelism.compile": False, "training.micro_batch_size": 2, "training.global_batch_size": 2}
        small |= {"validation.steps": 2, "validation.batch_size": 4}
    run = train(tmp_path / "run", small, nproc=1, config=REPO / "train_configs" / config)
    val = run.by_step[4]
    expected = 8 * 256 if "gpu" in config else (111541 - 1) // 64 * 64  # every window of the split (EOS included)
    assert val["val/tokens"] == expected
    assert val["val/loss/loop_1"] < 4.3  # ln 67 = 4.2: learning has started
