"""Greedy and sampled decoding for a LoopLM with a per-(loop, layer) KV cache and decode-time cache sharing.

KV cache (ouro §5.4.2, Table 14). The model asks `kv_cache.get(kind, loop, layer)` for a slot and calls
`slot.update(k, v) -> (k_all, v_all)` (kinds "prelude" | "loop" | "coda"; titanloop/model/looplm.py).
  - Prefill keeps one cache per (loop, layer): the paper finds every loop needs its own prompt cache.
  - Decoding keeps, per cache policy:
      full     one cache per (loop, layer)                          T x the memory of a plain transformer
      last     one cache per layer: the last loop's K/V             (prefill caches of loop T; new tokens'
      first    one cache per layer: the first loop's K/V             K/V of the same loop; averaged: the mean
      average  one cache per layer: the mean of all loops' K/V       over loops)
    With a shared policy every loop attends to the shared per-layer cache plus the current token's own K/V
    computed at that loop; after the token's last loop its K/V are committed to the shared cache by the
    policy. Memory after prefill is 1/T of `full` for the looped and coda layers (4x less at T = 4; prelude
    layers run once and always keep one cache).

Exit policy while decoding: `static` (every token runs T loops) or `q_exit` (the token is decoded from the
first loop whose exit CDF reaches q; ouro §3.2). What happens to the loops after a token's exit:
  - exit_kv='compute' (default, what Ouro's Hugging Face code does): all T loops still run, so every cache
    entry is exact and only the readout is chosen by the exit rule; no compute is saved.
  - exit_kv='copy': a decode step stops as soon as every sequence in the batch has exited. Later tokens
    still attend to the skipped loops' caches, so a token that exited at loop e gets, in loops e+1..T, a copy
    of its loop-e K/V (exact if loop e is a fixed point of the recurrence: the next loops would see the same
    layer inputs). Sequences are independent: a sequence's output never depends on its batch mates.
With exit_kv='compute' and cache_policy='full' the generated tokens equal recomputation without a cache
(`use_cache=False`), which tests/test_eval_generate.py checks.

Context: a token attends to at most `context` tokens, itself included (default the model's max_seq_len, the
longest row it was built for; e.g. 64 for nanoGPT's character model), as nanoGPT's sampler crops its input to the
block size: a longer prompt is cut to its last `context` tokens, and while decoding the cache keeps the last
`context - 1` positions (without a cache the input is cropped instead, so the two agree until the context fills).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from titanloop.config_errors import ConfigError, require, require_choice
from titanloop.eval.exits import q_reached
from titanloop.eval.trace import iter_loops
from titanloop.model import LoopLM, LoopLMConfig

CACHE_POLICIES = ("full", "last", "average", "first")
EXIT_POLICIES = ("static", "q_exit")
EXIT_KV = ("compute", "copy")


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32
    n_loops: int | None = None  # T; default the model's n_loops
    cache_policy: str = "full"  # full | last | average | first
    exit_policy: str = "static"  # static | q_exit
    q: float = 1.0  # Q-exit threshold in [0, 1]
    exit_kv: str = "compute"  # compute | copy (see the module docstring)
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # sample among the k most likely tokens (temperature > 0)
    seed: int = 0
    eos_token_id: int | None = None
    use_cache: bool = True  # False: recompute the whole sequence every step (the reference)
    context: int | None = None  # tokens a token attends to, itself included (None: the model's max_seq_len)

    def validate(self, model_cfg: LoopLMConfig) -> None:
        require(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        require(self.n_loops is None or self.n_loops >= 1, "n_loops", self.n_loops, "an integer >= 1 or None")
        require_choice(self.cache_policy, "cache_policy", CACHE_POLICIES)
        require_choice(self.exit_policy, "exit_policy", EXIT_POLICIES)
        require_choice(self.exit_kv, "exit_kv", EXIT_KV)
        require(0.0 <= self.q <= 1.0, "q", self.q, "a threshold in [0, 1]")
        require(self.temperature >= 0, "temperature", self.temperature, "a value >= 0 (0 = greedy)")
        require(self.top_k is None or self.top_k >= 1, "top_k", self.top_k, "an integer >= 1 or None")
        require(self.context is None or self.context >= 1, "context", self.context, "an integer >= 1 or None")
        require(
            self.eos_token_id is None or 0 <= self.eos_token_id < model_cfg.vocab_size,
            "eos_token_id",
            self.eos_token_id,
            f"a token id in [0, {model_cfg.vocab_size})",
        )


def kv_cache_bytes(
    cfg: LoopLMConfig, batch: int, tokens: int, n_loops: int, policy: str, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of K and V held for `tokens` positions after prefill+decode under `policy` (no prefill peak)."""
    require_choice(policy, "cache_policy", CACHE_POLICIES)
    per_layer = 2 * batch * tokens * cfg.kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    looped = (cfg.n_layers + cfg.n_coda_layers) * (n_loops if policy == "full" else 1)
    return per_layer * (cfg.n_prelude_layers + looped)


