"""Synthetic tasks: determinism, correct answers, disjoint held-out splits, answer-accuracy scoring."""

import numpy as np
import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.data import DataConfig, build_dataloader
from titanloop.data.synthetic_tasks import TaskSource, answer_accuracy, build_task, eval_batches, eval_examples

TASKS = {
    "mano": {"max_ops": 4},
    "addition": {"n_digits": 3},
    "xor": {"n_bits": 12, "eval_n_bits": 16},
    "chain": {},
    "multihop": {},
    "compose": {},
}


def prefix_eval(words, p=23):
    """Independent evaluator of a prefix expression over F_p."""

    def go(i):
        w = words[i]
        if w in "+-*":
            a, i = go(i + 1)
            b, i = go(i)
            return {"+": a + b, "-": a - b, "*": a * b}[w] % p, i
        return int(w), i + 1

    value, end = go(0)
    assert end == len(words)
    return value


def check_answer(task, prompt, answer):
    words, ans = task.decode(prompt), task.decode(answer)
    if task.name == "mano":
        assert words[0] == "<bos>" and words[-1] == "<ans>"
        n_ops = int(words[1][5:-1])
        assert sum(w in "+-*" for w in words[2:-1]) == n_ops
        assert int(ans[0]) == prefix_eval(words[2:-1])
    elif task.name == "addition":
        a, b = "".join(words[1:-1]).split("+")
        assert "".join(ans) == str(int(a) + int(b))
    elif task.name == "xor":
        bits = [int(w) for w in words[1:-1]]
        assert [int(w) for w in ans] == np.bitwise_xor.accumulate(bits).tolist()
    elif task.name == "chain":  # follow the assignments from the question's variable to a value
        assert words[0] == "<bos>" and words[-2] == "?"
        binding = dict(w.split("<") for w in words[1:-2])
        assert len(binding) == len(words) - 3  # every variable is assigned once
        node, hops = words[-1], 0
        while node in binding:
            node, hops = binding[node], hops + 1
        assert ans == [node] and node in task.values
        assert 1 <= hops <= max(task.hops, task.eval_hops)
    elif task.name == "compose":  # apply the relations left to right through the world's one-hop facts
        assert words[0] == "<bos>" and words[-1] == "="
        entity = int(words[1][1:])
        for r in words[2:-1]:
            entity = int(task.relation_maps[int(r[1:]), entity])
        assert ans == [f"e{entity}"] and 1 <= len(words) - 3 <= max(task.hops, task.eval_hops)
    else:  # multihop: follow the relations through the one-hop facts the task teaches
        facts = {}
        for layer in range(task.n_layers - 1):
            for i in range(task.layer_size):
                for r in range(task.n_relations):
                    facts[(task.people[layer * task.layer_size + i], task.relations[r])] = task.people[
                        int(task.edges[layer, i, r])
                    ]
        rels = [w for w in words if w.startswith("r")]
        person = words[words.index("?") - 1]
        for r in reversed(rels):  # "the r3 of the r2 of the r1 of p"
            person = facts[(person, r)]
        assert ans == [person]


@pytest.mark.parametrize("name", list(TASKS))
def test_examples_are_correct_and_splits_disjoint(name):
    task = build_task(name, seed=0, **TASKS[name])
    rng = np.random.default_rng(0)
    train = [task.example(rng, "train") for _ in range(3000)]
    held = eval_examples(task, 100)
    for prompt, answer in train[:200] + held:
        check_answer(task, prompt, answer)
    train_prompts = {tuple(p) for p, _ in train}
    held_prompts = {tuple(p) for p, _ in held}
    assert len(held_prompts) == 100 and not train_prompts & held_prompts
    assert all(task.in_eval(list(p)) for p in held_prompts) and not any(task.in_eval(list(p)) for p in train_prompts)


def test_small_mano_space_is_fully_partitioned():
    """With L=1 there are only 3*23*23 prompts: training covers its whole share and never an eval one."""
    task = build_task("mano", seed=0, max_ops=1)
    rng = np.random.default_rng(1)
    train = {tuple(task.example(rng, "train")[0]) for _ in range(20000)}
    held = {tuple(p) for p, _ in eval_examples(task, 40)}
    assert len(train) > 1300 and not train & held
    assert len(train) + sum(task.in_eval(list(p)) for p in held) <= 3 * 23 * 23


