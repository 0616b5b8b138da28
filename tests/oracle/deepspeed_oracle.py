"""DeepSpeed as the numerical oracle of zerotrain (docs/deepspeed_oracle.md; run by tests/oracle/run.sh).

Subcommands:
  prepare --dir D       writes the token files, the configuration matrix (one zerotrain JSON file
                        per case) and D/cases.json
  deepspeed --dir D     (under torch.distributed.run, 2 ranks) trains every case with DeepSpeed from
                        the initial weights zerotrain exported, on zerotrain's batches, and writes
                        D/<case>/deepspeed.json (per-step losses, grad norms) and deepspeed_weights.pt
                        (final fp32 master weights by zerotrain's parameter names)
  compare --dir D       reads both sides, prints the table and exits 1 when a case is out of tolerance
  cpp-python --dir D    (under torch.distributed.run, 2 ranks) the command line's cases again from a
                        Python loop over zerotrain.models.GPT (the same C++ GPT) and the Python package
  compare-cpp-python --dir D   exits 1 unless those losses equal the command line's bit for bit

The same batches: zerotrain's DistributedSampler (src/data/sampler.cpp) reimplemented below, bit for
bit; the same weights: the file `zerotrain export` wrote, loaded by name; the same configuration:
DeepSpeed reads the very JSON file zerotrain trained with (its own blocks "model", "data", "train"
are unknown to DeepSpeed, which ignores them). LAMB is the exception, see FusedLambReference; and
in bf16 two of DeepSpeed's start-up choices are undone before training (undo_construction_step,
set_fp32_masters; ZT_ORACLE_RAW=1 keeps them), see docs/deepspeed_oracle.md "Differences found".
"""

import argparse
import json
import math
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
from zt_gpt import GPT, PRESETS, load_hf_gpt2_weights, load_zerotrain_weights, read_safetensors  # noqa: E402

STEPS = 10
WORLD = 2
SEED = 1234
# Tolerances (docs/deepspeed_oracle.md "Tolerances"), each against the metric named beside it.
# fp32: the two systems run the same LibTorch kernels on the same inputs and differ only in the
# order and fusion of a few operations (gradient averaging, clipping, the optimizer's arithmetic):
# a few ulps per step, which ten steps of training amplify to about 1e-7 in the loss and a few 1e-6
# in the weights (measured: 2.0e-7 and 7.7e-6 at most).
FP32_LOSS_RTOL = 1e-5    # max over steps of |loss_zt - loss_ds| / |loss_ds|
FP32_WEIGHT_RTOL = 1e-5  # max over tensors of |a-b|_inf / max(|b|_inf, WEIGHT_FLOOR)
FP32_L2_RTOL = 1e-5      # |a-b|_2 / |b|_2 over all the weights
# bf16: a gradient element rounds to 8 bits of mantissa, differently in the two systems when their
# summation orders differ; where the gradient is near zero that can flip the sign of Adam's or
# LAMB's update for one element, which then differs by a fraction of a step (lr) from the other
# system's. Measured at most: loss 7.2e-5, per-tensor 1.6e-2 (isolated elements of small tensors,
# biases about 0.02 in size), whole-model L2 2.5e-4; the tolerances leave 3-7x of margin.
BF16_LOSS_RTOL = 5e-4
BF16_WEIGHT_RTOL = 5e-2
BF16_L2_RTOL = 1e-3
WEIGHT_FLOOR = 1e-3  # the metric's floor for |b|_inf (a tensor of zeros)


# ------------------------------------------------------------------------------------ data
MASK64 = (1 << 64) - 1


