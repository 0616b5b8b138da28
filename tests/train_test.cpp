// End-to-end `zerotrain train` through the CLI and launcher: stage-0 parity across world sizes,
// the summary file, the rank environment of external launchers, and bad input.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <sstream>

#include "checkpoint/safetensors.h"
#include "support/process.h"
#include "zerotrain/data/data.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/config/gpt_flops.h"

namespace {

using zt::testing::cli_path;
using zt::testing::make_temp_dir;
using zt::testing::run_process;

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  auto path = std::filesystem::path(dir) / name;
  std::ofstream(path) << text;
  return path.string();
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// Tiny GPT, 5 optimizer steps, accumulation 2, global batch 12, clipping far below the gradient
// norm so that it is active on every step.
std::string parity_config(const std::string& dir) {
  return write_file(dir, "config.json", R"({
    "train_batch_size": 12, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.003, "warmup_type": "linear"}},
    "steps_per_print": 1,
    "model": {"preset": "tiny"},
    "data": {"source": "embedded", "sequence_length": 32},
    "train": {"steps": 5, "seed": 11, "threads": 1, "log_dir": ")" + dir + R"("}})");
}

struct Run {
  nlohmann::json summary;
  std::vector<double> grad_norms;
  std::vector<std::string> csv_header;
  std::vector<std::vector<std::string>> csv_rows;
  std::string output;
};

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> fields;
  std::stringstream in(line);
  std::string field;
  while (std::getline(in, field, ',')) fields.push_back(field);
  if (!line.empty() && line.back() == ',') fields.emplace_back();
  return fields;
}

Run train(int world, const std::vector<std::string>& overrides = {}, const std::map<std::string, std::string>& env = {}) {
  auto dir = make_temp_dir("parity" + std::to_string(world));
  auto summary = dir + "/summary.json";
  std::vector<std::string> args{cli_path(), "train", parity_config(dir), "--nproc", std::to_string(world), "--summary",
                                summary};
  for (const auto& o : overrides) {
    args.push_back("--set");
    args.push_back(o);
  }
  auto r = run_process(args, env, std::chrono::seconds(240));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  Run run;
  run.output = r.output;
  if (r.exit_code != 0) return run;
  run.summary = read_json(summary);
  std::ifstream csv(dir + "/zerotrain.csv");
  std::string line;
  if (std::getline(csv, line)) run.csv_header = split_csv(line);
  while (std::getline(csv, line)) {
    run.csv_rows.push_back(split_csv(line));
    if (run.csv_rows.back().size() > 3) run.grad_norms.push_back(std::stod(run.csv_rows.back()[3]));
  }
  return run;
}

TEST(TrainParity, TwoAndThreeRanksEqualOneRank) {
  auto one = train(1);
  ASSERT_EQ(one.summary["losses"].size(), 5u);
  ASSERT_EQ(one.grad_norms.size(), 5u);
  for (double norm : one.grad_norms) EXPECT_GT(norm, 0.05) << "clipping must be active";
  for (int world : {2, 3}) {
    auto other = train(world);
    ASSERT_EQ(other.summary["world_size"], world);
    ASSERT_EQ(other.summary["losses"].size(), 5u);
    for (size_t i = 0; i < 5; ++i) {
      double a = one.summary["losses"][i], b = other.summary["losses"][i];
      EXPECT_LE(std::abs(a - b) / std::abs(a), 1e-5) << "world " << world << " step " << i << ": " << a << " vs " << b;
    }
  }
}

// The 2-D grid through the command line: 4 ranks as 2 tensor groups of 2 train as 2 ranks of
// data parallelism alone (the same batches, the batch keys counting data-parallel ranks), at
// stages 0 and 3, also with the checkpointed block inputs partitioned over the tensor groups.
TEST(TrainTensorParallel, TwoByTwoGridEqualsTwoDataParallelRanks) {
  for (const std::string stage : {"0", "3"}) {
    auto plain = train(2, {"zero_optimization.stage=" + stage});
    auto grid = train(4, {"zero_optimization.stage=" + stage, "tensor_parallel.autotp_size=2"});
    // ZeRO-R's partitioned activations with full recomputation: the same run.
    auto partitioned = train(4, {"zero_optimization.stage=" + stage, "tensor_parallel.autotp_size=2",
                                 "activation_checkpointing.policy=\"full\"",
                                 "activation_checkpointing.partition_activations=true"});
    ASSERT_EQ(partitioned.summary["losses"].size(), 5u) << partitioned.output;
    ASSERT_EQ(grid.summary["tensor_parallel"], 2) << grid.output;
    ASSERT_EQ(grid.summary["data_parallel_size"], 2);
    ASSERT_EQ(grid.summary["losses"].size(), 5u);
    EXPECT_NE(grid.output.find("tensor parallelism: 2 data-parallel group(s) of 2 rank(s)"), std::string::npos)
        << grid.output;
    for (size_t i = 0; i < 5; ++i) {
      double a = plain.summary["losses"][i], b = grid.summary["losses"][i];
      EXPECT_LE(std::abs(a - b) / std::abs(a), 1e-5) << "stage " << stage << " step " << i << ": " << a << " vs " << b;
      EXPECT_LE(std::abs(plain.grad_norms[i] - grid.grad_norms[i]) / plain.grad_norms[i], 1e-5)
          << "stage " << stage << " step " << i;
      double c = partitioned.summary["losses"][i];
      EXPECT_LE(std::abs(a - c) / std::abs(a), 1e-5) << "partitioned, stage " << stage << " step " << i;
    }
  }
}

// The Llama (grouped-query attention) split over tensor groups of 2 on a 2 x 2 grid trains what 2
// data-parallel ranks train at stage 3.
TEST(TrainTensorParallel, LlamaGridEqualsTwoDataParallelRanks) {
  const auto dir = make_temp_dir("llama-tp");
  auto run = [&](int world, int tensor, const std::string& name) {
    const std::string summary = dir + "/" + name + ".json";
    auto r = run_process({cli_path(), "train", std::string(ZT_SOURCE_DIR) + "/configs/llama_tiny.json", "--nproc",
                          std::to_string(world), "--steps", "4", "--summary", summary, "--set",
                          "zero_optimization.stage=3", "--set", "train.eval_interval=0", "--set",
                          "tensor_parallel.autotp_size=" + std::to_string(tensor), "--set",
                          "train.log_dir=\"" + dir + "/" + name + "\""},
                         {}, std::chrono::seconds(240));
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
    return r.exit_code == 0 ? read_json(summary) : nlohmann::json();
  };
  const auto plain = run(2, 1, "plain"), grid = run(4, 2, "grid");
  ASSERT_FALSE(plain.is_null() || grid.is_null());
  EXPECT_EQ(grid["tensor_parallel"], 2);
  ASSERT_EQ(grid["losses"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const double a = plain["losses"][i], b = grid["losses"][i];
    EXPECT_LE(std::abs(a - b) / a, 1e-5) << "step " << i + 1 << ": " << a << " vs " << b;
  }
}

// Whether /proc/cpuinfo lists every flag in `flags`.
bool cpu_has_flags(std::initializer_list<const char*> flags) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) {
      line += " ";
      for (const char* f : flags)
        if (line.find(std::string(" ") + f + " ") == std::string::npos) return false;
      return true;
    }
  return false;
}

