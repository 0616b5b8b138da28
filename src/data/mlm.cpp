// BERT pre-training data: masked language modelling and sentence pairs (zerotrain/data/bert_data.h).
#include <algorithm>
#include <cmath>
#include <string>

#include <torch/torch.h>

#include "data/mix64.h"
#include "zerotrain/error.h"
#include "zerotrain/data/bert_data.h"

namespace zt {
namespace {

// Different salts keep the pair stream and the masking stream of one sample independent.
constexpr uint64_t kPairSalt = 0x5041495253ULL;  // "PAIRS"
constexpr uint64_t kMaskSalt = 0x4D41534BULL;    // "MASK"

class Stream {
 public:
  Stream(uint64_t seed, uint64_t salt, int64_t step, int64_t sample)
      : state_(mix64(mix64(mix64(seed ^ salt) ^ static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(sample))) {}
  uint64_t next() { return mix64(state_++); }
  // Uniform in [0, 1) from the top 53 bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform in [0, n); the modulo bias is at most n/2^64.
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

[[noreturn]] void bad_option(const std::string& what) { throw ConfigError(what); }

void check_probability(const char* name, double v, bool allow_zero) {
  if (!(v >= 0.0 && v <= 1.0) || (!allow_zero && v == 0.0))
    bad_option(std::string("MlmOptions.") + name + " must be in " + (allow_zero ? "[0, 1]" : "(0, 1]") + ", found " +
               std::to_string(v));
}

}  // namespace

// ---- masking ------------------------------------------------------------------------------

void MlmOptions::validate() const {
  check_probability("probability", probability, false);
  check_probability("mask", mask, true);
  check_probability("random", random, true);
  if (mask + random > 1.0 + 1e-12)
    bad_option("MlmOptions.mask + MlmOptions.random must be <= 1 (the rest keeps its id), found " +
               std::to_string(mask) + " + " + std::to_string(random));
  if (max_predictions < 0)
    bad_option("MlmOptions.max_predictions must be >= 0 (0: no cap), found " + std::to_string(max_predictions));
}

MlmMasker::MlmMasker(MlmOptions options, BertSpecialTokens specials, uint64_t seed)
    : options_(options), specials_(specials), seed_(seed) {
  options_.validate();
  if (specials_.content_vocab <= 0)
    bad_option("MlmMasker: content_vocab must be > 0, found " + std::to_string(specials_.content_vocab));
}

void MlmMasker::mask_sequence(std::span<int64_t> tokens, int64_t step, int64_t global_sample,
                              std::vector<int64_t>& positions, std::vector<int64_t>& labels) const {
  std::vector<int64_t> candidates;
  candidates.reserve(tokens.size());
  for (size_t t = 0; t < tokens.size(); ++t)
    if (!specials_.is_special(tokens[t])) candidates.push_back(static_cast<int64_t>(t));
  const int64_t n = static_cast<int64_t>(candidates.size());
  if (n == 0) return;
  int64_t k = std::max<int64_t>(1, std::llround(options_.probability * static_cast<double>(n)));
  if (options_.max_predictions > 0) k = std::min(k, options_.max_predictions);
  k = std::min(k, n);
  Stream rng(seed_, kMaskSalt, step, global_sample);
  // Partial Fisher-Yates: the first k entries become a uniform k-subset.
  for (int64_t i = 0; i < k; ++i) std::swap(candidates[size_t(i)], candidates[size_t(i + rng.below(n - i))]);
  std::sort(candidates.begin(), candidates.begin() + k);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t t = candidates[size_t(i)];
    positions.push_back(t);
    labels.push_back(tokens[size_t(t)]);
    const double u = rng.uniform();
    if (u < options_.mask)
      tokens[size_t(t)] = specials_.mask();
    else if (u < options_.mask + options_.random)
      tokens[size_t(t)] = rng.below(specials_.content_vocab);
    // else: kept, and still predicted
  }
}

void MlmMasker::apply(BertBatch& batch, int64_t step, int64_t first_global_sample) const {
  auto& ids = batch.input_ids;
  if (!ids.defined() || ids.dim() != 2 || ids.scalar_type() != torch::kLong || !ids.device().is_cpu())
    throw ConfigError("MlmMasker::apply expects input_ids as an int64 CPU tensor [B, T], found " +
                      (ids.defined() ? c10::str(ids.scalar_type(), " ", ids.sizes(), " on ", ids.device())
                                     : std::string("an undefined tensor")));
  if (batch.attention_mask.defined() && batch.attention_mask.sizes() != ids.sizes())
    throw ConfigError("MlmMasker::apply expects attention_mask of the shape of input_ids " + c10::str(ids.sizes()) +
                      ", found " + c10::str(batch.attention_mask.sizes()));
  ids = ids.contiguous();
  const int64_t B = ids.size(0), T = ids.size(1);
  int64_t* data = ids.data_ptr<int64_t>();
  std::vector<int64_t> positions, labels, row_positions;
  for (int64_t b = 0; b < B; ++b) {
    row_positions.clear();
    mask_sequence({data + b * T, size_t(T)}, step, first_global_sample + b, row_positions, labels);
    for (int64_t t : row_positions) positions.push_back(b * T + t);
  }
  batch.masked_positions = torch::tensor(positions, torch::kLong);
  batch.masked_labels = torch::tensor(labels, torch::kLong);
}

// ---- sentence pairs -----------------------------------------------------------------------

void SentencePairOptions::validate() const {
  if (max_length < 5)
    bad_option("SentencePairOptions.max_length must be >= 5 ([CLS], two [SEP] and a token each for A and B), found " +
               std::to_string(max_length));
  if (!(next_probability >= 0.0 && next_probability <= 1.0))
    bad_option("SentencePairOptions.next_probability must be in [0, 1], found " + std::to_string(next_probability));
  if (specials.content_vocab <= 0 || specials.content_vocab > 65536)
    bad_option("SentencePairOptions.specials.content_vocab must be in [1, 65536] (uint16 token data), found " +
               std::to_string(specials.content_vocab));
}

SentencePairSampler::SentencePairSampler(const TokenDataset& data, SentencePairOptions options, int64_t micro_batch,
                                         int world_size, int rank, uint64_t seed)
    : data_(data), options_(std::move(options)), micro_batch_(micro_batch), world_size_(world_size), rank_(rank),
      seed_(seed) {
  options_.validate();
  if (micro_batch <= 0)
    throw ConfigError("SentencePairSampler: micro_batch must be > 0, found " + std::to_string(micro_batch));
  if (world_size <= 0)
    throw ConfigError("SentencePairSampler: world_size must be > 0, found " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size)
    throw ConfigError("SentencePairSampler: rank must be in [0, " + std::to_string(world_size) + "), found " +
                      std::to_string(rank));
  const int64_t L = options_.max_length - 3;
  // A's start is drawn below n - 5L: reaching a sentence start (<= L), skipping (<= L), A (<= L)
  // and B's start after it (<= 2L) all stay inside the data (see write_pair).
  data_.require_tokens(5 * L + 1, "sentence pairs of max_length=" + std::to_string(options_.max_length) +
                                      " (5·(max_length-3) + 1 tokens)");
  data_.data16();  // BERT's vocabularies are uint16: a uint32 dataset is refused here, not at the first batch
  is_end_.assign(65536, 0);
  is_skip_.assign(65536, 0);
  for (uint16_t t : options_.sentence_ends) is_end_[t] = 1;
  for (uint16_t t : options_.leading_skip) is_skip_[t] = 1;
}

int64_t SentencePairSampler::first_global_sample(int64_t micro_step) const {
  return micro_step * world_size_ * micro_batch_ + rank_ * micro_batch_;
}

void SentencePairSampler::write_pair(int64_t step, int64_t global_sample, int64_t* ids, int64_t* types, int64_t* mask,
                                     int64_t* nsp) const {
  const uint16_t* tok = data_.data16();
  const int64_t n = data_.size(), T = options_.max_length, L = T - 3;
  const bool sentences = !options_.sentence_ends.empty();
  Stream rng(seed_, kPairSalt, step, global_sample);

  // The first segment start at or after p (the rule in bert_data.h); always < n for p < n - 2L.
  auto segment_start = [&](int64_t p) {
    int64_t s = p;
    if (!sentences) return p;
    if (p > 0 && !is_end_[tok[p - 1]]) {
      int64_t q = p;
      const int64_t reach = std::min(p + L, n);
      while (q < reach && !is_end_[tok[q]]) ++q;
      if (q == reach) return p;  // no sentence end in reach: a fixed-length cut
      s = q + 1;
    }
    const int64_t limit = std::min(s + L, n - 1);
    while (s < limit && is_skip_[tok[s]]) ++s;
    return s;
  };
  // Length of the whole sentences from `start` that fit `budget`, or the budget when none does.
  auto segment_length = [&](int64_t start, int64_t budget) {
    const int64_t reach = std::min(start + budget, n);
    int64_t end = -1;
    if (sentences)
      for (int64_t t = start; t < reach; ++t)
        if (is_end_[tok[t]]) end = t + 1;
    return end > start ? end - start : reach - start;
  };

  const int64_t a_start = segment_start(rng.below(n - 5 * L));
  const int64_t a_length = segment_length(a_start, 1 + rng.below(L - 1));
  const bool is_next = rng.uniform() < options_.next_probability;
  const int64_t b_start = is_next ? segment_start(a_start + a_length) : segment_start(rng.below(n - 2 * L));
  const int64_t b_length = segment_length(b_start, L - a_length);

  const int64_t vocab = options_.specials.content_vocab;
  auto copy = [&](int64_t from, int64_t count, int64_t* out) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t id = tok[from + i];
      if (id >= vocab)
        throw DataError("SentencePairSampler: token " + std::to_string(id) + " at position " +
                        std::to_string(from + i) + " of " + data_.source() +
                        " is outside the content vocabulary (expected ids < " + std::to_string(vocab) + ")");
      out[i] = id;
    }
  };
  const auto& sp = options_.specials;
  int64_t t = 0;
  ids[t++] = sp.cls();
  copy(a_start, a_length, ids + t);
  t += a_length;
  ids[t++] = sp.sep();
  const int64_t first_b = t;
  copy(b_start, b_length, ids + t);
  t += b_length;
  ids[t++] = sp.sep();
  for (int64_t i = 0; i < T; ++i) {
    if (i >= t) ids[i] = sp.pad();
    types[i] = (i >= first_b && i < t) ? 1 : 0;
    mask[i] = i < t ? 1 : 0;
  }
  *nsp = is_next ? 0 : 1;
}

