"""KV-cache generation: full cache == recomputation, shared-cache policies and their memory, exit policies."""

import pytest
import torch

from titanloop.config_errors import ConfigError
from titanloop.eval.generate import GenerationConfig, LoopKVCache, generate, kv_cache_bytes
from titanloop.eval.trace import iter_loops
from titanloop.model import LoopLM, preset


def model(**overrides) -> LoopLM:
    torch.manual_seed(0)
    return LoopLM(preset("debug-tiny", vocab_size=96, **overrides)).eval()


PROMPT = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_prelude_layers": 1, "n_coda_layers": 1, "n_kv_heads": 2},
        {"gated_recurrence": True, "per_loop_norm": True},
    ],
)
def test_full_cache_greedy_equals_recomputation(overrides):
    m = model(**overrides)
    cfg = GenerationConfig(max_new_tokens=8)
    cached = generate(m, PROMPT, cfg)
    fresh = generate(m, PROMPT, GenerationConfig(max_new_tokens=8, use_cache=False))
    assert torch.equal(cached.tokens, fresh.tokens)
    # and the no-cache path is itself the model's forward: the last-position argmax at every step
    ids = PROMPT.clone()
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, m(ids, return_logits="last").logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(fresh.tokens, ids)


def test_full_cache_logits_match_forward_at_every_step():
    m = model()
    cache = LoopKVCache(4, "full")
    ids = PROMPT.clone()
    with torch.no_grad():
        steps = list(iter_loops(m, ids, 4, kv_cache=cache))
        cache.start_decoding()
        nxt = m.lm_head(steps[-1].exit_readout[:, -1]).argmax(-1, keepdim=True)
        for _ in range(3):
            step = list(iter_loops(m, nxt, 4, kv_cache=cache, position_offset=ids.shape[1]))[-1]
            cache.commit(torch.full((3,), 4))
            ids = torch.cat([ids, nxt], 1)
            ref = m(ids, return_logits="last").logits[:, -1]
            torch.testing.assert_close(m.lm_head(step.exit_readout[:, -1]), ref, atol=1e-5, rtol=1e-5)
            nxt = ref.argmax(-1, keepdim=True)


def test_sampling_with_cache_equals_recomputation_and_is_seeded():
    m = model()
    cfg = dict(max_new_tokens=6, temperature=0.8, top_k=10, seed=7)
    a = generate(m, PROMPT, GenerationConfig(**cfg))
    b = generate(m, PROMPT, GenerationConfig(**cfg, use_cache=False))
    c = generate(m, PROMPT, GenerationConfig(**{**cfg, "seed": 8}))
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


def test_q_exit_full_cache_equals_recomputation_and_thresholds():
    m = model()
    with torch.no_grad():
        m.early_exit_gate.weight.normal_(0, 2.0)  # spread the exit loops
    for q in (0.0, 0.6, 1.0):
        cfg = dict(max_new_tokens=6, exit_policy="q_exit", q=q)
        cached = generate(m, PROMPT, GenerationConfig(**cfg))
        fresh = generate(m, PROMPT, GenerationConfig(**cfg, use_cache=False))
        assert torch.equal(cached.tokens, fresh.tokens) and torch.equal(cached.exit_loops, fresh.exit_loops)
        if q == 0.0:
            assert cached.exit_loops.eq(1).all()
        if q == 1.0:
            assert cached.exit_loops.eq(4).all()
    mid = generate(m, PROMPT, GenerationConfig(max_new_tokens=6, exit_policy="q_exit", q=0.6)).exit_loops
    assert mid.unique().numel() > 1  # tokens really exit at different loops


def test_copy_exit_kv_saves_loops_and_is_batch_independent():
    m = model()
    with torch.no_grad():
        m.early_exit_gate.weight.normal_(0, 2.0)
    cfg = GenerationConfig(max_new_tokens=6, exit_policy="q_exit", q=0.5, exit_kv="copy")
    out = generate(m, PROMPT, cfg)
    assert out.loops_run[0] == 4 and min(out.loops_run[1:]) < 4  # prefill runs every loop, decode stops early
    for b in range(PROMPT.shape[0]):  # each sequence alone gives the same tokens as in the batch
        alone = generate(m, PROMPT[b : b + 1], cfg)
        assert torch.equal(alone.tokens[0], out.tokens[b])
    # static exit with copy: nothing to copy, identical to compute
    s1 = generate(m, PROMPT, GenerationConfig(max_new_tokens=6, exit_kv="copy"))
    s2 = generate(m, PROMPT, GenerationConfig(max_new_tokens=6))
    assert torch.equal(s1.tokens, s2.tokens)