def mix64(x):
    """SplitMix64's finaliser, as src/data/sampler.cpp mix64."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class Sampler:
    """zerotrain's DistributedSampler::batch: optimizer step s (0-based, as the trainer passes it),
    micro-step a, rank r takes global samples g = a·W·M + r·M + i, window start
    mix(mix(mix(seed) ^ s) ^ g) mod (n_tokens - seq_len)."""

    def __init__(self, tokens, seq_len, micro_batch, world, rank, seed):
        self.tokens, self.seq_len, self.micro, self.world, self.rank, self.seed = tokens, seq_len, micro_batch, world, rank, seed

    def start(self, step, g):
        h = mix64(mix64(mix64(self.seed) ^ step) ^ g)
        return h % (len(self.tokens) - self.seq_len)

    def batch(self, step, micro_step):
        base = micro_step * self.world * self.micro + self.rank * self.micro
        rows = [self.tokens[s:s + self.seq_len + 1] for s in (self.start(step, base + i) for i in range(self.micro))]
        w = torch.stack(rows).long()
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def read_tokens(path):
    """A nanoGPT .bin file: headerless little-endian uint16 tokens."""
    with open(path, "rb") as f:
        blob = f.read()
    return torch.frombuffer(bytearray(blob), dtype=torch.int16).to(torch.int32) & 0xFFFF


def corpus_tokens(n):
    """Deterministic English-like byte text (a fixed LCG over a small word list): learnable enough
    that ten steps move the loss, unlike uniform random tokens."""
    words = ("the a one two three cat dog sat ran on under over mat log red blue big small and then it "
             "was is saw sees plus minus equals four five six seven eight nine ten").split()
    out, state = bytearray(), 12345
    while len(out) < n:
        state = (state * 6364136223846793005 + 1442695040888963407) & MASK64
        out += words[(state >> 33) % len(words)].encode()
        out += b". " if (state >> 20) % 9 == 0 else b" "
    return bytes(out[:n])


# ------------------------------------------------------------------------------------ cases
def case_matrix():
    cases = []
    for optimizer in ("AdamW", "Lamb"):
        for precision in ("fp32", "bf16"):
            for stage in (0, 1, 2, 3):
                case = {"name": f"s{stage}-{precision}-{optimizer.lower()}", "stage": stage,
                        "precision": precision, "optimizer": optimizer}
                if optimizer == "Lamb" and stage > 0:
                    # DeepSpeed's ZeRO hands its optimizer one flat fp32 partition per rank, so its
                    # LAMB trust ratios are per partition, not per tensor; without ZeRO they are per
                    # tensor, as zerotrain's at every stage. Stage 0 is the reference.
                    case["reference"] = f"s0-{precision}-lamb"
                cases.append(case)
    # Parameter groups, no weight decay on biases and norms (the usual recipe): the command line has
    # no groups, so these run under DeepSpeed and under zerotrain's Python package only.
    for stage in (0, 1, 3):
        cases.append({"name": f"s{stage}-fp32-adamw-groups", "stage": stage, "precision": "fp32",
                      "optimizer": "AdamW", "groups": "no_decay_bias_norm", "python_only": True})
    return cases


def parameter_groups(model, kind):
    """DeepSpeed's model_parameters for the case's groups."""
    if kind != "no_decay_bias_norm":
        raise ValueError(f"unknown parameter groups {kind!r}")
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or p.dim() == 1 else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def write_config(d, case, paths):
    if case["optimizer"] == "AdamW":
        opt = {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    else:
        opt = {"type": "Lamb", "params": {"lr": 2e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                          "bias_correction": True, "min_coeff": 0.01, "max_coeff": 10.0}}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        # Binding: the tiny GPT's gradient norm is above this at every one of the ten steps
        # (the table's "clipped" column counts the steps it bound, from zerotrain's log).
        "gradient_clipping": 0.5,
        "steps_per_print": STEPS,
        "optimizer": opt,
        "zero_optimization": {"stage": case["stage"]},
        "bf16": {"enabled": case["precision"] == "bf16"},
        "csv_monitor": {"enabled": True, "output_path": os.path.join(d, "zerotrain"), "job_name": "zerotrain"},
        "model": {"preset": "tiny"},
        "data": {"source": "bin", "path": paths["train"], "val_path": paths["val"], "sequence_length": 64},
        # bf16 is compared with DeepSpeed's bf16 on every CPU, also those without 16-bit units
        # (where zerotrain would otherwise train in fp32, docs/memory.md).
        "train": {"steps": STEPS, "seed": SEED, "threads": 1, "log_dir": os.path.join(d, "zerotrain"),
                  "cpu_half_precision": "always"},
    }
    path = os.path.join(d, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def cmd_prepare(a):
    os.makedirs(a.dir, exist_ok=True)
    paths = {"train": os.path.join(a.dir, "train.bin"), "val": os.path.join(a.dir, "val.bin")}
    text = corpus_tokens(40000)
    # nanoGPT's layout: headerless little-endian uint16, one per token (a byte is a token).
    for key, chunk in (("train", text[:32000]), ("val", text[32000:])):
        with open(paths[key], "wb") as f:
            f.write(torch.tensor(list(chunk), dtype=torch.int16).numpy().tobytes())
    cases = case_matrix()
    for c in cases:
        c["dir"] = os.path.join(a.dir, c["name"])
        os.makedirs(c["dir"], exist_ok=True)
        c["config"] = write_config(c["dir"], c, paths)
    # The initial weights: one configuration (fp32 stage 0; the weights a configuration starts from
    # depend only on the model and train.seed) for `zerotrain export --init`.
    init = {"name": "init", "stage": 0, "precision": "fp32", "optimizer": "AdamW", "dir": os.path.join(a.dir, "init")}
    os.makedirs(init["dir"], exist_ok=True)
    init["config"] = write_config(init["dir"], init, paths)
    with open(os.path.join(a.dir, "cases.json"), "w") as f:
        json.dump({"cases": cases, "init": init}, f, indent=2)
    print("\n".join(c["name"] for c in cases))


# ------------------------------------------------------------------------------------ LAMB
class FusedLambReference(torch.optim.Optimizer):
    """DeepSpeed's FusedLamb (deepspeed/ops/lamb/fused_lamb.py, csrc/lamb/fused_lamb_cuda_kernel.cu)
    transcribed to PyTorch, because its op is CUDA-only: DeepSpeed's CPU accelerator gives
    FusedLambBuilder a NotImplementedBuilder. Per tensor handed to it:
      g' = g / combined_scale   (combined_scale = scale, times clip when max_grad_norm > 0 binds)
      m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'²
      u = m / (sqrt(v) + eps) + wd·p            (eps_inside_sqrt False: eps_mode 1)
      coeff = clamp(‖p‖/‖u‖, min_coeff, max_coeff), or 1 when either norm is 0
      p -= step_size·coeff·u,  step_size = lr·sqrt(1-b2^t)/(1-b1^t) (lr without bias correction),
    the constants in float as the kernel's host code computes them."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
                 weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01, amsgrad=False):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1

    @torch.no_grad()
    def step(self, closure=None, scale=1.0, grad_norms=None):
        f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))
        for gi, group in enumerate(self.param_groups):
            b1, b2 = group["betas"]
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                combined_scale = scale
                if group["max_grad_norm"] > 0:
                    norm = grad_norms[gi] if grad_norms is not None else None
                    clip = ((norm / scale) + 1e-6) / group["max_grad_norm"]
                    if clip > 1:
                        combined_scale = clip * scale
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.float() / f32(combined_scale)
                m.mul_(f32(b1)).add_(g * f32(1 - f32(b1)))
                v.mul_(f32(b2)).add_(g * g * f32(1 - f32(b2)))
                denom = (v + group["eps"]).sqrt() if self.eps_mode == 0 else v.sqrt() + f32(group["eps"])
                pf = p.float()
                update = m / denom + f32(group["weight_decay"]) * pf
                # The kernel's sums of squares are fp32 block reductions; double here (the order differs anyway).
                w = math.sqrt(float(pf.double().pow(2).sum()))
                u = math.sqrt(float(update.double().pow(2).sum()))
                coeff = 1.0
                if w != 0 and u != 0:
                    coeff = min(max(f32(w) / f32(u), group["min_coeff"]), group["max_coeff"])
                if group["bias_correction"]:
                    bc1 = f32(1 - math.pow(f32(b1), t))
                    bc2 = f32(1 - math.pow(f32(b2), t))
                    step_size = f32(f32(group["lr"]) * math.sqrt(bc2) / bc1)
                else:
                    step_size = f32(group["lr"])
                p.copy_((pf - f32(step_size * f32(coeff)) * update).to(p.dtype))
        return None


