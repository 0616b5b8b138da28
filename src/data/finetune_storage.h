// What backs zt::FinetuneExamples (zerotrain/data/tokenized_data.h), and the encoding of one jsonl line
// into an example, shared by the in-memory reader (finetune_examples.cpp) and the cache
// (finetune_cache.cpp). Internal to src/data.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/token_cache.h"
#include "zerotrain/data/tokenized_data.h"

namespace zt {

// Vectors filled by add(), or a mapped cache file (then the vectors are empty and the views point
// into the map).
struct FinetuneExamples::Storage {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> trained;
  std::vector<int64_t> starts{0};
  std::vector<int64_t> lines;
  std::vector<int64_t> first_targets;
  std::shared_ptr<const data::MappedFile> map;
  int64_t map_setup_bytes = 0;  // the map's header and index: what a rank reads before its steps
};

struct FinetuneStorageAccess {
  // Examples viewing all of `storage` (its map's columns given as views).
  static FinetuneExamples mapped(std::shared_ptr<FinetuneExamples::Storage> storage, std::span<const uint32_t> tokens,
                                 std::span<const uint8_t> trained, std::span<const int64_t> starts,
                                 std::span<const int64_t> lines, std::span<const int64_t> first_targets,
                                 uint32_t max_id, std::string source);
};

// One example: ids and whether each is trained.
struct EncodedExample {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> trained;
  void append(const std::vector<TokenId>& ids, bool train) {
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    trained.insert(trained.end(), ids.size(), uint8_t(train));
  }
};

// The example of jsonl line `number` of `file` (a pair or messages; docs/finetuning.md "The
// file"); `chat` is resolved from `chat_template` at the first messages line. Throws zt::DataError
// naming the file and line for a line that is no example or has nothing to train.
EncodedExample encode_example(std::string_view line, const std::string& file, int64_t number,
                              const HfTokenizer& tokenizer, const std::string& chat_template,
                              std::optional<ChatTemplate>& chat, std::optional<TokenId> eos);

// The first position k >= 1 with trained[k], or trained.size() when there is none.
int64_t first_target_of(const uint8_t* trained, int64_t size);

}  // namespace zt
