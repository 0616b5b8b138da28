#!/usr/bin/env bash
# DeepSpeed as the numerical oracle (docs/deepspeed_oracle.md): installs DeepSpeed (pinned, with
# its CPU accelerator: bench/deepspeed_env.sh), trains the tiny GPT for 10 steps on 2 CPU ranks over
# Gloo in zerotrain and in DeepSpeed from the same initial weights, on the same batches, with the
# same configuration file, over the matrix ZeRO stage 0-3 x fp32/bf16 x AdamW/LAMB (gradient
# clipping that binds, 2 accumulation steps), and compares per-step losses and final weights.
#
# Prints one table row per case and exits 1 when a case is out of tolerance or a run fails. When
# DeepSpeed cannot be installed it prints one line saying the tier did not run and why, and exits 0
# (the caller decides what that means).
#   ZT_BIN       the zerotrain CLI (default build/bin/zerotrain; it must be built)
#   ZT_PYTHON_DIR the built Python package (default build/python): DeepSpeed's side of the oracle
#                runs a second time with it standing in for DeepSpeed, compared the same way
#   ZT_ORACLE_DIR where the runs go (default build/oracle; emptied first)
#   ZT_ORACLE_CASES  comma-separated case names to run (default: all 16)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
root=$(pwd)
zt=${ZT_BIN:-$root/build/bin/zerotrain}
py_dir=${ZT_PYTHON_DIR:-$root/build/python}  # the built Python package (zerotrain/ and its extension)
out=${ZT_ORACLE_DIR:-$root/build/oracle}
only=${ZT_ORACLE_CASES:-}
oracle=tests/oracle/deepspeed_oracle.py
t_start=$SECONDS

if [ ! -x "$zt" ]; then
  echo "DeepSpeed oracle: FAILED: the zerotrain CLI is not built ($zt)"
  exit 1
fi
rm -rf "$out"
mkdir -p "$out"

source bench/deepspeed_env.sh
if ! ds_install fused_adam >"$out/install.log" 2>&1; then
  echo "DeepSpeed oracle: did not run: DeepSpeed $ds_version could not be installed ($(grep -v '^\s*$' "$out/install.log" | tail -1 | cut -c1-200); full log: $out/install.log)"
  exit 0
fi
ds_env
echo "DeepSpeed oracle: DeepSpeed $ds_version (CPU accelerator, Gloo) installed in $ds_dir ($((SECONDS - t_start)) s)"

fail() { echo "DeepSpeed oracle: FAILED: $*"; exit 1; }

