// Token data for training: a byte-level tokenizer, flat uint16 token datasets (nanoGPT and llm.c
// `.bin` files, or text), a built-in corpus, deterministic distributed sampling, and a background
// batch prefetcher.
//
// All failures on input data throw zt::DataError naming the file (or source), what was expected and
// what was found. Thread safety: TokenDataset and DistributedSampler are immutable after
// construction and safe to use from several threads; BatchPrefetcher is for one consumer thread.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace zt {

// Bytes are tokens: id = byte value, vocabulary 256. Lossless for any byte string (UTF-8 included).
class ByteTokenizer {
 public:
  static constexpr int64_t kVocabSize = 256;
  int64_t vocab_size() const { return kVocabSize; }
  std::vector<uint16_t> encode(std::string_view text) const;
  // Throws zt::DataError on an id >= 256 (e.g. a dataset made with a BPE tokenizer).
  std::string decode(std::span<const uint16_t> tokens) const;
};

// On-disk layouts of flat token files.
enum class BinFormat {
  NanoGPT,  // raw little-endian uint16 tokens, no header (nanoGPT's prepare.py: np.uint16 tofile)
  LlmC,     // llm.c: 256 × int32 header {20240520, version, n_tokens, 0…}, then n_tokens tokens:
            // version 1 holds uint16 tokens, version 2 uint32 tokens (llm.c's own Llama 3 layout)
};

// How wide the ids of a TokenDataset are: uint16 while every id fits (GPT-2's 50,257), uint32 for
// the vocabularies past 65,535 (Llama 3's 128,256, Qwen2's 151,665).
enum class TokenWidth : uint8_t {
  U16 = 2,
  U32 = 4,
};

// A contiguous, read-only run of token ids of one width. Copies share the storage (a vector, or a
// read-only memory map of a `.bin` file so multi-GB datasets are neither copied nor read up front);
// split() returns views of the same storage. Readers branch on width() once per batch, not per
// token: data16()/data32() give the typed run.
class TokenDataset {
 public:
  TokenDataset() = default;
  explicit TokenDataset(std::vector<uint16_t> tokens, std::string source = "<memory>");
  explicit TokenDataset(std::vector<uint32_t> tokens, std::string source = "<memory>");

  // Reads either layout: a file that starts with the llm.c magic 20240520 is llm.c (its header's
  // token count must match the file size; version 1 is uint16, version 2 uint32); anything else is
  // headerless nanoGPT uint16 (byte count must be even). The magic cannot be mistaken for GPT-2
  // tokens: as uint16 pairs it reads 55368, 308 and 55368 >= 50257. Throws zt::DataError for a
  // missing/unreadable file, an empty file, an odd byte count, a truncated llm.c file or an llm.c
  // version other than 1 and 2.
  static TokenDataset from_bin_file(const std::filesystem::path& path);
  // Writes tokens in the given layout (tests, data preparation). Throws zt::DataError on I/O error.
  static void write_bin_file(const std::filesystem::path& path, std::span<const uint16_t> tokens,
                             BinFormat format = BinFormat::LlmC);
  // llm.c version 2 (uint32). `header_extra` fills header ints 3… (llm.c leaves them zero and
  // ignores them; the tokenizing loader keeps its cache key there).
  static void write_bin_file(const std::filesystem::path& path, std::span<const uint32_t> tokens,
                             std::span<const int32_t> header_extra = {});
  static TokenDataset from_text(std::string_view text, const ByteTokenizer& tokenizer = {});

  // {train, val}: val is the last round(size·val_fraction) tokens (a contiguous held-out tail, so
  // no training window overlaps it), train everything before. val_fraction in [0, 1).
  std::pair<TokenDataset, TokenDataset> split(double val_fraction) const;

  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  TokenWidth width() const { return width_; }
  // The ids of a TokenWidth::U16 (data16) or U32 (data32) dataset; the other accessor throws
  // zt::DataError naming the source.
  const uint16_t* data16() const;
  const uint32_t* data32() const;
  std::span<const uint16_t> tokens16() const { return {data16(), static_cast<size_t>(size_)}; }
  std::span<const uint32_t> tokens32() const { return {data32(), static_cast<size_t>(size_)}; }
  uint32_t operator[](int64_t i) const {
    return width_ == TokenWidth::U16 ? static_cast<const uint16_t*>(data_)[i] : static_cast<const uint32_t*>(data_)[i];
  }
  // Largest token id (scans the tokens; 0 for an empty dataset).
  uint32_t max_token() const;
  // Throws zt::DataError naming the source, the first offending id and its position, and the
  // vocabulary when any id >= vocab_size.
  void validate(int64_t vocab_size) const;
  // Throws zt::DataError unless at least `n` tokens are present; `what` says what they are for.
  void require_tokens(int64_t n, const std::string& what) const;
  // Where the tokens came from (a path, "<memory>", "<text>", with " [train]"/" [val]" after split).
  const std::string& source() const { return source_; }

 private:
  struct Storage;
  TokenDataset(std::shared_ptr<const Storage> storage, const void* data, TokenWidth width, int64_t size,
               std::string source);

  std::shared_ptr<const Storage> storage_;
  const void* data_ = nullptr;
  TokenWidth width_ = TokenWidth::U16;
  int64_t size_ = 0;
  std::string source_ = "<empty>";
};

// The built-in training corpus: about 1.5 MB of procedurally generated English-like text built at
// first use from a fixed grammar (templated narrative sentences over a few hundred words, arithmetic
// facts such as "12 plus 7 is 19.", counting stories, and short question/answer dialogues). It is
// generated by a fixed-seed integer PRNG, so it is byte-identical on every platform and run, needs
// no download, and is regular enough that a small byte-level GPT visibly learns it within a few
// hundred steps. Thread-safe; the view stays valid for the life of the program.
std::string_view embedded_corpus();

