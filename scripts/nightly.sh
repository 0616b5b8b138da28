#!/usr/bin/env bash
# What does not fit the per-change run (scripts/test.sh) on a 2-core machine: zerotrain's own code
# built with ASan + UBSan (build-asan) running the unit tests and the multi-rank test binaries,
# and ten minutes of fuzzing per target. Run it daily and before a release; any sanitizer report
# or fuzzer finding fails it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh

stamp "sanitizers (ASan + UBSan)"
ZT_SANITIZE_TESTS=${ZT_SANITIZE_TESTS:-"layout_test config_test lr_schedule_test loss_scaler_test safetensors_test \
optim_kernels_test engine_test flight_recorder_test checkpoint_test zero_test comm_test"} scripts/sanitize.sh

stamp "fuzzing (${ZT_FUZZ_SECONDS:=600} s per target)"
ZT_FUZZ_SECONDS=$ZT_FUZZ_SECONDS scripts/fuzz.sh
stamp "done"
