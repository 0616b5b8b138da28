// The GPT's plain data (presets, validation, parameter count), apart from the modules: the
// configuration reads the presets to resolve "auto" sizes without LibTorch's module API. Tested
// with the model in tests/gpt_test.cpp (GPTPreset). Declared in zerotrain/config/gpt_config.h.
#include "zerotrain/config/gpt_config.h"

#include <string>
#include <vector>

#include "zerotrain/error.h"

namespace zt {
namespace {

struct Preset {
  const char* name;
  GPTConfig config;
};

// vocab, context, layers, heads, width. The GPT-2 family uses the GPT-2 BPE vocabulary (50257)
// and context 1024; the larger memory-work shapes follow GPT-3's table (context 2048). The gpt3-*
// presets are the same GPT-3 shapes (Brown et al. 2020, table 2.1; 13B's width 5140 rounded to
// 5120 = 40 heads of 128) at context 1024, the sizes of the single-GPU offload benchmark
// (docs/gpu.md).
const Preset kPresets[] = {
    {"tiny", {256, 64, 2, 2, 64, 0.0}},
    {"small", {256, 128, 4, 4, 128, 0.0}},
    {"gpt2-124m", {50257, 1024, 12, 12, 768, 0.0}},
    {"gpt2-350m", {50257, 1024, 24, 16, 1024, 0.0}},
    {"gpt2-774m", {50257, 1024, 36, 20, 1280, 0.0}},
    {"gpt2-1.5b", {50257, 1024, 48, 25, 1600, 0.0}},
    {"gpt-2.7b", {50257, 2048, 32, 32, 2560, 0.0}},
    {"gpt-6.7b", {50257, 2048, 32, 32, 4096, 0.0}},
    {"gpt-13b", {50257, 2048, 40, 40, 5120, 0.0}},
    {"gpt3-2.7b", {50257, 1024, 32, 32, 2560, 0.0}},
    {"gpt3-6.7b", {50257, 1024, 32, 32, 4096, 0.0}},
    {"gpt3-13b", {50257, 1024, 40, 40, 5120, 0.0}},
};

std::string join_names() {
  std::string out;
  for (const auto& p : kPresets) {
    if (!out.empty()) out += ", ";
    out += p.name;
  }
  return out;
}

[[noreturn]] void bad_input(const std::string& what) { throw ConfigError("GPT: " + what); }

}  // namespace

void GPTConfig::validate() const {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) bad_input(std::string("config.") + name + " must be > 0, found " + std::to_string(v));
  };
  positive("vocab_size", vocab_size);
  positive("context_length", context_length);
  positive("n_layer", n_layer);
  positive("n_head", n_head);
  positive("n_embd", n_embd);
  if (n_embd % n_head != 0)
    bad_input("config.n_embd (" + std::to_string(n_embd) + ") must be divisible by config.n_head (" +
              std::to_string(n_head) + ")");
  if (loss_chunk_tokens < 0)
    bad_input("config.loss_chunk_tokens must be >= 0 (0: the whole batch at once), found " +
              std::to_string(loss_chunk_tokens));
  if (!(dropout >= 0.0 && dropout < 1.0))
    bad_input("config.dropout must be in [0, 1), found " + std::to_string(dropout));
}

GPTConfig gpt_preset(const std::string& name) {
  for (const auto& p : kPresets)
    if (name == p.name) return p.config;
  throw ConfigError("unknown GPT preset '" + name + "'; valid presets: " + join_names());
}

std::vector<std::string> gpt_preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

int64_t gpt_parameter_count(const GPTConfig& c) {
  const int64_t C = c.n_embd;
  // Per block: ln_1 (2C) + c_attn (3C² + 3C) + c_proj (C² + C) + ln_2 (2C) + c_fc (4C² + 4C) +
  // mlp.c_proj (4C² + C) = 12C² + 13C. Embeddings V·C + T·C (the head is tied), ln_f 2C.
  return c.vocab_size * C + c.context_length * C + c.n_layer * (12 * C * C + 13 * C) + 2 * C;
}

}  // namespace zt