// bf16/fp16 on a CPU without LibTorch's fast 16-bit matrix multiply trains in fp32 ("auto"),
// exactly as an fp32 run, and says so; "always" keeps the configured precision. The CPU's answer
// is forced both ways (ZT_CPU_HALF_PRECISION_UNITS) so that every machine kind runs each case.
TEST(TrainPrecision, SixteenBitWithoutTheCpuUnitsTrainsInFp32AndSaysSo) {
  const std::map<std::string, std::string> absent{{"ZT_CPU_HALF_PRECISION_UNITS", "absent"}};
  const std::map<std::string, std::string> present{{"ZT_CPU_HALF_PRECISION_UNITS", "present"}};
  const auto fp32 = train(2, {"zero_optimization.stage=1"});
  const auto fallback = train(2, {"zero_optimization.stage=1", "bf16.enabled=true"}, absent);
  ASSERT_EQ(fallback.summary["losses"].size(), 5u) << fallback.output;
  EXPECT_EQ(fallback.summary["precision"], "fp32");
  EXPECT_EQ(fallback.summary["precision_configured"], "bf16");
  EXPECT_NE(fallback.output.find("this run trains in fp32"), std::string::npos) << fallback.output;
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(fallback.summary["losses"][i], fp32.summary["losses"][i]) << "step " << i;

  const auto fp16 = train(2, {"zero_optimization.stage=1", "fp16.enabled=true"}, absent);
  EXPECT_EQ(fp16.summary["precision"], "fp32");
  EXPECT_EQ(fp16.summary["precision_configured"], "fp16");

  for (const auto& [overrides, env] :
       {std::pair{std::vector<std::string>{"bf16.enabled=true", "train.cpu_half_precision=always"}, absent},
        std::pair{std::vector<std::string>{"bf16.enabled=true"}, present}}) {
    const auto kept = train(2, overrides, env);
    EXPECT_EQ(kept.summary["precision"], "bf16") << overrides.back();
    EXPECT_EQ(kept.output.find("this run trains in fp32"), std::string::npos) << kept.output;
  }

  // Unforced, the answer is LibTorch's: oneDNN's bf16 path needs AVX-512 (BW, VL, DQ) or
  // AVX2-VNNI-2 (AVX-NE-CONVERT with AVX-VNNI-INT8).
  const bool units = cpu_has_flags({"avx512bw", "avx512vl", "avx512dq"}) ||
                     cpu_has_flags({"avx_ne_convert", "avx_vnni_int8"});
  const auto detected = train(2, {"bf16.enabled=true"});
  EXPECT_EQ(detected.summary["precision"], units ? "bf16" : "fp32") << detected.output;

  auto dir = make_temp_dir("precision-env");
  auto r = run_process({cli_path(), "train", parity_config(dir), "--nproc", "1", "--set", "bf16.enabled=true"},
                       {{"ZT_CPU_HALF_PRECISION_UNITS", "maybe"}}, std::chrono::seconds(60));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("ZT_CPU_HALF_PRECISION_UNITS: expected \"present\" or \"absent\", found \"maybe\""),
            std::string::npos)
      << r.output;
}

TEST(TrainSummary, HasTheDocumentedFields) {
  auto run = train(2);
  const auto& s = run.summary;
  for (auto key : {"world_size", "steps", "losses", "final_loss", "skipped_steps", "tokens_per_second", "ranks"})
    EXPECT_TRUE(s.contains(key)) << key;
  ASSERT_EQ(s["ranks"].size(), 2u);
  for (const auto& rank : s["ranks"]) {
    EXPECT_GT(rank["peak_rss_bytes"].get<int64_t>(), 0);
    const auto& m = rank["model_state_bytes"];
    EXPECT_GT(m["parameters"].get<int64_t>(), 0);
    EXPECT_EQ(m["gradients"], m["parameters"]);
    EXPECT_EQ(m["optimizer_states"].get<int64_t>(), 2 * m["parameters"].get<int64_t>());
  }
  EXPECT_EQ(s["skipped_steps"], 0);
  EXPECT_GT(s["tokens_per_second"].get<double>(), 0);
}

// Through the CLI on 2 ranks: stage 2 in bf16 and stage 3 in fp32 train, and the summary's
// per-rank model-state bytes equal the formula (2Ψ + 14Ψ/N; 16Ψ/N) up to the padding
// (docs/design.md "Memory per parameter").
TEST(TrainSummary, ShardedBytesMatchTheFormula) {
  struct Case {
    std::vector<std::string> overrides;
    std::string precision;
    int64_t bytes_per_parameter_whole, bytes_per_parameter_sharded;
  };
  for (const Case& c : {Case{{"zero_optimization.stage=2", "bf16.enabled=true", "train.cpu_half_precision=always"}, "bf16", 2, 14},
                        Case{{"zero_optimization.stage=3", "zero_optimization.stage3_param_persistence_threshold=0"}, "fp32", 0, 16}}) {
    auto run = train(2, c.overrides);
    const auto& s = run.summary;
    ASSERT_EQ(s["losses"].size(), 5u) << c.overrides[0];
    EXPECT_EQ(s["precision"], c.precision);
    const int64_t psi = s["trainable_parameters"];
    const auto& formula = s["model_state_formula_bytes"];
    EXPECT_EQ(formula["total"].get<int64_t>(), c.bytes_per_parameter_whole * psi + c.bytes_per_parameter_sharded * psi / 2);
    for (const auto& rank : s["ranks"]) {
      const auto& m = rank["model_state_bytes"];
      for (auto role : {"parameters", "gradients", "optimizer_states", "total"}) {
        EXPECT_GE(m[role].get<int64_t>(), formula[role].get<int64_t>()) << role << " " << c.overrides[0];
        EXPECT_LE(m[role].get<int64_t>(), formula[role].get<int64_t>() * 1.01) << role << " " << c.overrides[0];
      }
      EXPECT_GT(rank["buffer_bytes"].get<int64_t>(), 0);
    }
  }
}

// The per-step CSV carries real figures on every row, not only on the steps that print: each
// step's own tokens/s and the largest peak RSS over all ranks so far (docs/memory.md).
TEST(TrainCsv, EveryRowHasTokensPerSecondAndPeakRss) {
  auto run = train(2, {"steps_per_print=3"});
  ASSERT_EQ(run.csv_rows.size(), 5u) << run.output;
  const auto& header = run.csv_header;
  const auto column = [&](const std::string& name) {
    return size_t(std::find(header.begin(), header.end(), name) - header.begin());
  };
  const size_t rate = column("tokens_per_second"), peak = column("peak_rss_bytes_max"), step = column("step");
  ASSERT_LT(rate, header.size());
  ASSERT_LT(peak, header.size());
  ASSERT_LT(step, header.size());
  const int64_t summary_peak = std::max(run.summary["ranks"][0]["peak_rss_bytes"].get<int64_t>(),
                                        run.summary["ranks"][1]["peak_rss_bytes"].get<int64_t>());
  int64_t previous_peak = 0;
  for (size_t i = 0; i < run.csv_rows.size(); ++i) {
    const auto& row = run.csv_rows[i];
    SCOPED_TRACE(::testing::Message() << "row " << i + 1 << ": " << ::testing::PrintToString(row));
    ASSERT_EQ(row.size(), header.size());
    EXPECT_EQ(std::stoll(row[step]), int64_t(i + 1));
    ASSERT_FALSE(row[rate].empty());
    ASSERT_FALSE(row[peak].empty());
    const double tokens_per_second = std::stod(row[rate]);
    EXPECT_TRUE(std::isfinite(tokens_per_second));
    EXPECT_GT(tokens_per_second, 0);
    const int64_t peak_rss = std::stoll(row[peak]);
    // A process's peak RSS only grows, and every row's is at least this tiny run's 10 MiB.
    EXPECT_GT(peak_rss, int64_t(10) << 20);
    EXPECT_GE(peak_rss, previous_peak);
    EXPECT_LE(peak_rss, summary_peak);
    previous_peak = peak_rss;
  }
}

