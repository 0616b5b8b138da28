#!/usr/bin/env python3
"""Reference values of DeepSpeed's learning-rate schedulers for tests/lr_schedule_test.cpp.

Runs DeepSpeed's own deepspeed/runtime/lr_schedules.py the way DeepSpeed's engine drives it: the
scheduler is built on the optimizer (its constructor installs the first step's lr, and OneCycle's
betas), and scheduler.step() follows every applied optimizer step. The value recorded for step k
is what the optimizer's param group holds after k calls of step(), i.e. what optimizer step k
(0-based) uses. Only lr_schedules.py is loaded (by file path, with deepspeed.utils.logger stubbed),
so neither DeepSpeed's ops nor its accelerator are needed; torch is.

Regenerate (DeepSpeed 0.19.8 from bench/deepspeed_env.sh, torch from scripts/bootstrap.sh):
  source bench/deepspeed_env.sh && ds_install && \
  python3 tests/data/lr_schedule_reference.py "$ds_dir/site/deepspeed/runtime/lr_schedules.py" \
      > tests/data/lr_schedule_reference.inc
"""
import glob
import importlib.util
import json
import logging
import os
import sys
import types

import torch


def load_lr_schedules(path):
    deepspeed = types.ModuleType("deepspeed")
    utils = types.ModuleType("deepspeed.utils")
    utils.logger = logging.getLogger("deepspeed")
    utils.logger.disabled = True  # DeepSpeed's warnings (unknown warmup_type, ...) are expected here
    deepspeed.utils = utils
    sys.modules.setdefault("deepspeed", deepspeed)
    sys.modules.setdefault("deepspeed.utils", utils)
    spec = importlib.util.spec_from_file_location("ds_lr_schedules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def deepspeed_version(path):
    site = os.path.dirname(os.path.dirname(os.path.dirname(path)))
    infos = glob.glob(os.path.join(site, "deepspeed-*.dist-info"))
    return os.path.basename(infos[0])[len("deepspeed-"):-len(".dist-info")] if infos else "unknown"


def upto(n):
    return list(range(n + 1))


# name, base lr (optimizer.params.lr), scheduler type, params, the steps to record.
CASES = [
    ("WarmupLR defaults (warmup_max_lr: the optimizer's lr)", 3e-4, "WarmupLR", {},
     [0, 1, 2, 3, 10, 100, 500, 998, 999, 1000, 1001, 1002, 5000]),
    ("WarmupLR linear", 1e-3, "WarmupLR",
     {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 10, "warmup_type": "linear"}, upto(14)),
    ("WarmupLR log, one warm-up step (DeepSpeed's minimum is 2)", 1e-3, "WarmupLR",
     {"warmup_num_steps": 1, "warmup_max_lr": 5e-3}, upto(5)),
    ("WarmupLR unknown warmup_type runs log", 1e-3, "WarmupLR",
     {"warmup_num_steps": 7, "warmup_type": "cosine", "warmup_min_lr": 1e-4}, upto(10)),
    ("WarmupLR warmup_max_lr below warmup_min_lr", 1e-3, "WarmupLR",
     {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-4, "warmup_num_steps": 5, "warmup_type": "linear"}, upto(8)),
    ("WarmupDecayLR linear", 1e-3, "WarmupDecayLR",
     {"total_num_steps": 50, "warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
      "warmup_type": "linear"}, upto(55)),
    ("WarmupDecayLR defaults", 3e-4, "WarmupDecayLR", {"total_num_steps": 3000},
     [0, 1, 2, 500, 999, 1000, 1001, 1002, 2000, 2999, 3000, 3001, 3500]),
    ("WarmupDecayLR total_num_steps shorter than the warm-up", 1e-3, "WarmupDecayLR",
     {"total_num_steps": 5, "warmup_num_steps": 10, "warmup_min_lr": 1e-4}, upto(14)),
    ("WarmupCosineLR linear", 2e-3, "WarmupCosineLR",
     {"total_num_steps": 60, "warmup_num_steps": 10, "warmup_type": "linear", "warmup_min_ratio": 0.1,
      "cos_min_ratio": 0.05}, upto(66)),
    ("WarmupCosineLR defaults", 1e-3, "WarmupCosineLR", {"total_num_steps": 3000},
     [0, 1, 2, 10, 999, 1000, 1001, 1002, 1500, 2000, 2998, 2999, 3000, 3001, 4000]),
    ("WarmupCosineLR total_num_steps shorter than the warm-up (zero2.json --steps 5)", 1e-3, "WarmupCosineLR",
     {"total_num_steps": 5, "warmup_num_steps": 20, "warmup_type": "linear", "warmup_min_ratio": 0.0,
      "cos_min_ratio": 0.1}, upto(25)),
    ("WarmupCosineLR total_num_steps equal to the warm-up", 1e-3, "WarmupCosineLR",
     {"total_num_steps": 8, "warmup_num_steps": 8, "warmup_min_ratio": 0.2}, upto(12)),
    ("OneCycle defaults", 1e-3, "OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3},
     [0, 1, 2, 3, 500, 1000, 1999, 2000, 2001, 3000, 3999, 4000, 4001, 4002, 6000, 9000]),
    ("OneCycle asymmetric with decay of lr and momentum", 1e-3, "OneCycle",
     {"cycle_min_lr": 1e-4, "cycle_max_lr": 3e-3, "cycle_first_step_size": 10, "cycle_second_step_size": 6,
      "decay_step_size": 4, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01, "cycle_min_mom": 0.85,
      "cycle_max_mom": 0.95}, upto(40)),
    ("OneCycle stairs in both halves", 1e-3, "OneCycle",
     {"cycle_min_lr": 2e-4, "cycle_max_lr": 2e-3, "cycle_first_step_size": 12, "cycle_second_step_size": 8,
      "cycle_first_stair_count": 3, "cycle_second_stair_count": 2, "decay_step_size": 5, "decay_lr_rate": 0.1},
     upto(40)),
    ("OneCycle first stair count for both halves, no momentum", 1e-3, "OneCycle",
     {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 9, "cycle_first_stair_count": 3,
      "cycle_momentum": False}, upto(30)),
    ("OneCycle with an empty second half", 1e-3, "OneCycle",
     {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5, "cycle_second_step_size": 0,
      "decay_step_size": 2, "decay_lr_rate": 1.0}, upto(15)),
    ("OneCycle fractional step sizes", 1e-3, "OneCycle",
     {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2.5, "cycle_second_step_size": 3.5,
      "cycle_first_stair_count": 2, "decay_step_size": 3, "decay_lr_rate": 0.2, "decay_mom_rate": 0.05}, upto(14)),
    ("LRRangeTest defaults", 1e-3, "LRRangeTest", {}, [0, 1, 2, 1000, 1999, 2000, 2001, 4000, 10000]),
    ("LRRangeTest staircase", 1e-3, "LRRangeTest",
     {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0,
      "lr_range_test_staircase": True}, upto(22)),
    ("LRRangeTest continuous", 1e-3, "LRRangeTest",
     {"lr_range_test_min_lr": 2e-5, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 0.5}, upto(12)),
]


def run_case(lrs, base_lr, type_name, params, steps):
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([weight], lr=base_lr, betas=(0.9, 0.999))
    scheduler = getattr(lrs, type_name)(optimizer, **params)
    cycled = isinstance(scheduler, lrs.OneCycle) and scheduler.cycle_momentum
    group = optimizer.param_groups[0]
    points = []
    done = 0
    for step in steps:
        while done < step:
            scheduler.step()
            done += 1
        betas = group["betas"]
        points.append((step, float(group["lr"]), float(betas[0]), float(betas[1])))
    return cycled, points


def main():
    path = sys.argv[1]
    lrs = load_lr_schedules(path)
    out = [f"// Generated by tests/data/lr_schedule_reference.py from DeepSpeed {deepspeed_version(path)}'s",
           "// deepspeed/runtime/lr_schedules.py; do not edit. {step, lr, beta1, beta2}: the param group",
           "// after `step` calls of scheduler.step(), the values optimizer step `step` uses.",
           "const std::vector<ReferenceCase> kDeepSpeedReference = {"]
    for name, base_lr, type_name, params, steps in CASES:
        cycled, points = run_case(lrs, base_lr, type_name, params, steps)
        config = json.dumps({"optimizer": {"type": "Adam", "params": {"lr": base_lr}},
                             "scheduler": {"type": type_name, "params": params}})
        out.append(f"    {{{json.dumps(name)},\n     R\"({config})\",\n     {'true' if cycled else 'false'},\n     {{")
        for step, lr, b1, b2 in points:
            out.append(f"      {{{step}, {lr!r}, {b1!r}, {b2!r}}},")
        out.append("     }},")
    out.append("};")
    print("\n".join(out))


if __name__ == "__main__":
    main()
