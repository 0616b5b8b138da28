// Text generation for the decoder models (models/gpt.h, models/llama.h) with a key/value cache: the
// prompt runs through the model once, then each new token runs alone, attending to the cached keys
// and values of every position before it, so a step costs one position's forward, not the whole
// sequence's. `zerotrain generate` (docs/cli.md) is its command-line front.
//
// Contracts:
//  - The model runs in evaluation mode (dropout off) without autograd; its parameters are read,
//    never changed. It must hold whole parameters: generation runs on one process, not on stage
//    3's shards. The model's mode is restored on return.
//  - Only the ids below vocab_limit are chosen when it is set (a tokenizer smaller than the
//    model's padded vocabulary cannot decode the others); 0: every id of the model's vocabulary.
//  - Greedy when temperature == 0: the most probable token, the lowest id among equals (as
//    torch.argmax). Otherwise the logits are divided by the temperature and, when top_p < 1,
//    restricted to the smallest set of the most probable tokens whose probabilities add up to
//    top_p (nucleus sampling; at least the most probable one), and a token is drawn with a CPU
//    generator seeded with `seed`: the same model, prompt and options give the same tokens.
//  - Stops after max_new_tokens, after a token of stop_ids (returned as the last token), or when
//    the sequence fills the model's context (context_length, max_position_embeddings).
//  - on_token, when set, is called with each new token as soon as it is chosen (streaming).
//  - Throws zt::ConfigError, before any token, for an empty prompt, an id outside the vocabulary,
//    a prompt that fills the context, vocab_limit outside [0, vocabulary], and for what
//    check_generation_options refuses.
//  - Not thread-safe (the model's modules are used).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace zt {

class GPTImpl;
class LlamaImpl;

struct GenerationOptions {
  int64_t max_new_tokens = 64;
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;
  uint64_t seed = 0;
  std::vector<int64_t> stop_ids;  // end-of-sequence tokens
  int64_t vocab_limit = 0;        // > 0: only ids below it are chosen
};

// The options alone, before a model is at hand: zt::ConfigError for max_new_tokens < 0, a
// temperature that is negative, not finite, or positive but below the smallest normal fp32
// (kMinTemperature: the logits are divided by it in fp32, where a smaller one is 0 or loses its
// precision), and top_p outside (0, 1].
inline constexpr double kMinTemperature = 1.1754943508222875e-38;  // FLT_MIN
void check_generation_options(const GenerationOptions& options);

using TokenCallback = std::function<void(int64_t id)>;

// The new tokens after `prompt` (the prompt itself not included).
std::vector<int64_t> generate(GPTImpl& model, const std::vector<int64_t>& prompt, const GenerationOptions& options,
                              const TokenCallback& on_token = {});
std::vector<int64_t> generate(LlamaImpl& model, const std::vector<int64_t>& prompt,
                              const GenerationOptions& options, const TokenCallback& on_token = {});

}  // namespace zt
