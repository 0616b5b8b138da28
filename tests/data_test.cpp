// Data: tokenizer, .bin formats and their errors, split, sampler determinism and the global-batch
// invariant, prefetcher order and error propagation, the embedded corpus.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include "zerotrain/data/data.h"
#include "zerotrain/error.h"

namespace fs = std::filesystem;
using zt::Batch;
using zt::BinFormat;
using zt::DistributedSampler;
using zt::TokenDataset;

namespace {

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("zt_data_test_" + std::to_string(::getpid()) + "_" +
                                         std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

void write_bytes(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<uint16_t> iota_tokens(size_t n, uint16_t mod = 50000) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>((i * 7 + 3) % mod);
  return t;
}

// Expects a DataError whose message contains every fragment.
template <class F>
void expect_data_error(F&& f, std::initializer_list<std::string> fragments) {
  try {
    f();
    ADD_FAILURE() << "expected zt::DataError";
  } catch (const zt::DataError& e) {
    const std::string msg = e.what();
    for (const auto& frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "'" << frag << "' not in: " << msg;
  }
}

TEST(ByteTokenizer, RoundTripsAnyBytes) {
  zt::ByteTokenizer tok;
  std::string text = "Hello, wörld! \n\t";
  text.push_back('\0');
  text.push_back(static_cast<char>(0xFF));
  auto ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[0], 'H');
  EXPECT_EQ(ids.back(), 255);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(tok.vocab_size(), 256);
  std::vector<uint16_t> bad = {72, 300};
  EXPECT_THROW(tok.decode(bad), zt::DataError);
}

TEST(TokenDataset, ReadsBothBinFormats) {
  TempDir dir;
  const auto tokens = iota_tokens(1000);
  for (auto fmt : {BinFormat::NanoGPT, BinFormat::LlmC}) {
    const auto path = dir / (fmt == BinFormat::LlmC ? "llmc.bin" : "nanogpt.bin");
    TokenDataset::write_bin_file(path, tokens, fmt);
    EXPECT_EQ(fs::file_size(path), 2 * tokens.size() + (fmt == BinFormat::LlmC ? 1024 : 0));
    auto ds = TokenDataset::from_bin_file(path);
    ASSERT_EQ(ds.size(), 1000);
    EXPECT_TRUE(std::equal(tokens.begin(), tokens.end(), ds.tokens16().begin()));
    EXPECT_EQ(ds.max_token(), *std::max_element(tokens.begin(), tokens.end()));
    EXPECT_EQ(ds.source(), path.string());
    EXPECT_NO_THROW(ds.validate(50257));
  }
}

TEST(TokenDataset, DatasetOutlivesNothing) {
  // The memory map is shared by copies and splits; it stays valid after the original is gone.
  TempDir dir;
  const auto tokens = iota_tokens(100);
  TokenDataset::write_bin_file(dir / "a.bin", tokens);
  TokenDataset val;
  {
    auto ds = TokenDataset::from_bin_file(dir / "a.bin");
    val = ds.split(0.1).second;
  }
  ASSERT_EQ(val.size(), 10);
  EXPECT_EQ(val[0], tokens[90]);
}

TEST(TokenDataset, MalformedFilesAreDataErrors) {
  TempDir dir;
  expect_data_error([&] { TokenDataset::from_bin_file(dir / "missing.bin"); }, {"missing.bin", "cannot open"});

  write_bytes(dir / "empty.bin", {});
  expect_data_error([&] { TokenDataset::from_bin_file(dir / "empty.bin"); }, {"empty.bin", "empty"});

  write_bytes(dir / "odd.bin", {1, 2, 3});
  expect_data_error([&] { TokenDataset::from_bin_file(dir / "odd.bin"); }, {"odd.bin", "odd byte count", "3"});

  // llm.c file cut short: header claims 1000 tokens, 999 present.
  TokenDataset::write_bin_file(dir / "trunc.bin", iota_tokens(1000));
  fs::resize_file(dir / "trunc.bin", 1024 + 2 * 999);
  expect_data_error([&] { TokenDataset::from_bin_file(dir / "trunc.bin"); }, {"trunc.bin", "1000 tokens", "1998 bytes"});

  // Header only partly present.
  TokenDataset::write_bin_file(dir / "hdr.bin", iota_tokens(10));
  fs::resize_file(dir / "hdr.bin", 100);
  expect_data_error([&] { TokenDataset::from_bin_file(dir / "hdr.bin"); }, {"hdr.bin", "header"});

  // llm.c version 2 (written by hand as llm.c does) holds uint32 tokens; version 3 is refused.
  {
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = 2;
    header[2] = 4;
    std::ofstream out(dir / "v2.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    uint32_t toks[4] = {1, 70000, 3, 128255};
    out.write(reinterpret_cast<const char*>(toks), sizeof toks);
  }
  {
    auto v2 = TokenDataset::from_bin_file(dir / "v2.bin");
    EXPECT_EQ(v2.width(), zt::TokenWidth::U32);
    ASSERT_EQ(v2.size(), 4);
    EXPECT_EQ(v2[1], 70000u);
    EXPECT_EQ(v2.max_token(), 128255u);
    EXPECT_THROW(v2.data16(), zt::DataError);
    expect_data_error([&] { v2.validate(128000); }, {"v2.bin", "128255", "position 3", "< 128000"});
  }
  {
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = 3;
    header[2] = 1;
    std::ofstream out(dir / "v3.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    uint32_t tok = 1;
    out.write(reinterpret_cast<const char*>(&tok), sizeof tok);
  }
  expect_data_error([&] { TokenDataset::from_bin_file(dir / "v3.bin"); }, {"v3.bin", "version 3"});
  // A uint32 file whose byte count disagrees with its header.
  TokenDataset::write_bin_file(dir / "t32.bin", std::vector<uint32_t>{5, 6, 7});
  fs::resize_file(dir / "t32.bin", 1024 + 10);
  expect_data_error([&] { TokenDataset::from_bin_file(dir / "t32.bin"); }, {"t32.bin", "3 tokens", "10 bytes"});

  // A directory is not a token file.
  fs::create_directories(dir / "adir");
  EXPECT_THROW(TokenDataset::from_bin_file(dir / "adir"), zt::DataError);

  // Token ids beyond the vocabulary.
  TokenDataset::write_bin_file(dir / "big.bin", std::vector<uint16_t>{1, 2, 300, 4}, BinFormat::NanoGPT);
  auto ds = TokenDataset::from_bin_file(dir / "big.bin");
  EXPECT_NO_THROW(ds.validate(301));
  expect_data_error([&] { ds.validate(256); }, {"big.bin", "300", "position 2", "< 256"});

  // Too few tokens for one sequence (seq_len + 1 needed).
  expect_data_error([&] { DistributedSampler(ds, 4, 1, 1, 0, 0); }, {"big.bin", "4 tokens", "at least 5"});
  EXPECT_NO_THROW(DistributedSampler(ds, 3, 1, 1, 0, 0));
}

TEST(TokenDataset, SplitIsContiguousTail) {
  auto ds = TokenDataset(iota_tokens(1000), "mem");
  auto [train, val] = ds.split(0.1);
  EXPECT_EQ(train.size(), 900);
  EXPECT_EQ(val.size(), 100);
  EXPECT_EQ(train.data16(), ds.data16());
  EXPECT_EQ(val.data16(), ds.data16() + 900);
  EXPECT_EQ(val.source(), "mem [val]");
  auto [all, none] = ds.split(0.0);
  EXPECT_EQ(all.size(), 1000);
  EXPECT_EQ(none.size(), 0);
  EXPECT_THROW(ds.split(1.0), zt::ConfigError);
  EXPECT_THROW(ds.split(-0.1), zt::ConfigError);
}

TEST(TokenDataset, FromText) {
  auto ds = TokenDataset::from_text("abc");
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds[1], 'b');
  EXPECT_EQ(ds.max_token(), 'c');
}

// ---- sampler ----

TEST(DistributedSampler, DeterministicAndTargetsShiftedByOne) {
  auto ds = TokenDataset(iota_tokens(5000), "mem");
  DistributedSampler a(ds, 16, 4, 2, 1, 42), b(ds, 16, 4, 2, 1, 42), other_seed(ds, 16, 4, 2, 1, 43);
  auto x = a.batch(3, 1), y = b.batch(3, 1);
  EXPECT_EQ(x.inputs.sizes(), torch::IntArrayRef({4, 16}));
  EXPECT_EQ(x.inputs.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(x.inputs, y.inputs));
  EXPECT_TRUE(torch::equal(x.targets, y.targets));
  EXPECT_FALSE(torch::equal(x.inputs, other_seed.batch(3, 1).inputs));
  EXPECT_FALSE(torch::equal(x.inputs, a.batch(4, 1).inputs));
  EXPECT_FALSE(torch::equal(x.inputs, a.batch(3, 0).inputs));
  // targets[:, t] == inputs[:, t+1] and both are real windows of the data.
  using torch::indexing::Slice;
  EXPECT_TRUE(torch::equal(x.targets.index({Slice(), Slice(0, 15)}), x.inputs.index({Slice(), Slice(1, 16)})));
  const auto* tok = ds.data16();
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t start = a.sample_start(3, 1 * 2 * 4 + 1 * 4 + i);
    EXPECT_LE(start + 16, ds.size() - 1);
    for (int64_t t = 0; t < 16; ++t) {
      EXPECT_EQ(x.inputs[i][t].item<int64_t>(), tok[start + t]);
      EXPECT_EQ(x.targets[i][t].item<int64_t>(), tok[start + t + 1]);
    }
  }
}

TEST(DistributedSampler, Uint32DatasetsGiveTheSameWindowsWithWideIds) {
  // The same sampling over uint32 ids: identical starts, ids past 65,535 intact, split views too.
  std::vector<uint32_t> wide(3000);
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = uint32_t(100'000 + i * 7);
  TokenDataset ds(wide, "wide");
  EXPECT_EQ(ds.width(), zt::TokenWidth::U32);
  auto [train, val] = ds.split(0.25);
  EXPECT_EQ(val[0], wide[2250]);
  EXPECT_EQ(val.data32(), ds.data32() + 2250);
  DistributedSampler s(train, 8, 2, 1, 0, 7);
  auto b = s.batch(2, 0);
  for (int64_t i = 0; i < 2; ++i) {
    const int64_t start = s.sample_start(2, i);
    for (int64_t t = 0; t < 8; ++t) {
      EXPECT_EQ(b.inputs[i][t].item<int64_t>(), int64_t(wide[size_t(start + t)]));
      EXPECT_EQ(b.targets[i][t].item<int64_t>(), int64_t(wide[size_t(start + t + 1)]));
    }
  }
}

TEST(DistributedSampler, StartsCoverTheWholeRange) {
  // A dataset with exactly seq_len + 2 tokens has two possible starts; both must appear.
  auto ds = TokenDataset(iota_tokens(10), "mem");
  DistributedSampler s(ds, 8, 1, 1, 0, 5);
  std::set<int64_t> starts;
  for (int64_t step = 0; step < 64; ++step) starts.insert(s.sample_start(step, 0));
  EXPECT_EQ(starts, (std::set<int64_t>{0, 1}));
}

// The global batch of a step depends on (seed, step, G, A) only: for every W in {1,2,3} and
// A in {1,2}, concatenating the ranks' micro-batches of micro-step a in rank order gives the
// samples {a·G/A + k}, identical to the single-rank sampler with micro-batch W·M.
TEST(DistributedSampler, GlobalBatchInvariantAcrossWorldSizes) {
  auto ds = TokenDataset(iota_tokens(20000), "mem");
  const int64_t T = 8, G = 12;
  const uint64_t seed = 99;
  for (int64_t A : {1, 2}) {
    const int64_t per_micro = G / A;  // samples per micro-step over all ranks
    DistributedSampler reference(ds, T, per_micro, 1, 0, seed);
    for (int W : {1, 2, 3}) {
      ASSERT_EQ(per_micro % W, 0);
      const int64_t M = per_micro / W;
      std::vector<DistributedSampler> ranks;
      for (int r = 0; r < W; ++r) ranks.emplace_back(ds, T, M, W, r, seed);
      for (int64_t step : {0, 5}) {
        for (int64_t a = 0; a < A; ++a) {
          std::vector<torch::Tensor> parts, part_targets;
          for (auto& s : ranks) {
            auto b = s.batch(step, a);
            parts.push_back(b.inputs);
            part_targets.push_back(b.targets);
          }
          auto joined = torch::cat(parts, 0);
          auto ref = reference.batch(step, a);
          EXPECT_TRUE(torch::equal(joined, ref.inputs)) << "W=" << W << " A=" << A << " a=" << a;
          EXPECT_TRUE(torch::equal(torch::cat(part_targets, 0), ref.targets));
          // And it is exactly global samples a·(G/A) + k.
          for (int64_t k = 0; k < per_micro; ++k) {
            const int64_t start = reference.sample_start(step, a * per_micro + k);
            EXPECT_EQ(joined[k][0].item<int64_t>(), ds[start]);
          }
        }
      }
    }
  }
}

TEST(DistributedSampler, EvalBatchesWalkTheHeldOutSplitInOrder) {
  auto ds = TokenDataset(iota_tokens(1001), "mem");  // (1001-1)/10 = 100 windows of 10
  auto [train, val] = ds.split(0.5);                  // val: 501 tokens, 50 windows
  DistributedSampler r0(val, 10, 5, 2, 0, 1), r1(val, 10, 5, 2, 1, 1);
  EXPECT_EQ(r0.eval_batches(), 5);
  std::set<int64_t> firsts;
  for (int64_t i = 0; i < r0.eval_batches(); ++i) {
    for (auto* s : {&r0, &r1}) {
      auto b = s->eval_batch(i);
      EXPECT_TRUE(torch::equal(b.inputs, s->eval_batch(i).inputs));  // deterministic
      for (int64_t j = 0; j < 5; ++j) firsts.insert(b.inputs[j][0].item<int64_t>());
    }
  }
  // Every window's first token (distinct in this data) was visited exactly once overall.
  EXPECT_EQ(firsts.size(), 50u);
  auto b = r0.eval_batch(0);
  EXPECT_EQ(b.inputs[1][0].item<int64_t>(), val[10]);
  EXPECT_EQ(b.targets[0][9].item<int64_t>(), val[10]);
}

TEST(DistributedSampler, BadArgumentsAreConfigErrors) {
  auto ds = TokenDataset(iota_tokens(100), "mem");
  EXPECT_THROW(DistributedSampler(ds, 0, 1, 1, 0, 0), zt::ConfigError);
  EXPECT_THROW(DistributedSampler(ds, 8, 0, 1, 0, 0), zt::ConfigError);
  EXPECT_THROW(DistributedSampler(ds, 8, 1, 0, 0, 0), zt::ConfigError);
  EXPECT_THROW(DistributedSampler(ds, 8, 1, 2, 2, 0), zt::ConfigError);
  EXPECT_THROW(DistributedSampler(ds, 8, 1, 2, -1, 0), zt::ConfigError);
  DistributedSampler s(ds, 8, 1, 1, 0, 0);
  EXPECT_THROW(s.batch(-1, 0), zt::ConfigError);
}

// ---- prefetcher ----

Batch tagged(int64_t index) {
  return {torch::full({1, 1}, index, torch::kLong), torch::full({1, 1}, index + 1, torch::kLong)};
}

TEST(BatchPrefetcher, ReturnsBatchesInOrderAndPrefetchesOneAhead) {
  std::atomic<int64_t> highest{-1};
  zt::BatchPrefetcher pf(
      [&](int64_t i) {
        highest = std::max<int64_t>(highest, i);
        return tagged(i);
      },
      10);
  EXPECT_EQ(pf.next_index(), 10);
  for (int64_t i = 10; i < 20; ++i) {
    auto b = pf.next();
    EXPECT_EQ(b.inputs.item<int64_t>(), i);
    EXPECT_EQ(b.targets.item<int64_t>(), i + 1);
  }
  EXPECT_EQ(pf.next_index(), 20);
  // The batch after the last one handed out is being (or has been) prepared; never two ahead.
  for (int k = 0; k < 200 && highest.load() < 20; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(highest.load(), 20);
}

TEST(BatchPrefetcher, OverlapsProductionWithTheCaller) {
  using namespace std::chrono;
  zt::BatchPrefetcher pf(
      [](int64_t i) {
        std::this_thread::sleep_for(milliseconds(50));
        return tagged(i);
      },
      0);
  pf.next();
  std::this_thread::sleep_for(milliseconds(80));  // the "step": the next batch is ready meanwhile
  const auto t0 = steady_clock::now();
  EXPECT_EQ(pf.next().inputs.item<int64_t>(), 1);
  EXPECT_LT(duration_cast<milliseconds>(steady_clock::now() - t0).count(), 40);
}

TEST(BatchPrefetcher, ProducerExceptionIsRethrownAndIndexRetried) {
  int failures_left = 1;
  zt::BatchPrefetcher pf(
      [&](int64_t i) {
        if (i == 2 && failures_left-- > 0) throw zt::DataError("boom at 2");
        return tagged(i);
      },
      0);
  EXPECT_EQ(pf.next().inputs.item<int64_t>(), 0);
  EXPECT_EQ(pf.next().inputs.item<int64_t>(), 1);
  EXPECT_THROW(pf.next(), zt::DataError);
  EXPECT_EQ(pf.next_index(), 2);
  EXPECT_EQ(pf.next().inputs.item<int64_t>(), 2);
  EXPECT_EQ(pf.next().inputs.item<int64_t>(), 3);
}

TEST(BatchPrefetcher, DestructorJoinsWhileProducing) {
  std::atomic<int> made{0};
  {
    zt::BatchPrefetcher pf(
        [&](int64_t i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(30));
          ++made;
          return tagged(i);
        },
        0);
  }  // destroyed while the first batch is in flight
  EXPECT_LE(made.load(), 1);
}

// ---- corpus ----

TEST(EmbeddedCorpus, NonTrivialDeterministicText) {
  const auto c = zt::embedded_corpus();
  EXPECT_GE(c.size(), 1'000'000u);
  EXPECT_LE(c.size(), 2'100'000u);
  EXPECT_EQ(c.data(), zt::embedded_corpus().data());  // generated once
  // Byte-identical across runs and platforms: pin a fingerprint (FNV-1a 64) of the whole text.
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char ch : c) h = (h ^ ch) * 1099511628211ULL;
  std::set<std::string> expected_words = {" plus ", " is ", " said ", " has ", "The "};
  for (const auto& w : expected_words) EXPECT_NE(c.find(w), std::string_view::npos) << w;
  // Printable ASCII plus newlines only.
  for (unsigned char ch : c) ASSERT_TRUE(ch == '\n' || (ch >= 32 && ch < 127)) << int(ch);
  // Arithmetic facts are correct.
  EXPECT_NE(c.find(" plus "), std::string_view::npos);
  size_t checked = 0;
  for (size_t pos = c.find(" plus "); pos != std::string_view::npos && checked < 200; pos = c.find(" plus ", pos + 1)) {
    size_t a0 = pos;
    while (a0 > 0 && std::isdigit(static_cast<unsigned char>(c[a0 - 1]))) --a0;
    if (a0 == pos) continue;
    int a = 0, b = 0, s = 0;
    if (std::sscanf(std::string(c.substr(a0, 40)).c_str(), "%d plus %d is %d", &a, &b, &s) == 3) {
      EXPECT_EQ(a + b, s);
      ++checked;
    }
  }
  EXPECT_GT(checked, 100u);
  EXPECT_EQ(h, 0xf6e8d946faca3c33ULL) << "the generator changed: update this fingerprint deliberately";
}

}  // namespace
