"""DeepSpeed's launcher command line (`deepspeed [flags] script.py args...`, DeepSpeed 0.19's runner)
over torch's own launcher, torch.distributed.run: the `deepspeed` command of the companion
distribution, and `python -m zerotrain.launcher`. Each rank gets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT as DeepSpeed's launcher sets them, and `--local_rank=N` after the
script's own arguments unless --no_local_rank.

Nodes are started one by one, as torchrun starts them: on each node, the same command with
--no_ssh, --num_nodes, --node_rank and --master_addr. What DeepSpeed does over ssh or MPI from a
hostfile (pdsh, OpenMPI, SLURM, ...) is refused flag by flag, naming that equivalent."""
import argparse
import os
import sys

from ._unsupported import NotSupportedError

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # DeepSpeed's file of variables for other nodes (Accelerate imports it)
DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's DLTS_HOSTFILE: read when present, as DeepSpeed does
PER_NODE = "start the same command on each node with --no_ssh --num_nodes N --node_rank I --master_addr HOST"


def parser(prog):
    p = argparse.ArgumentParser(prog=prog, description="DeepSpeed's launcher command line, run by zerotrain over "
                                "torch.distributed.run (one node per command).")
    p.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE)
    p.add_argument("-i", "--include", default="")
    p.add_argument("-e", "--exclude", default="")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1)
    p.add_argument("--master_port", type=int, default=DEFAULT_PORT)
    p.add_argument("--master_addr", default="")
    p.add_argument("--node_rank", type=int, default=-1)
    p.add_argument("--launcher", default="pdsh")
    p.add_argument("--launcher_args", default="")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--no_ssh", action="store_true")
    p.add_argument("--no_ssh_check", action="store_true")
    p.add_argument("--force_multi", action="store_true")
    p.add_argument("--save_pid", action="store_true")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--autotuning", default="", choices=["tune", "run"])
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--venv_script", default=None)
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def read_hostfile(path):
    """DeepSpeed's MPI-style hostfile (`host slots=N` per line, # comments) as {host: slots}."""
    hosts = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
                raise ValueError(f"{path}:{number}: expected 'HOST slots=N', found {line!r}")
            if parts[0] in hosts:
                raise ValueError(f"{path}:{number}: host {parts[0]} is listed twice")
            hosts[parts[0]] = int(parts[1][6:])
    return hosts


def parse_slots(spec, flag):
    """--include/--exclude on one node: 'localhost:0,2' or 'localhost' (all slots) -> slot list or None."""
    chosen = None
    for node in spec.split("@"):
        host, _, slots = node.partition(":")
        if host not in ("localhost", "127.0.0.1", os.uname().nodename):
            raise NotSupportedError(f"{flag} {spec!r} names host {host!r}: the zerotrain launcher starts this node only "
                                    f"({PER_NODE})")
        if slots:
            try:
                chosen = sorted(set(chosen or []) | {int(s) for s in slots.split(",")})
            except ValueError:
                raise ValueError(f"{flag} {spec!r}: slots must be integers, as in localhost:0,2") from None
    return chosen


def local_slots(args):
    """This node's device slots to use, from --num_gpus / --include / --exclude and the visible devices."""
    import torch

    if args.include and args.exclude:
        raise ValueError("--include and --exclude are mutually exclusive (as in DeepSpeed)")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    slots = list(range(available)) if available else [0]  # on the CPU: one rank unless told more
    if args.include:
        chosen = parse_slots(args.include, "--include")
        if chosen is not None:
            slots = chosen
    if args.exclude:
        dropped = parse_slots(args.exclude, "--exclude")
        slots = [] if dropped is None else [s for s in slots if s not in dropped]
    if args.num_gpus > 0:
        if available == 0 and not args.include and not args.exclude:
            slots = list(range(args.num_gpus))  # CPU ranks: as many as asked
        else:
            slots = slots[:args.num_gpus]
    if not slots:
        raise ValueError("no device slot is left to run on (check --include/--exclude/--num_gpus)")
    return slots, available


def refuse_what_needs_ssh(args):
    multi_node_hostfile = os.path.isfile(args.hostfile) and len(read_hostfile(args.hostfile)) > 1
    if args.no_ssh:
        if args.num_nodes > 1 and (args.node_rank < 0 or not args.master_addr):
            raise ValueError("--no_ssh with --num_nodes > 1 needs --node_rank and --master_addr on each node")
        return
    if multi_node_hostfile or args.num_nodes > 1 or args.force_multi:
        raise NotSupportedError(f"starting nodes over ssh or MPI (hostfile {args.hostfile}, --num_nodes, --force_multi) "
                                f"is not supported by zerotrain's launcher: {PER_NODE}")
    if args.launcher.lower() != "pdsh" or args.launcher_args:
        raise NotSupportedError(f"--launcher {args.launcher} / --launcher_args are not supported by zerotrain's launcher "
                                f"(it runs torch.distributed.run on this node): {PER_NODE}")


def torchrun_command(args):
    """torch.distributed.run's arguments, and the environment changes, for DeepSpeed's flags."""
    for flag, value in (("--autotuning", args.autotuning), ("--venv_script", args.venv_script),
                        ("--bind_cores_to_rank", args.bind_cores_to_rank), ("--bind_core_list", args.bind_core_list)):
        if value:
            raise NotSupportedError(f"{flag} is not supported by zerotrain's launcher (use numactl or taskset in the "
                                    "script's command for core binding; zerotrain has no autotuner)")
    refuse_what_needs_ssh(args)
    slots, available = local_slots(args)
    env = {}
    if available:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
    nodes = max(args.num_nodes, 1)
    command = ["--nproc_per_node", str(len(slots)), "--nnodes", str(nodes),
               "--node_rank", str(max(args.node_rank, 0)),
               "--master_addr", args.master_addr or "127.0.0.1", "--master_port", str(args.master_port)]
    if args.enable_each_rank_log != "None":
        os.makedirs(args.enable_each_rank_log, exist_ok=True)
        command += ["--log_dir", args.enable_each_rank_log, "--redirects", "3"]
    if args.module:
        command.append("--module")
    if args.no_python:
        command.append("--no_python")
    command.append(args.user_script)
    user_args = list(args.user_args)
    if not args.no_local_rank:
        user_args.append("--local_rank=${local_rank}")  # torch.distributed.run substitutes each rank's
    return command + user_args, env


def main(argv=None, prog="zerotrain-launcher"):
    args = parser(prog).parse_args(argv)
    try:
        command, env = torchrun_command(args)
    except (NotSupportedError, ValueError, OSError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    os.environ.update(env)
    if args.save_pid:
        with open(f"/tmp/{os.getpid()}.ds", "w") as f:
            f.write(str(os.getpid()))
    from torch.distributed import run

    if not args.quiet:
        print(f"{prog}: torch.distributed.run {' '.join(command)}", file=sys.stderr)
    run.main(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