def _last(t: torch.Tensor, n: int) -> torch.Tensor:
    """The last n positions (dim 2) of a [B, heads, positions, D] cache tensor (n = 0: none)."""
    return t[:, :, max(t.shape[2] - n, 0) :]


class _Slot:
    def __init__(self, cache: "LoopKVCache", key: tuple):
        self.cache, self.key = cache, key

    def update(self, k: torch.Tensor, v: torch.Tensor):
        return self.cache.update(self.key, k, v)


class LoopKVCache:
    """The cache object handed to LoopLM.forward / iter_loops as `kv_cache` (module docstring)."""

    def __init__(self, n_loops: int, policy: str = "full", window: int | None = None):
        require_choice(policy, "cache_policy", CACHE_POLICIES)
        self.n_loops, self.policy = n_loops, policy
        self.window = window  # positions kept while decoding (None: all)
        self.store: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.decoding = False

    def get(self, kind: str, loop: int, layer: int) -> _Slot:
        return _Slot(self, (kind, loop, layer))

    def _storage_key(self, key: tuple) -> tuple:
        kind, _, layer = key
        return key if (self.policy == "full" or kind == "prelude") else (kind, None, layer)

    def update(self, key: tuple, k: torch.Tensor, v: torch.Tensor):
        if not self.decoding:  # prefill: every (kind, loop, layer) keeps its own cache
            if key in self.store:
                pk, pv = self.store[key]
                k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
            self.store[key] = (k, v)
            return k, v
        self.pending[key] = (k, v)  # committed after the token's last loop (commit)
        pk, pv = self.store[self._storage_key(key)]
        if self.window is not None:
            pk, pv = _last(pk, self.window), _last(pv, self.window)
        return torch.cat([pk, k], 2), torch.cat([pv, v], 2)

    def start_decoding(self) -> None:
        """After prefill: collapse the per-loop caches into one per layer for the shared policies."""
        self.decoding = True
        if self.policy == "full":
            return
        groups: dict[tuple, list] = {}
        for (kind, loop, layer), kv in sorted(self.store.items(), key=lambda it: (it[0][0], it[0][2], it[0][1])):
            if kind != "prelude":
                groups.setdefault((kind, layer), []).append(kv)
        for (kind, layer), kvs in groups.items():
            for t in range(len(kvs)):
                del self.store[(kind, t, layer)]
            self.store[(kind, None, layer)] = self._combine([kv[0] for kv in kvs], [kv[1] for kv in kvs])

    def _combine(self, ks: list[torch.Tensor], vs: list[torch.Tensor]):
        if self.policy == "last":
            return ks[-1], vs[-1]
        if self.policy == "first":
            return ks[0], vs[0]
        return torch.stack(ks).mean(0), torch.stack(vs).mean(0)

    def commit(self, exit_loop: torch.Tensor) -> None:
        """Append the current token's K/V; exit_loop [B] (1-based) = the last loop each sequence really ran.
        Loops after a sequence's exit reuse its exit-loop K/V (exit_kv='copy')."""
        groups: dict[tuple, dict[int, tuple]] = {}
        for (kind, loop, layer), kv in self.pending.items():
            if kind == "prelude":
                self._append((kind, loop, layer), *kv)
            else:
                groups.setdefault((kind, layer), {})[loop] = kv
        for (kind, layer), by_loop in groups.items():
            ran = len(by_loop)
            ks = torch.stack([by_loop[t][0] for t in range(ran)])  # [R, B, H, 1, D]
            vs = torch.stack([by_loop[t][1] for t in range(ran)])
            last = (exit_loop.to(ks.device).long() - 1).clamp(0, ran - 1)
            per_loop = []  # K/V of loop t for each sequence: its own, or its exit loop's once it exited
            for t in range(self.n_loops):
                src = torch.minimum(last, torch.full_like(last, t))
                idx = src.view(1, -1, 1, 1, 1).expand(1, *ks.shape[1:])
                per_loop.append((ks.gather(0, idx)[0], vs.gather(0, idx)[0]))
            if self.policy == "full":
                for t, (k, v) in enumerate(per_loop):
                    self._append((kind, t, layer), k, v)
            else:
                self._append((kind, None, layer), *self._combine([p[0] for p in per_loop], [p[1] for p in per_loop]))
        self.pending.clear()

    def _append(self, key, k, v):
        pk, pv = self.store[key]
        k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        if self.window is not None:
            k, v = _last(k, self.window), _last(v, self.window)
        self.store[key] = (k, v)

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.store.values())


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, S + new] prompt followed by the generated tokens
    new_tokens: torch.Tensor  # [B, new]
    exit_loops: torch.Tensor  # [B, new] loop each generated token was decoded from (1-based)
    loops_run: list[int] = field(default_factory=list)  # loops actually computed per step (prefill first)
    cache_bytes: int = 0  # K/V bytes held at the end (0 without cache)
    prefill_cache_bytes: int = 0  # K/V bytes right after prefill (the per-loop peak)
    full_cache_bytes: int = 0  # what the 'full' policy holds for the same tokens (analytic)

    @property
    def memory_reduction(self) -> float:
        return self.full_cache_bytes / self.cache_bytes if self.cache_bytes else float("nan")


