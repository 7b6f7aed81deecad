"""Errors for bad shards: one line naming the shard and what to do about it."""

from __future__ import annotations


class ShardError(RuntimeError):
    """A shard is missing, truncated, corrupt, or was written with another tokenizer.

    The message is one line: `<shard path>: <what is wrong>; <how to fix it>`.
    """

    def __init__(self, shard: str, problem: str, fix: str = "re-create it with data_pipelines.tokenize"):
        self.shard = shard
        super().__init__(f"{shard}: {problem}; {fix}")
