// DistributedSampler: stateless, hash-based window sampling (see data.h for the invariant).
#include <torch/torch.h>

#include "data/mix64.h"
#include "zerotrain/data/data.h"
#include "zerotrain/error.h"

namespace zt {

DistributedSampler::DistributedSampler(const TokenDataset& data, int64_t seq_len, int64_t micro_batch, int world_size,
                                       int rank, uint64_t seed)
    : data_(data), seq_len_(seq_len), micro_batch_(micro_batch), world_size_(world_size), rank_(rank), seed_(seed) {
  if (seq_len <= 0) throw ConfigError("DistributedSampler: seq_len must be > 0, found " + std::to_string(seq_len));
  if (micro_batch <= 0)
    throw ConfigError("DistributedSampler: micro_batch must be > 0, found " + std::to_string(micro_batch));
  if (world_size <= 0)
    throw ConfigError("DistributedSampler: world_size must be > 0, found " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size)
    throw ConfigError("DistributedSampler: rank must be in [0, " + std::to_string(world_size) + "), found " +
                      std::to_string(rank));
  // One window needs seq_len inputs plus the target after the last one.
  data_.require_tokens(seq_len + 1, "one sequence of seq_len=" + std::to_string(seq_len) + " plus its next-token target");
}

int64_t DistributedSampler::sample_start(int64_t step, int64_t global_sample) const {
  const uint64_t h = mix64(mix64(mix64(seed_) ^ static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(global_sample));
  // Modulo bias is at most n/2^64: irrelevant for any real dataset.
  return static_cast<int64_t>(h % static_cast<uint64_t>(data_.size() - seq_len_));
}

namespace {

// One window per row; the loop is instantiated per id width so the uint16 path stays a plain copy.
template <typename Id>
void fill_windows(const Id* tok, int64_t rows, int64_t seq_len, const std::function<int64_t(int64_t i)>& start_of,
                  int64_t* in, int64_t* tg) {
  for (int64_t i = 0; i < rows; ++i) {
    const Id* w = tok + start_of(i);
    for (int64_t t = 0; t < seq_len; ++t) {
      in[i * seq_len + t] = w[t];
      tg[i * seq_len + t] = w[t + 1];
    }
  }
}

}  // namespace

Batch DistributedSampler::make_batch(const std::function<int64_t(int64_t i)>& start_of) const {
  auto inputs = torch::empty({micro_batch_, seq_len_}, torch::kLong);
  auto targets = torch::empty({micro_batch_, seq_len_}, torch::kLong);
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* tg = targets.data_ptr<int64_t>();
  if (data_.width() == TokenWidth::U16)
    fill_windows(data_.data16(), micro_batch_, seq_len_, start_of, in, tg);
  else
    fill_windows(data_.data32(), micro_batch_, seq_len_, start_of, in, tg);
  return {std::move(inputs), std::move(targets), /*segments=*/{}};  // one window per row
}

Batch DistributedSampler::batch(int64_t step, int64_t micro_step) const {
  if (step < 0 || micro_step < 0)
    throw ConfigError("DistributedSampler::batch: step and micro_step must be >= 0, found " + std::to_string(step) +
                      ", " + std::to_string(micro_step));
  const int64_t base = micro_step * world_size_ * micro_batch_ + rank_ * micro_batch_;
  return make_batch([&](int64_t i) { return sample_start(step, base + i); });
}

int64_t DistributedSampler::eval_batches() const {
  const int64_t windows = (data_.size() - 1) / seq_len_;
  const int64_t per_index = world_size_ * micro_batch_;
  return std::max<int64_t>(1, (windows + per_index - 1) / per_index);
}

Batch DistributedSampler::eval_batch(int64_t index) const {
  if (index < 0) throw ConfigError("DistributedSampler::eval_batch: index must be >= 0, found " + std::to_string(index));
  const int64_t windows = (data_.size() - 1) / seq_len_;  // >= 1 by the constructor's check
  const int64_t base = (index * world_size_ + rank_) * micro_batch_;
  return make_batch([&](int64_t i) { return ((base + i) % windows) * seq_len_; });
}

}  // namespace zt