python3 "$oracle" prepare --dir "$out" >/dev/null || fail "could not write the cases"
cases=$(python3 -c "import json,sys; print(' '.join(c['name'] for c in json.load(open(sys.argv[1]))['cases']))" "$out/cases.json")
if [ -n "$only" ]; then cases=$(tr ',' ' ' <<<"$only"); fi
# The cases the command line can run (parameter groups are the Python package's and DeepSpeed's).
cli_cases=$(python3 -c "import json,sys
only = set(sys.argv[2].split())
print(' '.join(c['name'] for c in json.load(open(sys.argv[1]))['cases'] if c['name'] in only and not c.get('python_only')))" \
  "$out/cases.json" "$cases")

# The initial weights, written by zerotrain: the weights the configuration starts from, in the
# Hugging Face GPT-2 layout (Conv1D weights transposed; the oracle maps the names back). Every case
# starts from them: they depend only on the model and train.seed, which all cases share.
init_dir="$out/init"
"$zt" export --init "$init_dir/config.json" --format hf --out "$init_dir/hf" >"$init_dir/export.log" 2>&1 ||
  fail "zerotrain export --init (see $init_dir/export.log)"
echo "$init_dir/hf" >"$init_dir/weights"

t0=$SECONDS
for c in $cli_cases; do
  d="$out/$c"
  [ -f "$d/config.json" ] || fail "no case named $c"
  if ! "$zt" train "$d/config.json" --nproc 2 --steps 10 --summary "$d/summary.json" --save-dir "$d/ckpt" \
    >"$d/zerotrain.log" 2>&1; then
    echo "zerotrain $c: training failed (see $d/zerotrain.log)"
    continue
  fi
  "$zt" export "$d/ckpt" --out "$d/final.safetensors" >"$d/export.log" 2>&1 || echo "zerotrain $c: export failed"
done
echo "DeepSpeed oracle: zerotrain ran $(wc -w <<<"$cli_cases") cases in $((SECONDS - t0)) s"

t0=$SECONDS
port=$((29500 + RANDOM % 2000))
python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$port" \
  "$oracle" deepspeed --dir "$out" --only "$(tr ' ' ',' <<<"$cases")" >"$out/deepspeed.log" 2>&1 ||
  echo "DeepSpeed oracle: the DeepSpeed runs failed (see $out/deepspeed.log)"
echo "DeepSpeed oracle: DeepSpeed ran $(wc -w <<<"$cases") cases in $((SECONDS - t0)) s (one process per rank for all)"

python3 "$oracle" compare --dir "$out" --only "$(tr ' ' ',' <<<"$cases")"
rc=$?

# DeepSpeed's side of the oracle again, unchanged, with zerotrain's Python package standing in for
# DeepSpeed (zerotrain.install_as_deepspeed()): the same script on zerotrain's engine, compared
# with DeepSpeed's results above.
t0=$SECONDS
if [ ! -f "$py_dir/zerotrain/__init__.py" ]; then
  echo "DeepSpeed oracle: FAILED: the Python package is not built ($py_dir/zerotrain)"
  exit 1
fi
port=$((29500 + RANDOM % 2000))
PYTHONPATH="$py_dir:$PYTHONPATH" python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \
  --master_port "$port" "$oracle" deepspeed --front python --dir "$out" --only "$(tr ' ' ',' <<<"$cases")" \
  >"$out/python.log" 2>&1 || echo "DeepSpeed oracle: the runs of zerotrain from Python failed (see $out/python.log)"
echo "DeepSpeed oracle: zerotrain from Python ran $(wc -w <<<"$cases") cases in $((SECONDS - t0)) s"
python3 "$oracle" compare --front python --dir "$out" --only "$(tr ' ' ',' <<<"$cases")" || rc=1

# The command line's own training once more, from a Python loop over zerotrain.models.GPT (the same
# C++ GPT) through the Python package: the losses must equal the command line's bit for bit.
port=$((29500 + RANDOM % 2000))
PYTHONPATH="$py_dir:$PYTHONPATH" python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \
  --master_port "$port" "$oracle" cpp-python --dir "$out" --only "$(tr ' ' ',' <<<"$cli_cases")" \
  >"$out/cpp_python.log" 2>&1 || echo "DeepSpeed oracle: the C++ GPT's runs from Python failed (see $out/cpp_python.log)"
python3 "$oracle" compare-cpp-python --dir "$out" --only "$(tr ' ' ',' <<<"$cli_cases")" || rc=1
# The Hugging Face Trainer, Accelerate and TRL, unchanged, on DeepSpeed and on zerotrain through its
# companion distribution (python/deepspeed-companion), compared (tests/oracle/hf_clients.py).
t0=$SECONDS
if ! hf_path=$(scripts/python_deps.sh 2>"$out/hf-install.log" | tail -n 1); then
  echo "DeepSpeed oracle: the Hugging Face clients did not run: transformers, Accelerate and TRL could not be installed (see $out/hf-install.log)"
  rc=1
elif ! python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$out/companion" \
    python/deepspeed-companion >"$out/companion-install.log" 2>&1; then
  echo "DeepSpeed oracle: the Hugging Face clients did not run: the companion distribution did not install (see $out/companion-install.log)"
  rc=1
else
  hf_site=${hf_path%%:*}
  python3 tests/oracle/hf_clients.py --out "$out/hf-clients" \
    --deepspeed-path "$hf_site:$ds_dir/site:$ds_torch_dir" \
    --zerotrain-path "$out/companion:$py_dir:$hf_site:$ds_torch_dir:${ZT_DEPS_DIR:-$HOME/.cache/zerotrain}/python-tools" || rc=1
  echo "DeepSpeed oracle: the Hugging Face clients took $((SECONDS - t0)) s"
fi
echo "DeepSpeed oracle: $((SECONDS - t_start)) s in all; details in $out"
exit $rc
