// Internal to src/config: what the key table's sections (schema_*.cpp) build it with. The
// builders give a Leaf its kind, default and range; the sections add the keys of one part of the
// configuration each, in the table's order (build_table in schema.cpp).
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "config/schema.h"

namespace zt::config_detail::keys {

// Stores a checked value in a field of whatever type the field has. An integer the field cannot
// hold means the table's range is wider than the field: a defect of the table, never stored
// truncated (config_test checks every integer key at its upper bound).
template <typename T>
void store(T& field, const json& v) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    const int64_t wide = v.get<int64_t>();
    if (!std::in_range<T>(wide))
      throw std::logic_error(fmt::format("configuration table: {} does not fit its field", wide));
    field = static_cast<T>(wide);
  } else {
    field = v.get<T>();
  }
}
#define ZT_FIELD(member) [](TrainConfig& c, const json& v) { store(c.member, v); }

Leaf make(std::string path, Kind kind, json def, std::function<void(TrainConfig&, const json&)> assign);
Leaf boolean(std::string path, bool def, std::function<void(TrainConfig&, const json&)> assign);
Leaf integer(std::string path, int64_t def, std::optional<double> lo, std::optional<double> hi,
             std::function<void(TrainConfig&, const json&)> assign);
Leaf number(std::string path, double def, std::optional<double> lo, bool lo_open, std::optional<double> hi,
            bool hi_open, std::function<void(TrainConfig&, const json&)> assign);
Leaf positive(std::string path, double def, std::function<void(TrainConfig&, const json&)> assign);
Leaf non_negative(std::string path, double def, std::function<void(TrainConfig&, const json&)> assign);
Leaf string(std::string path, std::string def, std::function<void(TrainConfig&, const json&)> assign,
            std::vector<std::string> choices = {});
Leaf batch(std::string path, std::function<void(TrainConfig&, const json&)> assign);
// A DeepSpeed key that zerotrain recognises but does not implement and that would change the
// training: only the default passes. `about` names the feature for the refusal.
Leaf reserved(Leaf leaf, std::string about);
// A DeepSpeed key that cannot change a zerotrain run: accepted, a note when set (`about` says why).
Leaf inert(Leaf leaf, std::string about);
// A DeepSpeed report zerotrain does not produce: accepted, named in the warning when set.
Leaf reporting(Leaf leaf, std::string about);
// A whole DeepSpeed feature block, read only for whether it switches the feature on.
Leaf block(std::string path, std::function<bool(const json&)> engaged);
// Whether a block has "enabled": true.
bool enabled_in(const json& v);
// True when any "enabled": true appears anywhere inside (compression_training's techniques each
// have their own switch, nested two levels down).
bool any_enabled(const json& v);
bool non_empty(const json& v);
Leaf nullable_string(std::string path, std::vector<std::string> choices = {});
Leaf nullable(Leaf leaf);

constexpr int64_t k5e8 = 500'000'000, k1e9 = 1'000'000'000;

// The table's sections, in its order.
void add_top_level_keys(std::vector<Leaf>& t);
void add_feature_block_keys(std::vector<Leaf>& t);
void add_optimizer_keys(std::vector<Leaf>& t);
void add_scheduler_keys(std::vector<Leaf>& t);
void add_zero_keys(std::vector<Leaf>& t);
void add_zero_variant_keys(std::vector<Leaf>& t);
void add_offload_keys(std::vector<Leaf>& t);
void add_precision_keys(std::vector<Leaf>& t);
void add_monitor_keys(std::vector<Leaf>& t);
void add_report_keys(std::vector<Leaf>& t);
void add_activation_checkpointing_keys(std::vector<Leaf>& t);
void add_aio_keys(std::vector<Leaf>& t);
void add_zerotrain_keys(std::vector<Leaf>& t);

}  // namespace zt::config_detail::keys
