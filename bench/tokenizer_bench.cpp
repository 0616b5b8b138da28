// Encoding throughput of zt::HfTokenizer on one thread: each line of a text file encoded with
// encode() (no template), best of REPEATS passes over the file. bench/tokenizer_bench.sh runs it
// beside the Python `tokenizers` library's encode_batch on one thread (docs/benchmarks.md).
//   tokenizer_bench TOKENIZER_JSON TEXT_FILE REPEATS
// Prints {"seconds": best pass, "bytes": ..., "tokens": ..., "load_seconds": ...} on one line.
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "zerotrain/error.h"
#include "zerotrain/data/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: tokenizer_bench TOKENIZER_JSON TEXT_FILE REPEATS\n";
    return 2;
  }
  using Clock = std::chrono::steady_clock;
  try {
    const auto load_start = Clock::now();
    const zt::HfTokenizer tokenizer = zt::HfTokenizer::from_file(argv[1]);
    const double load_seconds = std::chrono::duration<double>(Clock::now() - load_start).count();
    std::ifstream in(argv[2], std::ios::binary);
    if (!in) throw zt::DataError(std::string("tokenizer_bench: cannot open the text file ") + argv[2]);
    std::stringstream buffer;
    buffer << in.rdbuf();
    const std::string text = buffer.str();
    // The same lines Python's str.split("\n") gives, the last one included even when empty.
    std::vector<std::string_view> lines;
    for (size_t start = 0;;) {
      const size_t end = text.find('\n', start);
      lines.push_back(std::string_view(text).substr(start, end == std::string::npos ? std::string::npos : end - start));
      if (end == std::string::npos) break;
      start = end + 1;
    }
    const int repeats = std::stoi(argv[3]);
    double best = 1e300;
    size_t tokens = 0, bytes = 0;
    for (int r = 0; r < repeats; ++r) {
      tokens = bytes = 0;
      const auto start = Clock::now();
      for (const std::string_view line : lines) {
        tokens += tokenizer.encode(line).size();
        bytes += line.size();
      }
      best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
    }
    std::cout << nlohmann::json{{"seconds", best}, {"bytes", bytes}, {"tokens", tokens}, {"load_seconds", load_seconds}}.dump()
              << "\n";
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
