"""s3:// end to end against a real S3 server (moto's standalone server on 127.0.0.1, started here): tokenize
straight into a bucket, train `torchrun -m titanloop.train` from it, read and resume the same samples as the
local copy; transient errors retried with backoff; one-line errors for a missing bucket, refused or missing
credentials."""

from __future__ import annotations

import json
import os

import pytest

from data_pipelines import tokenize
from data_pipelines.sample_corpus import write_sample_corpus
from titanloop.data import DataConfig, ShardError, SourceConfig, build_dataloader
from titanloop.data.shards import ShardFetcher

from launch import free_port, train

SEQ, MBS, GBS, VOCAB = 32, 2, 8, 400
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1, a bucket, and the same shard sets written locally and into the bucket."""
    try:
        from moto.server import ThreadedMotoServer

        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
    except Exception as e:  # noqa: BLE001 - any failure to start is reported as the skip reason
        pytest.skip(f"moto S3 server could not start: {type(e).__name__}: {e}")
    endpoint = f"http://127.0.0.1:{port}"
    env = {**CREDENTIALS, "S3_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="corpus")
    root = tmp_path_factory.mktemp("s3")
    corpus = write_sample_corpus(str(root / "raw"), files=2, docs=40, vocab_size=VOCAB)
    for out in (str(root / "local"), "s3://corpus/shards/fineweb"):
        tokenize.main(
            [
                "--tokenizer",
                corpus["tokenizer"],
                "--out",
                out,
                "--format",
                "mds",
                "--workers",
                "1",
                "--shard-bytes",
                "6000",
                "--source",
                "fineweb",
                corpus["fineweb"],
            ]
        )
    yield {
        "endpoint": endpoint,
        "env": env,
        "local": str(root / "local"),
        "remote": "s3://corpus/shards/fineweb",
        "tokenizer": corpus["tokenizer"],
        "root": root,
    }
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


def cfg(path, **kw):
    return DataConfig(kind="mds", seed=2, shuffle_block=4, prefetch=0, sources=[SourceConfig(path)], **kw)


def read(path, world, steps, state=None):
    rows, states = {}, []
    for rank in range(world):
        ld = build_dataloader(
            cfg(path),
            seq_len=SEQ,
            micro_batch_size=MBS,
            global_batch_size=GBS,
            dp_rank=rank,
            dp_world=world,
            vocab_size=VOCAB,
        )
        if state:
            ld.load_state_dict(state)
        for _ in range(steps * GBS // (MBS * world)):
            b = next(ld)
            rows.update(zip(b["sample_ids"].tolist(), b["input_ids"].tolist()))
        states.append(ld.state_dict())
        ld.close()
    return rows, states[0]


def test_s3_reads_and_resumes_the_same_samples_as_local_disk(s3):
    local, _ = read(s3["local"], 1, 6)
    remote_head, state = read(s3["remote"], 2, 2)
    remote_tail, _ = read(s3["remote"], 1, 4, state=json.loads(json.dumps(state)))
    assert not set(remote_head) & set(remote_tail)
    assert {**remote_head, **remote_tail} == local


@pytest.mark.slow
def test_torchrun_trains_from_s3_on_the_local_samples(s3, tmp_path):
    trace = tmp_path / "trace"
    overrides = {
        "training.steps": 3,
        "training.seq_len": SEQ,
        "training.micro_batch_size": MBS,
        "training.global_batch_size": GBS,
        "model.vocab_size": VOCAB,
        "data.kind": "mds",
        "data.seed": 2,
        "data.shuffle_block": 4,
        "data.trace_samples": str(trace),
        "data.sources": [{"path": s3["remote"]}],
        "metrics.log_freq": 1,
    }
    train(tmp_path / "run", overrides, nproc=1, env=s3["env"])
    trained = [json.loads(ln) for ln in (trace / "rank-0.jsonl").read_text().splitlines()]
    ref_dir = tmp_path / "reference"
    ld = build_dataloader(
        cfg(s3["local"], trace_samples=str(ref_dir)),
        seq_len=SEQ,
        micro_batch_size=MBS,
        global_batch_size=GBS,
        dp_rank=0,
        dp_world=1,
        vocab_size=VOCAB,
    )
    for _ in range(3 * GBS // MBS):
        next(ld)
    ld.close()
    reference = [json.loads(ln) for ln in (ref_dir / "rank-0.jsonl").read_text().splitlines()]
    assert [(r["id"], r["tokens"]) for r in trained] == [(r["id"], r["tokens"]) for r in reference]


def inject(fetcher: ShardFetcher, responses: list[tuple[int, str]]):
    """The next GETs of `fetcher` are answered with these (HTTP status, S3 error code) before reaching the
    server, through botocore's own response path."""
    from botocore.awsrequest import AWSResponse

    pending = list(responses)

    class Raw:
        def __init__(self, body: bytes):
            self.body = body

        def stream(self, **_):
            yield self.body

    def before_send(request, **_):
        if not pending:
            return None
        status, code = pending.pop(0)
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, Raw(body))

    fetcher.client().meta.events.register("before-send.s3.GetObject", before_send)
    return pending


