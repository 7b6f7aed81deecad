"""Synthetic reasoning tasks with a fixed in-code vocabulary, seeded generation and held-out eval splits.

Tasks (each example is a prompt and an answer; only the answer is a training target):
  mano      modular-arithmetic expression trees in prefix notation over F_23 (ouro appendix B.2):
            `<bos> <len_3> - * a b + c d <ans>` -> `(a*b)+(c-d) mod 23`; train lengths 1..L, eval length L.
  addition  multi-digit addition (stars §4.1): `<bos> 1 2 3 4 + 5 6 7 8 =` -> `6 9 1 2`.
  xor       running XOR / prefix sums of a bit string (dice §3): `<bos> 1 0 1 1 =` -> `1 1 0 1`;
            eval may use longer strings (extrapolation).
  chain     in-context multi-hop (variable binding / pointer chasing): a shuffled list of assignments, one token
            each (`v3<v7` = "v3 is v7", `v7<5` = "v7 is 5"), forming `n_chains` chains that each end in a value;
            `<bos> v3<v7 v1<2 v7<5 ... ? v3` -> `5`. Answering a question of depth d takes d lookups (hops);
            training depths are uniform in [1, hops], eval at `eval_hops` (default hops). Every example is a fresh
            random program, so held-out answers cannot be memorized.
  multihop  3-hop relation QA (ouro appendix B.3): 5 layers x 100 single-token people, 20 relations, each
            (person, relation) points to a random person in the next layer; questions
            `<bos> who is the r3 of the r2 of the r1 of p ? answer :` -> `q`, plus the 8,000 one-hop facts
            `<bos> the r of p is q .` (fully supervised) mixed into training.
  compose   composition of fixed relations (permutations of entities learned in the weights), read left to right:
            `<bos> e5 r2 r0 r7 =` -> `r7(r0(r2(e5)))`; training depths 1..hops, eval at eval_hops; the deepest
            questions are too many to memorize.

Held-out split: an example belongs to the eval split iff a hash of its prompt falls in the eval bucket
(`eval_fraction`); training generation rejects those prompts, so train and eval can never share a prompt.
Every row, example and eval set is a pure function of (seed, index): identical on all ranks and resumes.
"""

from __future__ import annotations

import hashlib
import numpy as np
import torch

from titanloop.config_errors import ConfigError, require
from titanloop.data.packing import IGNORE_INDEX, PackedRow, pack_documents

SPECIALS = ["<pad>", "<bos>", "<eos>"]
PAD, BOS, EOS = 0, 1, 2
_BUCKETS = 1_000_000


class Task:
    """A task: its vocabulary, one random example, and the train/eval membership rule."""

    name = "task"
    eval_fraction = 0.05

    def __init__(self, tokens: list[str], seed: int):
        self.vocab = SPECIALS + tokens
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.seed = seed

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, words: list[str]) -> list[int]:
        return [self.ids[w] for w in words]

    def decode(self, ids) -> list[str]:
        return [self.vocab[int(i)] for i in ids]

    def fingerprint(self) -> str:
        """Identifies the vocabulary (stands in for a tokenizer fingerprint in shard manifests)."""
        return "task:" + hashlib.sha1("\n".join(self.vocab).encode()).hexdigest()[:16]

    def generate(self, rng: np.random.Generator, split: str) -> tuple[list[int], list[int]]:
        """One random (prompt, answer) pair before the split filter; prompt starts with <bos>."""
        raise NotImplementedError

    def max_example_len(self) -> int:
        raise NotImplementedError

    def in_eval(self, prompt: list[int]) -> bool:
        digest = hashlib.blake2b(
            np.asarray(prompt, dtype=np.int32).tobytes(), digest_size=8, key=b"titanloop-heldout"
        ).digest()
        return int.from_bytes(digest, "little") % _BUCKETS < self.eval_fraction * _BUCKETS

    def example(self, rng: np.random.Generator, split: str) -> tuple[list[int], list[int]]:
        """A (prompt, answer) pair of `split`, rejection-sampled so the two splits are disjoint."""
        want_eval = split == "eval"
        for _ in range(100_000):
            prompt, answer = self.generate(rng, split)
            if self.in_eval(prompt) == want_eval:
                return prompt, answer
        raise RuntimeError(f"task {self.name}: could not draw a {split} example; eval_fraction is too extreme")

    def training_document(self, rng: np.random.Generator) -> tuple[list[int], int]:
        """A training document (tokens ending with <eos>, number of leading non-target tokens)."""
        prompt, answer = self.example(rng, "train")
        return prompt + answer + [EOS], len(prompt)


