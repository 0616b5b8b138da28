// Python's json module writes Infinity, -Infinity and NaN, which JSON lacks (Accelerate writes
// `"steps_per_print": Infinity`, DeepSpeed's "never"). The configuration reader marks them before
// parsing and resolves them after.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace zt::config_detail {

// The text with each Infinity, -Infinity or NaN outside strings and comments turned into a JSON
// string that marks it.
std::string mark_non_finite(const std::string& text);
// Replaces the marks in a parsed document: steps_per_print's Infinity becomes the largest count
// (never reached); any other throws zt::ConfigError naming `origin` and the key's dotted path
// (`path`: where `node` sits).
void resolve_non_finite(nlohmann::json& node, const std::string& path, const std::string& origin);

}  // namespace zt::config_detail
