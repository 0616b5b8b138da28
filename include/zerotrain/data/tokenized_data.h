// Training data through a Hugging Face tokenizer (zerotrain/data/tokenizer.h): text and jsonl corpora
// tokenized at load time and cached as llm.c token files, and fine-tuning examples (prompt/response
// pairs, chat messages) with the loss on the response tokens only, cached and mapped too
// (docs/tokenizers.md "Tokenizing the training data", docs/finetuning.md). Every cache carries a
// checksum of its content: a damaged one is rebuilt, not trusted.
//
// All failures on input data throw zt::DataError naming the file (and line), what was expected and
// what was found. FinetuneExamples and FinetuneSampler are immutable after construction and safe
// to read from several threads.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "zerotrain/data/data.h"
#include "zerotrain/data/tokenizer.h"

namespace zt {

// The corpora a tokenizer turns into one token stream.
enum class CorpusFormat : int32_t {
  Text = 1,   // a UTF-8 text file: one stream, no special tokens added
  Jsonl = 2,  // one JSON object per line with a string "text": each a document, encoded with the
              // post-processor's special tokens (e.g. Llama's begin-of-text) and followed by the
              // end-of-document token when one is given; blank lines are skipped, other keys ignored
};

struct TokenizeOptions {
  std::filesystem::path cache_dir;  // "": the cache file goes beside the corpus
  std::string eos_token;            // a token of the tokenizer appended after every Jsonl document; "": none
  bool progress = false;            // print progress lines on stderr while tokenizing a large corpus
  // A text file is encoded in pieces of at least this many bytes, each cut just after a newline
  // that stands alone between two printable ASCII characters. Byte-level BPE (GPT-2, Llama 3,
  // Qwen2) splits the whole text there too, so the ids equal those of the whole file at once; a
  // SentencePiece-style tokenizer (Llama 2) starts each piece as a new text (with its leading "▁").
  int64_t text_piece_bytes = 1 << 20;
};

// Where a corpus's cache lives and whether loading it used the cache.
struct TokenizedCorpus {
  TokenDataset tokens;
  std::filesystem::path cache_file;
  bool built = false;  // true: tokenized now (missing or stale cache); false: read from the cache
};

// The tokens of `corpus` through the tokenizer.json at `tokenizer_path` (a file or a directory
// holding one). The cache file is `<corpus file name>.<tokenizer hash>.tokens.bin` in
// options.cache_dir (else beside the corpus): an llm.c token file (version 1, uint16 ids, when the
// vocabulary has at most 65,536 ids; version 2, uint32, otherwise) whose spare header ints hold
// the key it was made under: the tokenizer file's content hash, the corpus's size and
// modification time, the format and the end-of-document token, then a checksum of its tokens. A
// cache with another key, a size its header does not give, or tokens that do not match the
// checksum (truncated, altered) is stale and rebuilt; a new cache is written to a temporary file and renamed into place, so a reader
// never sees a partial one. The tokenizer is loaded only when the cache must be built (so a cache
// hit neither parses it nor checks options.eos_token against it). Throws zt::DataError for an
// eos_token the tokenizer does not have.
TokenizedCorpus load_tokenized_corpus(const std::filesystem::path& corpus, CorpusFormat format,
                                      const std::filesystem::path& tokenizer_path, const TokenizeOptions& options);

// How chat messages become tokens (docs/finetuning.md "Chat templates").
enum class ChatTemplate {
  ChatML,  // Qwen2: <|im_start|>ROLE\nCONTENT<|im_end|>\n per message
  Llama3,  // <|begin_of_text|>, then <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>
};
// "chatml", "llama3", or "auto": ChatML when the tokenizer has <|im_start|> and <|im_end|>,
// Llama3 when it has <|start_header_id|>, <|end_header_id|> and <|eot_id|>. Throws zt::DataError
// naming the tokenizer when the choice needs tokens it does not have, or "auto" finds neither.
ChatTemplate resolve_chat_template(const std::string& name, const HfTokenizer& tokenizer);

// Fine-tuning examples back to back: example i is tokens [starts[i], starts[i+1]); trained[k] is 1
// where token k is a response (assistant) token that the loss predicts, 0 for prompt tokens.
// The columns are read-only views of storage that copies and split() share: vectors that add()
// fills, or the memory map of a fine-tuning cache (load_finetune_cache), whose pages are read only
// where an example is used. add() first copies shared or mapped storage.
struct FinetuneExamples {
  std::span<const uint32_t> tokens;
  std::span<const uint8_t> trained;
  std::span<const int64_t> starts;  // count() + 1 offsets into tokens, ascending
  std::span<const int64_t> lines;   // the input line of each example (1-based), for messages
  // The first position k >= 1 of example i whose token is trained (the first target a batch
  // predicts), or the example's length when there is none: the sampler's check reads only these.
  std::span<const int64_t> first_targets;
  uint32_t max_id = 0;  // no id of the storage is larger (validate() reads the tokens only past it)
  std::string source = "<memory>";