// Held-out evaluation every K steps (train.eval_interval) runs at every multiple of K and at the
// last step, gives finite losses, and leaves training bit for bit as it is without evaluation
// (dropout on, so that an evaluation drawing random numbers or leaving the model in eval mode
// would show).
TEST(TrainEval, EveryKStepsAtTheRightStepsWithoutChangingTraining) {
  const std::vector<std::string> common{"model.dropout=0.1", "data.val_fraction=0.2", "train.eval_iters=2"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), common.begin(), common.end());
    return extra;
  };
  auto plain = train(2, with({"train.eval_interval=0"}));
  auto evaluated = train(2, with({"train.eval_interval=2"}));
  ASSERT_EQ(plain.summary["losses"].size(), 5u) << plain.output;
  ASSERT_EQ(evaluated.summary["losses"].size(), 5u) << evaluated.output;
  EXPECT_TRUE(plain.summary["eval_losses"].empty());
  const auto& evals = evaluated.summary["eval_losses"];
  ASSERT_EQ(evals.size(), 3u) << evals.dump();
  const int64_t expected_steps[] = {2, 4, 5};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(evals[i]["step"].get<int64_t>(), expected_steps[i]) << evals.dump();
    const double loss = evals[i]["loss"].get<double>();
    EXPECT_TRUE(std::isfinite(loss)) << evals.dump();
    EXPECT_GT(loss, 0) << evals.dump();
    // Every step prints here (steps_per_print 1): the held-out loss is on exactly those lines.
    const std::string line = "step " + std::to_string(expected_steps[i]) + "/5 |";
    const size_t at = evaluated.output.find(line);
    ASSERT_NE(at, std::string::npos) << evaluated.output;
    const std::string printed = evaluated.output.substr(at, evaluated.output.find('\n', at) - at);
    char held_out[64];
    std::snprintf(held_out, sizeof held_out, "held-out loss %.4f", loss);
    EXPECT_NE(printed.find(held_out), std::string::npos) << printed;
  }
  size_t printed_evals = 0;
  for (size_t at = 0; (at = evaluated.output.find("held-out loss", at)) != std::string::npos; ++at) ++printed_evals;
  EXPECT_EQ(printed_evals, 3u) << evaluated.output;
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(plain.summary["losses"][i].get<double>(), evaluated.summary["losses"][i].get<double>()) << "step " << i + 1;
    EXPECT_EQ(plain.grad_norms.at(i), evaluated.grad_norms.at(i)) << "step " << i + 1;
  }
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The README names where the demo writes its per-step figures, rank logs and summary: the demo's
// own command line (scripts/train-demo.sh, for three steps) writes exactly there.
TEST(Demo, WritesWhereTheReadmeSays) {
  const std::string root = ZT_SOURCE_DIR;
  const std::string readme = read_text(root + "/README.md");
  const size_t sentence = readme.find("figures go to");
  ASSERT_NE(sentence, std::string::npos) << "README.md must say where the demo writes";
  std::vector<std::string> paths;
  for (size_t at = sentence; paths.size() < 3;) {
    const size_t open = readme.find('`', at), close = readme.find('`', open + 1);
    ASSERT_NE(close, std::string::npos);
    paths.push_back(readme.substr(open + 1, close - open - 1));
    at = close + 1;
  }
  // The demo's command: the words after `zerotrain train` up to the forwarded "$@".
  const std::string script = read_text(root + "/scripts/train-demo.sh");
  const size_t command = script.find("zerotrain train ");
  ASSERT_NE(command, std::string::npos) << script;
  std::stringstream words(script.substr(command + 16, script.find('\n', command) - command - 16));
  std::vector<std::string> args{cli_path(), "train"};
  for (std::string word; words >> word && word != "\"$@\"";)
    args.push_back(word.rfind("configs/", 0) == 0 ? root + "/" + word : word);
  // Three steps, with the warm-up shortened to fit them (the schedule needs more steps than warm-up).
  args.insert(args.end(), {"--steps", "3", "--set", "scheduler.params.warmup_num_steps=1"});
  const std::string dir = make_temp_dir("demo");
  auto r = run_process(args, {}, std::chrono::seconds(240), dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string csv = paths[0], logs = paths[1], summary = paths[2];
  EXPECT_TRUE(std::filesystem::is_regular_file(std::filesystem::path(dir) / csv)) << csv;
  EXPECT_TRUE(std::filesystem::is_regular_file(std::filesystem::path(dir) / logs / "rank0.log")) << logs;
  EXPECT_TRUE(std::filesystem::is_regular_file(std::filesystem::path(dir) / summary)) << summary;
}

TEST(TrainLauncher, UsesTheEnvironmentOfAnExternalLauncher) {
  auto dir = make_temp_dir("external");
  auto port = std::to_string(zt::testing::free_port());
  auto r = run_process({cli_path(), "train", parity_config(dir), "--nproc", "4", "--steps", "1"},
                       {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"},
                        {"MASTER_PORT", port}},
                       std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("1 rank(s)"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/logs")) << "must not spawn ranks of its own";
}

// ---- Several nodes: `zerotrain train --nnodes N --node-rank K` on 127.0.0.1, one process per
// "node", against one node with as many ranks (same world, same rank order: the same run).

using NodeCommand = std::function<std::vector<std::string>(int node_rank, int port, const std::string& config,
                                                           const std::string& summary)>;

// Runs every node's command at once; returns node 0's summary (rank 0 writes it).
nlohmann::json train_on_nodes(const std::string& name, int nnodes, const NodeCommand& command,
                              const std::vector<std::string>& overrides,
                              const std::map<std::string, std::string>& env = {}) {
  auto dir = make_temp_dir(name);
  const std::string config = parity_config(dir), summary = dir + "/summary.json";
  const int port = zt::testing::free_port();
  std::vector<std::future<zt::testing::ProcessResult>> others;
  auto args_of = [&](int k) {
    auto args = command(k, port, config, summary);
    for (const auto& o : overrides) {
      args.push_back("--set");
      args.push_back(o);
    }
    return args;
  };
  for (int k = 1; k < nnodes; ++k)
    others.push_back(std::async(std::launch::async, [&, k] { return run_process(args_of(k), env, std::chrono::seconds(240)); }));
  auto zero = run_process(args_of(0), env, std::chrono::seconds(240));
  EXPECT_EQ(zero.exit_code, 0) << name << " node 0:\n" << zero.output;
  for (int k = 1; k < nnodes; ++k) {
    auto r = others[size_t(k - 1)].get();
    EXPECT_EQ(r.exit_code, 0) << name << " node " << k << ":\n" << r.output;
  }
  return zero.exit_code == 0 ? read_json(summary) : nlohmann::json();
}

NodeCommand zerotrain_nodes(int nnodes, int nproc) {
  return [=](int k, int port, const std::string& config, const std::string& summary) {
    std::vector<std::string> args{cli_path(), "train", config, "--nnodes", std::to_string(nnodes), "--node-rank",
                                  std::to_string(k), "--nproc-per-node", std::to_string(nproc), "--master-addr",
                                  "127.0.0.1", "--master-port", std::to_string(port)};
    if (k == 0) args.insert(args.end(), {"--summary", summary});
    return args;
  };
}

void expect_same_losses(const nlohmann::json& a, const nlohmann::json& b, const std::string& what) {
  ASSERT_EQ(a["losses"].size(), 5u) << what;
  ASSERT_EQ(b["losses"].size(), 5u) << what;
  for (size_t i = 0; i < 5; ++i) {
    const double x = a["losses"][i], y = b["losses"][i];
    EXPECT_LE(std::abs(x - y) / std::abs(x), 1e-6) << what << " step " << i << ": " << x << " vs " << y;
  }
}

void expect_nodes_equal_one_node(int nnodes, int nproc, const std::vector<int>& stages) {
  const int world = nnodes * nproc;
  for (int stage : stages) {
    const std::vector<std::string> overrides{"train_batch_size=" + std::to_string(4 * world),
                                             "zero_optimization.stage=" + std::to_string(stage)};
    const auto one = train_on_nodes("one-node", 1, zerotrain_nodes(1, world), overrides);
    const auto several = train_on_nodes("nodes", nnodes, zerotrain_nodes(nnodes, nproc), overrides);
    std::ostringstream describe;
    describe << nnodes << " nodes x " << nproc << " ranks, stage " << stage;
    const std::string what = describe.str();
    ASSERT_FALSE(one.is_null() || several.is_null()) << what;
    EXPECT_EQ(several["world_size"], world) << what;
    // The engine's node groups follow the launchers' nodes.
    EXPECT_EQ(several["nodes"]["count"], nnodes) << what;
    EXPECT_EQ(several["nodes"]["ranks_per_node"], nproc) << what;
    EXPECT_EQ(one["nodes"]["count"], 1) << what;
    EXPECT_EQ(one["nodes"]["ranks_per_node"], world) << what;
    expect_same_losses(one, several, what);
  }
}

TEST(TrainNodes, TwoNodesOfTwoRanksEqualOneNodeOfFourAtStagesZeroAndOne) { expect_nodes_equal_one_node(2, 2, {0, 1}); }
TEST(TrainNodes, TwoNodesOfTwoRanksEqualOneNodeOfFourAtStagesTwoAndThree) { expect_nodes_equal_one_node(2, 2, {2, 3}); }
TEST(TrainNodes, ThreeNodesOfOneRankEqualOneNodeOfThreeAtStagesZeroAndOne) { expect_nodes_equal_one_node(3, 1, {0, 1}); }
TEST(TrainNodes, ThreeNodesOfOneRankEqualOneNodeOfThreeAtStagesTwoAndThree) { expect_nodes_equal_one_node(3, 1, {2, 3}); }

// hpZ on two nodes of two ranks: each node's ranks hold a secondary partition, and with every
// block released after its use (reuse distance 0) and none persistent, backward gathers within the
// node; the run is the one of a single node of four without it.
TEST(TrainNodes, SecondaryPartitionWithinEachNodeTrainsAsOneNodeWithout) {
  const std::vector<std::string> common{"train_batch_size=16", "zero_optimization.stage=3",
                                        "zero_optimization.stage3_max_reuse_distance=0",
                                        "zero_optimization.stage3_param_persistence_threshold=0"};
  std::vector<std::string> with_hpz = common;
  with_hpz.push_back("zero_optimization.zero_hpz_partition_size=2");
  const auto one = train_on_nodes("one-node", 1, zerotrain_nodes(1, 4), common);
  const auto several = train_on_nodes("nodes-hpz", 2, zerotrain_nodes(2, 2), with_hpz);
  ASSERT_FALSE(one.is_null() || several.is_null());
  EXPECT_EQ(several["zero"]["hpz_partition_size"], 2);
  EXPECT_EQ(one["zero"]["secondary_block_gathers_rank0"], 0);
  EXPECT_GT(several["zero"]["secondary_block_gathers_rank0"].get<int64_t>(), 0);
  EXPECT_EQ(several["zero"]["block_gathers_rank0"], one["zero"]["block_gathers_rank0"]);
  expect_same_losses(one, several, "2 nodes x 2 ranks with hpZ 2 against 1 node of 4 without");
}

// The torch wheel's own torchrun starts the ranks (--no-python): its agent on node 0 serves the
// store every rank connects to (TORCHELASTIC_USE_AGENT_STORE=True).
TEST(TrainNodes, TorchrunWithNoPythonTrainsTwoNodesAsOneNode) {
  const std::map<std::string, std::string> python{{"PYTHONPATH", ZT_PYTHONPATH}, {"PYTHONWARNINGS", "ignore"}};
  auto probe = run_process({"/usr/bin/env", "python3", "-c", "import torch.distributed.run"}, python, std::chrono::seconds(120));
  ASSERT_EQ(probe.exit_code, 0) << "the torch wheel scripts/bootstrap.sh installs must provide torchrun:\n" << probe.output;
  auto torchrun = [](int k, int port, const std::string& config, const std::string& summary) {
    std::vector<std::string> args{"/usr/bin/env", "python3", "-m", "torch.distributed.run", "--nnodes", "2",
                                  "--node-rank", std::to_string(k), "--nproc-per-node", "2", "--master-addr",
                                  "127.0.0.1", "--master-port", std::to_string(port), "--no-python", cli_path(),
                                  "train", config};
    if (k == 0) args.insert(args.end(), {"--summary", summary});
    return args;
  };
  for (int stage : {0, 3}) {
    const std::vector<std::string> overrides{"train_batch_size=16", "zero_optimization.stage=" + std::to_string(stage)};
    const auto one = train_on_nodes("one-node", 1, zerotrain_nodes(1, 4), overrides);
    const auto several = train_on_nodes("torchrun", 2, torchrun, overrides, python);
    ASSERT_FALSE(one.is_null() || several.is_null()) << "stage " << stage;
    expect_same_losses(one, several, "torchrun 2 nodes x 2 ranks, stage " + std::to_string(stage));
  }
}

struct BadInput {
  std::string name;
  std::vector<std::string> args;
  std::string expected;  // substring of the one-line error
};

TEST(TrainBadInput, ExitsTwoWithOneLineAndStartsNothing) {
  auto dir = make_temp_dir("bad");
  auto config = parity_config(dir);
  std::vector<BadInput> cases = {
      {"unknown key", {"--set", "zero_optimisation.stage=0"}, "zero_optimization"},
      {"impossible batch", {"--set", "train_micro_batch_size_per_gpu=5"}, "train_batch_size"},
      {"missing data", {"--set", "data.source=bin", "--set", "data.path=/nonexistent/train.bin"}, "/nonexistent/train.bin"},
      {"bad nproc", {"--nproc", "0"}, "--nproc"},
      {"wrong type", {"--set", "optimizer.params.lr=\"fast\""}, "optimizer.params.lr"},
      {"unimplemented feature", {"--set", "fp16.auto_cast=true"},
       "fp16.auto_cast = true is not supported: autocast of fp16 operations"},
      {"tensor groups not dividing the world", {"--set", "tensor_parallel.autotp_size=3"},
       "tensor_parallel.autotp_size: expected a divisor of the world size 2, found 3"},
      {"tensor groups not dividing the heads", {"--set", "tensor_parallel.autotp_size=2", "--set", "model.n_head=1"},
       "model.n_head: expected a multiple of tensor_parallel.autotp_size 2"},
      {"tensor groups not dividing the vocabulary",
       {"--set", "tensor_parallel.autotp_size=2", "--set", "model.vocab_size=257"},
       "model.vocab_size: expected a multiple of tensor_parallel.autotp_size 2"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {cli_path(), "train", config, "--nproc", "2"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = run_process(argv, {}, std::chrono::seconds(60));
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.name << ": " << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << c.name << ": " << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir + "/logs")) << c.name << ": nothing may start";
  }
  auto missing = run_process({cli_path(), "train", dir + "/no-such-config.json"}, {}, std::chrono::seconds(60));
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("no-such-config.json"), std::string::npos) << missing.output;
}

TEST(Example, CustomModelTrainsOnTwoRanks) {
  auto dir = make_temp_dir("example");
  auto r = run_process({cli_path(), "launch", "--nproc", "2", "--log-dir", dir, "--",
                        std::string(ZT_BIN_DIR) + "/custom_model_example"},
                       {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("final loss"), std::string::npos) << r.output;
  // The same example at stage 3: its marked blocks, built already sharded.
  const std::string config = dir + "/stage3.json";
  std::ofstream(config) << R"({"train_micro_batch_size_per_gpu": 32, "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})";
  r = run_process({cli_path(), "launch", "--nproc", "2", "--log-dir", dir, "--",
                   std::string(ZT_BIN_DIR) + "/custom_model_example", config},
                  {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("final loss"), std::string::npos) << r.output;
}

}  // namespace

namespace {

TEST(LaunchCommand, FailingRankSetsTheExitCodeAndLeavesNothingBehind) {
  auto dir = make_temp_dir("launch-cli");
  auto pids = dir + "/pids";
  auto start = std::chrono::steady_clock::now();
  auto r = run_process({cli_path(), "launch", "--nproc", "3", "--log-dir", dir, "--", "/bin/sh", "-c",
                        "echo $$ >> " + pids + "; if [ \"$RANK\" = 1 ]; then sleep 0.5; exit 3; fi; sleep 60"},
                       {}, std::chrono::seconds(60));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_LT(seconds, 20.0) << "the other ranks must be stopped within seconds";
  std::ifstream in(pids);
  int pid = 0, count = 0;
  while (in >> pid) {
    ++count;
    // Gone, or a zombie no one reaps (a container's pid 1 may not reap): either way not running.
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (std::getline(stat, line)) EXPECT_NE(line.find(") Z"), std::string::npos) << "rank pid " << pid << " still running";
  }
  EXPECT_EQ(count, 3);
}

}  // namespace

namespace {

// `zerotrain train` on the parity configuration with extra arguments; the summary, or null.
nlohmann::json train_with(const std::string& dir, int world, std::vector<std::string> extra, const std::string& name) {
  const std::string summary = dir + "/" + name + ".json";
  std::vector<std::string> args{cli_path(), "train", dir + "/config.json", "--nproc", std::to_string(world),
                                "--summary", summary};
  args.insert(args.end(), extra.begin(), extra.end());
  auto r = run_process(args, {}, std::chrono::seconds(240));
  EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
  return r.exit_code == 0 ? read_json(summary) : nlohmann::json();
}

}  // namespace

// Through the CLI: 3 steps, save, and a resumed run to step 6 give exactly the losses of 6 steps
// straight; resuming the same checkpoint on 3 ranks at stage 3 continues within 1e-5.
TEST(TrainCheckpoint, ResumeContinuesExactlyAndOnAnotherWorldSize) {
  const auto dir = make_temp_dir("resume");
  parity_config(dir);
  const std::string ckpt = dir + "/ckpt";
  const std::vector<std::string> stage2{"--set", "zero_optimization.stage=2"};
  auto with = [&](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const auto straight = train_with(dir, 2, with({"--steps", "6"}, stage2), "straight");
  const auto first = train_with(dir, 2, with({"--steps", "3", "--save-dir", ckpt}, stage2), "first");
  const auto second = train_with(dir, 2, with({"--steps", "6", "--resume", ckpt}, stage2), "second");
  ASSERT_FALSE(straight.is_null() || first.is_null() || second.is_null());
  EXPECT_EQ(second["first_step"], 3);
  ASSERT_EQ(second["losses"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(first["losses"][i].get<double>(), straight["losses"][i].get<double>()) << i;
    EXPECT_EQ(second["losses"][i].get<double>(), straight["losses"][3 + i].get<double>()) << "step " << 4 + i;
  }
  const auto other = train_with(dir, 3,
                                {"--steps", "6", "--resume", ckpt, "--set", "zero_optimization.stage=3", "--set",
                                 "zero_optimization.stage3_param_persistence_threshold=0"},
                                "other");
  ASSERT_FALSE(other.is_null());
  for (int i = 0; i < 3; ++i) {
    const double expected = straight["losses"][3 + i].get<double>();
    EXPECT_LE(std::abs(other["losses"][i].get<double>() - expected) / expected, 1e-5) << "step " << 4 + i;
  }
  // A damaged checkpoint: one line naming the file, a non-zero exit, the checkpoint untouched.
  const auto shard = std::filesystem::path(ckpt) / "step-3" / "rank-00001-of-00002.safetensors";
  std::string bytes;
  {
    std::ifstream in(shard, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes[bytes.size() - 10] ^= 0x04;
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
  auto damaged = run_process({cli_path(), "train", dir + "/config.json", "--nproc", "2", "--steps", "6", "--resume",
                              ckpt, "--set", "zero_optimization.stage=2"},
                             {}, std::chrono::seconds(120));
  EXPECT_NE(damaged.exit_code, 0) << damaged.output;
  EXPECT_NE(damaged.output.find("zerotrain: error: '" + shard.string() + "': tensor"), std::string::npos)
      << damaged.output;
  EXPECT_NE(damaged.output.find("fails its checksum"), std::string::npos) << damaged.output;
  std::ifstream after(shard, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(after), {}), bytes) << "the checkpoint must be left as it was";
  // Nothing to resume from: one line, exit 2, nothing started.
  auto r = run_process({cli_path(), "train", dir + "/config.json", "--resume", dir + "/nothing"}, {},
                       std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--resume: no checkpoint in"), std::string::npos) << r.output;
}

// Across tensor-parallel sizes through the CLI: saved by a 2 x 2 grid and resumed on 2 ranks,
// saved on 2 ranks and resumed by the grid; the losses continue within 1e-5 of the straight run,
// and `zerotrain export` writes the grid's checkpoint as whole tensors.
TEST(TrainCheckpoint, ResumesAcrossTensorParallelSizes) {
  const auto dir = make_temp_dir("resume-tp");
  parity_config(dir);
  const std::string split = dir + "/from-split", whole = dir + "/from-whole";
  auto grid = [](std::vector<std::string> a) {
    a.insert(a.end(), {"--set", "tensor_parallel.autotp_size=2"});
    return a;
  };
  const auto straight = train_with(dir, 2, {"--steps", "6"}, "straight");
  const auto split_first = train_with(dir, 4, grid({"--steps", "3", "--save-dir", split}), "split-first");
  const auto whole_second = train_with(dir, 2, {"--steps", "6", "--resume", split}, "whole-second");
  const auto whole_first = train_with(dir, 2, {"--steps", "3", "--save-dir", whole}, "whole-first");
  const auto split_second = train_with(dir, 4, grid({"--steps", "6", "--resume", whole}), "split-second");
  ASSERT_FALSE(straight.is_null() || split_first.is_null() || whole_second.is_null() || whole_first.is_null() ||
               split_second.is_null());
  EXPECT_EQ(split_second["tensor_parallel"], 2);
  for (const auto* resumed : {&whole_second, &split_second}) {
    ASSERT_EQ((*resumed)["losses"].size(), 3u);
    EXPECT_EQ((*resumed)["first_step"], 3);
    for (int i = 0; i < 3; ++i) {
      const double expected = straight["losses"][3 + i].get<double>();
      EXPECT_LE(std::abs((*resumed)["losses"][i].get<double>() - expected) / expected, 1e-5)
          << (resumed == &whole_second ? "T = 1 from T = 2" : "T = 2 from T = 1") << ", step " << 4 + i;
    }
  }
  // Exported, both checkpoints hold the same whole tensors (to fp32 rounding: the grids add in
  // another order).
  for (const std::string& from : {split, whole}) {
    auto r = run_process({cli_path(), "export", from, "--out", from + ".safetensors"}, {}, std::chrono::seconds(60));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  zt::SafetensorsReader a(split + ".safetensors"), b(whole + ".safetensors");
  ASSERT_EQ(a.entries().size(), b.entries().size());
  for (size_t i = 0; i < a.entries().size(); ++i) {
    ASSERT_EQ(a.entries()[i].name, b.entries()[i].name);
    ASSERT_EQ(a.entries()[i].shape, b.entries()[i].shape) << a.entries()[i].name;
    const at::Tensor x = a.read(a.entries()[i].name), y = b.read(b.entries()[i].name);
    EXPECT_TRUE(at::allclose(x, y, 1e-4, 1e-5)) << a.entries()[i].name << ": largest difference "
                                                  << (x - y).abs().max().item<double>();
  }
}

namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace

// With dropout and gradient accumulation (2 micro-steps): 3 steps, save, and a resumed run to step
// 6 in fresh processes give the losses of 6 steps straight bitwise, and the same saved state, file
// for file.
TEST(TrainCheckpoint, ResumeIsExactWithDropoutAndAccumulation) {
  const auto dir = make_temp_dir("resume-dropout");
  parity_config(dir);  // gradient_accumulation_steps 2
  const std::vector<std::string> common{"--set", "zero_optimization.stage=2", "--set", "model.dropout=0.1"};
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.end(), common.begin(), common.end());
    return a;
  };
  const auto straight = train_with(dir, 2, with({"--steps", "6", "--save-dir", dir + "/straight"}), "straight");
  const auto first = train_with(dir, 2, with({"--steps", "3", "--save-dir", dir + "/resumed"}), "first");
  const auto second =
      train_with(dir, 2, with({"--steps", "6", "--resume", dir + "/resumed", "--save-dir", dir + "/resumed"}), "second");
  const auto without = train_with(dir, 2, {"--steps", "1", "--set", "zero_optimization.stage=2"}, "without");
  ASSERT_FALSE(straight.is_null() || first.is_null() || second.is_null() || without.is_null());
  EXPECT_NE(without["losses"][0].get<double>(), straight["losses"][0].get<double>()) << "dropout must be active";
  ASSERT_EQ(second["losses"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(first["losses"][i].get<double>(), straight["losses"][i].get<double>()) << i;
    EXPECT_EQ(second["losses"][i].get<double>(), straight["losses"][3 + i].get<double>()) << "step " << 4 + i;
  }
  for (const char* file : {"rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"}) {
    const std::string a = file_bytes(dir + "/straight/step-6/" + file), b = file_bytes(dir + "/resumed/step-6/" + file);
    EXPECT_FALSE(a.empty()) << file;
    EXPECT_TRUE(a == b) << file << ": the saved states must be identical";
  }
}

// Resuming with another optimizer type: refused (exit 2, one error naming both) unless
// --reset-optimizer, which loads the weights and continues the step count; a changed
// hyper-parameter is reported on one line naming the old and new values.
TEST(TrainCheckpoint, AnotherOptimizerNeedsResetOptimizer) {
  const auto dir = make_temp_dir("resume-optimizer");
  parity_config(dir);  // AdamW, lr 0.003
  const std::string ckpt = dir + "/ckpt";
  ASSERT_FALSE(train_with(dir, 1, {"--steps", "3", "--save-dir", ckpt}, "first").is_null());
  const std::vector<std::string> base{cli_path(), "train", dir + "/config.json", "--nproc", "1", "--steps", "5",
                                      "--resume", ckpt, "--summary", dir + "/after.json"};
  auto run = [&](const std::vector<std::string>& extra) {
    auto args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return run_process(args, {}, std::chrono::seconds(120));
  };
  auto refused = run({"--set", "optimizer.type=Lamb"});
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  const auto at = refused.output.find("zerotrain: error:");
  ASSERT_NE(at, std::string::npos) << refused.output;
  const std::string line = refused.output.substr(at, refused.output.find('\n', at) - at);
  EXPECT_NE(line.find("saved with optimizer AdamW, this run uses Lamb"), std::string::npos) << line;
  EXPECT_NE(line.find("--reset-optimizer"), std::string::npos) << line;
  // One error: the rank's line, repeated by the launcher as its last line with the rank named.
  const auto again = refused.output.find("zerotrain: error:", at + 1);
  ASSERT_NE(again, std::string::npos) << refused.output;
  EXPECT_EQ(refused.output.substr(again, refused.output.find('\n', again) - again), line + " (rank 0)");
  EXPECT_EQ(refused.output.find("zerotrain: error:", again + 1), std::string::npos) << "one error: " << refused.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/after.json")) << "nothing may run";

  auto reset = run({"--set", "optimizer.type=Lamb", "--reset-optimizer"});
  EXPECT_EQ(reset.exit_code, 0) << reset.output;
  EXPECT_NE(reset.output.find("optimizer.type: \"AdamW\" -> \"Lamb\""), std::string::npos) << reset.output;
  EXPECT_NE(reset.output.find("optimizer moments reset"), std::string::npos) << reset.output;
  if (reset.exit_code == 0) {
    const auto summary = read_json(dir + "/after.json");
    EXPECT_EQ(summary["first_step"], 3);
    EXPECT_EQ(summary["losses"].size(), 2u);
  }

  auto changed = run({"--set", "optimizer.params.lr=0.001"});
  EXPECT_EQ(changed.exit_code, 0) << changed.output;
  EXPECT_NE(changed.output.find("optimizer.params.lr: 0.003 -> 0.001"), std::string::npos) << changed.output;
  EXPECT_EQ(changed.output.find("optimizer.type:"), std::string::npos) << changed.output;

  auto alone = run_process({cli_path(), "train", dir + "/config.json", "--reset-optimizer"}, {}, std::chrono::seconds(60));
  EXPECT_EQ(alone.exit_code, 2) << alone.output;
  EXPECT_NE(alone.output.find("--reset-optimizer: needs --resume"), std::string::npos) << alone.output;
}

// Activation checkpointing through the CLI, with dropout and accumulation: full (in a contiguous
// buffer, profiled) and selective recomputation, with the optimizer in memory, offloaded to cpu
// and to NVMe (stage 3: parameters too), each saved at step 3 and resumed to step 6, give the
// losses of 6 steps without recomputation bitwise.
TEST(TrainActivationCheckpointing, ComposesWithOffloadAndResumesExactly) {
  const auto dir = make_temp_dir("recompute");
  parity_config(dir);
  std::filesystem::create_directories(dir + "/swap");
  struct Case {
    std::string name;
    int stage;
    std::vector<std::string> settings;
  };
  const std::vector<Case> cases = {
      {"full-contiguous", 2,
       {"--set", "activation_checkpointing.policy=\"full\"", "--set",
        "activation_checkpointing.contiguous_memory_optimization=true", "--set", "activation_checkpointing.profile=true"}},
      {"selective-cpu", 2,
       {"--set", "activation_checkpointing.policy=\"selective\"", "--set",
        "zero_optimization.offload_optimizer.device=\"cpu\""}},
      {"full-nvme", 3,
       {"--set", "activation_checkpointing.number_checkpoints=1", "--set", "activation_checkpointing.profile=true",
        "--set",
        "zero_optimization.offload_optimizer.device=\"nvme\"", "--set",
        "zero_optimization.offload_optimizer.nvme_path=\"" + dir + "/swap\"", "--set",
        "zero_optimization.offload_param.device=\"nvme\"", "--set",
        "zero_optimization.offload_param.nvme_path=\"" + dir + "/swap\""}},
  };
  std::map<int, nlohmann::json> straight;
  for (int stage : {2, 3})
    straight[stage] = train_with(dir, 2,
                                 {"--steps", "6", "--set", "model.dropout=0.1", "--set",
                                  "zero_optimization.stage=" + std::to_string(stage)},
                                 "straight" + std::to_string(stage));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> common = {"--set", "model.dropout=0.1", "--set",
                                       "zero_optimization.stage=" + std::to_string(c.stage)};
    common.insert(common.end(), c.settings.begin(), c.settings.end());
    auto with = [&](std::vector<std::string> a) {
      a.insert(a.end(), common.begin(), common.end());
      return a;
    };
    const std::string save = dir + "/" + c.name;
    const auto first = train_with(dir, 2, with({"--steps", "3", "--save-dir", save}), c.name + "-first");
    const auto second = train_with(dir, 2, with({"--steps", "6", "--resume", save}), c.name + "-second");
    const auto& reference = straight[c.stage];
    ASSERT_FALSE(first.is_null() || second.is_null() || reference.is_null());
    ASSERT_EQ(first["losses"].size(), 3u);
    ASSERT_EQ(second["losses"].size(), 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(first["losses"][i].get<double>(), reference["losses"][i].get<double>()) << "step " << i + 1;
      EXPECT_EQ(second["losses"][i].get<double>(), reference["losses"][3 + i].get<double>()) << "step " << 4 + i;
    }
    EXPECT_NE(second["activation_checkpointing"]["policy"].get<std::string>(), "none");
    if (c.name == "full-contiguous") {
      const auto& ac = second["activation_checkpointing"];
      ASSERT_TRUE(ac.contains("blocks")) << ac.dump();
      for (const auto& block : ac["blocks"]) {
        EXPECT_EQ(block["forward_calls"].get<int64_t>(), 6) << block.dump();  // 3 steps of 2 micro-steps
        EXPECT_EQ(block["recomputations"].get<int64_t>(), 6) << block.dump();
        EXPECT_GT(block["recompute_seconds"].get<double>(), 0.0);
      }
      EXPECT_EQ(ac["contiguous_buffer"]["buffer_allocations"].get<int64_t>(), 1) << ac.dump();
      EXPECT_EQ(ac["contiguous_buffer"]["overflows"].get<int64_t>(), 0) << ac.dump();
    }
    if (c.name == "full-nvme") {
      // number_checkpoints 1 of the tiny GPT's 2 blocks: the second is checkpointed, the first not.
      const auto& blocks = second["activation_checkpointing"]["blocks"];
      ASSERT_EQ(blocks.size(), 2u) << blocks.dump();
      EXPECT_FALSE(blocks[0]["checkpointed"].get<bool>());
      EXPECT_EQ(blocks[0]["forward_calls"].get<int64_t>(), 0);
      EXPECT_TRUE(blocks[1]["checkpointed"].get<bool>());
      EXPECT_EQ(blocks[1]["recomputations"].get<int64_t>(), 6);
    }
  }
}

// activation_checkpointing.policy "auto" picks the cheapest policy whose estimate fits this
// machine (the tiny GPT fits without recomputation) and says so.
TEST(TrainActivationCheckpointing, AutoPolicyChoosesAndSaysWhy) {
  const auto dir = make_temp_dir("recompute-auto");
  parity_config(dir);
  const std::string summary = dir + "/auto.json";
  auto r = run_process({cli_path(), "train", dir + "/config.json", "--nproc", "2", "--steps", "1", "--summary", summary,
                        "--set", "activation_checkpointing.policy=\"auto\""},
                       {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("activation_checkpointing.policy \"auto\" chose \"none\""), std::string::npos) << r.output;
  EXPECT_EQ(read_json(summary)["activation_checkpointing"]["policy"].get<std::string>(), "none");
  // cpu_checkpointing and synchronize_checkpoint_boundary act on CUDA tensors: on the CPU the run
  // says so once.
  r = run_process({cli_path(), "train", dir + "/config.json", "--nproc", "2", "--steps", "1", "--set",
                   "activation_checkpointing.cpu_checkpointing=true", "--set",
                   "activation_checkpointing.synchronize_checkpoint_boundary=true"},
                  {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("activation checkpointing: full recomputation in 2 of 2 blocks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("act on CUDA devices; on the CPU the kept inputs are in host memory already"), std::string::npos)
      << r.output;
}

// comms_logger and flops_profiler through the CLI on 2 ranks: rank 0's table and every rank's
// CSV with the collectives the run issued (stage 0 reduces each gradient bucket once per step),
// and the profile of step 2 in its output file with the analytic FLOPs of this configuration.
TEST(TrainReporting, CommsLoggerAndFlopsProfilerWriteTheirOutputs) {
  auto dir = make_temp_dir("reporting");
  const int steps = 5;
  auto summary = dir + "/summary.json";
  auto r = run_process({cli_path(), "train", parity_config(dir), "--nproc", "2", "--summary", summary, "--set",
                        "zero_optimization.reduce_bucket_size=30000", "--set", "comms_logger.enabled=true", "--set",
                        "comms_logger.debug=true", "--set", "flops_profiler.enabled=true", "--set",
                        "flops_profiler.profile_step=2", "--set", "flops_profiler.output_file=\"" + dir + "/flops.txt\""},
                       {}, std::chrono::seconds(240));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("Comm. Op"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("all_reduce | [Caller: grads.bucket0]"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("zerotrain flops profiler"), std::string::npos) << "the report goes to its file";

  for (int rank : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    std::ifstream csv(dir + "/comms_rank" + std::to_string(rank) + ".csv");
    std::string line;
    ASSERT_TRUE(std::getline(csv, line));
    EXPECT_EQ(line, "op,caller,message_bytes,count,total_latency_ms,avg_latency_ms,algbw_gbps,busbw_gbps");
    std::set<std::string> buckets;
    int64_t gradient_reductions = 0, loss_reductions = 0, gradient_bytes = 0;
    while (std::getline(csv, line)) {
      const auto f = split_csv(line);
      ASSERT_EQ(f.size(), 8u) << line;
      const int64_t count = std::stoll(f[3]);
      EXPECT_GT(count, 0) << line;
      EXPECT_GE(std::stod(f[4]), 0.0) << line;
      if (f[0] == "all_reduce" && f[1].rfind("grads.bucket", 0) == 0) {
        buckets.insert(f[1]);
        gradient_reductions += count;
        gradient_bytes += std::stoll(f[2]);
        EXPECT_EQ(count, steps) << "one reduction per bucket per step: " << line;
      }
      if (f[0] == "all_reduce" && f[1] == "train.loss") loss_reductions += count;
    }
    EXPECT_GE(buckets.size(), 2u) << "30000-element buckets split the tiny GPT";
    EXPECT_EQ(gradient_reductions, int64_t(steps) * int64_t(buckets.size()));
    // The buckets together hold every trainable parameter once, in fp32 (padding aside).
    const int64_t params = zt::gpt_parameter_count(zt::gpt_preset("tiny"));
    EXPECT_GE(gradient_bytes, 4 * params);
    EXPECT_LE(gradient_bytes, 4 * params + 4096);
    EXPECT_EQ(loss_reductions, steps);
  }

  std::ifstream report_file(dir + "/flops.txt");
  std::stringstream report;
  report << report_file.rdbuf();
  const std::string text = report.str();
  EXPECT_NE(text.find("Profile summary at step 2"), std::string::npos) << text;
  EXPECT_NE(text.find("measured matmul peak"), std::string::npos) << text;
  EXPECT_NE(text.find("MFU = model FLOPS / peak"), std::string::npos) << text;
  EXPECT_NE(text.find("blocks.1.mlp.c_fc (Linear)"), std::string::npos) << text;
  const auto s = read_json(summary);
  ASSERT_TRUE(s.contains("flops_profiler")) << s.dump();
  const auto& fp = s["flops_profiler"];
  // Global batch 12 on 2 ranks with accumulation 2: micro-batches of 3 sequences of 32 tokens.
  const int64_t forward = zt::gpt_forward_flops(zt::gpt_preset("tiny"), 3, 32).flops;
  EXPECT_EQ(fp["forward_flops_per_micro_batch"].get<int64_t>(), forward);
  EXPECT_DOUBLE_EQ(fp["model_flops_per_step_per_rank"].get<double>(), 2.0 * 3 * double(forward));
  EXPECT_GT(fp["peak_flops_per_rank"].get<double>(), 0.0);
  EXPECT_GT(fp["mfu"].get<double>(), 0.0);
  EXPECT_TRUE(s.contains("comms_logger"));
}

TEST(TrainReporting, UnknownProfOpsIsAConfigError) {
  auto dir = make_temp_dir("reporting-bad");
  auto r = run_process({cli_path(), "train", parity_config(dir), "--nproc", "1", "--set", "comms_logger.enabled=true",
                        "--set", "comms_logger.prof_all=false", "--set", "comms_logger.prof_ops=[\"allreduce\"]"},
                       {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("comms_logger.prof_ops"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("reduce_scatter"), std::string::npos) << r.output;
}

namespace {

// --device: cpu trains as before; a bad value names the valid ones; cuda is refused in one line
// where it cannot run (a CPU build here; on a CUDA build without a visible GPU, that), before
// any rank starts. `launch --device` is checked the same way.
TEST(TrainDevice, CpuTrainsAndUnavailableOrUnknownDevicesAreRefused) {
  auto dir = make_temp_dir("device");
  auto config = parity_config(dir);
  auto summary = dir + "/summary.json";
  auto cpu = run_process({cli_path(), "train", config, "--nproc", "1", "--steps", "2", "--device", "cpu", "--summary",
                          summary},
                         {}, std::chrono::seconds(120));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  EXPECT_NE(cpu.output.find("device: cpu"), std::string::npos) << cpu.output;
  const auto s = read_json(summary);
  EXPECT_EQ(s["losses"].size(), 2u);
  EXPECT_EQ(s["device"]["type"], "cpu");

  auto bogus = run_process({cli_path(), "train", config, "--device", "bogus"}, {}, std::chrono::seconds(60));
  EXPECT_EQ(bogus.exit_code, 2) << bogus.output;
  EXPECT_NE(bogus.output.find("--device: expected auto, cpu or cuda, found 'bogus'"), std::string::npos)
      << bogus.output;
  EXPECT_EQ(std::count(bogus.output.begin(), bogus.output.end(), '\n'), 1) << bogus.output;

  auto bogus_env = run_process({cli_path(), "train", config}, {{"ZT_DEVICE", "tpu"}}, std::chrono::seconds(60));
  EXPECT_EQ(bogus_env.exit_code, 2) << bogus_env.output;
  EXPECT_NE(bogus_env.output.find("ZT_DEVICE: expected auto, cpu or cuda, found 'tpu'"), std::string::npos)
      << bogus_env.output;

  auto launch_bogus = run_process({cli_path(), "launch", "--nproc", "1", "--device", "bogus", "--", "/bin/true"}, {},
                                  std::chrono::seconds(60));
  EXPECT_EQ(launch_bogus.exit_code, 2) << launch_bogus.output;
  EXPECT_NE(launch_bogus.output.find("expected auto, cpu or cuda"), std::string::npos) << launch_bogus.output;

#ifndef ZT_CUDA
  const bool cuda_refused = true;
  const std::string why = "--device cuda: this zerotrain was built without CUDA (configure with -DZT_CUDA=ON)";
#else
  const bool cuda_refused = !torch::cuda::is_available();
  const std::string why = "--device cuda: no CUDA device is visible";
#endif
  if (cuda_refused) {
    auto quiet_dir = make_temp_dir("device-refused");
    auto quiet_config = parity_config(quiet_dir);
    for (const auto& argv : std::vector<std::vector<std::string>>{
             {cli_path(), "train", quiet_config, "--nproc", "2", "--device", "cuda"},
             {cli_path(), "launch", "--nproc", "1", "--device", "cuda", "--", "/bin/true"}}) {
      auto r = run_process(argv, {}, std::chrono::seconds(60));
      EXPECT_EQ(r.exit_code, 2) << argv[1] << ": " << r.output;
      EXPECT_NE(r.output.find(why), std::string::npos) << argv[1] << ": " << r.output;
      EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << argv[1] << ": " << r.output;
    }
    EXPECT_FALSE(std::filesystem::exists(quiet_dir + "/logs")) << "nothing may start";
    // Under a launcher (torchrun's variables) the rank refuses it the same way.
    auto port = std::to_string(zt::testing::free_port());
    auto rank = run_process({cli_path(), "train", config, "--device", "cuda"},
                            {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"},
                             {"MASTER_PORT", port}},
                            std::chrono::seconds(60));
    EXPECT_EQ(rank.exit_code, 2) << rank.output;
    EXPECT_NE(rank.output.find(why), std::string::npos) << rank.output;
  }
  // auto picks the CPU where CUDA cannot run, and says so.
  if (cuda_refused) {
    auto automatic = run_process({cli_path(), "train", config, "--nproc", "1", "--steps", "1"}, {},
                                 std::chrono::seconds(120));
    EXPECT_EQ(automatic.exit_code, 0) << automatic.output;
    EXPECT_NE(automatic.output.find("device: cpu"), std::string::npos) << automatic.output;
  }
}

}  // namespace

// --- model.type "bert" through `zerotrain train` (docs/bert.md "Training from the CLI").
namespace {

// bert-tiny with LAMB and WarmupDecayLR, global batch 8 in two micro-steps on two ranks, masked
// sentence pairs of `sequence` tokens from the embedded corpus, 16 steps, evaluation every 8.
std::string bert_config(const std::string& dir, int sequence) {
  return write_file(dir, "config.json", R"({
    "train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 1,
    "optimizer": {"type": "Lamb", "params": {"lr": 0.05, "weight_decay": 0.01, "min_coeff": 0.01, "max_coeff": 5.0}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 0.05, "total_num_steps": 40}},
    "model": {"type": "bert", "preset": "bert-tiny"},
    "data": {"source": "embedded", "sequence_length": )" + std::to_string(sequence) + R"(, "max_predictions": 10},
    "train": {"steps": 16, "seed": 5, "threads": 1, "eval_interval": 8, "eval_iters": 2, "log_dir": ")" + dir + R"("}})");
}

struct BertRun {
  nlohmann::json summary;
  std::string output;
};

BertRun train_bert(const std::string& dir, int world, std::vector<std::string> extra, const std::string& name) {
  const std::string summary = dir + "/" + name + ".json";
  std::vector<std::string> args{cli_path(), "train", dir + "/config.json", "--nproc", std::to_string(world),
                                "--summary", summary};
  args.insert(args.end(), extra.begin(), extra.end());
  auto r = run_process(args, {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
  return {r.exit_code == 0 ? read_json(summary) : nlohmann::json(), r.output};
}

}  // namespace

// Stage 0 and stage 3 on two ranks: the BERT is built, the masked-LM loss is finite and falls,
// held-out pairs are evaluated, and stage 3 (built sharded) gives stage 0's losses.
TEST(TrainBert, TrainsAtStagesZeroAndThreeOnTwoRanks) {
  const auto dir = make_temp_dir("bert");
  bert_config(dir, 64);
  const auto zero = train_bert(dir, 2, {"--set", "zero_optimization.stage=0"}, "stage0");
  const auto three = train_bert(dir, 2, {"--set", "zero_optimization.stage=3"}, "stage3");
  ASSERT_FALSE(zero.summary.is_null() || three.summary.is_null());
  EXPECT_NE(zero.output.find("model: bert preset 'bert-tiny' (2 layers, 2 heads, hidden 64"), std::string::npos)
      << zero.output;
  EXPECT_NE(zero.output.find("no estimate: the memory estimate models the GPT"), std::string::npos) << zero.output;
  EXPECT_NE(zero.output.find("held-out loss"), std::string::npos) << zero.output;
  EXPECT_EQ(zero.summary["model"]["type"], "bert");
  EXPECT_EQ(zero.summary["parameters"], 133894);
  const auto& losses = zero.summary["losses"];
  ASSERT_EQ(losses.size(), 16u);
  for (const auto& l : losses) EXPECT_TRUE(std::isfinite(l.get<double>())) << losses;
  // ln(260) + ln(2) ≈ 6.25 at the start (MLM + NSP); the token frequencies alone bring it down.
  EXPECT_GT(losses[0].get<double>(), 5.5) << losses;
  EXPECT_LT(losses[15].get<double>(), losses[0].get<double>() - 0.3) << losses;
  ASSERT_EQ(zero.summary["eval_losses"].size(), 2u);
  ASSERT_EQ(three.summary["losses"].size(), 16u);
  for (size_t i = 0; i < 16; ++i) {
    const double a = losses[i], b = three.summary["losses"][i];
    EXPECT_LE(std::abs(a - b) / a, 1e-4) << "step " << i + 1 << ": " << a << " vs " << b;
  }
}

// BERT split over tensor groups of 2 (a 2 x 2 grid) trains what 2 data-parallel ranks train:
// the same losses and held-out losses at stage 3 (each tensor group reads one data rank's pairs).
TEST(TrainBert, TensorParallelGridEqualsTwoDataParallelRanks) {
  const auto dir = make_temp_dir("bert-tp");
  bert_config(dir, 64);
  const std::vector<std::string> common{"--steps", "8", "--set", "zero_optimization.stage=3"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), common.begin(), common.end());
    return extra;
  };
  const auto plain = train_bert(dir, 2, common, "plain");
  const auto grid = train_bert(dir, 4, with({"--set", "tensor_parallel.autotp_size=2"}), "grid");
  ASSERT_FALSE(plain.summary.is_null() || grid.summary.is_null());
  EXPECT_EQ(grid.summary["tensor_parallel"], 2);
  EXPECT_EQ(grid.summary["data_parallel_size"], 2);
  ASSERT_EQ(grid.summary["losses"].size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    const double a = plain.summary["losses"][i], b = grid.summary["losses"][i];
    EXPECT_LE(std::abs(a - b) / a, 1e-5) << "step " << i + 1 << ": " << a << " vs " << b;
  }
  ASSERT_EQ(grid.summary["eval_losses"].size(), 1u);
  const double a = plain.summary["eval_losses"][0]["loss"], b = grid.summary["eval_losses"][0]["loss"];
  EXPECT_LE(std::abs(a - b) / a, 1e-5) << a << " vs " << b;
}

// The BERT keys reach the run: masking more positions, leaving out the NSP head and pre-LN
// change what is trained (the run says so, and the first loss differs from the default run's).
TEST(TrainBert, ModelAndMaskingKeysChangeTheRun) {
  const auto dir = make_temp_dir("bert-keys");
  bert_config(dir, 64);
  const auto base = train_bert(dir, 1, {"--steps", "2"}, "default");
  const auto changed = train_bert(dir, 1,
                                  {"--steps", "2", "--set", "data.mlm_probability=0.4", "--set",
                                   "data.max_predictions=0", "--set", "model.next_sentence=false", "--set",
                                   "model.pre_layer_norm=true"},
                                  "changed");
  ASSERT_FALSE(base.summary.is_null() || changed.summary.is_null());
  EXPECT_NE(base.output.find("post-LN, MLM + NSP loss"), std::string::npos) << base.output;
  EXPECT_NE(base.output.find("15% of the content positions predicted (at most 10 per sequence)"), std::string::npos)
      << base.output;
  EXPECT_NE(changed.output.find("pre-LN, MLM loss"), std::string::npos) << changed.output;
  EXPECT_NE(changed.output.find("40% of the content positions predicted\n"), std::string::npos) << changed.output;
  // Without the NSP head (a pooler and classifier fewer) and with the final LayerNorm of pre-LN.
  EXPECT_EQ(changed.summary["parameters"].get<int64_t>(), base.summary["parameters"].get<int64_t>() - (64 * 64 + 64) -
                                                              (2 * 64 + 2) + 2 * 64);
  EXPECT_NE(changed.summary["losses"][0].get<double>(), base.summary["losses"][0].get<double>());
}

// BERT's two phases: phase 1 at 64 tokens saves, phase 2 resumes it at 128 tokens with another
// micro-batch and accumulation (the same global batch), continuing from the saved step.
TEST(TrainBert, PhaseTwoResumesPhaseOneWithLongerSequencesAndAnotherMicroBatch) {
  const auto dir = make_temp_dir("bert-phases");
  bert_config(dir, 64);
  const std::string ckpt1 = dir + "/phase1", ckpt2 = dir + "/phase2";
  const auto one = train_bert(dir, 2, {"--steps", "4", "--save-dir", ckpt1}, "phase1");
  ASSERT_FALSE(one.summary.is_null());
  ASSERT_TRUE(std::filesystem::exists(ckpt1 + "/step-4")) << one.output;
  const auto two = train_bert(dir, 2,
                              {"--steps", "7", "--resume", ckpt1, "--save-dir", ckpt2, "--set", "data.sequence_length=128",
                               "--set", "train_micro_batch_size_per_gpu=4", "--set", "gradient_accumulation_steps=1"},
                              "phase2");
  ASSERT_FALSE(two.summary.is_null());
  EXPECT_NE(two.output.find("at step 4"), std::string::npos) << two.output;
  EXPECT_NE(two.output.find("global batch 8 x 128 tokens"), std::string::npos) << two.output;
  EXPECT_EQ(two.summary["first_step"], 4);
  ASSERT_EQ(two.summary["losses"].size(), 3u);
  for (const auto& l : two.summary["losses"]) {
    EXPECT_TRUE(std::isfinite(l.get<double>())) << two.summary["losses"];
    // Phase 1's progress is kept: nowhere near the untrained loss.
    EXPECT_LT(l.get<double>(), one.summary["losses"][0].get<double>()) << two.summary["losses"];
  }
  EXPECT_TRUE(std::filesystem::exists(ckpt2 + "/step-7")) << two.output;
}

// The other data sources: a text file (the byte tokenizer: 260 ids), and a .bin file of another
// tokenizer's ids, refused with the preset's vocabulary (naming the file) and trained once
// model.vocab_size covers them.
TEST(TrainBert, TrainsOnTextAndOnBinDataWithTheFilesVocabulary) {
  const auto dir = make_temp_dir("bert-data");
  std::string text;
  for (int i = 0; i < 300; ++i) text += "Sentence number " + std::to_string(i) + " ends here. ";
  write_file(dir, "corpus.txt", text);
  bert_config(dir, 32);
  const auto from_text = train_bert(dir, 1, {"--steps", "2", "--set", "data.source=text", "--set",
                                             "data.path=" + dir + "/corpus.txt"},
                                    "text");
  ASSERT_FALSE(from_text.summary.is_null());
  EXPECT_EQ(from_text.summary["losses"].size(), 2u);
  std::vector<uint16_t> tokens(6000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 7919) % 1000);
  zt::TokenDataset::write_bin_file(dir + "/train.bin", tokens);
  const std::vector<std::string> bin{"--steps", "2", "--set", "data.source=bin", "--set", "data.path=" + dir + "/train.bin"};
  std::vector<std::string> args{cli_path(), "train", dir + "/config.json"};
  args.insert(args.end(), bin.begin(), bin.end());
  const auto refused = run_process(args, {}, std::chrono::seconds(60));
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_NE(refused.output.find("train.bin"), std::string::npos) << refused.output;
  std::vector<std::string> wider = bin;
  wider.insert(wider.end(), {"--set", "model.vocab_size=1004"});
  const auto from_bin = train_bert(dir, 1, wider, "bin");
  ASSERT_FALSE(from_bin.summary.is_null());
  EXPECT_NE(from_bin.output.find("vocab 1004 with 4 specials"), std::string::npos) << from_bin.output;
  for (const auto& l : from_bin.summary["losses"]) EXPECT_TRUE(std::isfinite(l.get<double>()));
}
