"""Data configuration: which samples the trainer reads, in what mixture, and how strictly shards are checked.

Plain dataclasses (no torch), validated on construction so a bad config fails with one line before any
process group exists. `DataConfig.from_dict` accepts the nested dict of a TOML/JSON training config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titanloop.config_errors import from_dict_strict, require, require_choice

KINDS = ("synthetic_text", "synthetic_task", "mds", "webdataset", "shards")
SHARD_KINDS = ("mds", "webdataset", "shards")  # shards: each source in the format its manifest names
ON_BAD_SHARD = ("error", "skip")


@dataclass
class SourceConfig:
    """One shard set (a directory written by `data_pipelines`, holding `manifest.json`) and its mixture weight.

    `path` may be local or any URL the shard libraries accept (s3://, gs://, ...). Weights are relative:
    (73.4, 13.0, 2.0, 7.5, 4.1) and (0.734, 0.13, ...) give the same mixture.
    """

    path: str
    weight: float = 1.0
    name: str | None = None  # defaults to the manifest's `source`

    def __post_init__(self):
        require(
            isinstance(self.path, str) and self.path != "",
            "data.sources[].path",
            self.path,
            "a shard directory (local path or s3://, gs:// URL) containing manifest.json",
        )
        require(float(self.weight) > 0, "data.sources[].weight", self.weight, "a positive mixture weight")


@dataclass
class DataConfig:
    kind: str = "synthetic_text"  # synthetic_text | synthetic_task | mds | webdataset | shards (mds and/or wds)
    seed: int = 0  # fixes the global sample sequence (synthetic content, shuffle blocks)

    # kind = mds | webdataset | shards
    sources: list[SourceConfig] = field(default_factory=list)
    tokenizer: str | None = None  # tokenizer.json path; when set, every manifest's fingerprint must match it
    shuffle_block: int = 32  # windows a lane reads as one byte range and shuffles (1 = stream order)
    on_bad_shard: str = "error"  # error: one-line ShardError | skip: warn, count, emit the rows fully masked
    verify_checksums: bool = True  # compare each shard's sha1 with the manifest when it is first read
    cache_dir: str | None = None  # where non-s3 remote (gs://, ...) shards are downloaded; default a temp dir
    cache_mb: int = 512  # memory for fetched blocks and shard indexes, per source (LRU)
    io_retries: int = 5  # retries of a transient s3:// error (exponential backoff from 0.2 s)

    # kind = synthetic_text: motif tokens from ids 1..motif_vocab-1 only (0: the model's whole vocabulary)
    motif_vocab: int = 0

    # kind = synthetic_task
    task: str = "mano"  # mano | addition | xor | multihop
    task_options: dict = field(default_factory=dict)  # passed to the task's own config, e.g. {"max_ops": 10}
    split: str = "train"  # train | eval (held-out examples)

    prefetch: int = 4  # micro-batches prepared ahead by a background thread (0 = synchronous)
    trace_samples: str | None = None  # audit aid: directory; each rank appends (step, sample id, source, row,
    #                                   tokens hash) of every micro-batch it returns to rank-<r>.jsonl

    def __post_init__(self):
        self.sources = [s if isinstance(s, SourceConfig) else SourceConfig(**s) for s in self.sources]
        self.validate()

    def validate(self) -> None:
        require_choice(self.kind, "data.kind", KINDS)
        require_choice(self.on_bad_shard, "data.on_bad_shard", ON_BAD_SHARD)
        require_choice(self.split, "data.split", ("train", "eval"))
        require(int(self.shuffle_block) >= 1, "data.shuffle_block", self.shuffle_block, "an integer >= 1")
        require(int(self.prefetch) >= 0, "data.prefetch", self.prefetch, "an integer >= 0")
        require(int(self.cache_mb) >= 1, "data.cache_mb", self.cache_mb, "an integer >= 1 (MiB)")
        require(int(self.io_retries) >= 0, "data.io_retries", self.io_retries, "an integer >= 0")
        if self.kind in SHARD_KINDS:
            require(
                len(self.sources) >= 1,
                "data.sources",
                self.sources,
                f"at least one {{path, weight}} shard set for data.kind={self.kind!r}",
            )
            names = [s.name for s in self.sources if s.name is not None]
            require(len(names) == len(set(names)), "data.sources[].name", names, "distinct source names")

    @classmethod
    def from_dict(cls, d: dict) -> "DataConfig":
        return from_dict_strict(cls, d, "data config")

    from_table = from_dict  # the [data] table of a training config (titanloop.config_fields.build_section)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