class ManoTask(Task):
    name = "mano"

    def __init__(
        self,
        seed: int,
        max_ops: int = 10,
        modulus: int = 23,
        eval_ops: int | None = None,
        heldout_min_ops: int = 1,
    ):
        """max_ops = L: training lengths uniform in [1, L], eval at exactly L (ouro uses 10, 16, 24); eval_ops
        scores another length in [1, L] with the same vocabulary (accuracy by tree size).

        heldout_min_ops = k: only trees of >= k operators may be held out. With k = 2 every 1-operator tree (the
        3 * modulus**2 entries of the operation tables) is trained, so a held-out tree asks for composing trained
        entries, not for inferring an unseen entry from the modular rule (grokking). The eval split at a size
        below k has nothing held out: it draws trained trees and scores memorization. Default 1: any tree may be
        held out (ouro's split)."""
        self.max_ops, self.modulus, self.eval_ops = max_ops, modulus, eval_ops or max_ops
        self.heldout_min_ops = heldout_min_ops
        require(max_ops >= 1, "data.task_options.max_ops", max_ops, "an integer >= 1")
        require(1 <= self.eval_ops <= max_ops, "data.task_options.eval_ops", eval_ops, f"an integer in [1, {max_ops}]")
        require(
            1 <= heldout_min_ops <= max_ops,
            "data.task_options.heldout_min_ops",
            heldout_min_ops,
            f"an integer in [1, max_ops={max_ops}]",
        )
        numbers = [str(i) for i in range(modulus)]
        super().__init__(["<ans>"] + [f"<len_{i}>" for i in range(max_ops + 1)] + ["+", "-", "*"] + numbers, seed)

    def _tree(self, rng, n_ops: int) -> tuple[list[str], int]:
        """A uniformly split random binary tree with n_ops operators: (prefix tokens, value mod p)."""
        if n_ops == 0:
            v = int(rng.integers(self.modulus))
            return [str(v)], v
        op = ("+", "-", "*")[int(rng.integers(3))]
        left = int(rng.integers(n_ops))
        lt, lv = self._tree(rng, left)
        rt, rv = self._tree(rng, n_ops - 1 - left)
        p = self.modulus
        value = (lv + rv) % p if op == "+" else (lv - rv) % p if op == "-" else (lv * rv) % p
        return [op] + lt + rt, value

    def generate(self, rng, split):
        n_ops = self.eval_ops if split == "eval" else int(rng.integers(1, self.max_ops + 1))
        expr, value = self._tree(rng, n_ops)
        return self.encode(["<bos>", f"<len_{n_ops}>"] + expr + ["<ans>"]), self.encode([str(value)])

    def in_eval(self, prompt: list[int]) -> bool:
        n_ops = int(self.vocab[prompt[1]][len("<len_") : -1])
        return n_ops >= self.heldout_min_ops and super().in_eval(prompt)

    def example(self, rng, split):
        if split == "eval" and self.eval_ops < self.heldout_min_ops:  # nothing this small is held out
            return self.generate(rng, split)
        return super().example(rng, split)

    def max_example_len(self):
        return 3 + 2 * self.max_ops + 1 + 1 + 1


class AdditionTask(Task):
    name = "addition"

    def __init__(self, seed: int, n_digits: int = 4):
        require(n_digits >= 1, "data.task_options.n_digits", n_digits, "an integer >= 1")
        self.n_digits = n_digits
        super().__init__([str(d) for d in range(10)] + ["+", "="], seed)

    def generate(self, rng, split):
        lo, hi = 10 ** (self.n_digits - 1) if self.n_digits > 1 else 0, 10**self.n_digits
        a, b = int(rng.integers(lo, hi)), int(rng.integers(lo, hi))
        return self.encode(["<bos>", *str(a), "+", *str(b), "="]), self.encode(list(str(a + b)))

    def max_example_len(self):
        return 1 + 2 * self.n_digits + 2 + self.n_digits + 1 + 1


class XorTask(Task):
    name = "xor"

    def __init__(self, seed: int, n_bits: int = 32, eval_n_bits: int | None = None):
        require(n_bits >= 1, "data.task_options.n_bits", n_bits, "an integer >= 1")
        self.n_bits, self.eval_n_bits = n_bits, eval_n_bits or n_bits
        super().__init__(["0", "1", "="], seed)

    def generate(self, rng, split):
        n = self.eval_n_bits if split == "eval" else self.n_bits
        bits = rng.integers(0, 2, size=n)
        running = np.bitwise_xor.accumulate(bits)
        return (self.encode(["<bos>", *map(str, bits.tolist()), "="]), self.encode(list(map(str, running.tolist()))))

    def max_example_len(self):
        return 2 * max(self.n_bits, self.eval_n_bits) + 3


