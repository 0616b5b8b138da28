#include "zero/start_agreement.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

// Keys whose values name what belongs to one rank or one node: each node may mount its swap
// space, logs and outputs elsewhere, and size its own threads.
bool rank_local(const std::string& key) {
  const std::string leaf = key.substr(key.rfind('.') == std::string::npos ? 0 : key.rfind('.') + 1);
  for (const char* suffix : {"path", "dir", "file", "folder"})
    if (leaf.size() >= std::strlen(suffix) && leaf.compare(leaf.size() - std::strlen(suffix), std::string::npos, suffix) == 0)
      return true;
  return leaf == "job_name" || leaf == "threads" || leaf.rfind("output", 0) == 0;
}

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += line + '\n';
  return text;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1)
    lines.push_back(text.substr(start, end - start));
  return lines;
}

std::pair<std::string, std::string> key_and_value(const std::string& line) {
  const size_t eq = line.find(" = ");
  if (eq == std::string::npos) return {line, ""};
  return {line.substr(0, eq), line.substr(eq + 3)};
}

// The first line in which this rank's `own` lines differ from rank 0's, as a sentence; empty when
// they are the same.
std::string first_difference(const std::vector<std::string>& own, const std::vector<std::string>& reference,
                             int rank, const std::string& what) {
  std::map<std::string, std::string> theirs;
  for (const auto& line : reference) theirs.insert(key_and_value(line));
  std::map<std::string, std::string> mine;
  for (const auto& line : own) {
    const auto [key, value] = key_and_value(line);
    mine.emplace(key, value);
    const auto it = theirs.find(key);
    if (it == theirs.end())
      return "rank " + std::to_string(rank) + "'s " + what + " has " + key + " = " + value + ", which rank 0's lacks";
    if (it->second != value)
      return "rank " + std::to_string(rank) + " has " + key + " = " + value + " where rank 0 has " + it->second;
  }
  for (const auto& line : reference) {
    const auto [key, value] = key_and_value(line);
    if (!mine.count(key))
      return "rank 0's " + what + " has " + key + " = " + value + ", which rank " + std::to_string(rank) + "'s lacks";
  }
  // Same keys and values, another order (the model's parameters registered differently).
  return own == reference ? std::string() : "rank " + std::to_string(rank) + "'s " + what + " lists its entries in another order than rank 0's";
}

std::string shape_of(const at::Tensor& p) {
  std::ostringstream out;
  out << p.sizes();
  return out.str();
}

}  // namespace

std::vector<std::string> configuration_agreement_lines(const TrainConfig& config) {
  std::vector<std::string> lines;
  for (const auto& [key, value] : config.resolved)
    if (!rank_local(key)) lines.push_back(key + " = " + value);
  // Decided per rank after parsing (16-bit precision falls back to fp32 on a CPU without 16-bit
  // units): ranks on different CPUs could otherwise reduce buffers of different dtypes.
  lines.push_back(std::string("precision in effect = ") + to_string(config.precision));
  return lines;
}

std::vector<std::string> model_agreement_lines(const torch::nn::Module& model) {
  std::vector<std::string> lines;
  for (const auto& named : model.named_parameters(/*recurse=*/true))
    if (named.value().requires_grad())
      lines.push_back("parameter '" + named.key() + "' = " + shape_of(named.value()) + " " +
                      std::string(c10::toString(named.value().scalar_type())));
  return lines;
}

void check_ranks_agree(Communicator& comm, const std::vector<std::string>& lines, const std::string& what) {
  if (comm.world_size() == 1) return;
  const std::string text = joined(lines);
  const uint64_t digest = fnv1a(text);
  // Halves of 32 bits are exact in a double; the maximum of x and of -x give the range.
  const double high = double(digest >> 32), low = double(digest & 0xffffffffull);
  at::Tensor range = at::tensor({high, low, -high, -low}, at::kDouble);
  comm.all_reduce(range, ReduceOp::Max, "start.agreement." + what).wait();
  const auto* r = range.data_ptr<double>();
  if (r[0] == -r[2] && r[1] == -r[3]) return;

  at::Tensor size = at::tensor({int64_t(text.size())}, at::kLong);
  comm.broadcast(size, 0, "start.agreement." + what + ".size").wait();
  at::Tensor bytes = at::zeros({size.item<int64_t>()}, at::kByte);
  if (comm.rank() == 0) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  comm.broadcast(bytes, 0, "start.agreement." + what).wait();
  const std::string reference(reinterpret_cast<const char*>(bytes.data_ptr()), size_t(bytes.numel()));
  const std::string difference =
      comm.rank() == 0 ? std::string() : first_difference(lines, split_lines(reference), comm.rank(), what);
  on_every_rank(comm, "start.agreement", [&] {
    if (!difference.empty())
      throw ConfigError("ranks started with different " + what + "s: " + difference +
                        "; every rank must start with the same " + what);
  });
  // The digests differ but no rank found a difference: only a hash collision of equal texts
  // could do that, and equal texts have equal hashes.
  throw Error("ranks started with different " + what + "s, but no rank found the difference");
}

}  // namespace zt
