// A bounded look at untrusted JSON before it is parsed into a document: one streaming (SAX) pass
// that allocates nothing per value, so that a hostile header or manifest cannot make the parser
// build an outsized document or nest without limit.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace zt {

// Empty if `text` is JSON whose containers nest at most `max_depth` deep (the root container is
// depth 1) and whose root object has at most `max_root_keys` keys; else the problem in words
// ("nests deeper than 3 levels", "has more than 1000000 entries", or the parser's message).
std::string json_bounds_problem(std::string_view text, int max_depth, int64_t max_root_keys);

}  // namespace zt
