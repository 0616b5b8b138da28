"""Process groups for a zerotrain job, as `deepspeed.comm` offers them.

init_distributed() makes two views of the same job: zerotrain's own communicator, which the engine's
collectives use (the C++ one the command line uses: Gloo, or shared memory between ranks of one
machine), and torch.distributed's default process group, for the script's own collectives. Both
meet at the same rendezvous: the variables torchrun and `zerotrain launch` set (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...), Slurm's or Open MPI's.
"""
import atexit
import datetime

import torch
import torch.distributed as dist

from . import _C

_communicator = None
_owns_torch_group = False  # torch.distributed's default group was initialised here


def init_distributed(dist_backend="gloo", auto_mpi_discovery=True, distributed_port=None, verbose=True,
                     timeout=None, init_method=None, dist_init_required=None, config=None, rank=-1, world_size=-1):
    """Joins the job (a no-op when already joined). With torch.distributed already initialised by the
    script (env://), zerotrain's communicator joins the store it serves; otherwise zerotrain meets the
    other ranks first and then initialises torch.distributed over the same store."""
    global _communicator, _owns_torch_group
    if _communicator is not None:
        return
    if dist_backend not in ("gloo", "nccl", None):
        raise ValueError(f"zerotrain.comm.init_distributed: expected dist_backend 'gloo' or 'nccl', found {dist_backend!r}")
    if init_method not in (None, "env://"):
        raise ValueError(f"zerotrain.comm.init_distributed: expected init_method None or 'env://', found {init_method!r} "
                         "(zerotrain meets the other ranks through the environment torchrun and zerotrain launch set)")
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    info = _C.rendezvous_from_environment()
    if rank >= 0 and rank != info["rank"] or world_size >= 0 and world_size != info["world_size"]:
        raise ValueError(f"zerotrain.comm.init_distributed: rank {rank} of {world_size} given, but the environment says "
                         f"rank {info['rank']} of {info['world_size']}")
    already = dist.is_available() and dist.is_initialized()
    _communicator = _C.make_communicator(clients_only=already and info["world_size"] > 1, timeout_seconds=seconds)
    if already:
        return
    backend = dist_backend or "gloo"
    kwargs = {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}
    if info["world_size"] == 1:
        store = dist.HashStore()
    else:
        store = dist.PrefixStore("torch.distributed/", dist.TCPStore(info["master_addr"], info["master_port"],
                                                                      info["world_size"], is_master=False,
                                                                      **kwargs))
    dist.init_process_group(backend, store=store, rank=info["rank"], world_size=info["world_size"], **kwargs)
    _owns_torch_group = True


def _shut_down():
    """At interpreter exit, before Python's teardown destroys objects in no particular order: every
    engine first (they use the communicator), then the communicator, whose threads are joined."""
    global _communicator
    from . import _registry

    _registry.destroy_engines()
    _communicator = None
    # torch.distributed's Gloo threads free their finished work (and with it the script's tensors)
    # on their own; at interpreter teardown that takes the GIL from a dying thread and aborts the
    # process. Destroying the group we made joins them first.
    if _owns_torch_group and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(_shut_down)


def communicator():
    """zerotrain's communicator of this job (init_distributed() first)."""
    if _communicator is None:
        init_distributed()
    return _communicator


def is_initialized():
    return _communicator is not None


def get_rank(group=None):
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None):
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank():
    return _C.rendezvous_from_environment()["local_rank"]


def barrier(group=None, async_op=False, device_ids=None):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False):
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


ReduceOp = dist.ReduceOp


def log_summary(show_straggler=False):
    """comms_logger's table on rank 0, as DeepSpeed's comm.log_summary(): the engine's collectives
    (counted once comms_logger is enabled in an engine's configuration). The script's own
    torch.distributed calls through this module are not counted."""
    if show_straggler:
        raise ValueError("zerotrain.comm.log_summary(show_straggler=True) is not supported: the table gives each "
                         "operation's count, sizes, latency and bandwidths on this rank")
    table = communicator().comms_summary()
    if get_rank() == 0 and table:
        print(table, end="" if table.endswith("\n") else "\n", flush=True)
