#include "support/transformers.h"

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <random>

namespace zt::testing {

std::string hf_pythonpath() {
  const char* env = std::getenv("ZT_HF_PYTHONPATH");
  return env && *env ? env : ZT_HF_PYTHONPATH;
}

const std::string& transformers_problem() {
  static const std::string problem = [] {
    auto r = run_process({"/usr/bin/env", "python3", "-c", "import transformers; from transformers import GPT2LMHeadModel"},
                         {{"PYTHONPATH", hf_pythonpath()}, {"PYTHONNOUSERSITE", "1"}, {"HF_HUB_OFFLINE", "1"}},
                         std::chrono::seconds(120));
    if (r.exit_code == 0) return std::string();
    std::string tail = r.output.size() > 300 ? r.output.substr(r.output.size() - 300) : r.output;
    for (char& c : tail)
      if (c == '\n') c = ' ';
    return "transformers " + std::string(ZT_HF_VERSION) + " is not importable with PYTHONPATH=" + hf_pythonpath() +
           " (install it with scripts/python_deps.sh): " + tail;
  }();
  return problem;
}

ProcessResult run_transformers_script(const std::string& script, const std::vector<std::string>& args,
                                      std::chrono::seconds timeout) {
  std::vector<std::string> argv = {"/usr/bin/env", "python3", std::string(ZT_SOURCE_DIR) + "/tests/support/" + script};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv,
                     {{"PYTHONPATH", hf_pythonpath()}, {"PYTHONNOUSERSITE", "1"}, {"HF_HUB_OFFLINE", "1"},
                      {"PYTHONWARNINGS", "ignore"}, {"TRANSFORMERS_VERBOSITY", "error"}},
                     timeout);
}

std::string write_byte_token_file(const std::string& dir) {
  std::mt19937 generator(5);
  std::vector<uint16_t> tokens(4096);
  for (auto& t : tokens) t = uint16_t(generator() % 256);
  const std::string path = dir + "/tokens.bin";
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * sizeof(uint16_t)));
  return path;
}

}  // namespace zt::testing
