"""Checkpoint interchange with other ecosystems: Ouro Hugging Face directories (ouro_hf)."""

from titanloop.interchange.ouro_hf import (
    VARIANT_MODEL_TYPE,
    expected_tensors,
    export_ouro_hf,
    import_ouro_hf,
    ouro_config_dict,
    ouro_incompatibilities,
    read_ouro_config,
    summarize,
)

__all__ = [
    "export_ouro_hf",
    "import_ouro_hf",
    "expected_tensors",
    "ouro_config_dict",
    "ouro_incompatibilities",
    "read_ouro_config",
    "summarize",
    "VARIANT_MODEL_TYPE",
]