# ------------------------------------------------------------------------------------ DeepSpeed
def fp32_masters(engine, model):
    """The final fp32 master weights by zerotrain's names, whatever wrapper DeepSpeed chose."""
    from deepspeed.utils import safe_get_full_fp32_param

    opt = engine.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    if hasattr(opt, "fp32_groups_flat") and hasattr(opt, "fp16_groups"):  # FP16_Optimizer (bf16, stage 0)
        for flat, group in zip(opt.fp32_groups_flat, opt.fp16_groups):
            off = 0
            for p in group:
                out[names[id(p)]] = flat.detach()[off:off + p.numel()].view(p.shape).clone()
                off += p.numel()
        return out
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups") and not hasattr(opt, "bf16_groups"):
        for fg, lg in zip(opt.fp32_groups, opt.fp16_groups):  # FP16_UnfusedOptimizer
            for f, p in zip(fg, lg):
                out[names[id(p)]] = f.detach().clone()
        return out
    for n, p in model.named_parameters():
        full = safe_get_full_fp32_param(p)  # ZeRO 1-3 and BF16_Optimizer (a collective at stage 3)
        if full is None:
            full = p.detach()
            if full.dtype != torch.float32:
                raise RuntimeError(f"no fp32 master found for {n} under {type(opt).__name__}")
        out[n] = full.detach().float().clone()
    return out