class ChainTask(Task):
    name = "chain"

    def __init__(
        self,
        seed: int,
        n_vars: int = 12,
        n_values: int = 10,
        n_chains: int = 3,
        hops: int = 4,
        eval_hops: int | None = None,
    ):
        self.n_vars, self.n_values, self.n_chains, self.hops = n_vars, n_values, n_chains, hops
        self.eval_hops = eval_hops or hops
        require(hops >= 1, "data.task_options.hops", hops, "an integer >= 1")
        require(
            2 <= n_chains <= n_values,
            "data.task_options.n_chains",
            n_chains,
            f"an integer in [2, n_values={n_values}] (each chain ends in a distinct value)",
        )
        require(
            n_vars >= n_chains * max(hops, self.eval_hops),
            "data.task_options.n_vars",
            n_vars,
            f">= n_chains * max(hops, eval_hops) = {n_chains * max(hops, self.eval_hops)} (distinct variables)",
        )
        self.vars = [f"v{i}" for i in range(n_vars)]
        self.values = [f"{i}" for i in range(n_values)]
        edges = [f"{a}<{b}" for a in self.vars for b in self.vars + self.values]
        super().__init__(["?"] + self.values + self.vars + edges, seed)

    def generate(self, rng, split):
        depth = self.eval_hops if split == "eval" else int(rng.integers(1, self.hops + 1))
        lengths = [depth] + [int(rng.integers(1, self.hops + 1)) for _ in range(self.n_chains - 1)]
        names = iter(rng.permutation(self.n_vars).tolist())
        roots = rng.permutation(self.n_values)[: self.n_chains].tolist()
        statements = []
        for c, (root, length) in enumerate(zip(roots, lengths)):
            target = self.values[root]
            for _ in range(length):
                var = self.vars[next(names)]
                statements.append(f"{var}<{target}")
                target = var
            if c == 0:  # the first chain holds the question
                question = target
        order = rng.permutation(len(statements))
        words = ["<bos>"] + [statements[i] for i in order] + ["?", question]
        return self.encode(words), self.encode([self.values[roots[0]]])

    def max_example_len(self):
        return 1 + self.n_chains * max(self.hops, self.eval_hops) + 2 + 1 + 1


