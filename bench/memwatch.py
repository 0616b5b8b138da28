"""Runs a command and watches the memory of its whole process tree, without ulimit or systemd.

  python3 bench/memwatch.py --cap-bytes N --result FILE [--interval S] [--disk-dir DIR] -- command args...

Every interval (0.2 s) it sums the proportional set size (Pss of /proc/PID/smaps_rollup: shared
pages, such as the libraries every rank maps or memory shared between ranks, counted once over
the tree instead of once per process; VmRSS where smaps_rollup cannot be read) over the command
and all its descendants (found through /proc/*/stat parent links, so ranks that start their own
sessions are counted too). When the sum
exceeds the cap it kills the whole tree with SIGKILL and records "memory-cap". A tree that dies of
SIGKILL that the watchdog did not send (the kernel's OOM killer, which is what a SIGKILL from
nowhere means here) is recorded as "oom-kill", also when a launcher reports it for one of its
ranks ("Signal 9", "SIGKILL", "killed by signal 9" in its output, which the caller passes with
--log). With --disk-dir it also samples the bytes allocated under DIR about once a second (swap
files are removed at exit, so their size is only seen while the run lives). Writes one JSON
object to FILE:
  {"status": "ok"|"memory-cap"|"oom-kill"|"error", "rc": int, "seconds": float,
   "peak_tree_memory_bytes": int, "peak_disk_bytes": int, "cap_bytes": int, "detail": str}
and exits with the command's exit code (137 when the watchdog killed it).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time


def processes():
    """{pid: (ppid, rss_bytes)} for every process we can read."""
    out = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            # The command name may hold spaces and parentheses: split after the last ')'.
            fields = stat[stat.rindex(")") + 2:].split()
            out[int(name)] = (int(fields[1]), int(fields[21]) * page)
        except (OSError, ValueError, IndexError):
            continue
    return out


def memory(pid, rss):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss


def tree(root, procs):
    children = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in seen:
            seen.append(pid)
            todo.extend(children.get(pid, []))
    return seen


def disk_bytes(path):
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except OSError:
                pass
    return total


def kill_tree(root):
    pids = tree(root, processes())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(root, signal.SIGKILL)
    except OSError:
        pass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cap-bytes", type=int, required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--disk-dir", default="", help="sample the bytes allocated under this directory")
    p.add_argument("--log", default="", help="the command's output file, searched for a rank killed by SIGKILL")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        sys.exit("memwatch: no command given")

    t0 = time.monotonic()
    child = subprocess.Popen(cmd, start_new_session=True)
    peak, capped, disk_peak, last_disk = 0, False, 0, 0.0
    while child.poll() is None:
        if a.disk_dir and time.monotonic() - last_disk >= 1.0:
            disk_peak, last_disk = max(disk_peak, disk_bytes(a.disk_dir)), time.monotonic()
        procs = processes()
        total = sum(memory(pid, procs[pid][1]) for pid in tree(child.pid, procs))
        peak = max(peak, total)
        if total > a.cap_bytes:
            capped = True
            kill_tree(child.pid)
            break
        time.sleep(a.interval)
    rc = child.wait()
    # Whatever is left of the tree (a rank whose launcher already exited) goes too.
    kill_tree(child.pid)
    seconds = time.monotonic() - t0

    log = ""
    if a.log:
        try:
            with open(a.log, errors="replace") as f:
                log = f.read()
        except OSError:
            pass
    sigkill_line = next((line.strip() for line in log.splitlines()
                         if re.search(r"Signal 9\b|SIGKILL|killed by signal 9|exitcode\s*:\s*-9\b", line)), "")
    if capped:
        status, detail = "memory-cap", f"process tree PSS {total} B > cap {a.cap_bytes} B: killed"
        rc = 137
    elif rc in (-9, 137) or sigkill_line:
        status, detail = "oom-kill", sigkill_line or "killed by SIGKILL (not by the watchdog): the kernel's OOM killer"
    elif rc == 0:
        status, detail = "ok", ""
    else:
        status, detail = "error", f"exit code {rc}"
    with open(a.result, "w") as f:
        json.dump({"status": status, "rc": rc, "seconds": seconds, "peak_tree_memory_bytes": peak,
                   "peak_disk_bytes": disk_peak if a.disk_dir else None,
                   "cap_bytes": a.cap_bytes, "detail": detail}, f)
    sys.exit(rc if 0 <= rc < 256 else 128 - rc)


if __name__ == "__main__":
    main()