  FinetuneExamples();
  int64_t count() const { return int64_t(starts.size()) - 1; }
  // Appends one example; `trained` as tokens.
  void add(const std::vector<uint32_t>& example_tokens, const std::vector<uint8_t>& example_trained, int64_t line);
  // {train, val}: val holds the last round(count·val_fraction) examples. val_fraction in [0, 1).
  // Views of the same storage.
  std::pair<FinetuneExamples, FinetuneExamples> split(double val_fraction) const;
  // Throws zt::DataError naming the source, the example's line and the id when an id >= vocab_size.
  void validate(int64_t vocab_size) const;
  // Bytes of the storage a rank reads before its first step (the sampler's check, validate()):
  // the mapped cache's header and index, or the vectors' whole size in memory.
  int64_t setup_bytes() const;

  struct Storage;  // data/finetune_storage.h

 private:
  friend struct FinetuneStorageAccess;
  void refresh();
  void own();
  std::shared_ptr<Storage> storage_;
};

// Reads a jsonl file of fine-tuning examples, one per line (blank lines skipped), each either
//   {"prompt": STRING, "response": STRING}: the prompt encoded with the post-processor's special
//       tokens, then the response's ids (trained), then `eos` when given (trained); no separator is
//       put between them, so the text carries its own;
//   {"messages": [{"role": STRING, "content": STRING}, ...]}: rendered with the chat template
//       (resolved from `chat_template` at the first such line); the content of "assistant"
//       messages and the end-of-turn token after each is trained, everything else is not.
// Each message part (header, content, end of turn) is encoded on its own and the ids joined.
// The id of `token` (a key's value, named in the error by `key`); throws zt::DataError naming the
// tokenizer when it has no such token.
TokenId require_token(const HfTokenizer& tokenizer, const std::string& token, const std::string& key);

FinetuneExamples load_finetune_examples(const std::filesystem::path& path, const HfTokenizer& tokenizer,
                                        const std::string& chat_template, std::optional<TokenId> eos);

// The fine-tuning examples of the jsonl file `path` (as load_finetune_examples reads it) through
// the tokenizer.json at `tokenizer_path`, tokenized once into a cache file and then mapped: the
// cache is `<data file name>.<tokenizer hash>.examples.bin` in options.cache_dir (else beside the
// data file), keyed as load_tokenized_corpus's (the tokenizer's content, the data file's size and
// modification time, options.eos_token, the chat template) and carrying a checksum of its content;
// a cache with another key, another size or another checksum is rebuilt. The file is read a line
// at a time (progress lines with options.progress), so building holds one line and the examples'
// index, not the file nor its tokens; a hit reads the index and the examples used, not the rest.
struct FinetuneCache {
  FinetuneExamples examples;
  std::filesystem::path cache_file;
  bool built = false;  // true: tokenized now (missing or stale cache); false: mapped from the cache
};
FinetuneCache load_finetune_cache(const std::filesystem::path& path, const std::filesystem::path& tokenizer_path,
                                  const std::string& chat_template, const TokenizeOptions& options);

// Batches of fine-tuning examples: one example per row, its first seq_len + 1 tokens (a longer
// example is cut), padded with id 0 after its end. targets[b][t] is the token after inputs[b][t]
// where that token is trained, else -100 (prompt and padding: the models' losses skip -100, so
// the loss of a batch is the mean over its response tokens). Example of global sample g at step s:
// mix(seed, s, g) mod count(), ranks and micro-steps assigned as DistributedSampler's windows;
// eval_batch(index) walks the examples in order as DistributedSampler walks its windows.
//
// Packed (`pack`, docs/finetuning.md "Packing"): batch() fills each row with several examples. An
// example cut to n tokens takes n - 1 positions (its last token is only a target); the row of
// global sample g takes the example the unpacked row would hold, then the examples of
// mix(seed, s, g, k), k = 1, 2, …, while each fits in the positions left, and stops at the first
// that does not; the rest is padding (id 0, target -100). Batch::segments numbers the examples of
// a row 0, 1, … and its padding -1. eval_batch() is not packed: one example per row as above.
class FinetuneSampler {
 public:
  // Throws zt::ConfigError for non-positive sizes or rank outside [0, world_size), and
  // zt::DataError for no examples or an example with no trained token in its first seq_len + 1.
  FinetuneSampler(FinetuneExamples examples, int64_t seq_len, int64_t micro_batch, int world_size, int rank,
                  uint64_t seed, bool pack = false);
  Batch batch(int64_t step, int64_t micro_step) const;
  Batch eval_batch(int64_t index) const;
  int64_t eval_batches() const;
  int64_t example_of(int64_t step, int64_t global_sample) const;
  const FinetuneExamples& examples() const { return examples_; }
  bool packed() const { return pack_; }

 private:
  Batch make_batch(const std::function<int64_t(int64_t i)>& example_of_row) const;
  Batch make_packed_batch(int64_t step, int64_t first_sample) const;

  FinetuneExamples examples_;
  int64_t seq_len_, micro_batch_;
  int world_size_, rank_;
  uint64_t seed_;
  bool pack_;
};

}  // namespace zt
