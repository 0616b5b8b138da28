// The key table's builders (schema_keys.h).
#include "config/schema_keys.h"

namespace zt::config_detail::keys {

Leaf make(std::string path, Kind kind, json def, std::function<void(TrainConfig&, const json&)> assign) {
  Leaf leaf;
  leaf.path = std::move(path);
  leaf.kind = kind;
  leaf.def = std::move(def);
  leaf.assign = std::move(assign);
  return leaf;
}
Leaf boolean(std::string path, bool def, std::function<void(TrainConfig&, const json&)> assign) {
  return make(std::move(path), Kind::Bool, def, std::move(assign));
}
Leaf integer(std::string path, int64_t def, std::optional<double> lo, std::optional<double> hi,
             std::function<void(TrainConfig&, const json&)> assign) {
  Leaf leaf = make(std::move(path), Kind::Int, def, std::move(assign));
  leaf.lo = lo;
  leaf.hi = hi;
  return leaf;
}
Leaf number(std::string path, double def, std::optional<double> lo, bool lo_open, std::optional<double> hi,
            bool hi_open, std::function<void(TrainConfig&, const json&)> assign) {
  Leaf leaf = make(std::move(path), Kind::Number, def, std::move(assign));
  leaf.lo = lo;
  leaf.lo_open = lo_open;
  leaf.hi = hi;
  leaf.hi_open = hi_open;
  return leaf;
}
Leaf positive(std::string path, double def, std::function<void(TrainConfig&, const json&)> assign) {
  return number(std::move(path), def, 0.0, true, std::nullopt, false, std::move(assign));
}
Leaf non_negative(std::string path, double def, std::function<void(TrainConfig&, const json&)> assign) {
  return number(std::move(path), def, 0.0, false, std::nullopt, false, std::move(assign));
}
Leaf string(std::string path, std::string def, std::function<void(TrainConfig&, const json&)> assign,
            std::vector<std::string> choices) {
  Leaf leaf = make(std::move(path), Kind::String, std::move(def), std::move(assign));
  leaf.choices = std::move(choices);
  return leaf;
}
Leaf batch(std::string path, std::function<void(TrainConfig&, const json&)> assign) {
  return make(std::move(path), Kind::BatchSize, "auto", std::move(assign));
}
// A DeepSpeed key that zerotrain recognises but does not implement and that would change the
// training: only the default passes. `about` names the feature for the refusal.
Leaf reserved(Leaf leaf, std::string about) {
  leaf.supported = false;
  leaf.status = Status::Reserved;
  leaf.about = std::move(about);
  leaf.assign = nullptr;
  return leaf;
}
// A DeepSpeed key that cannot change a zerotrain run: accepted, a note when set (`about` says why).
Leaf inert(Leaf leaf, std::string about) {
  leaf.status = Status::Inert;
  leaf.about = std::move(about);
  leaf.assign = nullptr;
  return leaf;
}
// A DeepSpeed report zerotrain does not produce: accepted, named in the warning when set.
Leaf reporting(Leaf leaf, std::string about) {
  leaf.status = Status::Reporting;
  leaf.about = std::move(about);
  leaf.assign = nullptr;
  return leaf;
}
// A whole DeepSpeed feature block, read only for whether it switches the feature on.
Leaf block(std::string path, std::function<bool(const json&)> engaged) {
  Leaf leaf = make(std::move(path), Kind::Object, json::object(), nullptr);
  leaf.nullable = true;
  leaf.engaged = std::move(engaged);
  return leaf;
}
bool enabled_in(const json& v) {
  return v.is_object() && v.contains("enabled") && v["enabled"].is_boolean() && v["enabled"].get<bool>();
}
// True when any "enabled": true appears anywhere inside (compression_training's techniques each
// have their own switch, nested two levels down).
bool any_enabled(const json& v) {
  if (enabled_in(v)) return true;
  if (v.is_object() || v.is_array())
    for (const json& child : v) if (any_enabled(child)) return true;
  return false;
}
bool non_empty(const json& v) { return !v.is_null() && !(v.is_object() && v.empty()); }
Leaf nullable_string(std::string path, std::vector<std::string> choices) {
  Leaf leaf = make(std::move(path), Kind::String, nullptr, nullptr);
  leaf.nullable = true;
  leaf.choices = std::move(choices);
  return leaf;
}
Leaf nullable(Leaf leaf) {
  leaf.nullable = true;
  return leaf;
}

}  // namespace zt::config_detail::keys
