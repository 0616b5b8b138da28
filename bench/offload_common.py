"""Parsing and tables for bench/offload_vs_deepspeed.sh and bench/offload.sh.

  record zerotrain --dir RUN [--meta KEY=VALUE ...]   one JSON line from a zerotrain run's files
  record deepspeed --dir RUN [--meta KEY=VALUE ...]   one JSON line from a DeepSpeed run's log
  peer-table RECORDS.jsonl                            the markdown table of the peer comparison
  proof-table | overhead-table | bpp-table ...        the tables of bench/offload.sh (see there)
  params PRESET                                       the preset's parameter count

A run directory holds: log (stdout and stderr of the launcher), watch.json (bench/memwatch.py),
and for zerotrain summary.json and zerotrain.csv when the run got that far.

Parsing is tolerant: a field a build does not print is left out (null), and every line of the
zerotrain log or summary that mentions NVMe or I/O is kept verbatim in "io_lines", so a report
can show what the engine said even where the names it uses are not the ones expected here.
"""

import csv
import json
import os
import re
import statistics
import sys

PRESETS = {  # vocab, context, layers, heads, width: src/models/gpt.cpp
    "tiny": (256, 64, 2, 2, 64),
    "small": (256, 128, 4, 4, 128),
    "gpt2-124m": (50257, 1024, 12, 12, 768),
    "gpt2-350m": (50257, 1024, 24, 16, 1024),
    "gpt2-774m": (50257, 1024, 36, 20, 1280),
    "gpt2-1.5b": (50257, 1024, 48, 25, 1600),
    "gpt-2.7b": (50257, 2048, 32, 32, 2560),
    "gpt-6.7b": (50257, 2048, 32, 32, 4096),
    "gpt-13b": (50257, 2048, 40, 40, 5120),
}
GIB = 1024 ** 3
IO_PATTERN = re.compile(r"nvme|\bI/O\b|\bio[_ ]|swap|read GB|write GB|GB/s", re.IGNORECASE)


def params(preset):
    v, t, layers, _, c = PRESETS[preset]
    return v * c + t * c + layers * (12 * c * c + 13 * c) + 2 * c


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def median_step(seconds):
    """Median step time without the first step (warm-up: first-touch of every buffer)."""
    timed = seconds[1:] if len(seconds) > 1 else seconds
    return statistics.median(timed) if timed else None


def flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list) and len(obj) <= 8:
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def first_error_line(log):
    for line in log.splitlines():
        if re.search(r"\berror\b", line, re.IGNORECASE):
            return line.strip()
    lines = [l for l in log.splitlines() if l.strip()]
    return lines[-1].strip() if lines else ""