def set_fp32_masters(engine, model, weights):
    """Sets DeepSpeed's fp32 master weights to the fp32 initial values (bf16 runs): DeepSpeed casts
    the model to bf16 before its optimizer copies the masters, so they would start from the bf16
    rounding of the initial weights, zerotrain's from the weights themselves."""
    from deepspeed.utils import safe_set_full_fp32_param

    opt = engine.optimizer
    if hasattr(opt, "fp32_groups_flat") and hasattr(opt, "fp16_groups"):
        for flat, group in zip(opt.fp32_groups_flat, opt.fp16_groups):
            off = 0
            for p in group:
                n = [k for k, q in model.named_parameters() if q is p][0]
                flat.data[off:off + p.numel()].copy_(weights[n].reshape(-1))
                off += p.numel()
        return "FP16_Optimizer.fp32_groups_flat"
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups") and not hasattr(opt, "bf16_groups"):
        named = {id(q): k for k, q in model.named_parameters()}
        for fg, lg in zip(opt.fp32_groups, opt.fp16_groups):
            for f, p in zip(fg, lg):
                f.data.copy_(weights[named[id(p)]])
        return "FP16_UnfusedOptimizer.fp32_groups"
    for n, p in model.named_parameters():
        safe_set_full_fp32_param(p, weights[n].clone())
    return "safe_set_full_fp32_param"


def load_initial_weights(model, path):
    """zerotrain's initial weights: a Hugging Face GPT-2 directory (`zerotrain export --init --format
    hf`) or a safetensors file by zerotrain's names (`zerotrain export` of a checkpoint)."""
    if os.path.isdir(path):
        load_hf_gpt2_weights(model, path)
    else:
        load_zerotrain_weights(model, path)


def undo_construction_step(engine):
    """DeepSpeed's stage-0 16-bit wrappers (FP16_Optimizer, FP16_UnfusedOptimizer: bf16 without
    ZeRO) take one optimizer step with zero gradients when they are built (initialize_optimizer_states)
    to create the optimizer's state: the step count starts at 1, so bias correction runs one step
    ahead for the whole run, and weight decay shrinks the masters once before training. zerotrain
    does neither. The step count goes back to 0 here (the moments are still zero) and the masters
    are set afterwards (set_fp32_masters), so that what is compared is the training itself."""
    opt = engine.optimizer
    if type(opt).__name__ not in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
        return False
    for state in opt.optimizer.state.values():
        if "step" not in state:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state and bool(state[key].abs().max() != 0):
                raise RuntimeError(f"{type(opt).__name__}: {key} is not zero after construction")
        if int(state["step"]) != 1:
            raise RuntimeError(f"{type(opt).__name__}: step {state['step']} after construction, expected 1")
        state["step"] = 0 if not torch.is_tensor(state["step"]) else torch.zeros_like(state["step"])
    for group in opt.optimizer.param_groups:
        if "step" in group:
            group["step"] = 0
    return True


