"""Process groups for a zerotrain job, as `deepspeed.comm` offers them.

init_distributed() makes two views of the same job: zerotrain's own communicator, which the engine's
collectives use (the C++ one the command line uses: Gloo, or shared memory between ranks of one
machine), and torch.distributed's default process group, for the script's own collectives. Both
meet at the same rendezvous: the variables torchrun and `zerotrain launch` set (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...), Slurm's or Open MPI's.
"""
import atexit
import gc
import datetime
import os

import torch
import torch.distributed as dist

from . import _C, _unsupported

_communicator = None
_owns_torch_group = False  # torch.distributed's default group was initialised here
_launcher_store = None  # rank 0 under `zerotrain launch`: the store every rank of the job meets at


def _serve_the_launchers_rendezvous():
    """Under `zerotrain launch`, rank 0 is handed the socket listening on MASTER_PORT
    (ZT_RENDEZVOUS_LISTEN_FD) for zerotrain's rendezvous, so a script's own
    torch.distributed.init_process_group() could not bind that port for its store (EADDRINUSE).
    As torchrun's agent does, rank 0 serves one store on that socket as soon as zerotrain is
    imported, and every rank's torch.distributed and zerotrain connect to it as clients
    (TORCHELASTIC_USE_AGENT_STORE). A script that initialises torch.distributed before it imports
    zerotrain is not helped: import zerotrain (or deepspeed) first."""
    global _launcher_store
    env = os.environ
    if env.get("ZT_LAUNCHED") != "1" or "TORCHELASTIC_USE_AGENT_STORE" in env or not dist.is_available():
        return
    if int(env.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    listen_fd = env.pop("ZT_RENDEZVOUS_LISTEN_FD", None)
    if env.get("RANK") == "0":
        address = env.get("MASTER_ADDR", "127.0.0.1")
        _launcher_store = dist.TCPStore(address, int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=True,
                                        wait_for_workers=False,
                                        master_listen_fd=int(listen_fd) if listen_fd is not None else None)
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    env.setdefault("TORCHELASTIC_RESTART_COUNT", "0")  # torch's prefix for its keys in that store


_serve_the_launchers_rendezvous()


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=None, verbose=True,
                     timeout=None, init_method=None, dist_init_required=None, config=None, rank=-1, world_size=-1):
    """Joins the job (a no-op when already joined). With torch.distributed already initialised by the
    script (env://), zerotrain's communicator joins the store it serves; otherwise zerotrain meets the
    other ranks first and then initialises torch.distributed over the same store. The backend of
    torch.distributed's group: dist_backend, else the accelerator's (Gloo on the CPU, NCCL when the
    package trains on CUDA), as DeepSpeed's; training on CUDA, the rank's device is made current
    first (LOCAL_RANK modulo the visible GPUs, as the command line picks it)."""
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
    from .accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda":
        torch.cuda.set_device(info["local_rank"] % torch.cuda.device_count())
    backend = dist_backend or accelerator.communication_backend_name()
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

    joined = _communicator is not None
    _registry.destroy_engines()
    _communicator = None
    # What still holds the communicator in a reference cycle (a module and its engine) lets go of it
    # now, while Python can run its destructor: its Gloo worker threads are joined there.
    gc.collect()
    # torch.distributed's Gloo threads free their finished work (and with it the script's tensors)
    # on their own; at interpreter teardown that takes the GIL from a dying thread and aborts the
    # process ("terminate called without an active exception") after the script has finished.
    # Destroying the group joins them first: the group we made, and a Gloo group the script's
    # framework made (Accelerate on the CPU does) and left alive, as torch asks scripts not to.
    if not (joined and dist.is_available() and dist.is_initialized()):
        return
    if _owns_torch_group or _default_backend_is_gloo():
        dist.destroy_process_group()


def _default_backend_is_gloo():
    try:
        return "gloo" in str(dist.get_backend()).lower()
    except (RuntimeError, ValueError):
        return False


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


# DeepSpeed's collectives over torch.distributed's default group (the script's own; the engine's
# go through zerotrain's communicator). DeepSpeed's prof/log_name/debug keywords are accepted and
# change nothing: the comms logger counts the engine's collectives only.
ReduceOp = dist.ReduceOp


def is_available():
    return True


def barrier(group=None, async_op=False, device_ids=None, **logging):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, **logging):
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, **logging):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


inference_all_reduce = all_reduce


def broadcast(tensor, src, group=None, async_op=False, **logging):
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, **logging):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, **logging):
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, **logging):
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, **logging):
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, **logging):
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, **logging):
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, **logging):
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, **logging):
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, **logging):
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      **logging):
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, **logging):
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def send(tensor, dst, group=None, tag=0, **logging):
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag=0, **logging):
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor, dst, group=None, tag=0, **logging):
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor, src=None, group=None, tag=0, **logging):
    return dist.irecv(tensor, src, group=group, tag=tag)