@pytest.mark.parametrize("policy", ["last", "average", "first"])
def test_shared_policies_cut_memory_by_t(policy):
    m = model()
    full = generate(m, PROMPT, GenerationConfig(max_new_tokens=5))
    shared = generate(m, PROMPT, GenerationConfig(max_new_tokens=5, cache_policy=policy))
    held = PROMPT.shape[1] + 5 - 1
    assert full.cache_bytes == kv_cache_bytes(m.cfg, 3, held, 4, "full") == full.full_cache_bytes
    assert shared.cache_bytes == kv_cache_bytes(m.cfg, 3, held, 4, policy)
    assert shared.memory_reduction == 4.0 and full.memory_reduction == 1.0  # T = 4
    assert shared.prefill_cache_bytes == full.prefill_cache_bytes  # prefill keeps every loop (ouro §5.4.2)
    assert torch.equal(shared.new_tokens[:, 0], full.new_tokens[:, 0])  # the first token comes from prefill


def test_shared_policies_differ_and_combine_as_documented():
    m = model()
    cache = LoopKVCache(4, "average")
    with torch.no_grad():
        list(iter_loops(m, PROMPT, 4, kv_cache=cache))
    per_loop_k = [cache.store[("loop", t, 0)][0] for t in range(4)]
    cache.start_decoding()
    torch.testing.assert_close(cache.store[("loop", None, 0)][0], torch.stack(per_loop_k).mean(0))
    assert ("loop", 0, 0) not in cache.store
    toks = {
        p: generate(m, PROMPT, GenerationConfig(max_new_tokens=6, cache_policy=p)).new_tokens
        for p in ("full", "last", "first")
    }
    assert not torch.equal(toks["first"], toks["full"])  # sharing really changes what decoding attends to


def test_prelude_layers_keep_one_cache():
    cfg = preset("debug-tiny", n_prelude_layers=1)
    assert kv_cache_bytes(cfg, 1, 10, 4, "full") / kv_cache_bytes(cfg, 1, 10, 4, "last") == pytest.approx(9 / 3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cache_policy": "middle"}, "cache_policy"),
        ({"q": 1.5}, "q=1.5"),
        ({"exit_policy": "ash"}, "exit_policy"),
        ({"max_new_tokens": 0}, "max_new"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_generate_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        generate(model(), PROMPT, GenerationConfig(**kwargs))


def test_generate_bad_prompt():
    with pytest.raises(ConfigError, match="token ids in"):
        generate(model(), torch.tensor([[1, 500]]), GenerationConfig(max_new_tokens=1))


def test_context_bounds_what_a_token_attends_to():
    """context = c: the prompt is cut to its last c tokens, the cache keeps c - 1 positions while decoding, and
    without a cache every step reads the last c tokens (nanoGPT's crop to block_size)."""
    m = model()
    long_prompt = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(5))
    c = 6
    cut = generate(m, long_prompt, GenerationConfig(max_new_tokens=1, context=c))
    assert torch.equal(cut.new_tokens, generate(m, long_prompt[:, -c:], GenerationConfig(max_new_tokens=1)).new_tokens)
    cached = generate(m, long_prompt, GenerationConfig(max_new_tokens=10, context=c))
    assert cached.cache_bytes == kv_cache_bytes(m.cfg, 3, c - 1, 4, "full")  # not 12 + 9 positions
    fresh = generate(m, long_prompt, GenerationConfig(max_new_tokens=10, context=c, use_cache=False))
    ids = long_prompt.clone()
    with torch.no_grad():
        for _ in range(10):
            logits = m(ids[:, -c:], return_logits="last").logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(fresh.tokens[:, -10:], ids[:, -10:])
    # a context that never binds changes nothing; the default is the model's max_seq_len
    wide = generate(m, PROMPT, GenerationConfig(max_new_tokens=8, context=64))
    assert torch.equal(wide.tokens, generate(m, PROMPT, GenerationConfig(max_new_tokens=8)).tokens)
    short = LoopLM(preset("debug-tiny", vocab_size=96, max_seq_len=6)).eval()
    assert generate(short, long_prompt, GenerationConfig(max_new_tokens=3)).cache_bytes == kv_cache_bytes(
        short.cfg, 3, 5, 4, "full"
    )
