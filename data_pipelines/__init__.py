"""Command-line tools that turn raw corpora into titanloop training shards.

    python -m data_pipelines.tokenize   FineWeb / FineWeb-Edu parquet, Nemotron-CC jsonl.zst -> MDS / webdataset
    python -m data_pipelines.synthetic  synthetic reasoning tasks (mano, addition, xor, multihop) -> shards
    python -m data_pipelines.stats      documents, tokens, tokens per source of one or more shard sets

Layouts and the manifest are described in titanloop/data/shard_format.py and docs/data.md.
"""
