"""deepspeed.accelerator.get_accelerator(): the device zerotrain trains on, with DeepSpeed's
accelerator methods (device names, seeds, streams, memory counters, the communication backend).

Which one: the device types the front end trains on (engine.TRAINING_DEVICE_TYPES: "cuda" too when
the extension was built with the engine's CUDA path, zerotrain._C.built_with_cuda()), together
with torch.cuda.is_available(): the CUDA accelerator when the package trains on "cuda" and torch
sees a GPU, else the CPU.
"""
import contextlib
import os

import torch

from . import _unsupported


def _local_rank():
    # What DeepSpeed's accelerators read for the current device: the launcher's LOCAL_RANK.
    return int(os.environ.get("LOCAL_RANK", 0))


def _page_bytes(field):
    """This process's resident bytes from /proc/self/statm (field 1), or 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[field]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class DeepSpeedAccelerator:
    """What every accelerator answers alike; CPUAccelerator and CUDAAccelerator add the device's."""

    _name = None
    _communication_backend_name = None

    # Tensor types, as DeepSpeed's accelerators expose them.
    BFloat16Tensor = property(lambda self: torch.BFloat16Tensor)
    ByteTensor = property(lambda self: torch.ByteTensor)
    DoubleTensor = property(lambda self: torch.DoubleTensor)
    FloatTensor = property(lambda self: torch.FloatTensor)
    HalfTensor = property(lambda self: torch.HalfTensor)
    IntTensor = property(lambda self: torch.IntTensor)
    LongTensor = property(lambda self: torch.LongTensor)

    def communication_backend_name(self):
        return self._communication_backend_name

    def is_available(self):
        return True

    def random(self):
        return torch.random

    def manual_seed(self, seed):
        return torch.manual_seed(seed)

    def initial_seed(self):
        return torch.initial_seed()

    def is_bf16_supported(self):
        return True

    def is_fp64_supported(self):
        return True

    def supported_dtypes(self):
        return [torch.float32, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])

    def lazy_call(self, callback):
        return callback()

    def range_push(self, msg, domain=None, category=None):
        return None

    def range_pop(self, domain=None):
        return None

    def is_triton_supported(self):
        return False

    def is_pinned(self, tensor):
        return tensor.is_pinned()

    def export_envs(self):
        return []

    def visible_devices_envs(self):
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env, local_accelerator_ids):
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self):
        return "inductor"

    def prefer_triton_grouped_mm(self):
        return False

    def pin_memory_alignment(self):
        return 1  # no alignment asked of host memory handed to the device

    def pin_empty(self, *size, dtype, device="cpu"):
        """Host memory of that size (pinned where the device pins host memory)."""
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return self.pin_memory(torch.empty(shape, dtype=dtype, device=device), make_copy=False)

    def pin_empty_like(self, tensor, device="cpu", dtype=None):
        return self.pin_empty(tuple(tensor.shape), dtype=tensor.dtype if dtype is None else dtype, device=device)

    def register_host_memory(self, address, num_bytes):
        return False  # DeepSpeed's default: no registration with the device runtime

    def unregister_host_memory(self, address):
        return None

    def unpin_memory(self, tensor):
        return None

    # DeepSpeed compiles its own kernels through op builders; zerotrain's kernels are in its library.
    create_op_builder = _unsupported.function("deepspeed.accelerator.get_accelerator().create_op_builder",
                                              "zerotrain's kernels are built into its library")
    get_op_builder = _unsupported.function("deepspeed.accelerator.get_accelerator().get_op_builder",
                                           "zerotrain's kernels are built into its library")
    op_builder_dir = _unsupported.function("deepspeed.accelerator.get_accelerator().op_builder_dir",
                                           "zerotrain's kernels are built into its library")
    build_extension = _unsupported.function("deepspeed.accelerator.get_accelerator().build_extension",
                                            "zerotrain's kernels are built into its library")
    set_compile_backend = _unsupported.function("deepspeed.accelerator.get_accelerator().set_compile_backend")