BertBatch SentencePairSampler::pairs(int64_t step, int64_t micro_step) const {
  if (step < 0 || micro_step < 0)
    throw ConfigError("SentencePairSampler::pairs: step and micro_step must be >= 0, found " + std::to_string(step) +
                      ", " + std::to_string(micro_step));
  const int64_t M = micro_batch_, T = options_.max_length;
  BertBatch batch;
  batch.input_ids = torch::empty({M, T}, torch::kLong);
  batch.token_type_ids = torch::empty({M, T}, torch::kLong);
  batch.attention_mask = torch::empty({M, T}, torch::kLong);
  batch.nsp_labels = torch::empty({M}, torch::kLong);
  const int64_t base = first_global_sample(micro_step);
  for (int64_t i = 0; i < M; ++i)
    write_pair(step, base + i, batch.input_ids.data_ptr<int64_t>() + i * T,
               batch.token_type_ids.data_ptr<int64_t>() + i * T, batch.attention_mask.data_ptr<int64_t>() + i * T,
               batch.nsp_labels.data_ptr<int64_t>() + i);
  return batch;
}

BertBatch SentencePairSampler::batch(int64_t step, int64_t micro_step, const MlmMasker& masker) const {
  if (masker.specials().content_vocab != options_.specials.content_vocab)
    throw ConfigError("SentencePairSampler::batch: the masker's content vocabulary (" +
                      std::to_string(masker.specials().content_vocab) + ") must be the sampler's (" +
                      std::to_string(options_.specials.content_vocab) + ")");
  auto b = pairs(step, micro_step);
  masker.apply(b, step, first_global_sample(micro_step));
  return b;
}

}  // namespace zt