class MultiHopTask(Task):
    """3-hop QA over a fixed random relation graph (the "world" is a function of `world_seed`)."""

    name = "multihop"
    HOPS = 3

    def __init__(
        self,
        seed: int,
        n_layers: int = 5,
        layer_size: int = 100,
        n_relations: int = 20,
        fact_fraction: float = 0.5,
        n_eval: int = 3000,
        world_seed: int = 1234,
    ):
        require(n_layers > self.HOPS, "data.task_options.n_layers", n_layers, f"an integer > {self.HOPS}")
        require(0.0 <= fact_fraction < 1.0, "data.task_options.fact_fraction", fact_fraction, "a float in [0, 1)")
        self.n_layers, self.layer_size, self.n_relations = n_layers, layer_size, n_relations
        self.fact_fraction = fact_fraction
        self.people = [f"p{i}" for i in range(n_layers * layer_size)]
        self.relations = [f"r{i}" for i in range(n_relations)]
        super().__init__(["who", "is", "the", "of", "?", "answer", ":", "."] + self.relations + self.people, seed)
        world = np.random.default_rng(world_seed)
        # edges[layer, person_in_layer, relation] -> person index in the next layer (global index)
        self.edges = (np.arange(1, n_layers)[:, None, None] * layer_size) + world.integers(
            0, layer_size, size=(n_layers - 1, layer_size, n_relations)
        )
        self.n_questions = layer_size * n_relations**self.HOPS
        require(
            1 <= n_eval <= self.n_questions // 2,
            "data.task_options.n_eval",
            n_eval,
            f"an integer in [1, {self.n_questions // 2}]",
        )
        # the held-out questions: exactly n_eval of them (ouro B.3 leaves out 3,000), chosen by hash
        self._eval_ids = np.sort(np.argsort(self._hash(np.arange(self.n_questions)), kind="stable")[:n_eval])
        self._eval_set = set(self._eval_ids.tolist())

    def _question(self, q: int) -> tuple[list[int], list[int]]:
        rels = []
        for _ in range(self.HOPS):
            q, r = divmod(q, self.n_relations)
            rels.append(r)
        person = start = q  # a person of layer 0
        for layer, r in enumerate(rels):
            person = int(self.edges[layer, person - layer * self.layer_size, r])
        words = ["<bos>", "who", "is"]
        for r in reversed(rels):  # "the r3 of the r2 of the r1 of p": r1 is applied first
            words += ["the", self.relations[r], "of"]
        words += [self.people[start], "?", "answer", ":"]
        return self.encode(words), self.encode([self.people[person]])

    @staticmethod
    def _hash(q: np.ndarray) -> np.ndarray:
        """splitmix64 of question ids, vectorized over all 800K questions."""
        with np.errstate(over="ignore"):
            z = (q.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
            return z ^ (z >> np.uint64(29))

    def generate(self, rng, split):
        ids = self._eval_ids if split == "eval" else None
        q = int(ids[rng.integers(len(ids))]) if ids is not None else int(rng.integers(self.n_questions))
        return self._question(q)

    def in_eval(self, prompt: list[int]) -> bool:
        return self._question_id(prompt) in self._eval_set

    def _question_id(self, prompt: list[int]) -> int:
        words = self.decode(prompt)
        rels = [int(w[1:]) for w in words if w.startswith("r")][::-1]  # r1 first
        q = int(words[words.index("?") - 1][1:])
        for r in reversed(rels):
            q = q * self.n_relations + r
        return q

    def fact(self, rng) -> tuple[list[int], int]:
        layer = int(rng.integers(self.n_layers - 1))
        i, r = int(rng.integers(self.layer_size)), int(rng.integers(self.n_relations))
        head, tail = self.people[layer * self.layer_size + i], self.people[int(self.edges[layer, i, r])]
        return self.encode(["<bos>", "the", self.relations[r], "of", head, "is", tail, ".", "<eos>"]), 1

    def training_document(self, rng):
        if rng.random() < self.fact_fraction:
            return self.fact(rng)
        return super().training_document(rng)

    def max_example_len(self):
        return 3 + 3 * self.HOPS + 4 + 1 + 1


class ComposeTask(Task):
    """Composition of fixed relations, read left to right: `<bos> e5 r2 r0 r7 =` -> `r7(r0(r2(e5)))`.

    The "world" (seeded by `world_seed`) has `n_relations` relations, each a random permutation of `n_entities`
    entities: n_relations * n_entities one-hop facts, learned in the weights. A question of depth d applies d
    relations to an entity, left to right; training depths are uniform in [1, hops], the eval split asks depth
    `eval_hops` (default hops) and is held out by a hash of the prompt. With n_relations ** hops * n_entities
    distinct deepest questions (8 ** 4 * 32 = 131,072 by default) they cannot be memorized: every answer is a
    composition of one-hop facts. A shared block looped T times can apply one relation per loop along the
    sequence (the state after r_i at r_i's position); n distinct layers run once only about n.
    """

    name = "compose"

    def __init__(
        self,
        seed: int,
        n_entities: int = 32,
        n_relations: int = 8,
        hops: int = 4,
        eval_hops: int | None = None,
        world_seed: int = 1234,
    ):
        require(n_entities >= 2, "data.task_options.n_entities", n_entities, "an integer >= 2")
        require(n_relations >= 1, "data.task_options.n_relations", n_relations, "an integer >= 1")
        require(hops >= 1, "data.task_options.hops", hops, "an integer >= 1")
        self.n_entities, self.n_relations, self.hops = n_entities, n_relations, hops
        self.eval_hops = eval_hops or hops
        require(1 <= self.eval_hops <= 64, "data.task_options.eval_hops", eval_hops, "an integer in [1, 64]")
        world = np.random.default_rng(world_seed)
        self.relation_maps = np.stack([world.permutation(n_entities) for _ in range(n_relations)])
        self.entities = [f"e{i}" for i in range(n_entities)]
        self.relations = [f"r{i}" for i in range(n_relations)]
        super().__init__(["="] + self.relations + self.entities, seed)

    def answer(self, entity: int, relations: list[int]) -> int:
        for r in relations:
            entity = int(self.relation_maps[r, entity])
        return entity

    def generate(self, rng, split):
        depth = self.eval_hops if split == "eval" else int(rng.integers(1, self.hops + 1))
        x = int(rng.integers(self.n_entities))
        rels = rng.integers(self.n_relations, size=depth).tolist()
        words = ["<bos>", self.entities[x]] + [self.relations[r] for r in rels] + ["="]
        return self.encode(words), self.encode([self.entities[self.answer(x, rels)]])

    def max_example_len(self):
        return 3 + max(self.hops, self.eval_hops) + 1 + 1


TASKS = {
    "mano": ManoTask,
    "addition": AdditionTask,
    "xor": XorTask,
    "chain": ChainTask,
    "multihop": MultiHopTask,
    "compose": ComposeTask,
}


def build_task(name: str, seed: int = 0, **options) -> Task:
    """A task by name with its options, e.g. build_task("mano", max_ops=16)."""
    if name not in TASKS:
        raise ConfigError(f"data.task={name!r} is unknown: expected one of {sorted(TASKS)}")
    cls = TASKS[name]
    try:
        return cls(seed, **options)
    except TypeError as e:
        raise ConfigError(f"data.task_options={options!r} do not fit task {name!r}: {e}") from None


class TaskSource:
    """Rows of packed training documents of a task: row k is a function of (seed, k) only.

    Documents are packed whole (never split) until the next one would not fit; the tail is padding.
    With `train_size` set, documents are drawn from a fixed pool of that many training examples
    (sample-efficiency studies: ouro B.3 trains on 2.5%-25% of all QA pairs).
    """

    def __init__(self, task: Task, seq_len: int, seed: int, train_size: int | None = None):
        require(
            task.max_example_len() <= seq_len + 1,
            "seq_len",
            seq_len,
            f">= {task.max_example_len() - 1} to fit one {task.name} example",
        )
        self.task, self.seq_len, self.seed, self.train_size = task, seq_len, seed, train_size
        self.name = f"task:{task.name}"

    def epoch_of(self, samples: int) -> int:
        return 0

    def _document(self, rng) -> tuple[list[int], int]:
        if self.train_size is None:
            return self.task.training_document(rng)
        j = int(rng.integers(self.train_size))
        return self.task.training_document(np.random.default_rng([self.seed, 1, j]))

    def row(self, k: int) -> PackedRow:
        rng = np.random.default_rng([self.seed, 0, k])
        docs, used = [], 0
        while True:
            doc, n_prompt = self._document(rng)
            if used + len(doc) > self.seq_len + 1:
                break
            docs.append((np.asarray(doc), n_prompt))
            used += len(doc)
        return pack_documents(docs, self.seq_len + 1, PAD)


def eval_examples(task: Task, n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """`n` distinct held-out (prompt, answer) pairs, never produced by training rows."""
    rng = np.random.default_rng([task.seed, 2, seed])
    seen, out = set(), []
    for _ in range(100 * n + 1000):
        prompt, answer = task.example(rng, "eval")
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            out.append((prompt, answer))
            if len(out) == n:
                return out
    raise ConfigError(f"task {task.name}: only {len(out)} distinct held-out examples exist, asked for n={n}")


def eval_batches(task: Task, n: int, batch_size: int, seed: int = 0):
    """Held-out examples as batches, one example per row, right-padded; labels only on the answer tokens.

    Yields {"input_ids", "labels", "doc_ids"} like the training loader, so `answer_accuracy` applies.
    """
    examples = eval_examples(task, n, seed)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        width = max(len(p) + len(a) for p, a in chunk)
        inputs = torch.full((len(chunk), width), PAD, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        for r, (p, a) in enumerate(chunk):
            seq = p + a
            inputs[r, : len(seq) - 1] = torch.tensor(seq[:-1])
            labels[r, len(p) - 1 : len(seq) - 1] = torch.tensor(a)  # position t predicts token t+1
        yield {"input_ids": inputs, "labels": labels, "doc_ids": torch.zeros_like(inputs)}


def answer_accuracy(predictions: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor) -> tuple[int, int]:
    """Exact-match answer accuracy: (examples with every answer token right, examples with answer tokens).

    predictions: argmax token ids [B, S] aligned with `labels` (already-shifted next-token targets, -100 =
    ignore); an example is one (row, doc_id) group, so packed training rows are scored per example.
    """
    mask = labels != IGNORE_INDEX
    key = (torch.arange(labels.shape[0], device=labels.device)[:, None] * (labels.shape[1] + 1) + doc_ids)[mask]
    wrong = (predictions != labels)[mask]
    groups, inverse = torch.unique(key, return_inverse=True)
    any_wrong = torch.zeros(len(groups), dtype=torch.bool, device=labels.device).scatter_reduce(
        0, inverse, wrong, reduce="amax"
    )
    return int((~any_wrong).sum()), int(len(groups))