class CPUAccelerator(DeepSpeedAccelerator):
    """DeepSpeed's CPU accelerator (Gloo; host memory is what the counters report)."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self):
        self._peak_rss = _page_bytes(1)

    def is_synchronized_device(self):
        return True

    use_host_timers = resolves_data_dependency = handles_memory_backpressure = is_synchronized_device

    def device_name(self, device_index=None):
        return "cpu"

    def device(self, device_index=None):
        return None  # as DeepSpeed's CPU accelerator: torch.device(device_name()) names the device

    def set_device(self, device_index):
        return None

    def current_device(self):
        return _local_rank()

    def current_device_name(self):
        return "cpu"

    def device_count(self):
        # DeepSpeed's CPU accelerator: LOCAL_SIZE when a launcher set it (else its NUMA node count,
        # the processes it would start per machine); zerotrain's launchers say how many ranks share
        # this machine.
        for var in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            if int(os.environ.get(var, 0)) > 0:
                return int(os.environ[var])
        return 1

    def synchronize(self, device_index=None):
        return None

    def set_rng_state(self, new_state, device_index=None):
        return torch.set_rng_state(new_state)

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state()

    def manual_seed_all(self, seed):
        return torch.manual_seed(seed)

    def default_generator(self, device_index):
        return torch.default_generator

    # The CPU has no streams or events: DeepSpeed's CPU accelerator answers None and a no-op context.
    Stream = property(lambda self: None)
    Event = property(lambda self: None)

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return None

    def default_stream(self, device_index=None):
        return None

    def is_current_stream_capturing(self):
        return False

    # No graphs on the CPU: DeepSpeed's CPU accelerator makes none and captures into a no-op context.
    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph):
        return None

    # Memory: the process's resident set, as DeepSpeed's CPU accelerator reports it.
    def empty_cache(self):
        return None

    def memory_allocated(self, device_index=None):
        rss = _page_bytes(1)
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index=None):
        self.memory_allocated()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index=None):
        self._peak_rss = _page_bytes(1)

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index=None):
        current = self.memory_allocated()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index=None):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def is_fp16_supported(self):
        return True  # the engine trains in fp16 on the CPU (fp16.enabled, with DeepSpeed's loss scaler)

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        # DeepSpeed's CPU accelerator: host memory is not pinned for a CPU device; the tensor as it is.
        return tensor

    def on_accelerator(self, tensor):
        return tensor.device.type == "cpu"


class CUDAAccelerator(DeepSpeedAccelerator):
    """DeepSpeed's CUDA accelerator (NCCL), over torch.cuda."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_synchronized_device(self):
        return False

    use_host_timers = resolves_data_dependency = handles_memory_backpressure = is_synchronized_device

    def device_name(self, device_index=None):
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.device("cuda", device_index)

    def set_device(self, device_index):
        torch.cuda.set_device(device_index)

    def current_device(self):
        return torch.cuda.current_device()

    def current_device_name(self):
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self):
        return torch.cuda.device_count()

    def synchronize(self, device_index=None):
        return torch.cuda.synchronize(device_index)

    def set_rng_state(self, new_state, device_index=None):
        return torch.cuda.set_rng_state(new_state) if device_index is None else \
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index=None):
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed):
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self):
        return torch.cuda.initial_seed()

    def default_generator(self, device_index):
        return torch.cuda.default_generators[device_index]

    Stream = property(lambda self: torch.cuda.Stream)
    Event = property(lambda self: torch.cuda.Event)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    def is_current_stream_capturing(self):
        return torch.cuda.is_current_stream_capturing()

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph):
        graph.replay()

    def empty_cache(self):
        return torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None):
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None):
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None):
        return torch.cuda.reset_max_memory_allocated(device_index)

    def memory_reserved(self, device_index=None):
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None):
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached, max_memory_cached = memory_reserved, max_memory_reserved

    def reset_max_memory_cached(self, device_index=None):
        return torch.cuda.reset_peak_memory_stats(device_index)

    reset_peak_memory_stats = reset_max_memory_cached

    def memory_stats(self, device_index=None):
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index=None):
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index=None):
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self):
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self):
        return torch.cuda.get_device_capability()[0] >= 7  # DeepSpeed: fp16 on compute capability 6 is deprecated

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        if make_copy:
            return tensor.pin_memory()
        return torch.empty(tensor.shape if match_shape else (tensor.numel(),), dtype=tensor.dtype, pin_memory=True)

    def on_accelerator(self, tensor):
        return tensor.device.type == "cuda"


_accelerator = None


def _trains_on_cuda():
    from .engine import TRAINING_DEVICE_TYPES

    return "cuda" in TRAINING_DEVICE_TYPES and torch.cuda.is_available()


def get_accelerator():
    """The accelerator of the device zerotrain's engine trains on in this process (one object)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = CUDAAccelerator() if _trains_on_cuda() else CPUAccelerator()
    return _accelerator


def is_current_accelerator_supported():
    return True


set_accelerator = _unsupported.function("deepspeed.accelerator.set_accelerator",
                                        "the accelerator is the device zerotrain's engine trains on")
