// Test helpers for the tests that compare with Hugging Face transformers, installed pinned by
// scripts/python_deps.sh beside the torch wheel (ZT_HF_PYTHONPATH): whether it imports, and
// running a Python script of tests/support with it.
#pragma once
#include <chrono>
#include <string>
#include <vector>

#include "support/process.h"

namespace zt::testing {

// The PYTHONPATH that holds the pinned transformers (ZT_HF_PYTHONPATH from the environment,
// else the build's).
std::string hf_pythonpath();

// Empty when transformers imports; otherwise why not, for GTEST_SKIP's message.
const std::string& transformers_problem();

// Runs tests/support/<script> with `args` under that PYTHONPATH, offline and quiet.
ProcessResult run_transformers_script(const std::string& script, const std::vector<std::string>& args,
                                      std::chrono::seconds timeout = std::chrono::seconds(180));

// Writes DIR/tokens.bin: 4096 seeded byte-valued tokens (below every tiny test model's vocabulary
// of 256) as a raw uint16 (nanoGPT) file, the first-step batches both sides of a comparison read.
// Returns its path.
std::string write_byte_token_file(const std::string& dir);

}  // namespace zt::testing

#define REQUIRE_TRANSFORMERS()                                                                                  \
  do {                                                                                                          \
    if (!zt::testing::transformers_problem().empty()) GTEST_SKIP() << zt::testing::transformers_problem(); \
  } while (0)