// One micro-batch: inputs and targets are int64 [micro_batch, seq_len] on the CPU, targets being
// the inputs shifted left by one token (targets[b][t] = token after inputs[b][t]).
struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
  // Packed rows only (docs/finetuning.md "Packing"), else undefined: int64 [micro_batch, seq_len],
  // the index of the example each position belongs to within its row (0, 1, …, one run each, in
  // order) and -1 for the padding after the last; a token attends only within its own run.
  at::Tensor segments;
};

// Deterministic sampling of training windows for data-parallel ranks.
//
// Let W = world_size, M = micro_batch, and A the gradient-accumulation count of the caller. For
// optimizer step s, global sample g (g >= 0) is the window starting at
//     start(seed, s, g) = mix(seed, s, g) mod (n_tokens - seq_len)
// (every start with a full input and target window is possible). Rank r at micro-step a takes the
// global samples g = a·(W·M) + r·M + i, i in [0, M), in that order.
//
// Invariant relied on by the parity tests: with the global batch G = A·W·M fixed, the samples of
// micro-step a over all ranks are exactly {a·(G/A) + k : k in [0, G/A)}, and the whole step is
// {0 … G-1}, for ANY world size W. So 1 rank with micro-batch W·M and k ranks with micro-batch M
// see identical data per micro-step (concatenating ranks in order gives the 1-rank batch), and the
// step's data depends on (seed, s, G, A) only. Sampling is with replacement, independent of any
// epoch notion, and costs O(M·seq_len) per call (no shuffle state), so resuming at a step needs only
// the step number.
//
// Evaluation: eval_batch(index) takes consecutive non-overlapping windows [k·seq_len, k·seq_len +
// seq_len] in order, k = (index·W + r)·M + i modulo the number of such windows, so the ranks of one
// eval index together cover W·M consecutive windows and indices 0 … eval_batches()-1 cover every
// window (the last index wraps around to the first windows when W·M does not divide their count).
class DistributedSampler {
 public:
  // Throws zt::ConfigError for non-positive sizes or rank outside [0, world_size), and
  // zt::DataError when the dataset has fewer than seq_len + 1 tokens.
  DistributedSampler(const TokenDataset& data, int64_t seq_len, int64_t micro_batch, int world_size, int rank,
                     uint64_t seed);

  Batch batch(int64_t step, int64_t micro_step) const;
  Batch eval_batch(int64_t index) const;
  // Number of eval indices that together cover every non-overlapping window (at least 1).
  int64_t eval_batches() const;

  // The start offset of global sample g at step s (exposed for tests and debugging).
  int64_t sample_start(int64_t step, int64_t global_sample) const;

  int64_t seq_len() const { return seq_len_; }
  int64_t micro_batch() const { return micro_batch_; }
  int world_size() const { return world_size_; }
  int rank() const { return rank_; }
  uint64_t seed() const { return seed_; }
  const TokenDataset& dataset() const { return data_; }

 private:
  Batch make_batch(const std::function<int64_t(int64_t i)>& start_of) const;

  TokenDataset data_;
  int64_t seq_len_, micro_batch_;
  int world_size_, rank_;
  uint64_t seed_;
};

// Prepares batch index+1 on a background thread while the caller computes on batch index.
//
// next() returns make(first_index), then make(first_index + 1), … in order; each call hands out
// the batch prepared in the background and immediately starts preparing the following one, so at
// most one batch is in flight. An exception thrown by `make` is rethrown by the next() that wanted
// that index; that index is then attempted again by the following next() (nothing is skipped
// silently). The destructor waits for the in-flight batch and joins the thread. One consumer thread.
// `make` runs on the background thread: what it reads must be safe to read from there.
template <typename BatchType>
class Prefetcher {
 public:
  using Producer = std::function<BatchType(int64_t index)>;
  Prefetcher(Producer make, int64_t first_index)
      : make_(std::move(make)), index_(first_index), requested_(true) {
    worker_ = std::thread([this] { run(); });
  }
  ~Prefetcher() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();  // an in-flight make() finishes first; its result is dropped
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  BatchType next() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return ready_.has_value() || error_ != nullptr; });
    if (error_) {
      // Retry the same index on the following call; start it now so the retry overlaps too.
      auto error = std::exchange(error_, nullptr);
      requested_ = true;
      lock.unlock();
      cv_.notify_all();
      std::rethrow_exception(error);
    }
    BatchType batch = std::move(*ready_);
    ready_.reset();
    ++index_;
    requested_ = true;
    lock.unlock();
    cv_.notify_all();
    return batch;
  }

  // The index the next call to next() returns.
  int64_t next_index() const {
    std::lock_guard lock(mu_);
    return index_;
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || requested_; });
      if (stop_) return;
      requested_ = false;
      const int64_t index = index_;
      lock.unlock();  // the producer runs unlocked: this is the overlap with the caller's step
      std::optional<BatchType> result;
      std::exception_ptr error;
      try {
        result = make_(index);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      ready_ = std::move(result);
      error_ = error;
      cv_.notify_all();
    }
  }

  Producer make_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t index_;                   // index handed out by the next next()
  bool requested_ = false;          // worker should produce `index_`
  bool stop_ = false;
  std::optional<BatchType> ready_;  // result for index_
  std::exception_ptr error_;        // failure for index_
  std::thread worker_;
};

// The GPT's token windows (instantiated once, in src/data/prefetch.cpp).
extern template class Prefetcher<Batch>;
using BatchPrefetcher = Prefetcher<Batch>;

}  // namespace zt