def record_zerotrain(run, meta):
    log, watch = read(f"{run}/log"), load_json(f"{run}/watch.json") or {}
    summary = load_json(f"{run}/summary.json")
    rec = dict(meta, system="zerotrain", status=watch.get("status", "error"), detail=watch.get("detail", ""),
               peak_tree_memory_bytes=watch.get("peak_tree_memory_bytes"), peak_disk_bytes=watch.get("peak_disk_bytes"),
               wall_seconds=watch.get("seconds"))
    if rec["status"] == "error":
        line = first_error_line(log)
        offload = meta.get("offload_optimizer", "none") != "none" or meta.get("offload_param", "none") != "none"
        key = re.search(r"offload_optimizer|offload_param|\baio\b|sub_group_size", line)
        if offload and key:
            rec["detail"] = f"{key.group(0)} refused by this build: {line}"
        else:
            rec["detail"] = line or rec["detail"]
    rows = []
    try:
        with open(f"{run}/zerotrain.csv") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        pass
    elapsed = [float(r["elapsed_seconds"]) for r in rows if r.get("elapsed_seconds")]
    rec["step_seconds"] = [b - a for a, b in zip([0.0] + elapsed, elapsed)]
    rec["losses"] = [float(r["loss"]) for r in rows if r.get("loss")]
    if summary:
        rec["params"] = summary.get("parameters", rec.get("params"))
        rec["peak_rss_per_rank"] = [r.get("peak_rss_bytes") for r in summary.get("ranks", [])]
        rec["losses"] = summary.get("losses", rec["losses"])
        rec["summary_io"] = {k: v for k, v in flatten(summary) if IO_PATTERN.search(k)}
    elif rows:
        rec["peak_rss_per_rank"] = [int(rows[-1]["peak_rss_bytes_max"])]  # the largest rank only
    rec["s_per_step"] = median_step(rec["step_seconds"])
    # wall_clock_breakdown with steps_per_print 1: "| ms/step fwd F bwd B step S" on each progress line.
    br = re.findall(r"ms/step fwd (\d+(?:\.\d+)?) bwd (\d+(?:\.\d+)?) step (\d+(?:\.\d+)?)", log)
    rec["fwd_bwd_seconds"] = [(float(f) + float(b)) / 1e3 for f, b, _ in br]
    rec["optimizer_seconds"] = [float(o) / 1e3 for _, _, o in br]
    if summary:
        rec["baseline_rss_per_rank"] = [r.get("baseline_rss_bytes") for r in summary.get("ranks", [])]
    rec["io_lines"] = [l.strip() for l in log.splitlines()
                       if IO_PATTERN.search(l) and not re.match(r"^\S+\s+=\s|zerotrain launch:", l)]  # not the resolved-config listing
    return rec


def record_deepspeed(run, meta):
    log, watch = read(f"{run}/log"), load_json(f"{run}/watch.json") or {}
    rec = dict(meta, system="deepspeed", status=watch.get("status", "error"), detail=watch.get("detail", ""),
               peak_tree_memory_bytes=watch.get("peak_tree_memory_bytes"), peak_disk_bytes=watch.get("peak_disk_bytes"),
               wall_seconds=watch.get("seconds"))
    steps, summaries = {}, {}
    for line in log.splitlines():
        m = re.search(r"DSBENCH (step|summary) (.*)", line)
        if not m:
            continue
        fields = dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)
        rank = int(fields.get("rank", 0))
        if m.group(1) == "step":
            steps.setdefault(rank, []).append(fields)
        else:
            summaries[rank] = fields
    # A step's time is the slowest rank's (they wait for each other in the collectives).
    per_rank = [[float(s["seconds"]) for s in steps[r]] for r in sorted(steps)]
    rec["step_seconds"] = [max(ts) for ts in zip(*per_rank)] if per_rank else []
    rec["losses"] = [float(s["loss"]) for s in steps.get(0, [])]
    rec["s_per_step"] = median_step(rec["step_seconds"])
    if summaries:
        rec["peak_rss_per_rank"] = [int(summaries[r]["peak_rss_bytes"]) for r in sorted(summaries)]
        rec["params"] = int(summaries[min(summaries)]["params"])
        rec["baseline_rss_per_rank"] = [int(summaries[r].get("baseline_rss_bytes", 0)) or None for r in sorted(summaries)]
    elif steps:
        rec["peak_rss_per_rank"] = [int(steps[r][-1]["peak_rss_bytes"]) for r in sorted(steps)]
    if rec["status"] == "ok" and len(summaries) == 0:
        rec["status"], rec["detail"] = "error", "no summary line"
    if rec["status"] == "error":
        tb = [l.strip() for l in log.splitlines() if re.search(r"Error|error:|Exception|assert", l)]
        rec["detail"] = (tb[-1] if tb else first_error_line(log))[:300]
    return rec


def gib(b):
    return "–" if b is None else f"{b / GIB:.2f}"


def status_text(rec):
    s = rec["status"]
    if s == "ok":
        return "OK"
    if s == "memory-cap":
        return f"killed for memory (process tree > cap {rec.get('cap_gib', '?')} GiB)"
    if s == "oom-kill":
        return f"killed for memory (OOM killer: {rec.get('detail', '')[:80]})"
    if s == "not-run":
        return "not run (" + rec.get("detail", "") + ")"
    return "error: " + rec.get("detail", "")[:200].replace("|", "/")