class P2POp:
    """DeepSpeed's point-to-point operation for batch_isend_irecv: op is this module's isend or irecv
    (torch's P2POp takes torch's own only)."""

    def __init__(self, op, tensor, peer, group=None, tag=0):
        if op not in (isend, irecv, dist.isend, dist.irecv):
            raise ValueError("P2POp: expected op to be deepspeed.comm.isend or deepspeed.comm.irecv")
        self.op = "isend" if op in (isend, dist.isend) else "irecv"
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list, **logging):
    return dist.batch_isend_irecv([dist.P2POp(getattr(dist, op.op), op.tensor, op.peer, op.group, op.tag)
                                   if isinstance(op, P2POp) else op for op in p2p_op_list])


def broadcast_object_list(object_list, src, group=None, device=None, **logging):
    return dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather_object(object_list, obj, group=None, **logging):
    return dist.all_gather_object(object_list, obj, group=group)


class _Works:
    """The handles of several collectives issued together, waited on as one."""

    def __init__(self, works):
        self._works = [w for w in works if w is not None]

    def wait(self):
        for work in self._works:
            work.wait()
        return True

    def is_completed(self):
        return all(work.is_completed() for work in self._works)


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False, **logging):
    """Each tensor all-reduced (one collective apiece: the result DeepSpeed's coalesced one gives)."""
    works = [dist.all_reduce(t, op=op, group=group, async_op=async_op) for t in tensors]
    return _Works(works) if async_op else None


def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    """all_gather_into_tensor of each input into its output (one collective apiece)."""
    works = [dist.all_gather_into_tensor(o, i, group=group, async_op=async_op)
             for o, i in zip(output_tensors, input_tensors)]
    return _Works(works) if async_op else None


def has_all_gather_into_tensor():
    return True


def has_reduce_scatter_tensor():
    return True


def has_all_reduce_coalesced():
    return True


def has_coalescing_manager():
    return False  # the coalesced collectives above run one collective per tensor


def new_group(ranks):
    return dist.new_group(ranks)


def destroy_process_group(group=None):
    return dist.destroy_process_group(group)


def get_world_group():
    return dist.group.WORLD


def get_global_rank(group=None, group_rank=0):
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None):
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


# The launcher's numbers, as DeepSpeed reads them from the environment (any launcher zerotrain knows).
def get_local_rank_from_launcher():
    return _C.rendezvous_from_environment()["local_rank"]


def get_world_rank_from_launcher():
    return _C.rendezvous_from_environment()["rank"]


def get_world_size_from_launcher():
    return _C.rendezvous_from_environment()["world_size"]


# DeepSpeed's cloud detection: the variables each platform sets.
def in_aml():
    return "AZUREML_EXPERIMENT_ID" in os.environ


def in_aws_sm():
    return "SM_TRAINING_ENV" in os.environ


def in_dlts():
    return "DLTS_JOB_ID" in os.environ


_LOGGER = "the comms logger counts the engine's collectives; log_summary() prints them"
configure = _unsupported.function("deepspeed.comm.configure", "the configuration's comms_logger block sets the logger")
reset_log = _unsupported.function("deepspeed.comm.reset_log", _LOGGER)
has_comm_data = _unsupported.function("deepspeed.comm.has_comm_data", _LOGGER)
get_comm_operation_count = _unsupported.function("deepspeed.comm.get_comm_operation_count", _LOGGER)
get_logged_comm_ops = _unsupported.function("deepspeed.comm.get_logged_comm_ops", _LOGGER)
_BACKEND = "init_distributed() meets the other ranks and makes the groups"
set_backend = _unsupported.function("deepspeed.comm.set_backend", _BACKEND)
init_deepspeed_backend = _unsupported.function("deepspeed.comm.init_deepspeed_backend", _BACKEND)
mpi_discovery = _unsupported.function("deepspeed.comm.mpi_discovery", "zerotrain reads Open MPI's variables itself")
initialize_mesh_device = _unsupported.function("deepspeed.comm.initialize_mesh_device",
                                               "zerotrain trains data-parallel only")
enable_symm_mem_for_group = _unsupported.function("deepspeed.comm.enable_symm_mem_for_group",
                                                  "zerotrain's Python front end trains on the CPU")
patch_aml_env_for_torch_nccl_backend = _unsupported.function("deepspeed.comm.patch_aml_env_for_torch_nccl_backend")
patch_aws_sm_env_for_torch_nccl_backend = _unsupported.function(
    "deepspeed.comm.patch_aws_sm_env_for_torch_nccl_backend")


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