def _pick(logits: torch.Tensor, cfg: GenerationConfig, gen: torch.Generator) -> torch.Tensor:
    if cfg.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen)[:, 0].to(logits.device)


def _run_loops(model, ids, n_loops, cfg: GenerationConfig, **kw):
    """Run up to n_loops loops on `ids`; return (readout [B, H] at each sequence's exit, exit loop [B], loops run).
    The exit rule reads only the last position (the token being predicted)."""
    b = ids.shape[0]
    exit_loop = torch.full((b,), n_loops, dtype=torch.long, device=ids.device)
    decided = torch.zeros(b, dtype=torch.bool, device=ids.device)
    chosen = None
    log_surv = torch.zeros(b, device=ids.device)
    ran = 0
    for step in iter_loops(model, ids, n_loops, **kw):
        ran = step.t
        readout = step.exit_readout[:, -1]
        chosen = readout.clone() if chosen is None else chosen
        z = step.gate_logit[:, -1].float()
        log_surv = log_surv + torch.nn.functional.logsigmoid(-z)
        if cfg.exit_policy == "static" or step.t == n_loops:
            now = ~decided if step.t == n_loops else torch.zeros_like(decided)
        else:
            now = ~decided & q_reached(log_surv, cfg.q)
        chosen[now] = readout[now]
        exit_loop[now] = step.t
        decided |= now
        if cfg.exit_kv == "copy" and bool(decided.all()):
            break
    return chosen, exit_loop, ran


@torch.no_grad()
def generate(model: LoopLM, input_ids: torch.Tensor, cfg: GenerationConfig | None = None) -> GenerationResult:
    """Decode `cfg.max_new_tokens` tokens after the prompt `input_ids` [B, S] (same length in the batch)."""
    cfg = cfg or GenerationConfig()
    if not isinstance(model, LoopLM):
        raise ConfigError(f"model of type {type(model).__name__} is invalid: expected a titanloop LoopLM")
    cfg.validate(model.cfg)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    require(
        input_ids.dim() == 2 and input_ids.shape[1] >= 1,
        "input_ids",
        list(input_ids.shape),
        "a [B, S] prompt with S >= 1",
    )
    require(
        int(input_ids.max()) < model.cfg.vocab_size and int(input_ids.min()) >= 0,
        "input_ids",
        int(input_ids.max()),
        f"token ids in [0, {model.cfg.vocab_size})",
    )
    n_loops = cfg.n_loops or model.cfg.n_loops
    context = cfg.context or model.cfg.max_seq_len
    device = model.embed_tokens.weight.device
    ids = input_ids[:, -context:].to(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    cache = LoopKVCache(n_loops, cfg.cache_policy, window=context - 1) if cfg.use_cache else None
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    new, exits, loops_run = [], [], []
    prefill_bytes = 0
    for i in range(cfg.max_new_tokens):
        if cache is None:
            readout, exit_loop, ran = _run_loops(model, ids[:, -context:], n_loops, cfg)
        elif i == 0:  # prefill: all loops, one cache per (loop, layer)
            readout, exit_loop, _ = _run_loops(
                model, ids, n_loops, dataclasses.replace(cfg, exit_kv="compute"), kv_cache=cache
            )
            ran = n_loops
            prefill_bytes = cache.nbytes()
            cache.start_decoding()
        else:
            readout, exit_loop, ran = _run_loops(
                model, ids[:, -1:], n_loops, cfg, kv_cache=cache, position_offset=ids.shape[1] - 1
            )
            cache.commit(exit_loop if cfg.exit_kv == "copy" else torch.full_like(exit_loop, n_loops))
        tok = _pick(model.lm_head(readout), cfg, gen)
        if cfg.eos_token_id is not None:
            tok = torch.where(finished, torch.full_like(tok, cfg.eos_token_id), tok)
            finished |= tok == cfg.eos_token_id
        ids = torch.cat([ids, tok[:, None]], 1)
        new.append(tok)
        exits.append(exit_loop)
        loops_run.append(ran)
        if cfg.eos_token_id is not None and bool(finished.all()):
            break
    # The last token's K/V would only be written when it is fed back; count the cache for the tokens it holds.
    held = min(ids.shape[1] - 1, context)
    return GenerationResult(
        tokens=ids,
        new_tokens=torch.stack(new, 1),
        exit_loops=torch.stack(exits, 1),
        loops_run=loops_run,
        cache_bytes=cache.nbytes() if cache else 0,
        prefill_cache_bytes=prefill_bytes,
        full_cache_bytes=kv_cache_bytes(
            model.cfg, ids.shape[0], held, n_loops, "full", model.embed_tokens.weight.dtype
        ),
    )
