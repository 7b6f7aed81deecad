"""lm-evaluation-harness adapter, offline: a custom multiple-choice task (YAML + local jsonl) scored through
lm_eval.simple_evaluate, checked against log-likelihoods computed directly from the model."""

import json
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from titanloop.config_errors import ConfigError  # noqa: E402
from titanloop.eval.lm_eval_adapter import ByteTokenizer, TitanloopLM  # noqa: E402
from titanloop.interchange import export_ouro_hf  # noqa: E402
from titanloop.model import LoopLM, preset  # noqa: E402

DOCS = [
    {"question": "2+2=", "choices": ["4", "5", "22"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " green"], "answer": 0},
    {"question": "abc", "choices": ["d", "x", "abc"], "answer": 2},
    {"question": "Cats say", "choices": [" meow", " woof"], "answer": 1},
    {"question": "1,2,3,", "choices": ["4", "9"], "answer": 0},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = LoopLM(preset("debug-tiny", vocab_size=256, n_layers=1, n_loops=3)).eval()
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(0, 1.0)
    path = tmp_path_factory.mktemp("ckpt") / "hf"
    export_ouro_hf(model, path)
    return path, model


def direct_loglik(model, ctx: str, cont: str, n_loops: int) -> float:
    tok = ByteTokenizer()
    full = tok.encode(ctx) + tok.encode(cont)
    ids = torch.tensor([full[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, n_loops=n_loops, return_logits="last").logits[0], -1)
    n = len(tok.encode(cont))
    return float(sum(logp[len(full) - 1 - n + i, full[len(full) - n + i]] for i in range(n)))


def write_task(tmp_path):
    data = tmp_path / "tiny.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in DOCS))
    (tmp_path / "tiny_choice.yaml").write_text(f"""task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {tmp_path / "hf_datasets"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return tmp_path


def test_loglikelihood_matches_model(checkpoint):
    path, model = checkpoint
    lm = TitanloopLM(pretrained=str(path), n_loops=2, tokenizer="bytes", batch_size=2)

    class Req:
        def __init__(self, *args):
            self.args = args

    reqs = [Req(d["question"], c) for d in DOCS for c in d["choices"]]
    got = lm.loglikelihood(reqs)
    for r, (lp, greedy) in zip(reqs, got):
        assert lp == pytest.approx(direct_loglik(model, *r.args, n_loops=2), abs=1e-4)
        assert isinstance(greedy, bool)
    # Q-exit with q = 0 decodes every token from loop 1, i.e. equals a 1-loop model
    q0 = TitanloopLM(pretrained=str(path), exit_policy="q_exit", q=0.0, tokenizer="bytes").loglikelihood(reqs[:3])
    for r, (lp, _) in zip(reqs[:3], q0):
        assert lp == pytest.approx(direct_loglik(model, *r.args, n_loops=1), abs=1e-4)
    rolling = lm.loglikelihood_rolling([Req("hello world")])
    assert rolling[0] < 0 and math.isfinite(rolling[0])
    text = lm.generate_until([Req("abc", {"until": ["\n"], "max_gen_toks": 4})])
    assert isinstance(text[0], str)


def test_simple_evaluate_on_local_task(checkpoint, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    path, model = checkpoint
    task_dir = write_task(tmp_path)
    out = simple_evaluate(
        model="titanloop",
        model_args=f"pretrained={path},n_loops=3,tokenizer=bytes",
        tasks=["tiny_choice"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        batch_size=4,
        log_samples=False,
        bootstrap_iters=0,
    )
    acc = out["results"]["tiny_choice"]["acc,none"]
    expected = sum(
        max(range(len(d["choices"])), key=lambda i: direct_loglik(model, d["question"], d["choices"][i], 3))
        == d["answer"]
        for d in DOCS
    ) / len(DOCS)
    assert acc == pytest.approx(expected)


def test_adapter_bad_input(checkpoint, tmp_path):
    path, _ = checkpoint
    with pytest.raises(ConfigError, match="q=1.5 is invalid"):
        TitanloopLM(pretrained=str(path), exit_policy="q_exit", q=1.5, tokenizer="bytes")
    with pytest.raises(ConfigError, match="tokenizer"):
        TitanloopLM(pretrained=str(path))  # no tokenizer.json next to the checkpoint
    with pytest.raises(ConfigError, match="not a LoopLM checkpoint"):
        TitanloopLM(pretrained=str(tmp_path), tokenizer="bytes")


def test_adapter_device_and_dtype(checkpoint):
    """model_args dtype (default auto) and lm_eval's device (default auto): CUDA in bfloat16 with a GPU, else the
    CPU in float32; `cuda` on a machine without a GPU and a bad dtype are one-line errors."""
    path, _ = checkpoint
    weight = TitanloopLM(pretrained=str(path), tokenizer="bytes").model.embed_tokens.weight
    expected = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    assert (weight.device.type, weight.dtype) == expected
    lm = TitanloopLM(pretrained=str(path), tokenizer="bytes", device="cpu", dtype="bfloat16")
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^device='cuda' is invalid here: torch.cuda.is_available\(\) is False"):
            TitanloopLM(pretrained=str(path), tokenizer="bytes", device="cuda")
    with pytest.raises(ConfigError, match=r"^dtype='int8' is invalid: expected auto, float32, bfloat16 or float16$"):
        TitanloopLM(pretrained=str(path), tokenizer="bytes", dtype="int8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")
def test_adapter_cli_refuses_cuda_without_a_gpu_in_one_line(checkpoint, tmp_path):
    """`--device cuda` on a machine without a GPU: exit 2 and one line saying so (it used to run on the CPU)."""
    import subprocess
    import sys

    path, _ = checkpoint
    cmd = [sys.executable, "-m", "titanloop.eval.lm_eval_adapter", "run", "--model", "titanloop", "--model_args"]
    cmd += [f"pretrained={path},tokenizer=bytes", "--tasks", "tiny_choice", "--include_path", str(write_task(tmp_path))]
    proc = subprocess.run([*cmd, "--device", "cuda"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: device='cuda' is invalid here: torch.cuda.is_available() is False on this machine; expected auto or cpu"
    ), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
