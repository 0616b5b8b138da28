// layout: a pure function, checked alone over many random parameter lists and world sizes.
#include <gtest/gtest.h>

#include <random>

#include "zerotrain/error.h"
#include "zerotrain/layout/layout.h"

namespace {

using zt::compute_layout;
using zt::FlatLayout;
using zt::LayoutOptions;
using zt::ParameterSpec;

std::vector<ParameterSpec> random_parameters(std::mt19937& rng) {
  std::uniform_int_distribution<int> count(1, 40), rank_of(1, 3), dim(1, 97);
  std::vector<ParameterSpec> specs(count(rng));
  for (size_t i = 0; i < specs.size(); ++i) {
    specs[i].name = "p" + std::to_string(i);
    const int dims = rank_of(rng);
    for (int d = 0; d < dims; ++d) specs[i].shape.push_back(dim(rng));
  }
  // Groups (stage-3 blocks) in runs, some parameters in none, as a model's blocks are.
  std::uniform_int_distribution<int> run_length(1, 5), group_of(-1, 6);
  for (size_t i = 0; i < specs.size();) {
    const int group = group_of(rng);
    for (int k = run_length(rng); k > 0 && i < specs.size(); --k) specs[i++].group = group;
  }
  return specs;
}

int64_t numel_of(const ParameterSpec& spec) {
  int64_t n = 1;
  for (auto d : spec.shape) n *= d;
  return n;
}

TEST(Layout, RandomListsEveryElementOwnedOnceAlignedAndBucketed) {
  std::mt19937 rng(20261129);
  std::uniform_int_distribution<int64_t> bucket_size(1, 60000);
  std::uniform_int_distribution<int> alignment_pick(0, 3);
  const int64_t alignments[] = {1, 8, 16, 32};
  int cases = 0;
  for (int list = 0; list < 120; ++list) {
    const auto specs = random_parameters(rng);
    int64_t psi = 0;
    for (const auto& s : specs) psi += numel_of(s);
    for (int world = 1; world <= 8; ++world) {
      LayoutOptions options{world, alignments[alignment_pick(rng)], bucket_size(rng)};
      const FlatLayout layout = compute_layout(specs, options);
      SCOPED_TRACE("list " + std::to_string(list) + " world " + std::to_string(world) + " bucket " +
                   std::to_string(options.bucket_size) + " align " + std::to_string(options.alignment));
      ++cases;
      ASSERT_EQ(layout.parameter_numel, psi);
      ASSERT_EQ(layout.placements.size(), specs.size());
      ASSERT_EQ(layout.total_numel % (world * options.alignment), 0);
      ASSERT_EQ(layout.partition_numel * world, layout.total_numel);

      // Reverse registration order, each parameter once, within its bucket, no overlaps.
      for (size_t i = 0; i < layout.placements.size(); ++i) {
        const auto& p = layout.placements[i];
        ASSERT_EQ(p.index, int(specs.size() - 1 - i));
        ASSERT_EQ(p.numel, numel_of(specs[p.index]));
        const auto& b = layout.buckets[p.bucket];
        ASSERT_GE(p.offset, b.offset);
        ASSERT_LE(p.offset + p.numel, b.offset + b.numel);
        if (i > 0) ASSERT_GE(p.offset, layout.placements[i - 1].offset + layout.placements[i - 1].numel);
      }
      // Buckets tile the buffer; each respects the size unless it holds one oversized parameter;
      // padding below one quantum; shards equal and aligned; partitions laid out bucket by bucket.
      int64_t cursor = 0, partition_cursor = 0;
      for (size_t b = 0; b < layout.buckets.size(); ++b) {
        const auto& bucket = layout.buckets[b];
        ASSERT_EQ(bucket.offset, cursor);
        ASSERT_EQ(bucket.numel, bucket.shard_numel * world);
        ASSERT_EQ(bucket.shard_numel % options.alignment, 0);
        ASSERT_EQ(bucket.offset % options.alignment, 0);
        ASSERT_EQ(bucket.partition_offset, partition_cursor);
        ASSERT_LT(bucket.numel - bucket.parameter_numel, world * options.alignment);
        const int held = bucket.end_placement - bucket.first_placement;
        ASSERT_GE(held, 1);
        if (held > 1) ASSERT_LE(bucket.parameter_numel, options.bucket_size);
        for (int pi = bucket.first_placement; pi < bucket.end_placement; ++pi)
          ASSERT_EQ(specs[layout.placements[pi].index].group, bucket.group) << "a bucket holds one group";
        // A bucket closes only when the next parameter would not fit or is of another group.
        if (b + 1 < layout.buckets.size() && specs[layout.placements[bucket.end_placement].index].group == bucket.group)
          ASSERT_GT(bucket.parameter_numel + layout.placements[bucket.end_placement].numel, options.bucket_size);
        cursor += bucket.numel;
        partition_cursor += bucket.shard_numel;
      }
      ASSERT_EQ(cursor, layout.total_numel);

      // Ownership: the fragments of all ranks cover every element exactly once, and agree with
      // the placements.
      std::vector<uint8_t> owners(layout.total_numel, 0);
      for (int rank = 0; rank < world; ++rank) {
        int64_t partition_expected = 0;
        for (const auto& f : layout.owned_fragments(rank)) {
          ASSERT_EQ(f.partition_offset, partition_expected);
          partition_expected += f.numel;
          ASSERT_GT(f.numel, 0);
          const auto& bucket = layout.buckets[f.bucket];
          ASSERT_GE(f.flat_offset, layout.shard_offset(f.bucket, rank));
          ASSERT_LE(f.flat_offset + f.numel, layout.shard_offset(f.bucket, rank) + bucket.shard_numel);
          if (f.placement >= 0) {
            const auto& p = layout.placements[f.placement];
            ASSERT_EQ(f.flat_offset, p.offset + f.parameter_offset);
            ASSERT_LE(f.parameter_offset + f.numel, p.numel);
          }
          for (int64_t e = f.flat_offset; e < f.flat_offset + f.numel; ++e) ++owners[e];
        }
        ASSERT_EQ(partition_expected, layout.partition_numel);
      }
      for (int64_t e = 0; e < layout.total_numel; ++e) ASSERT_EQ(owners[e], 1) << "element " << e;
    }
  }
  EXPECT_GE(cases, 800);
}

TEST(Layout, PaddingIsSmallForARealisticModel) {
  // 12 blocks of a 768-wide transformer, default bucket: padding stays far below 1%.
  std::vector<ParameterSpec> specs{{"wte", {50257, 768}}, {"wpe", {1024, 768}}};
  for (int l = 0; l < 12; ++l)
    for (auto shape : std::vector<std::vector<int64_t>>{{768}, {768}, {2304, 768}, {2304}, {768, 768}, {768},
                                                        {768}, {768}, {3072, 768}, {3072}, {768, 3072}, {768}})
      specs.push_back({"h" + std::to_string(l), shape});
  for (int world = 1; world <= 8; ++world) {
    auto layout = compute_layout(specs, {world, 32, 500'000'000});
    EXPECT_LT(double(layout.total_numel - layout.parameter_numel) / layout.parameter_numel, 0.01);
  }
}

TEST(Layout, BadInputNamesTheProblem) {
  auto message = [](const std::vector<ParameterSpec>& specs, LayoutOptions options) {
    try {
      compute_layout(specs, options);
    } catch (const zt::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::vector<ParameterSpec> ok{{"w", {4, 4}}};
  EXPECT_NE(message(ok, {0, 32, 10}).find("world_size must be at least 1, found 0"), std::string::npos);
  EXPECT_NE(message(ok, {1, 0, 10}).find("alignment must be at least 1"), std::string::npos);
  EXPECT_NE(message(ok, {1, 32, 0}).find("bucket_size must be at least 1"), std::string::npos);
  EXPECT_NE(message({}, {1, 32, 10}).find("expected at least one parameter"), std::string::npos);
  EXPECT_NE(message({{"e", {3, 0}}}, {1, 32, 10}).find("parameter 'e' has no elements"), std::string::npos);
  EXPECT_NE(message({{"n", {-2}}}, {1, 32, 10}).find("parameter 'n' has a negative dimension -2"), std::string::npos);
  EXPECT_NE(message({{"a", {2}, "float32"}, {"b", {2}, "bfloat16"}}, {1, 32, 10}).find("found bfloat16 for 'b'"),
            std::string::npos);
  EXPECT_NE(message(ok, {2, 32, 10}).find("no error"), std::string::npos);
  EXPECT_THROW(compute_layout(ok, {2, 32, 10}).owned_fragments(2), zt::ConfigError);
}

// Stage 3's blocks: a marked module's parameters of at least the threshold form its block (ids in
// order of appearance), the rest are persistent and come first within their module's run.
TEST(Layout, Stage3BlocksPutPersistentParametersFirstWithinTheirModule) {
  std::vector<ParameterSpec> specs = {{"free", {7}},     {"a.bias", {3}}, {"a.weight", {4, 4}},
                                      {"b.weight", {5, 5}}, {"b.bias", {5}}, {"c.bias", {2}}};
  const std::vector<int> owners = {-1, 0, 0, 1, 1, 2};
  const zt::Stage3Blocks blocks = zt::assign_stage3_blocks(specs, owners, 10);
  EXPECT_EQ(blocks.module_of_block, (std::vector<int>{0, 1}));  // module 2 has nothing over the threshold
  std::vector<int> groups;
  for (const ParameterSpec& s : specs) groups.push_back(s.group);
  EXPECT_EQ(groups, (std::vector<int>{-1, -1, 0, 1, -1, -1}));
  EXPECT_EQ(blocks.order, (std::vector<size_t>{0, 1, 2, 4, 3, 5}));
}

}  // namespace
