"""The one place where titanloop accommodates torchtitan on a machine without a GPU.

torchtitan 0.3.0 picks its device once, at import of `torchtitan.tools.utils`:
`device_type = _get_available_device_type() or "cuda"`, and modules such as `distributed.parallel_dims`
copy that name with `from torchtitan.tools.utils import device_type`. On a CPU-only host that yields
"cuda", so building a DeviceMesh or selecting the local device fails.

`use_cpu_if_no_gpu()` rewrites `device_type = "cpu"` and `device_module = CPU_DEVICE_MODULE` in every
loaded torchtitan module (and in tools.utils, for modules imported later). CPU_DEVICE_MODULE is torch.cpu
except that `current_device()` returns the index 0 rather than the string "cpu", because torchtitan's
`set_pg_timeouts` passes it to `barrier(device_ids=[...])`, which needs integers. With CPU as the device, torchtitan's
`init_distributed` picks the gloo backend (`Backend.default_device_backend_map["cpu"]`). Nothing is changed
when CUDA is available. titanloop.train.startup.init_mesh calls it first; torchtitan modules imported before
or after the call see the CPU either way.
"""

from __future__ import annotations

import sys

import torch


class _CpuDeviceModule:
    """torch.cpu with an integer current_device()."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0


CPU_DEVICE_MODULE = _CpuDeviceModule()


def use_cpu_if_no_gpu() -> str:
    """Point torchtitan at the CPU when there is no CUDA device; returns the device type in use."""
    import torchtitan.tools.utils as tt_utils

    if torch.cuda.is_available():
        return tt_utils.device_type
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
            if hasattr(module, "device_module"):
                module.device_module = CPU_DEVICE_MODULE
    return "cpu"