def offload_text(rec):
    o, p = rec.get("offload_optimizer", "none"), rec.get("offload_param", "none")
    return f"opt {o}, param {p}" if int(rec.get("stage", 0)) == 3 else f"opt {o}"


def peer_table(path):
    recs = [json.loads(l) for l in open(path) if l.strip()]
    print("| preset | parameters | system | stage | precision | offload | s/step | peak RSS per rank (GiB) "
          "| peak process-tree PSS (GiB) | peak disk (GiB) | status |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in recs:
        ranks = " / ".join(gib(b) for b in r.get("peak_rss_per_rank") or []) or "–"
        sps = f"{r['s_per_step']:.2f}" if r.get("s_per_step") is not None and r["status"] == "ok" else "–"
        print(f"| {r['preset']} | {params(r['preset']) / 1e6:.1f} M | {r['system']} | {r['stage']} | {r['precision']} "
              f"| {offload_text(r)} | {sps} | {ranks} | {gib(r.get('peak_tree_memory_bytes'))} "
              f"| {gib(r.get('peak_disk_bytes'))} | {status_text(r)} |")
    print()
    for system in ("zerotrain", "deepspeed"):
        ok = [r for r in recs if r["system"] == system and r["status"] == "ok"]
        if any(r["system"] == system for r in recs):
            best = max(ok, key=lambda r: params(r["preset"])) if ok else None
            print(f"- largest model {system} trains: " + (f"{best['preset']} ({params(best['preset']) / 1e6:.1f} M parameters, "
                  f"{best['s_per_step']:.2f} s/step)" if best else "none of those tried"))


def numeric_io(rec):
    return {k: v for k, v in (rec.get("summary_io") or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def engine_rate(rec, role):
    """Achieved GB/s for role (read/write) from the summary's I/O fields, when it names bytes and
    seconds for it; None otherwise."""
    io = numeric_io(rec)
    b = [v for k, v in io.items() if role in k.lower() and "bytes" in k.lower() and "per" not in k.lower()]
    t = [v for k, v in io.items() if role in k.lower() and ("seconds" in k.lower() or k.lower().endswith("_s"))]
    if len(b) == 1 and len(t) == 1 and t[0] > 0:
        return b[0] / t[0] / 1e9
    g = [v for k, v in io.items() if role in k.lower() and "gb" in k.lower() and ("s" in k.lower())]
    return g[0] if len(g) == 1 else None


def print_io(rec):
    io = numeric_io(rec)
    if io:
        print("I/O fields of the run summary: " + ", ".join(f"`{k}` = {v:.6g}" for k, v in sorted(io.items())))
    if rec.get("io_lines"):
        print()
        print("I/O lines of the run's output:")
        print()
        for line in rec["io_lines"][:20]:
            print(f"    {line}")
    if not io and not rec.get("io_lines"):
        print("The run printed no NVMe or I/O figures.")


def dd_rates(paths):
    ds = [load_json(p) for p in paths]
    ds = [d for d in ds if d]
    if not ds:
        return None, None
    return statistics.median(d["read_bps"] for d in ds), statistics.median(d["write_bps"] for d in ds)


def proof_table(rec_path, ram_bytes, *dd_paths):
    rec = json.loads(open(rec_path).read())
    ram = int(ram_bytes)
    p = params(rec["preset"])
    ranks = rec.get("peak_rss_per_rank") or []
    worst = max((b for b in ranks if b), default=None)
    print("| preset | parameters | fp32 model states (GB, 16 B/param) | RAM (GiB) | peak RSS per rank (GiB) | a third of RAM (GiB) "
          "| under a third | peak disk (GiB) | s/step | status |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sps = f"{rec['s_per_step']:.1f}" if rec.get("s_per_step") else "–"
    under = "–" if worst is None else ("yes" if worst < ram / 3 else "no")
    print(f"| {rec['preset']} | {p / 1e9:.2f} B | {16 * p / 1e9:.1f} | {ram / GIB:.1f} | "
          f"{' / '.join(gib(b) for b in ranks) or '–'} | {ram / 3 / GIB:.2f} | {under} | {gib(rec.get('peak_disk_bytes'))} "
          f"| {sps} | {status_text(rec)} |")
    print()
    losses, steps = rec.get("losses") or [], rec.get("step_seconds") or []
    if losses:
        print("| step | loss | step time (s) | forward + backward (s) | optimizer step (s) |")
        print("|---|---|---|---|---|")
        fb, op = rec.get("fwd_bwd_seconds") or [], rec.get("optimizer_seconds") or []
        for i, loss in enumerate(losses):
            cell = lambda xs: f"{xs[i]:.2f}" if i < len(xs) else "–"
            print(f"| {i + 1} | {loss:.4f} | {cell(steps)} | {cell(fb)} | {cell(op)} |")
        print()
        falling = len(losses) > 1 and losses[-1] < losses[0]
        print(f"Loss {losses[0]:.4f} → {losses[-1]:.4f}: {'falling' if falling else 'NOT falling'}.")
        print()
    read_bps, write_bps = dd_rates(dd_paths)
    if read_bps:
        print(f"Plain sequential O_DIRECT rate of the swap directory's disk (dd, 1 MiB blocks, same run): "
              f"read {read_bps / 1e9:.2f} GB/s, write {write_bps / 1e9:.2f} GB/s.")
        for role, rate in (("read", read_bps), ("write", write_bps)):
            got = engine_rate(rec, role)
            if got is not None:
                print(f"- optimizer-step {role}: {got:.2f} GB/s = {got * 1e9 / rate:.2f} of the plain rate (target ≥ 0.8)")
        print()
    print_io(rec)


def overhead_table(records_path, *dd_paths):
    recs = [json.loads(l) for l in open(records_path) if l.strip()]
    read_bps, write_bps = dd_rates(dd_paths)
    preset = recs[0]["preset"]
    p = params(preset)
    print("| stage | variant | s/step (median) | vs no offload | optimizer step (s) | runs | status |")
    print("|---|---|---|---|---|---|---|")
    by = {}
    for r in recs:
        by.setdefault((int(r["stage"]), r["variant"]), []).append(r)
    med = {}
    for (stage, variant), rs in sorted(by.items()):
        ok = [r for r in rs if r["status"] == "ok" and r.get("s_per_step")]
        m = statistics.median(r["s_per_step"] for r in ok) if ok else None
        med[(stage, variant)] = m
        base = med.get((stage, "none"))
        opt = [x for r in ok for x in (r.get("optimizer_seconds") or [])[1:]]
        bad = [r for r in rs if r["status"] != "ok"]
        print(f"| {stage} | {variant} | {f'{m:.3f}' if m else '–'} | {f'{m / base:.3f}' if m and base else '–'} "
              f"| {f'{statistics.median(opt):.3f}' if opt else '–'} | {len(ok)}/{len(rs)} "
              f"| {status_text(bad[0]) if bad else 'OK'} |")
    print()
    # fp32: the working parameters are the masters and stay in memory; the moments m and v (8 B per
    # parameter over all ranks) are read and written once per step.
    read_b = write_b = 8 * p
    print(f"Bounds, measured in the same run: the disk's plain sequential O_DIRECT rate (dd, 1 MiB blocks) "
          + (f"read {read_bps / 1e9:.2f} GB/s, write {write_bps / 1e9:.2f} GB/s; " if read_bps else "not measured; ")
          + f"the step's bytes: {read_b / 1e9:.2f} GB read + {write_b / 1e9:.2f} GB written (the fp32 moments, "
          f"8 B/parameter each way, all ranks on one disk).")
    print()
    print("| stage | compute-only step (s) | bytes at sequential rate (s) | max of the bounds (s) | nvme + delayed update (s) "
          "| ratio to max bound (target ≤ 1.15) |")
    print("|---|---|---|---|---|---|")
    for stage in sorted({s for s, _ in by}):
        none = [r for r in by.get((stage, "none"), []) if r["status"] == "ok"]
        # The no-offload run's step minus its optimizer step, per timed step.
        comp = [t - o for r in none for t, o in list(zip(r.get("step_seconds") or [], r.get("optimizer_seconds") or []))[1:]]
        c = statistics.median(comp) if comp else None
        io = read_b / read_bps + write_b / write_bps if read_bps else None
        bound = max(x for x in (c, io) if x is not None) if (c or io) else None
        d = med.get((stage, "nvme+delayed"))
        fmt = lambda x: f"{x:.3f}" if x is not None else "–"
        print(f"| {stage} | {fmt(c)} | {fmt(io)} | {fmt(bound)} | {fmt(d)} | {f'{d / bound:.3f}' if d and bound else '–'} |")
    print()
    for r in recs:
        if r["variant"] != "none" and r["status"] == "ok":
            print_io(r)
            break


def bpp_table(records_path, world):
    recs = [json.loads(l) for l in open(records_path) if l.strip()]
    n = int(world)
    # fp32 at stage 2, per rank: parameters replicated (4 B), the gradient partition (4 B / N), the
    # moments (8 B / N) in RAM unless on NVMe.
    ideal = {"none": 4 + 12 / n, "cpu": 4 + 12 / n, "nvme": 4 + 4 / n}
    print("| system | stage | offload_optimizer | parameters | peak RSS per rank (GiB) | B/param per rank "
          "| B/param per rank above the pre-model baseline | ideal B/param per rank | status |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in recs:
        p = params(r["preset"])
        ranks = [b for b in (r.get("peak_rss_per_rank") or []) if b]
        base = [b for b in (r.get("baseline_rss_per_rank") or []) if b]
        worst = max(ranks) if ranks else None
        above = max(a - b for a, b in zip(ranks, base)) if base and len(base) == len(ranks) else None
        dev = r.get("offload_optimizer", "none")
        print(f"| {r['system']} | {r['stage']} | {dev} | {p / 1e6:.1f} M | {' / '.join(gib(b) for b in ranks) or '–'} "
              f"| {f'{worst / p:.1f}' if worst else '–'} | {f'{above / p:.1f}' if above else '–'} "
              f"| {ideal.get(dev, float('nan')):.1f} | {status_text(r)} |")
    print()
    print(f"DeepSpeed's measured host memory at ZeRO-2 with CPU offload: 28 B/parameter in an earlier measurement; "
          f"target ≤ 16. With bf16 moments (2 + 2 B instead of 4 + 4 B) the ideal per rank would be "
          f"{4 + 8 / n:.1f} B/param with CPU offload at N = {n} (fp32 parameters, fp32 gradient partition).")


def parse_meta(args):
    meta = {}
    for a in args:
        k, _, v = a.partition("=")
        meta[k] = v
    return meta


def main():
    cmd = sys.argv[1:]
    if cmd[:1] == ["record"] and len(cmd) >= 4 and cmd[2] == "--dir":
        meta = parse_meta(cmd[5:] if cmd[4:5] == ["--meta"] else cmd[4:])
        rec = (record_zerotrain if cmd[1] == "zerotrain" else record_deepspeed)(cmd[3], meta)
        print(json.dumps(rec))
    elif cmd[:1] == ["peer-table"]:
        peer_table(cmd[1])
    elif cmd[:1] == ["proof-table"]:
        proof_table(*cmd[1:])
    elif cmd[:1] == ["overhead-table"]:
        overhead_table(*cmd[1:])
    elif cmd[:1] == ["bpp-table"]:
        bpp_table(*cmd[1:])
    elif cmd[:1] == ["params"]:
        print(params(cmd[1]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