# Which front end runs DeepSpeed's side: DeepSpeed itself, or zerotrain's Python package standing in
# for it (zerotrain.install_as_deepspeed(): every `import deepspeed` below then gets zerotrain).
FRONTS = {"deepspeed": ("deepspeed.json", "deepspeed_weights.pt"), "python": ("python.json", "python_weights.pt")}
FRONT = "deepspeed"


def train_steps(engine, sampler, accum, world, before_step=None):
    """STEPS optimizer steps of `accum` micro-steps through a DeepSpeed-style engine; the losses
    as the command line reports them (the mean over micro-steps and ranks, in double) and the
    gradient norms."""
    losses, norms = [], []
    for step in range(STEPS):
        if before_step is not None:
            before_step(step)
        loss_sum = 0.0
        for a in range(accum):
            x, y = sampler.batch(step, a)
            loss = engine(x, y)
            loss_sum += float(loss.item())
            engine.backward(loss)
            engine.step()
        mean = torch.tensor([loss_sum / accum], dtype=torch.float64)
        torch.distributed.all_reduce(mean)
        losses.append(float(mean.item()) / world)
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else None)
    return losses, norms


def run_case(case, init_path, rank, world):
    import deepspeed

    with open(case["config"]) as f:
        config = json.load(f)
    preset = config["model"]["preset"]
    seq = config["data"]["sequence_length"] or PRESETS[preset][1]
    micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    tokens = read_tokens(config["data"]["path"])
    sampler = Sampler(tokens, seq, micro, world, rank, config["train"]["seed"])

    model = GPT(preset)
    load_initial_weights(model, init_path)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer, ds_config, note = None, case["config"], "optimizer from the configuration file"
    if config["optimizer"]["type"] == "Lamb":
        try:  # DeepSpeed's own, where its op loads
            from deepspeed.ops.lamb import FusedLamb

            FusedLamb([torch.nn.Parameter(torch.zeros(1))])
        except Exception as e:  # the CPU accelerator: "This op had not been implemented on CPU backend."
            # The same hyperparameters go to the transcription, handed to DeepSpeed as a client
            # optimizer (DeepSpeed then needs zero_allow_untested_optimizer).
            ds_config = dict(config)
            params = dict(ds_config.pop("optimizer")["params"])
            ds_config["zero_allow_untested_optimizer"] = True
            optimizer = FusedLambReference(model.parameters(), **params)
            note = f"FusedLamb unavailable ({type(e).__name__}: {e}); its transcription as a client optimizer"
    model_parameters = parameter_groups(model, case["groups"]) if case.get("groups") else model.parameters()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model_parameters, optimizer=optimizer,
                                           config=ds_config)
    masters_from, undone = "", False
    if os.environ.get("ZT_ORACLE_RAW") != "1":  # 1: DeepSpeed exactly as it runs by default
        undone = undo_construction_step(engine)
        if config.get("bf16", {}).get("enabled"):
            masters_from = set_fp32_masters(engine, model, initial)
    t0 = time.time()
    losses, norms = train_steps(engine, sampler, accum, world)
    seconds = time.time() - t0
    weights = fp32_masters(engine, model)
    if rank == 0:
        torch.save(weights, os.path.join(case["dir"], FRONTS[FRONT][1]))
        with open(os.path.join(case["dir"], FRONTS[FRONT][0]), "w") as f:
            json.dump({"losses": losses, "grad_norms": norms, "seconds": seconds, "optimizer": type(engine.optimizer).__name__,
                       "basic_optimizer": type(engine.basic_optimizer).__name__, "note": note,
                       "masters_set_by": masters_from, "construction_step_undone": undone}, f, indent=2)
        print(f"{FRONT} {case['name']}: {type(engine.optimizer).__name__} over {type(engine.basic_optimizer).__name__}, "
              f"{seconds:.1f} s, losses {' '.join(f'{l:.6f}' for l in losses)}", flush=True)
    engine.destroy() if hasattr(engine, "destroy") else None
    del engine, model, optimizer


