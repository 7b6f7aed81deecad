"""torch.compile of each decoder layer (the looped block's unit), in place.

Every loop calls the same layer modules with the same shapes, so Dynamo compiles each layer's forward
once and every further loop, and every other loop count T, reuses that graph (no recompilation: the loop
index never reaches the compiled code). Layers compile with fullgraph=True (one graph per layer, an error
instead of a silent graph break) unless the attention backend or the objective needs code Dynamo cannot
trace: attention_backend 'flash' or 'sdpa_per_doc' (their document-masked calls are
`torch.compiler.disable`d; see titanloop.model.attention). Under fullgraph the model's document masks use
only kernels that trace (varlen_attn, FlexAttention or the dense mask); cu_seqlens is marked dynamic, so a
new document count does not recompile. On CPU, varlen_attn runs on the reference kernel of
titanloop.model.varlen_cpu. `nn.Module.compile` keeps parameter names unchanged (no `_orig_mod.`), so
checkpoints and the HF adapter are unaffected.

`fullgraph_check` runs a compiled model over several loop counts and document batches and counts graph
breaks and graphs: tests/test_model_attention_varlen.py on CPU, and a GPU check on CUDA.
"""

from __future__ import annotations

from typing import Iterable

import torch

from titanloop.model import LoopLM
from titanloop.model.attention import document_lengths, fullgraph_ok


def apply_compile(model: LoopLM, backend="inductor", fullgraph: bool | None = None) -> bool:
    """Compile every decoder layer of `model` (prelude, looped stack, coda) with `backend`. fullgraph: None =
    True for a LoopLM whose attention backend allows it (attention.fullgraph_ok). Returns the fullgraph used."""
    if fullgraph is None:  # a RetrofitLM (no cfg; its compiled path is untested) keeps fullgraph=False
        cfg = getattr(model, "cfg", None)
        fullgraph = cfg is not None and fullgraph_ok(cfg.attention_backend)
    for layer in [*model.prelude, *model.layers, *model.coda]:
        layer.compile(backend=backend, fullgraph=fullgraph, dynamic=False)
    model.graph_safe_attention = fullgraph
    model.compiled_layers = True
    return fullgraph


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (every recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    """Graph breaks Dynamo has recorded in this process so far."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def fullgraph_check(
    model: LoopLM, input_ids: torch.Tensor, doc_batches: Iterable[torch.Tensor], loop_counts: Iterable[int]
) -> dict:
    """Forward + backward of a compiled `model` (apply_compile) on `input_ids` [B, S] for every loop count and
    every doc_ids [B, S] in `doc_batches` (e.g. different document counts). Returns the loop counts and
    document counts run, the graph breaks recorded meanwhile, the graphs compiled after the first step and
    after all (equal = no recompilation), and `ok`: no graph break and no recompilation."""
    doc_batches, loop_counts = list(doc_batches), list(loop_counts)
    breaks_before, graphs = graph_breaks(), []
    for t in loop_counts:
        for doc in doc_batches:
            out = model(input_ids, t, doc_ids=doc)
            sum(r.float().pow(2).mean() for r in out.readouts).backward()
            graphs.append(compiled_graphs())
    model.zero_grad(set_to_none=True)
    breaks = graph_breaks() - breaks_before
    return {
        "loop_counts": loop_counts,
        "doc_counts": [len(document_lengths(d.cpu())) for d in doc_batches],
        "graph_breaks": breaks,
        "graphs_after_first_step": graphs[0],
        "graphs_after_all": graphs[-1],
        "ok": breaks == 0 and graphs[0] == graphs[-1],
    }