def test_transient_errors_are_retried_then_reported_in_one_line(s3):
    good = ShardFetcher(s3["remote"]).read("manifest.json")
    f = ShardFetcher(s3["remote"], retries=3, backoff=0.01)
    inject(f, [(503, "SlowDown"), (500, "InternalError")])
    assert f.read("manifest.json") == good and f.retried == 2
    f = ShardFetcher(s3["remote"], retries=1, backoff=0.01)
    inject(f, [(503, "SlowDown")] * 3)
    with pytest.raises(ShardError) as e:
        f.read("manifest.json")
    msg = str(e.value)
    assert "\n" not in msg and "still failing after 2 attempts" in msg and "SlowDown" in msg


def test_missing_bucket_and_bad_credentials_are_one_line_errors(s3, monkeypatch):
    def error(path, **kw):
        with pytest.raises(ShardError) as e:
            build_dataloader(
                cfg(path, **kw),
                seq_len=SEQ,
                micro_batch_size=MBS,
                global_batch_size=GBS,
                dp_rank=0,
                dp_world=1,
                vocab_size=VOCAB,
            )
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "bucket 'no-such-bucket' does not exist" in error("s3://no-such-bucket/shards")
    assert "manifest.json: missing" in error("s3://corpus/not-there")
    f = ShardFetcher(s3["remote"], retries=0)
    inject(f, [(403, "InvalidAccessKeyId")])
    with pytest.raises(ShardError, match=r"access refused \(InvalidAccessKeyId\); check the AWS credentials"):
        f.read("manifest.json")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(s3["root"] / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(s3["root"] / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert "no AWS credentials found" in error(s3["remote"])


def test_remote_out_holding_objects_is_refused_unless_overwrite(s3):
    """Shards already under an s3:// --out are never written over silently: the second run is refused in one line
    (and uploads nothing); with --overwrite it replaces them, and the set reads back whole."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3["endpoint"])
    listing = lambda: {  # noqa: E731
        o["Key"]: o["ETag"] for o in client.list_objects_v2(Bucket="corpus", Prefix="shards/fineweb/")["Contents"]
    }
    before = listing()
    argv = ["--tokenizer", s3["tokenizer"], "--out", s3["remote"], "--format", "mds", "--workers", "1"]
    argv += ["--shard-bytes", "6000", "--source", "fineweb", str(s3["root"] / "raw" / "fineweb")]
    with pytest.raises(SystemExit) as e:
        tokenize.main(argv)
    assert "already holds objects" in str(e.value) and "--overwrite" in str(e.value) and "\n" not in str(e.value)
    assert listing() == before
    tokenize.main([*argv, "--overwrite"])
    assert set(listing()) == set(before)  # the same names: the same corpus and settings give the same shards
    assert read(s3["remote"], 1, 1)[0] and ShardFetcher(s3["remote"]).read("manifest.json")
