"""verl platform "cpu": lets verl's own worker code (`TrainingWorker`, its batch and metric paths) run
on a machine without an accelerator.

verl 0.9 resolves its device through a platform registry (`verl.plugin.platform`), the documented
extension point for new hardware; it ships nvidia/npu/rocm platforms and, with none of them present,
falls back to "nvidia" (and then calls `torch.cuda`). Importing this package registers a "cpu"
platform; `VERL_PLATFORM=cpu` selects it (explicitly: auto-detection never picks it, so a GPU
machine whose probe fails is not silently moved to CPU). Collectives go through gloo.

`device_module` is torch.cpu plus the few `torch.cuda`-style calls verl makes unconditionally
(memory statistics in every `TrainingWorker` output, `empty_cache`, RNG state): CPU tensors have no
caching allocator, so "allocated"/"reserved" report this process's resident memory (peak for the
max_* variants) and the cache calls do nothing.
"""
from __future__ import annotations

import contextlib
import resource
import sys
import types
from typing import Any, Optional

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM = "cpu"


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _mem_get_info(device=None) -> tuple[int, int]:
    vm = psutil.virtual_memory()
    return vm.available, vm.total


class _CPUDeviceModule(types.ModuleType):
    """torch.cpu with the torch.cuda-style extras verl calls on whatever `get_torch_device()` is."""

    def __init__(self):
        super().__init__("megatron_fp4.verl.platform.cpu_device")
        extras = {
            "memory_allocated": lambda device=None: _rss(),
            "memory_reserved": lambda device=None: _rss(),
            "max_memory_allocated": lambda device=None: _peak_rss(),
            "max_memory_reserved": lambda device=None: _peak_rss(),
            "reset_peak_memory_stats": lambda device=None: None,
            "mem_get_info": _mem_get_info,
            "empty_cache": lambda: None,
            "ipc_collect": lambda: None,
            "set_per_process_memory_fraction": lambda fraction, device=None: None,
            "get_device_name": lambda device=None: "CPU",  # verl's flops table has a "CPU" entry
            "manual_seed": torch.manual_seed,
            "manual_seed_all": torch.manual_seed,
            "get_rng_state": lambda device=None: torch.get_rng_state(),
            "set_rng_state": lambda state, device=None: torch.set_rng_state(state),
        }
        self.__dict__.update(extras)

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)


CPU_DEVICE = _CPUDeviceModule()


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only processes (gloo collectives, no profiler ranges)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # only by name (VERL_PLATFORM=cpu), never by auto-detection

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass  # one CPU "device" per process

    def synchronize(self, device_index: Optional[int] = None) -> None:
        torch.cpu.synchronize()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass  # no caching allocator on CPU

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # read by verl's Worker; no effect on CPU

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
