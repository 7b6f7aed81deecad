"""lm-evaluation-harness adapter: score a titanloop checkpoint at a chosen loop count and exit policy.

Registered as model name `titanloop` (lm_eval 0.4.x). lm_eval cannot import titanloop by itself, so run it
through this module, which registers the class and then hands the command line to lm_eval unchanged:

    python -m titanloop.eval.lm_eval_adapter run --model titanloop \\
        --model_args pretrained=out/hf,n_loops=4,exit_policy=q_exit,q=0.8,tokenizer=out/hf/tokenizer.json \\
        --tasks hellaswag --batch_size 8

Python: `lm_eval.simple_evaluate(model=TitanloopLM(pretrained=...), tasks=[...])`.

model_args: pretrained (a path titanloop.eval.load_model accepts), n_loops (T, default the model's),
exit_policy static|q_exit, q (Q-exit threshold in [0, 1]), tokenizer (a tokenizer.json, default
<pretrained>/tokenizer.json; or `bytes` for UTF-8 bytes as token ids), bos_token_id (the token that
conditions an empty context and the first rolling window; default the tokenizer's, else 0), max_length,
dtype (auto: bfloat16 on CUDA, float32 on the CPU; or float32, bfloat16, float16). lm_eval's --device picks the
device (default auto: CUDA when torch.cuda.is_available(), else the CPU; `cuda` without a GPU is a one-line error).
Scoring is teacher-forced: every position is decoded from its own exit loop (static: loop T; q_exit: the first
loop whose exit CDF reaches q, as in Ouro's Hugging Face code). Generation uses titanloop.eval.generate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from titanloop.config_errors import ConfigError, require, require_choice
from titanloop.eval.exits import q_exit
from titanloop.eval.generate import GenerationConfig, generate
from titanloop.checkpoint.loading import load_model
from titanloop.eval.trace import iter_loops


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (no files needed; for tests and byte-level models)."""

    bos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)
        self.bos_token_id = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _tokenizer(spec: str | None, pretrained: str):
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec) if spec else Path(pretrained) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"tokenizer={str(spec or path)!r} is invalid: expected a tokenizer.json path or 'bytes' "
            "(no tokenizer.json next to the checkpoint)"
        )
    return JsonTokenizer(str(path))


@register_model("titanloop")
class TitanloopLM(LM):
    def __init__(
        self,
        pretrained: str,
        n_loops: int | None = None,
        exit_policy: str = "static",
        q: float = 1.0,
        tokenizer: str | None = None,
        bos_token_id: int | None = None,
        max_length: int | None = None,
        batch_size: int | str | None = 1,
        device: str | None = "auto",
        dtype: str | None = "auto",
        **_lm_eval_extras,
    ):
        # _lm_eval_extras: options lm_eval passes to every model class (e.g. max_batch_size), unused here
        super().__init__()
        self.model = load_model(pretrained, device=device or "auto", dtype=dtype or "auto")  # cuda without a GPU: error
        cfg = self.model.cfg
        self.n_loops = int(n_loops) if n_loops is not None else cfg.n_loops
        require(self.n_loops >= 1, "n_loops", n_loops, "an integer >= 1")
        require_choice(exit_policy, "exit_policy", ("static", "q_exit"))
        self.exit_policy, self.q = exit_policy, float(q)
        require(0.0 <= self.q <= 1.0, "q", q, "a threshold in [0, 1]")
        self.tokenizer = _tokenizer(tokenizer, pretrained)
        bos = bos_token_id if bos_token_id is not None else self.tokenizer.bos_token_id
        self.bos_token_id = int(bos) if bos is not None else 0
        self.max_length = int(max_length) if max_length else cfg.max_seq_len
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1

    # ----- scoring ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _exit_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> log-probabilities [B, S, V] from each position's exit loop."""
        steps = list(iter_loops(self.model, ids, self.n_loops))
        if self.exit_policy == "static":
            readout = steps[-1].exit_readout
        else:
            exit_loop = q_exit(torch.stack([s.gate_logit for s in steps]), self.q)  # [B, S]
            stacked = torch.stack([s.exit_readout for s in steps])  # [T, B, S, H]
            idx = (exit_loop - 1)[None, ..., None].expand(1, *stacked.shape[1:])
            readout = stacked.gather(0, idx)[0]
        return torch.log_softmax(self.model.lm_head(readout).float(), dim=-1)

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum log p(continuation), continuation is the greedy output)."""
        out = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start : start + self.batch_size]
            rows = []
            for ctx, cont in chunk:
                full = ((ctx or [self.bos_token_id]) + cont)[-(self.max_length + 1) :]
                rows.append((full, len(cont)))
            width = max(len(f) for f, _ in rows) - 1
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            for i, (f, _) in enumerate(rows):
                ids[i, : len(f) - 1] = torch.tensor(f[:-1])
            logp = self._exit_logprobs(ids.to(self.model.embed_tokens.weight.device)).cpu()
            for i, (f, n_cont) in enumerate(rows):
                end = len(f) - 1
                target = torch.tensor(f[-n_cont:])
                lp = logp[i, end - n_cont : end]
                out.append((float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [(self.tokenizer.encode(ctx), self.tokenizer.encode(cont)) for ctx, cont in (r.args for r in requests)]
        return self._score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        results = []
        for (text,) in (r.args[:1] for r in requests):
            windows = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tokenizer.encode(text),
                    prefix_token=self.bos_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            results.append(sum(lp for lp, _ in self._score(windows)))
        return results

    def generate_until(self, requests) -> list[str]:
        results = []
        for ctx, gen_kwargs in (r.args for r in requests):
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = (self.tokenizer.encode(ctx) or [self.bos_token_id])[-self.max_length :]
            cfg = GenerationConfig(
                max_new_tokens=int(gen_kwargs.get("max_gen_toks", 64)),
                n_loops=self.n_loops,
                exit_policy=self.exit_policy,
                q=self.q,
                temperature=float(gen_kwargs.get("temperature", 0.0) or 0.0),
            )
            text = self.tokenizer.decode(generate(self.model, torch.tensor([ids]), cfg).new_tokens[0].tolist())
            for stop in until:
                text = text.split(stop)[0]
            results.append(text)
        return results


def main(argv: list[str] | None = None) -> None:
    """`python -m titanloop.eval.lm_eval_adapter <lm_eval arguments>`: lm_eval's CLI with `titanloop` registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]
    try:
        cli_evaluate()
    except ConfigError as e:  # bad model_args or --device: one line, not lm_eval's traceback
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