def test_mano_heldout_min_ops_trains_every_table_entry():
    """heldout_min_ops = 2: all 3*p*p one-operator trees are trained, held-out trees have >= 2 operators (never
    trained), and the eval split at 1 operator draws trained trees; the default still holds out 1-operator trees."""
    task = build_task("mano", seed=0, max_ops=2, modulus=5, heldout_min_ops=2)
    rng = np.random.default_rng(1)
    train = {tuple(task.example(rng, "train")[0]) for _ in range(20000)}
    assert sum(task.decode(p)[1] == "<len_1>" for p in train) == 3 * 5 * 5
    held = {tuple(p) for p, _ in eval_examples(task, 40)}
    assert all(task.decode(p)[1] == "<len_2>" for p in held) and not train & held
    table = build_task("mano", seed=0, max_ops=2, modulus=5, heldout_min_ops=2, eval_ops=1)
    for prompt, answer in eval_examples(table, 30):
        assert tuple(prompt) in train
        words = table.decode(prompt)
        assert words[1] == "<len_1>" and int(table.decode(answer)[0]) == prefix_eval(words[2:-1], p=5)
    default = build_task("mano", seed=0, max_ops=1)
    assert any(default.in_eval(list(p)) for p, _ in eval_examples(default, 5))
    with pytest.raises(ConfigError, match="heldout_min_ops"):
        build_task("mano", seed=0, max_ops=2, heldout_min_ops=3)


def test_eval_depths_of_chain_and_mano():
    """chain: held-out questions take exactly eval_hops lookups; mano: eval_ops picks the scored tree size."""
    chain = build_task("chain", seed=0, hops=3, eval_hops=4, n_vars=16)
    for prompt, answer in eval_examples(chain, 50):
        words = chain.decode(prompt)
        binding = dict(w.split("<") for w in words[1:-2])
        node, hops = words[-1], 0
        while node in binding:
            node, hops = binding[node], hops + 1
        assert hops == 4 and chain.decode(answer) == [node]
    mano = build_task("mano", seed=0, max_ops=4, eval_ops=2)
    assert mano.vocab == build_task("mano", seed=0, max_ops=4).vocab
    for prompt, answer in eval_examples(mano, 20):
        assert mano.decode(prompt)[1] == "<len_2>"
        check_answer(mano, prompt, answer)
    with pytest.raises(ConfigError, match="eval_ops"):
        build_task("mano", seed=0, max_ops=4, eval_ops=5)
    with pytest.raises(ConfigError, match="n_vars"):
        build_task("chain", seed=0, n_vars=8)


def test_rows_are_deterministic_and_seeded():
    task = build_task("mano", seed=0, max_ops=6)
    a, b = TaskSource(task, 128, seed=5), TaskSource(task, 128, seed=5)
    c = TaskSource(task, 128, seed=6)
    for k in (0, 1, 999):
        assert np.array_equal(a.row(k).tokens, b.row(k).tokens)
    assert not np.array_equal(a.row(0).tokens, c.row(0).tokens)
    pool = TaskSource(task, 128, seed=5, train_size=10)  # fixed pool of 10 training examples
    docs = set()
    for k in range(30):
        row = pool.row(k)
        starts = np.flatnonzero(np.diff(np.concatenate([[-1], row.doc_ids])))
        for s, e in zip(starts, list(starts[1:]) + [len(row.tokens)]):
            if row.tokens[s] == 1:  # <bos>: a whole example, not the padding tail
                docs.add(tuple(row.tokens[s:e].tolist()))
    assert len(docs) <= 10


def test_sizes_and_multihop_world():
    task = build_task("multihop", seed=0)
    assert task.n_questions == 800_000 and task.vocab_size < 600  # ouro B.3: 100 x 20^3 3-hop questions
    assert len(eval_examples(task, 3000)) == 3000


@pytest.mark.parametrize("name", list(TASKS))
def test_answer_accuracy_scores_eval_batches(name):
    task = build_task(name, seed=0, **TASKS[name])
    batches = list(eval_batches(task, 20, batch_size=8))
    assert sum(b["input_ids"].shape[0] for b in batches) == 20
    for b in batches:
        labels = b["labels"]
        perfect = torch.where(labels == -100, torch.zeros_like(labels), labels)
        assert answer_accuracy(perfect, labels, b["doc_ids"]) == (len(labels), len(labels))
        wrong = perfect.clone()
        first = (labels[0] != -100).nonzero()[0, 0]
        wrong[0, first] = (wrong[0, first] + 1) % task.vocab_size
        assert answer_accuracy(wrong, labels, b["doc_ids"]) == (len(labels) - 1, len(labels))
        for row, (inp, lab) in enumerate(zip(b["input_ids"], labels)):  # label t is input t+1
            pos = (lab != -100).nonzero().flatten()
            assert torch.equal(lab[pos[:-1]], inp[pos[:-1] + 1])


def test_packed_training_rows_score_per_example():
    cfg = DataConfig(kind="synthetic_task", task="addition", task_options={"n_digits": 2}, prefetch=0)
    ld = build_dataloader(
        cfg, seq_len=64, micro_batch_size=2, global_batch_size=2, dp_rank=0, dp_world=1, vocab_size=32
    )
    b = next(ld)
    n_examples = sum(len(torch.unique(d[lab != -100])) for d, lab in zip(b["doc_ids"], b["labels"]))
    assert answer_accuracy(b["labels"].clamp(min=0), b["labels"], b["doc_ids"]) == (n_examples, n_examples)
    assert n_examples >= 2 * 64 // 12
