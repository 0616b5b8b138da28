// Every rank of a run must start the same run: the same resolved configuration and the same
// trainable parameters. Ranks whose configurations differ in a key that leaves the collectives'
// shapes alone (stage 1 on one rank, stage 2 on another) would otherwise train to the end, each
// computing something else. Checked once when an engine is built, before its first collective.
#pragma once
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace zt {

class Communicator;
struct TrainConfig;

// "key = value" for every key of the resolved configuration that every rank must share, in the
// configuration's order. Left out: the keys that name a rank's own files and resources (paths,
// directories, output files, job names, thread counts), which may differ between nodes.
std::vector<std::string> configuration_agreement_lines(const TrainConfig& config);

// "parameter NAME = [shape] dtype" for every trainable parameter of `model`, in registration
// order; the shape is the parameter's logical shape (a parameter built sharded included).
std::vector<std::string> model_agreement_lines(const torch::nn::Module& model);

// One collective when the ranks agree (a digest of `lines`, reduced). When they do not, rank 0's
// lines are broadcast and every rank throws ConfigError naming the first key in which a rank
// differs from rank 0, both values, and `what` (the configuration, the model).
void check_ranks_agree(Communicator& comm, const std::vector<std::string>& lines, const std::string& what);

}  // namespace zt
