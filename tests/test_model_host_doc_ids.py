"""Document ids may stay in host memory while the tokens are on the accelerator (the trainer's batches do): the
model then finds the document boundaries on the host, so building the mask never waits for the device (`nonzero` on
a device tensor is a device-to-host sync). The meta device stands in for the accelerator here: `nonzero` cannot run
on it at all, so any boundary computed from the device copy fails."""

from __future__ import annotations

import pytest
import torch

from titanloop.data import DataConfig, build_dataloader
from titanloop.model import LoopLM, looplm, preset
from titanloop.model.attention import DocumentMask, cu_seqlens, document_mask

DOCS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])


def test_document_mask_reads_the_boundaries_on_the_host():
    on_device = DOCS.to("meta")
    with pytest.raises(NotImplementedError):  # what the mask did before: nonzero on the device copy
        document_mask(on_device, "auto", torch.bfloat16, kernel="varlen")
    mask = document_mask(on_device, "auto", torch.bfloat16, kernel="varlen", host_doc_ids=DOCS)
    assert isinstance(mask, DocumentMask) and mask.cu_seqlens.device.type == "meta"
    assert mask.cu_seqlens.shape == cu_seqlens(DOCS).shape and mask.max_seqlen == 16


def test_forward_with_host_doc_ids(monkeypatch):
    """The model's own forward: equal outputs with host and device ids on the CPU, and on the meta device (where
    the varlen kernel takes cu_seqlens) a forward that never computes the boundaries from the device copy."""
    cfg = preset("debug-tiny", vocab_size=64, n_layers=1, attention_backend="varlen")
    torch.manual_seed(0)
    model = LoopLM(cfg)
    x = torch.randint(0, 64, DOCS.shape, generator=torch.Generator().manual_seed(1))
    ref = model(x, 2, doc_ids=DOCS).readouts[-1]
    with torch.device("meta"):
        meta_model = LoopLM(cfg)
    with pytest.raises(NotImplementedError):  # device ids: the boundaries would be read on the device
        meta_model(x.to("meta"), 2, doc_ids=DOCS.to("meta"))
    masks = []
    monkeypatch.setattr(looplm, "document_mask", lambda *a, **k: masks.append(document_mask(*a, **k)) or masks[-1])
    out = meta_model(x.to("meta"), 2, doc_ids=DOCS)  # host ids, meta tokens
    assert out.readouts[-1].shape == ref.shape and out.readouts[-1].device.type == "meta"
    assert [m.cu_seqlens.device.type for m in masks] == ["meta"]  # on the tokens' device, computed on the host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (page-locked memory)")
def test_loader_pins_its_batches_for_asynchronous_copies():
    loader = build_dataloader(
        DataConfig(prefetch=1),
        seq_len=16,
        micro_batch_size=2,
        global_batch_size=2,
        dp_rank=0,
        dp_world=1,
        vocab_size=64,
        pin_memory=True,
    )
    try:
        batch = next(iter(loader))
        assert all(v.is_pinned() for v in batch.values() if isinstance(v, torch.Tensor))
    finally:
        loader.close()