def cmd_deepspeed(a):
    global FRONT
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    FRONT = a.front
    if FRONT == "python":
        import zerotrain

        zerotrain.install_as_deepspeed()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with open(os.path.join(a.dir, "cases.json")) as f:
        spec = json.load(f)
    with open(os.path.join(spec["init"]["dir"], "weights")) as f:
        init_path = f.read().strip()
    chosen = selected(spec, a.only)
    needed = {c["name"] for c in chosen} | {c["reference"] for c in chosen if "reference" in c}
    for case in spec["cases"]:
        if case["name"] in needed:
            run_case(case, init_path, rank, world)
        torch.distributed.barrier()
    if FRONT == "deepspeed":
        # DeepSpeed leaves its Gloo group alive, and torch's teardown of a live Gloo group at
        # interpreter exit sometimes aborts a process that has finished: the script ends it, as
        # torch asks. (zerotrain's package does the same at exit on its own.)
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------ C++ GPT from Python
def cmd_cpp_python(a):
    """The command line's training of each case again, from a Python loop: zerotrain.models.GPT (the
    C++ GPT the command line trains) through zerotrain.initialize, on the same batches, with the
    command line's per-step dropout seeds; D/<case>/cpp_python.json."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import zerotrain

    zerotrain.init_distributed()
    rank, world = zerotrain.comm.get_rank(), zerotrain.comm.get_world_size()
    with open(os.path.join(a.dir, "cases.json")) as f:
        spec = json.load(f)
    for case in selected(spec, a.only):
        if case.get("python_only"):
            continue
        with open(case["config"]) as f:
            config = json.load(f)
        seq, seed = config["data"]["sequence_length"], config["train"]["seed"]
        micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
        sampler = Sampler(read_tokens(config["data"]["path"]), seq, micro, world, rank, seed)
        model = zerotrain.models.GPT(config)
        engine, _, _, _ = zerotrain.initialize(model=model, config=config)
        # The command line's dropout seeds, set before each step.
        losses, _ = train_steps(engine, sampler, accum, world,
                                before_step=lambda step: torch.manual_seed(seed + 1000003 * (rank + 1) + 7919 * step))
        if rank == 0:
            with open(os.path.join(case["dir"], "cpp_python.json"), "w") as f:
                json.dump({"losses": losses}, f)
        engine.destroy()
        torch.distributed.barrier()


def cmd_compare_cpp_python(a):
    """Bit for bit: the Python loop's losses against the command line's summary, every case."""
    with open(os.path.join(a.dir, "cases.json")) as f:
        spec = json.load(f)
    failed, n = [], 0
    for case in selected(spec, a.only):
        if case.get("python_only"):
            continue
        n += 1
        try:
            with open(os.path.join(case["dir"], "summary.json")) as f:
                cli = json.load(f)["losses"]
            with open(os.path.join(case["dir"], "cpp_python.json")) as f:
                py = json.load(f)["losses"]
        except (OSError, ValueError, KeyError) as e:
            failed.append(f"{case['name']}: missing output ({e})")
            continue
        if cli != py:
            worst = max(abs(x - y) / abs(y) for x, y in zip(py, cli)) if len(cli) == len(py) else math.inf
            failed.append(f"{case['name']}: losses differ (at most {worst:.2e} relative)")
    for f in failed:
        print(f"  FAIL {f}")
    print(f"C++ GPT from Python against the command line: {n - len(failed)} of {n} cases with bitwise equal losses")
    return 1 if failed else 0


# ------------------------------------------------------------------------------------ compare
def selected(spec, only):
    names = [n for n in only.split(",") if n] if only else None
    return [c for c in spec["cases"] if names is None or c["name"] in names]


def key_bias_mask(name, t):
    """True on the elements of the weight metric: all but the key third of attn.c_attn.bias. A key
    bias adds q·b_k to every score of a query, which softmax cancels: its gradient is zero in exact
    arithmetic, and what training does to it is Adam or LAMB applied to rounding noise (|g| ~ 1e-11
    here, normalised by sqrt(v)), different in any two runs that round differently. Reported apart."""
    keep = torch.ones_like(t, dtype=torch.bool)
    if name.endswith("attn.c_attn.bias"):
        c = t.numel() // 3
        keep[c:2 * c] = False
    return keep


def weight_metrics(zw, dw):
    """(per-tensor metric, worst tensor, whole-model L2 metric, key-bias max |a-b|), b DeepSpeed's
    fp32 master weights, a zerotrain's, the key biases left out of both metrics:
      per tensor: max over tensors of |a-b|_inf / max(|b|_inf, WEIGHT_FLOOR)
      L2:         |a-b|_2 / |b|_2 over all the weights together."""
    if set(zw) != set(dw):
        return math.inf, f"names differ: {sorted(set(zw) ^ set(dw))}", math.inf, math.inf
    worst, where, kb, num, den = 0.0, "", 0.0, 0.0, 0.0
    for n in dw:
        a, b = zw[n].double(), dw[n].double()
        if a.shape != b.shape:
            return math.inf, f"{n}: shapes {tuple(a.shape)} and {tuple(b.shape)}", math.inf, math.inf
        keep = key_bias_mask(n, b)
        diff = (a - b).abs()
        r = float(diff[keep].max()) / max(float(b[keep].abs().max()), WEIGHT_FLOOR)
        if r > worst:
            worst, where = r, n
        num += float((diff[keep] ** 2).sum())
        den += float((b[keep] ** 2).sum())
        if not bool(keep.all()):
            kb = max(kb, float(diff[~keep].max()))
    return worst, where, math.sqrt(num / den), kb


def load_ds(d, front="deepspeed"):
    with open(os.path.join(d, FRONTS[front][0])) as f:
        ds = json.load(f)
    return ds, torch.load(os.path.join(d, FRONTS[front][1]))


def cmd_compare(a):
    with open(os.path.join(a.dir, "cases.json")) as f:
        spec = json.load(f)
    by_name = {c["name"]: c for c in spec["cases"]}
    cases = [c for c in selected(spec, a.only) if a.front == "python" or not c.get("python_only")]
    print(f"{'case':<14} {'DeepSpeed run (wrapper)':<44} {'loss':>8} {'weights':>8} {'L2':>8} "
          f"{'tolerances':>16} {'k-bias':>7} {'clipped':>7}  result")
    failed, rows = 0, []
    for case in cases:
        d = case["dir"]
        ref = by_name.get(case.get("reference", case["name"]), case)
        try:
            if a.front == "python":  # zerotrain's side: the Python front end over the same script
                zt, zw = load_ds(d, "python")
            else:
                with open(os.path.join(d, "summary.json")) as f:
                    zt = json.load(f)
                zw = read_safetensors(os.path.join(d, "final.safetensors"))
            ds, dw = load_ds(ref["dir"])
        except (OSError, ValueError, RuntimeError) as e:
            print(f"{case['name']:<14} missing output: {e}")
            failed += 1
            continue
        zl, dl = zt["losses"], ds["losses"]
        loss_diff = max(abs(x - y) / abs(y) for x, y in zip(zl, dl)) if len(zl) == len(dl) == STEPS else math.inf
        weight_diff, worst, l2, kb = weight_metrics(zw, dw)
        clipped = "?"
        csv_path = os.path.join(d, "zerotrain", "zerotrain.csv")
        if a.front == "python":
            with open(case["config"]) as f:
                clip = json.load(f)["gradient_clipping"]
            norms = [n for n in zt["grad_norms"] if n is not None]
            clipped = f"{sum(n > clip for n in norms)}/{len(norms)}"
        elif os.path.exists(csv_path):
            with open(csv_path) as f:
                norms = [float(line.split(",")[3]) for line in f.read().splitlines()[1:]]
            with open(case["config"]) as f:
                clip = json.load(f)["gradient_clipping"]
            clipped = f"{sum(n > clip for n in norms)}/{len(norms)}"
        bf16 = case["precision"] == "bf16"
        lt, wt, l2t = (BF16_LOSS_RTOL, BF16_WEIGHT_RTOL, BF16_L2_RTOL) if bf16 else \
            (FP32_LOSS_RTOL, FP32_WEIGHT_RTOL, FP32_L2_RTOL)
        ok = loss_diff <= lt and weight_diff <= wt and l2 <= l2t
        failed += 0 if ok else 1
        what = f"{ref['name']} ({ds.get('optimizer')})"
        row = {"case": case["name"], "reference": ref["name"], "deepspeed_optimizer": ds.get("optimizer"),
               "deepspeed_basic_optimizer": ds.get("basic_optimizer"), "deepspeed_note": ds.get("note", ""), "loss_rel_diff": loss_diff,
               "weight_diff": weight_diff, "worst_tensor": worst, "weight_l2_diff": l2, "key_bias_abs_diff": kb,
               "clipped": clipped, "loss_tolerance": lt, "weight_tolerance": wt, "l2_tolerance": l2t, "pass": ok, "zerotrain_losses": zl, "deepspeed_losses": dl}
        if a.front == "python" and os.path.exists(os.path.join(d, "summary.json")):
            with open(os.path.join(d, "summary.json")) as f:  # the same training by the command line
                cli = json.load(f)["losses"]
            row["cli_loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(zl, cli))
        if ref is not case and os.path.exists(os.path.join(d, "deepspeed.json")):
            # DeepSpeed at the same stage, for the record (its LAMB sees flat partitions there).
            same, same_w = load_ds(d)
            row["same_stage_loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(zl, same["losses"]))
            row["same_stage_weight_diff"] = weight_metrics(zw, same_w)[0]
        rows.append(row)
        print(f"{case['name']:<14} {what:<44} {loss_diff:8.1e} {weight_diff:8.1e} {l2:8.1e} "
              f"{lt:.0e}/{wt:.0e}/{l2t:.0e} {kb:7.0e} {clipped:>7}  {'pass' if ok else 'FAIL'}")
    for row in rows:
        if "same_stage_loss_rel_diff" in row:
            print(f"  note {row['case']}: against DeepSpeed at its own stage (LAMB over each rank's flat fp32 "
                  f"partition, not per tensor) the loss differs by {row['same_stage_loss_rel_diff']:.2e} and the "
                  f"weights by {row['same_stage_weight_diff']:.2e}: a deliberate difference (docs/deepspeed_oracle.md)")
    notes = sorted({r["deepspeed_note"] for r in rows if r["case"].endswith("lamb")})
    for n in notes:
        print(f"  note: DeepSpeed's LAMB: {n}")
    if a.front == "python":
        worst = max((r["cli_loss_rel_diff"] for r in rows if "cli_loss_rel_diff" in r), default=None)
        if worst is not None:
            print(f"  note: zerotrain from Python against the zerotrain command line on the same cases (the "
                  f"oracle's Python GPT against the C++ GPT): losses differ by at most {worst:.2e} (relative)")
    with open(os.path.join(a.dir, "results.json" if a.front == "cli" else "results_python.json"), "w") as f:
        json.dump(rows, f, indent=2)
    side = "zerotrain" if a.front == "cli" else "zerotrain from Python (import zerotrain as deepspeed)"
    print(f"DeepSpeed oracle, {side}: {len(cases) - failed} of {len(cases)} cases within tolerance")
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "deepspeed", "compare", "cpp-python", "compare-cpp-python"):
        s = sub.add_parser(name)
        s.add_argument("--dir", required=True)
        if name != "prepare":
            s.add_argument("--only", default="", help="comma-separated case names")
        if name == "deepspeed":
            s.add_argument("--front", choices=("deepspeed", "python"), default="deepspeed",
                           help="python: zerotrain's Python package stands in for DeepSpeed")
        if name == "compare":
            s.add_argument("--front", choices=("cli", "python"), default="cli",
                           help="which zerotrain side to compare with DeepSpeed: the command line or the Python package")
    a = p.parse_args()
    return {"prepare": cmd_prepare, "deepspeed": cmd_deepspeed, "compare": cmd_compare, "cpp-python": cmd_cpp_python,
            "compare-cpp-python": cmd_compare_cpp_python}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
