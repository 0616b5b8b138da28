#include "checkpoint/json_bounds.h"

#include <nlohmann/json.hpp>

namespace zt {
namespace {

struct BoundsChecker {
  using json = nlohmann::json;
  using number_integer_t = json::number_integer_t;
  using number_unsigned_t = json::number_unsigned_t;
  using number_float_t = json::number_float_t;
  using string_t = json::string_t;
  using binary_t = json::binary_t;

  int max_depth = 0;
  int64_t max_root_keys = 0;
  int depth = 0;
  int64_t root_keys = 0;
  std::string problem;

  bool enter() {
    if (++depth <= max_depth) return true;
    problem = "nests deeper than " + std::to_string(max_depth) + " levels";
    return false;
  }
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(number_integer_t) { return true; }
  bool number_unsigned(number_unsigned_t) { return true; }
  bool number_float(number_float_t, const string_t&) { return true; }
  bool string(string_t&) { return true; }
  bool binary(binary_t&) { return true; }
  bool start_object(std::size_t) { return enter(); }
  bool key(string_t&) {
    if (depth != 1 || ++root_keys <= max_root_keys) return true;
    problem = "has more than " + std::to_string(max_root_keys) + " entries";
    return false;
  }
  bool end_object() {
    --depth;
    return true;
  }
  bool start_array(std::size_t) { return enter(); }
  bool end_array() {
    --depth;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    problem = std::string("is not valid JSON (") + e.what() + ")";
    return false;
  }
};

}  // namespace

std::string json_bounds_problem(std::string_view text, int max_depth, int64_t max_root_keys) {
  BoundsChecker checker;
  checker.max_depth = max_depth;
  checker.max_root_keys = max_root_keys;
  if (nlohmann::json::sax_parse(text, &checker)) return "";
  return checker.problem.empty() ? "is not valid JSON" : checker.problem;
}

}  // namespace zt
