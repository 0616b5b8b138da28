// Checkpoints through the engine: an exact resume in a fresh process at every stage, resuming on
// another world size and stage, and damaged or foreign checkpoints refused without harm.
//
// Each case runs its ranks several times (a separate process per phase); the rank body reads
// what to do from ZT_CKPT_* variables and writes its global losses to a file the parent compares.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "checkpoint/file_system.h"
#include "checkpoint/safetensors.h"
#include "support/counting_allocator.h"
#include "support/multirank.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"

namespace {

namespace fs = std::filesystem;
using zt::testing::is_rank_process;
using zt::testing::run_ranks;

constexpr int kGlobalBatch = 6;  // sequences per step, split evenly over 1, 2 or 3 ranks

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// The tiny GPT trained on a global batch that depends only on the step, each rank taking its
// slice, so that the global loss and the update do not depend on the world size. Starts from the
// checkpoint in `load_dir` when given (from a model built with another seed, so that the load must
// overwrite everything) and saves to `save_dir` at the end. Returns the global mean loss per step.
std::vector<double> train(int stage, int steps, const std::string& load_dir, const std::string& save_dir) {
  auto comm = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
  const int world = comm->world_size(), rank = comm->rank();
  const int64_t micro = kGlobalBatch / world;
  auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": )" + std::to_string(micro) +
                                     R"(, "gradient_accumulation_steps": 1, "gradient_clipping": 0.05,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
      "zero_optimization": {"stage": )" + std::to_string(stage) +
                                     R"(, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 1000}})",
                                 {}, world);
  torch::manual_seed(load_dir.empty() ? 7 : 99);
  auto gpt_config = zt::gpt_preset("tiny");
  auto model = zt::GPT(gpt_config);
  zt::Engine engine(model.ptr(), config, comm);
  if (!load_dir.empty()) {
    auto client = engine.load_checkpoint(load_dir);
    EXPECT_EQ(client.at("note"), "saved by the test");
  }
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) {
    const int64_t step = engine.global_step();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
    auto tokens = torch::randint(0, gpt_config.vocab_size, {kGlobalBatch, 17}, gen, torch::kLong).narrow(0, rank * micro, micro);
    auto loss = model->loss(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16));
    torch::Tensor global = loss.detach().reshape({1}).to(torch::kDouble) / world;
    comm->all_reduce(global, zt::ReduceOp::Sum, "test.loss").wait();
    losses.push_back(global.item<double>());
    engine.backward(loss);
    EXPECT_TRUE(engine.step().stepped);
  }
  if (!save_dir.empty()) engine.save_checkpoint(save_dir, "step-" + std::to_string(engine.global_step()), {{"note", "saved by the test"}});
  return losses;
}

void write_losses(const std::string& path, const std::vector<double>& losses) {
  std::ofstream out(path);
  for (double l : losses) {
    char text[64];
    std::snprintf(text, sizeof text, "%.17g\n", l);
    out << text;
  }
}

std::vector<double> read_losses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> out;
  for (double l; in >> l;) out.push_back(l);
  return out;
}

// Parent side: one phase of `world` ranks.
void phase(int world, int stage, int steps, const std::string& load_dir, const std::string& save_dir,
           const std::string& losses_file) {
  auto r = run_ranks(world, "CheckpointRankBody.TrainSaveLoad",
                     {{"ZT_CKPT_STAGE", std::to_string(stage)}, {"ZT_CKPT_STEPS", std::to_string(steps)},
                      {"ZT_CKPT_LOAD", load_dir}, {"ZT_CKPT_SAVE", save_dir}, {"ZT_CKPT_LOSSES", losses_file},
                      {"ZT_COMM_TIMEOUT_SECONDS", "60"}},
                     std::chrono::seconds(240));
  ASSERT_TRUE(r.all_succeeded()) << "world " << world << " stage " << stage << ":\n" << r.describe();
}

std::string fresh_dir(const std::string& name) { return zt::testing::make_temp_dir("checkpoint-" + name); }

}  // namespace

// The rank body of every case below: a suite ending in RankBody, which ctest does not list
// (tests/CMakeLists.txt); run_ranks starts it by name.
TEST(CheckpointRankBody, TrainSaveLoad) {
  if (!is_rank_process()) GTEST_SKIP() << "a rank body: the tests of this file start it as ranks";
  const auto losses = train(std::stoi(env("ZT_CKPT_STAGE")), std::stoi(env("ZT_CKPT_STEPS")), env("ZT_CKPT_LOAD"),
                            env("ZT_CKPT_SAVE"));
  if (zt::testing::test_rank() == 0) write_losses(env("ZT_CKPT_LOSSES"), losses);
}

// 10 steps straight equal 5 steps, save, and 5 more in fresh processes that load: every loss and
// every saved master weight and moment bitwise, at every stage.
TEST(Checkpoint, ExactResumeAtEveryStage) {
  for (int stage : {0, 1, 2, 3}) {
    const std::string straight = fresh_dir("straight"), resumed = fresh_dir("resumed");
    phase(2, stage, 10, "", straight, straight + "/losses");
    phase(2, stage, 5, "", resumed, resumed + "/losses-first");
    phase(2, stage, 5, resumed, resumed, resumed + "/losses-second");
    auto expected = read_losses(straight + "/losses");
    auto found = read_losses(resumed + "/losses-first");
    for (double l : read_losses(resumed + "/losses-second")) found.push_back(l);
    ASSERT_EQ(expected.size(), 10u);
    EXPECT_EQ(found, expected) << "stage " << stage;
    // The final states, file by file and tensor by tensor.
    for (const auto& entry : fs::directory_iterator(fs::path(straight) / "step-10")) {
      if (entry.path().extension() != ".safetensors") continue;
      zt::SafetensorsReader a(entry.path()), b(fs::path(resumed) / "step-10" / entry.path().filename());
      ASSERT_EQ(a.entries().size(), b.entries().size()) << entry.path();
      for (const auto& e : a.entries())
        EXPECT_TRUE(torch::equal(a.read(e.name), b.read(e.name))) << "stage " << stage << " " << e.name;
    }
  }
}

// Saved at one world size and stage, resumed at another: the losses continue within 1e-5 of the
// uninterrupted run (the reductions add in another order).
TEST(Checkpoint, ResumesOnAnotherWorldSizeAndStage) {
  const std::string straight = fresh_dir("reshard-straight");
  phase(2, 2, 10, "", "", straight + "/losses");
  const auto expected = read_losses(straight + "/losses");
  struct Case {
    int save_world, save_stage, load_world, load_stage;
  };
  for (const Case& c : {Case{2, 2, 1, 0}, Case{2, 2, 3, 3}, Case{1, 0, 2, 2}, Case{3, 3, 2, 2}}) {
    const std::string dir = fresh_dir("reshard");
    phase(c.save_world, c.save_stage, 5, "", dir, dir + "/losses-first");
    phase(c.load_world, c.load_stage, 5, dir, "", dir + "/losses-second");
    auto found = read_losses(dir + "/losses-first");
    for (double l : read_losses(dir + "/losses-second")) found.push_back(l);
    ASSERT_EQ(found.size(), expected.size());
    for (size_t i = 0; i < found.size(); ++i)
      EXPECT_LE(std::abs(found[i] - expected[i]) / expected[i], 1e-5)
          << "saved at N=" << c.save_world << " stage " << c.save_stage << ", loaded at N=" << c.load_world
          << " stage " << c.load_stage << ", step " << i << ": " << found[i] << " vs " << expected[i];
  }
}

namespace {

// One process, one rank: the tiny GPT after one step, saved as "first" and (after another step)
// as "second".
struct SingleRank {
  std::shared_ptr<zt::Communicator> comm = zt::make_communicator(zt::RendezvousInfo{}, {});
  zt::GPT model{nullptr};
  std::unique_ptr<zt::Engine> engine;
  // `optimizer`: the configuration's "optimizer" block (default: Adam with its defaults);
  // `weights`: values to start from instead of the seed's (the engine adopts them).
  explicit SingleRank(int seed = 7, int64_t vocab = 256, const std::string& optimizer = "",
                      const torch::Tensor& weights = {}) {
    torch::manual_seed(seed);
    auto gpt_config = zt::gpt_preset("tiny");
    gpt_config.vocab_size = vocab;
    model = zt::GPT(gpt_config);
    if (weights.defined()) {
      torch::NoGradGuard no_grad;
      int64_t at = 0;
      for (auto& p : model->parameters()) {
        p.copy_(weights.narrow(0, at, p.numel()).view(p.sizes()));
        at += p.numel();
      }
    }
    auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1})" +
                                       (optimizer.empty() ? "" : ", \"optimizer\": " + optimizer) + "}",
                                   {}, 1);
    engine = std::make_unique<zt::Engine>(model.ptr(), config, comm);
  }
  void step() { step(torch::randint(0, 256, {2, 17}, torch::kLong)); }
  void step(const torch::Tensor& tokens) {
    engine->backward(model->loss(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16)));
    engine->step();
  }
  torch::Tensor parameters() {
    std::vector<torch::Tensor> flat;
    for (auto& p : model->parameters()) flat.push_back(p.detach().reshape({-1}).clone());
    return torch::cat(flat);
  }
};

// Every file under `dir` with its bytes: to show that a failed load changed nothing.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) {
      std::ifstream in(e.path(), std::ios::binary);
      out[e.path().string()] = {std::istreambuf_iterator<char>(in), {}};
    }
  return out;
}

}  // namespace

// A missing shard, a truncated or bit-flipped file, a damaged manifest, a checkpoint of another
// model and a `latest` that points nowhere: each a zt::DataError naming the file and the problem,
// with the engine and the checkpoint directory left as they were.
TEST(Checkpoint, DamagedOrForeignCheckpointsAreRefusedWithoutHarm) {
  const fs::path base = fresh_dir("damaged");
  {
    SingleRank saver;
    saver.step();
    saver.engine->save_checkpoint(base.string(), "first");
    saver.step();
    saver.engine->save_checkpoint(base.string(), "second");
  }
  const fs::path shard = base / "second" / "rank-00000-of-00001.safetensors";
  const fs::path manifest = base / "second" / "manifest.json";
  auto edit = [](const fs::path& path, const std::function<void(std::string&)>& change) {
    std::ifstream in(path, std::ios::binary);
    std::string bytes{std::istreambuf_iterator<char>(in), {}};
    in.close();
    change(bytes);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  };
  struct Case {
    std::string what, expected;
    std::function<void(const fs::path& dir)> damage;
  };
  const std::vector<Case> cases = {
      {"latest points nowhere", "names 'third', which is not a checkpoint directory",
       [&](const fs::path& dir) { std::ofstream(dir / "latest") << "third\n"; }},
      {"missing shard", "cannot open",
       [&](const fs::path& dir) { fs::remove(dir / "second" / shard.filename()); }},
      {"truncated shard", "truncated",
       [&](const fs::path& dir) {
         fs::resize_file(dir / "second" / shard.filename(), fs::file_size(dir / "second" / shard.filename()) - 100);
       }},
      {"flipped byte in a shard", "fails its checksum",
       [&](const fs::path& dir) {
         edit(dir / "second" / shard.filename(), [](std::string& b) { b[b.size() - 1000] ^= 0x10; });
       }},
      {"damaged manifest", "is not valid JSON",
       [&](const fs::path& dir) { edit(dir / "second" / manifest.filename(), [](std::string& b) { b.resize(b.size() / 2); }); }},
      {"another model", "checkpoint of another model: parameter 'wte.weight' has shape",
       [&](const fs::path& dir) {
         fs::remove_all(dir / "second");  // replaced by a checkpoint of a GPT with another vocabulary
         SingleRank other(5, 255);
         other.engine->save_checkpoint(dir.string(), "second");
       }},
      {"flipped byte in the manifest", "fails its checksum",
       [&](const fs::path& dir) {
         edit(dir / "second" / manifest.filename(), [](std::string& b) {
           const auto at = b.find("\"global_step\": \"");
           ASSERT_NE(at, std::string::npos);
           b[at + 16] ^= 0x01;  // the step count's first digit
         });
       }},
  };
  for (const Case& c : cases) {
    const fs::path dir = fresh_dir("damaged-case");
    fs::copy(base, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    c.damage(dir);
    const auto before = snapshot(dir);
    SingleRank loader(99);
    const auto parameters = loader.parameters();
    try {
      loader.engine->load_checkpoint(dir.string());
      ADD_FAILURE() << c.what << ": expected zt::DataError";
    } catch (const zt::DataError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(c.expected), std::string::npos) << c.what << ": " << message;
      EXPECT_NE(message.find(dir.string()), std::string::npos) << c.what << " must name the file: " << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << c.what << ": one line";
    }
    EXPECT_TRUE(torch::equal(loader.parameters(), parameters)) << c.what << ": the engine must be unchanged";
    EXPECT_EQ(snapshot(dir), before) << c.what << ": nothing in the directory may change";
    // The other checkpoint is still loadable by name.
    EXPECT_NO_THROW(loader.engine->load_checkpoint(dir.string(), "first")) << c.what;
  }
}

// The saver of the crash test, a process body that ctest does not list (as a RankBody suite):
// one checkpoint, a "ready" mark, then checkpoints back to back (keeping 3) until it is killed.
TEST(CheckpointCrashRankBody, Saver) {
  const std::string dir = env("ZT_CKPT_CRASH_DIR");
  if (dir.empty()) GTEST_SKIP() << "the saver of SaveKilledAnywhereLeavesTheLastCheckpointLoadable, started by it";
  SingleRank saver;
  saver.step();
  saver.engine->save_checkpoint(dir, "t-0", {}, 3);
  std::ofstream(dir + "/ready") << "1";
  for (int i = 1;; ++i) saver.engine->save_checkpoint(dir, "t-" + std::to_string(i), {}, 3);
}

// A save killed with SIGKILL at random moments always leaves `latest` naming a checkpoint that
// loads (interrupted saves leave only a staging directory, which loading ignores).
TEST(Checkpoint, SaveKilledAnywhereLeavesTheLastCheckpointLoadable) {
  std::mt19937 rng(5);
  int interrupted = 0;
  const int trials = 12;
  for (int trial = 0; trial < trials; ++trial) {
    const fs::path dir = fresh_dir("crash");
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::setenv("ZT_CKPT_CRASH_DIR", dir.c_str(), 1);
      const std::string self = zt::testing::self_executable();
      ::execl(self.c_str(), self.c_str(), "--gtest_filter=CheckpointCrashRankBody.Saver", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    const auto start = std::chrono::steady_clock::now();
    while (!fs::exists(dir / "ready") && std::chrono::steady_clock::now() - start < std::chrono::seconds(60))
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 150));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saver must have been running until killed (trial " << trial << ")";
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().rfind(".partial-", 0) == 0) ++interrupted;
    SingleRank loader(99);
    EXPECT_NO_THROW(loader.engine->load_checkpoint(dir.string())) << "trial " << trial;
  }
  std::printf("%d of %d kills interrupted a save in progress\n", interrupted, trials);
  // The saver does nothing but save, so most kills land inside one; at least one must, or the
  // test has not shown what it claims.
  EXPECT_GE(interrupted, 1) << "no kill landed while a save was in progress (no staging directory at kill time)";
}

// keep_last keeps the newest checkpoints, `latest` names the newest, and staging directories of
// interrupted saves are cleared by the next save.
TEST(Checkpoint, KeepsTheNewestAndClearsInterruptedSaves) {
  const fs::path dir = fresh_dir("keep");
  SingleRank saver;
  fs::create_directories(dir / ".partial-old");
  for (int i = 1; i <= 5; ++i) {
    saver.step();
    saver.engine->save_checkpoint(dir.string(), "step-" + std::to_string(i), {}, 2);
  }
  std::set<std::string> found;
  for (const auto& e : fs::directory_iterator(dir)) found.insert(e.path().filename().string());
  EXPECT_EQ(found, (std::set<std::string>{"latest", "step-4", "step-5"}));
  std::ifstream latest(dir / "latest");
  std::string tag;
  std::getline(latest, tag);
  EXPECT_EQ(tag, "step-5");
  EXPECT_THROW(saver.engine->save_checkpoint(dir.string(), "step-5"), zt::Error) << "never overwritten";
  EXPECT_THROW(saver.engine->save_checkpoint(dir.string(), "../x"), zt::ConfigError);
}

// `zerotrain export` of a checkpoint saved by 2 ranks at stage 3: Python's safetensors opens the
// fp32 and bf16 files; fp32 equals the parameters an engine loads from the same checkpoint, bf16
// equals them rounded by torch; and export holds about one parameter at a time, not the model.
TEST(Checkpoint, ExportOpensInPythonWithTheModelsValues) {
  const std::string dir = fresh_dir("export");
  phase(2, 3, 3, "", dir, dir + "/losses");
  // The reference: what an engine loads, written parameter by parameter.
  SingleRank loader(99);
  loader.engine->load_checkpoint(dir);
  std::vector<zt::TensorRecord> records;
  int64_t largest = 0, total = 0;
  for (const auto& p : loader.model->named_parameters()) {
    records.push_back({p.key(), torch::kFloat, p.value().sizes().vec()});
    largest = std::max<int64_t>(largest, p.value().nbytes());
    total += p.value().nbytes();
  }
  {
    zt::SafetensorsWriter reference(dir + "/reference.safetensors", records);
    for (const auto& p : loader.model->named_parameters()) reference.write(p.value().detach());
    reference.finish();
  }
  for (std::string dtype : {"fp32", "bf16"}) {
    auto r = zt::testing::run_process({zt::testing::cli_path(), "export", dir, "--out", dir + "/model-" + dtype + ".safetensors",
                                       "--dtype", dtype},
                                      {}, std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("wrote "), std::string::npos) << r.output;
  }
  const std::string script = R"(
import sys, torch
from safetensors.torch import load_file
d = sys.argv[1]
ref, f32, b16 = (load_file(d + name) for name in ('/reference.safetensors', '/model-fp32.safetensors', '/model-bf16.safetensors'))
assert list(f32) == list(ref) and list(b16) == list(ref), (list(f32), list(ref))
for name, t in ref.items():
    assert f32[name].dtype == torch.float32 and b16[name].dtype == torch.bfloat16, name
    assert torch.equal(f32[name], t), name
    assert torch.equal(b16[name], t.to(torch.bfloat16)), name
    assert t.numel() > 0 and t.abs().sum() > 0, name + ' is empty'
print('checked', len(ref), 'tensors')
)";
  auto r = zt::testing::run_process({"/usr/bin/env", "python3", "-c", script, dir},
                                    {{"PYTHONPATH", ZT_PYTHONPATH}, {"PYTHONWARNINGS", "ignore"}},
                                    std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checked " + std::to_string(records.size()) + " tensors"), std::string::npos) << r.output;

  auto& counter = zt::testing::CountingAllocator::instance();
  counter.install();
  zt::export_checkpoint(dir, "", dir + "/measured.safetensors", torch::kBFloat16);
  counter.uninstall();
  EXPECT_LE(counter.peak(), 3 * largest) << "largest parameter " << largest << " bytes, model " << total;
  EXPECT_LT(3 * largest, total / 2) << "the bound must be well below the model to mean anything";
  // Nothing to export: one line, exit 2, no file written.
  r = zt::testing::run_process({zt::testing::cli_path(), "export", dir + "/none", "--out", dir + "/none.safetensors"}, {},
                               std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/none.safetensors"));
}

// Every truncation and every single-bit flip of the manifest and of `latest` is refused.
TEST(Checkpoint, EveryDamageToTheManifestOrLatestIsDetected) {
  const fs::path dir = fresh_dir("manifest");
  SingleRank saver;
  saver.step();
  saver.engine->save_checkpoint(dir.string(), "only");
  std::mt19937 rng(3);
  for (const fs::path file : {dir / "only" / "manifest.json", dir / "latest"}) {
    std::ifstream in(file, std::ios::binary);
    const std::string bytes{std::istreambuf_iterator<char>(in), {}};
    in.close();
    auto refused = [&](const std::string& damaged, const std::string& what) {
      std::ofstream(file, std::ios::binary | std::ios::trunc) << damaged;
      try {
        saver.engine->load_checkpoint(dir.string());
        ADD_FAILURE() << file.filename() << ": " << what << " not detected";
      } catch (const zt::DataError&) {
      }
    };
    for (size_t length = 0; length < bytes.size(); ++length) refused(bytes.substr(0, length), "truncation to " + std::to_string(length));
    for (size_t at = 0; at < bytes.size(); ++at) {
      std::string copy = bytes;
      copy[at] = char(copy[at] ^ (1 << (rng() % 8)));
      refused(copy, "flip at byte " + std::to_string(at));
    }
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
    EXPECT_NO_THROW(saver.engine->load_checkpoint(dir.string())) << "restored " << file.filename();
  }
}

namespace {

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// The manifest of dir/tag, changed by `change` and given a valid checksum again (as one who
// crafts a file would): what fails to load then fails for what was changed.
void rewrite_manifest(const fs::path& manifest_path, const std::function<void(nlohmann::json&)>& change) {
  auto manifest = nlohmann::json::parse(read_text(manifest_path));
  change(manifest);
  manifest["checksum"] = "00000000";
  manifest["checksum"] = zt::crc32_hex(manifest.dump(1));
  std::ofstream(manifest_path, std::ios::binary | std::ios::trunc) << manifest.dump(1);
}

// A rank file rewritten from its tensors after `change` (names and values), with valid checksums.
void rewrite_rank_file(const fs::path& path, const std::function<void(std::vector<std::pair<std::string, torch::Tensor>>&)>& change) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  std::map<std::string, std::string> metadata;
  {
    zt::SafetensorsReader reader(path);
    metadata = reader.metadata();
    for (const auto& e : reader.entries()) tensors.emplace_back(e.name, reader.read(e.name));
  }
  change(tensors);
  std::vector<zt::TensorRecord> records;
  for (const auto& [name, t] : tensors) records.push_back({name, t.scalar_type(), t.sizes().vec()});
  zt::SafetensorsWriter writer(path, records, metadata);
  for (const auto& [name, t] : tensors) writer.write(t);
  writer.finish();
}

std::vector<std::string> fragment_roles(const zt::StateFragment& f) {
  std::vector<std::string> roles;
  for (const auto& [role, t] : f.roles) roles.push_back(role);
  return roles;
}

}  // namespace

// Loading another optimizer's state is refused with one line naming both (it used to load Adam's
// moments into LAMB or SGD silently); with reset_optimizer the weights load, the moments start
// from zero and the optimizer's step count from 0, while the global step is kept. A changed
// hyper-parameter is allowed and reported.
TEST(Checkpoint, AnotherOptimizerIsRefusedUnlessTheOptimizerIsReset) {
  const fs::path dir = fresh_dir("optimizer");
  SingleRank saver(7, 256, R"({"type": "Adam", "params": {"lr": 0.001}})");
  saver.step();
  saver.step();
  saver.engine->save_checkpoint(dir.string(), "adam");
  const torch::Tensor saved_weights = saver.parameters();
  struct Refused {
    std::string optimizer, type;
  };
  for (const Refused& c : {Refused{R"({"type": "Lamb", "params": {"lr": 0.001}})", "Lamb"},
                           Refused{R"({"type": "SGD", "params": {"lr": 0.001, "momentum": 0.9}})", "SGD"},
                           Refused{R"({"type": "SGD", "params": {"lr": 0.001}})", "SGD"}}) {
    SingleRank loader(99, 256, c.optimizer);
    const torch::Tensor before = loader.parameters();
    try {
      loader.engine->load_checkpoint(dir.string());
      ADD_FAILURE() << c.type << ": another optimizer's state must be refused";
    } catch (const zt::DataError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("saved with optimizer Adam, this run uses " + c.type), std::string::npos) << message;
      EXPECT_NE(message.find((dir / "adam" / "manifest.json").string()), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
    EXPECT_TRUE(torch::equal(loader.parameters(), before)) << c.type << ": the engine must be unchanged";
    EXPECT_EQ(loader.engine->global_step(), 0);
  }
  // AdamW keeps Adam's state: it loads, and the changes are reported, one line each.
  {
    SingleRank loader(99, 256, R"({"type": "AdamW", "params": {"lr": 0.0005}})");
    std::vector<std::string> lines;
    zt::LoadOptions options;
    options.log = [&](const std::string& line) { lines.push_back(line); };
    loader.engine->load_checkpoint(dir.string(), "", options);
    EXPECT_TRUE(torch::equal(loader.parameters(), saved_weights));
    EXPECT_NE(std::find(lines.begin(), lines.end(), "optimizer.params.lr: 0.001 -> 0.0005"), lines.end())
        << ::testing::PrintToString(lines);
    EXPECT_NE(std::find(lines.begin(), lines.end(), "optimizer.type: \"Adam\" -> \"AdamW\""), lines.end())
        << ::testing::PrintToString(lines);
    for (const auto& line : lines)
      EXPECT_TRUE(line.rfind("optimizer.", 0) == 0 || line.rfind("scheduler.", 0) == 0) << line;
    // Unchanged settings report nothing.
    SingleRank same(98, 256, R"({"type": "Adam", "params": {"lr": 0.001}})");
    lines.clear();
    same.engine->load_checkpoint(dir.string(), "", options);
    EXPECT_TRUE(lines.empty()) << ::testing::PrintToString(lines);
  }
  // Reset: LAMB from Adam's weights. One step equals one step of a fresh LAMB engine started from
  // the same weights (zero moments, bias correction at step 1), and the global step continues.
  const std::string lamb = R"({"type": "Lamb", "params": {"lr": 0.001}})";
  SingleRank reset(99, 256, lamb);
  zt::LoadOptions options;
  options.reset_optimizer = true;
  reset.engine->load_checkpoint(dir.string(), "", options);
  EXPECT_TRUE(torch::equal(reset.parameters(), saved_weights));
  EXPECT_EQ(reset.engine->global_step(), 2);
  SingleRank fresh(5, 256, lamb, saved_weights);
  ASSERT_TRUE(torch::equal(fresh.parameters(), saved_weights));
  torch::manual_seed(21);
  const auto tokens = torch::randint(0, 256, {2, 17}, torch::kLong);
  reset.step(tokens);
  fresh.step(tokens);
  EXPECT_EQ(reset.engine->global_step(), 3);
  EXPECT_TRUE(torch::equal(reset.parameters(), fresh.parameters()))
      << "after a reset the first LAMB step must be that of a fresh optimizer";
  // Saved and resumed again, the reset run continues exactly (its optimizer step count is saved).
  reset.engine->save_checkpoint(dir.string(), "lamb");
  SingleRank again(97, 256, lamb);
  again.engine->load_checkpoint(dir.string());
  torch::manual_seed(22);
  const auto next = torch::randint(0, 256, {2, 17}, torch::kLong);
  again.step(next);
  reset.step(next);
  EXPECT_TRUE(torch::equal(again.parameters(), reset.parameters()));
  // An explicit tag that is not a plain name is refused before anything is read.
  EXPECT_THROW(again.engine->load_checkpoint(dir.string(), "../adam"), zt::ConfigError);
}

// A save made to fail at each of its file operations in turn (the k-th create, write, fsync,
// rename or mkdir, or a full disk from the k-th write on), until a save hits no fault: every failed
// save throws a zt::Error naming the file and the OS error, and leaves the directory byte for byte
// as it was (`latest` naming the previous checkpoint, no new checkpoint, no staging directory or
// temporary file), and the previous checkpoint loads with the values it was saved with.
TEST(CheckpointFaults, AFailedSaveLeavesThePreviousCheckpoint) {
  auto comm = zt::make_communicator(zt::RendezvousInfo{}, {});
  const std::vector<zt::CheckpointParameter> parameters = {{"w", {3, 4}}, {"b", {5}}};
  auto make_fragments = [](float base) {
    std::vector<zt::StateFragment> fragments(2);
    fragments[0] = {"w", 0, 12, {{"master", torch::arange(12, torch::kFloat) + base}, {"exp_avg", torch::full({12}, base)}}};
    fragments[1] = {"b", 0, 5, {{"master", torch::arange(5, torch::kFloat) - base}, {"exp_avg", torch::full({5}, -base)}}};
    return fragments;
  };
  zt::CheckpointContents contents;
  contents.parameters = parameters;
  contents.scalars = {{"global_step", "1"}};
  const fs::path base = fresh_dir("faults");
  zt::save_sharded_checkpoint(*comm, base, "old", contents, make_fragments(1.5f), 0);
  using Fault = zt::FaultInjectingFileSystem::Fault;
  for (Fault kind : {Fault::Create, Fault::Write, Fault::Sync, Fault::Rename, Fault::Mkdir, Fault::DiskFull}) {
    const std::string what = zt::to_string(kind);
    const fs::path dir = fresh_dir("faults-case");
    fs::copy(base, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    const auto before = snapshot(dir);
    int failures = 0;
    for (int k = 1;; ++k) {
      ASSERT_LE(k, 200) << what << ": a save should not take this many operations";
      zt::FaultInjectingFileSystem files(zt::FileSystem::real(), kind, k);
      std::string error;
      try {
        zt::save_sharded_checkpoint(*comm, dir, "new", contents, make_fragments(7.25f), 0, files);
      } catch (const zt::Error& e) {
        error = e.what();
      }
      if (!files.fault_hit()) {
        EXPECT_EQ(error, "") << what << " k=" << k << ": no fault, no error";
        EXPECT_EQ(read_text(dir / "latest"), "new\n");
        break;
      }
      ++failures;
      ASSERT_NE(error, "") << what << " k=" << k << ": the fault must fail the save";
      const std::string os_error = kind == Fault::DiskFull ? std::strerror(ENOSPC)
                                   : kind == Fault::Create || kind == Fault::Mkdir ? std::strerror(EACCES)
                                                                                    : std::strerror(EIO);
      EXPECT_NE(error.find(os_error), std::string::npos) << what << " k=" << k << ": " << error;
      EXPECT_NE(error.find("'" + dir.string()), std::string::npos) << what << " k=" << k << " must name the file: " << error;
      EXPECT_EQ(error.find('\n'), std::string::npos) << error;
      EXPECT_EQ(snapshot(dir), before) << what << " k=" << k << ": " << error;
      std::set<std::string> names;
      for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
      EXPECT_EQ(names, (std::set<std::string>{"latest", "old"})) << what << " k=" << k;
      // The previous checkpoint, loaded, has exactly its values.
      auto loaded = make_fragments(0.0f);
      const auto expected = make_fragments(1.5f);
      for (auto& f : loaded)
        for (auto& [role, t] : f.roles) t = torch::full_like(t, -99.0f);
      zt::load_sharded_checkpoint(*comm, dir, "", parameters, loaded);
      for (size_t i = 0; i < loaded.size(); ++i)
        for (const auto& role : fragment_roles(loaded[i]))
          EXPECT_TRUE(torch::equal(loaded[i].roles.at(role), expected[i].roles.at(role))) << what << " k=" << k << " " << role;
    }
    EXPECT_GT(failures, 0) << what;
    std::printf("%s: %d failed saves before one with no fault\n", what.c_str(), failures);
  }
}

// The rank body of the next test (not listed by ctest): rank 1's writes fail; every rank must
// throw (none hangs), and the directory keeps the previous checkpoint.
TEST(CheckpointFaultRankBody, FailedWrites) {
  if (!is_rank_process()) GTEST_SKIP() << "a rank body: the next test starts it as ranks";
  auto comm = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
  const fs::path dir = env("ZT_CKPT_FAULT_DIR");
  const std::vector<zt::CheckpointParameter> parameters = {{"w", {8}}};
  const int rank = comm->rank();
  auto fragments = [&](float value) {
    return std::vector<zt::StateFragment>{{"w", 4 * rank, 4, {{"master", torch::full({4}, value + rank)}}}};
  };
  zt::CheckpointContents contents;
  contents.parameters = parameters;
  zt::save_sharded_checkpoint(*comm, dir, "old", contents, fragments(1.0f), 0);
  zt::FaultInjectingFileSystem faulty(zt::FileSystem::real(), zt::FaultInjectingFileSystem::Fault::Write, 1);
  zt::FileSystem& files = rank == 1 ? static_cast<zt::FileSystem&>(faulty) : zt::FileSystem::real();
  try {
    zt::save_sharded_checkpoint(*comm, dir, "new", contents, fragments(2.0f), 0, files);
    ADD_FAILURE() << "rank " << rank << ": the save must fail on every rank";
  } catch (const zt::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("rank-00001-of-00002.safetensors"), std::string::npos) << message;
    EXPECT_NE(message.find(std::strerror(EIO)), std::string::npos) << message;
  }
  comm->barrier("test.after");
  EXPECT_EQ(read_text(dir / "latest"), "old\n");
  EXPECT_FALSE(fs::exists(dir / "new"));
  EXPECT_FALSE(fs::exists(dir / ".partial-new"));
  auto loaded = fragments(0.0f);
  zt::load_sharded_checkpoint(*comm, dir, "", parameters, loaded);
  EXPECT_TRUE(torch::equal(loaded[0].roles.at("master"), torch::full({4}, 1.0f + rank)));
}

TEST(CheckpointFaults, AFailureOnOneRankFailsTheSaveOnEveryRank) {
  const std::string dir = fresh_dir("fault-ranks");
  auto r = run_ranks(2, "CheckpointFaultRankBody.FailedWrites", {{"ZT_CKPT_FAULT_DIR", dir}, {"ZT_COMM_TIMEOUT_SECONDS", "60"}},
                     std::chrono::seconds(120));
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}

namespace {

struct ScopedEnv {
  std::string name;
  ScopedEnv(std::string n, const std::string& value) : name(std::move(n)) { setenv(name.c_str(), value.c_str(), 1); }
  ~ScopedEnv() { unsetenv(name.c_str()); }
};

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace

// Roles given as sources (saving) and sinks (loading) stream in pieces of at most the chunk size
// (4096 bytes here: 1024 elements), in order, through buffers that never hold a whole role: the
// file is byte for byte the one written from whole tensors, and a sink receives exactly the
// saved values. A flipped byte in the data fails the streamed load with the checksum error, after
// the sink has seen data of that piece (which is why sinks write to staging).
TEST(Checkpoint, SourcesAndSinksStreamInBoundedPiecesToTheSameFile) {
  ScopedEnv chunk("ZT_CHECKPOINT_CHUNK_BYTES", "4096");
  ASSERT_EQ(zt::checkpoint_chunk_bytes(), 4096);
  auto comm = zt::make_communicator(zt::RendezvousInfo{}, {});
  const std::vector<zt::CheckpointParameter> parameters = {{"w", {50, 100}}, {"b", {7}}};
  const torch::Tensor w_master = torch::randn({5000}), w_avg = torch::randn({5000}), b_master = torch::randn({7});
  zt::CheckpointContents contents;
  contents.parameters = parameters;
  contents.scalars = {{"global_step", "1"}};
  auto whole = [&] {
    return std::vector<zt::StateFragment>{{"w", 0, 5000, {{"master", w_master}, {"exp_avg", w_avg}}},
                                          {"b", 0, 7, {{"master", b_master}}}};
  };
  std::vector<std::pair<int64_t, int64_t>> produced;  // (offset, count) of each source call
  auto streamed = [&] {
    auto fragments = whole();
    for (const char* role : {"master", "exp_avg"}) {
      const torch::Tensor values = fragments[0].roles.at(role);
      fragments[0].roles.erase(role);
      fragments[0].sources[role] = [&produced, values](int64_t offset, int64_t count, float* out) {
        produced.emplace_back(offset, count);
        std::memcpy(out, values.data_ptr<float>() + offset, size_t(count) * sizeof(float));
      };
    }
    return fragments;
  };
  const fs::path dir = fresh_dir("streamed");
  zt::save_sharded_checkpoint(*comm, dir, "whole", contents, whole(), 0);
  zt::save_sharded_checkpoint(*comm, dir, "streamed", contents, streamed(), 0);
  const std::string file = "rank-00000-of-00001.safetensors";
  EXPECT_EQ(read_bytes(dir / "streamed" / file), read_bytes(dir / "whole" / file));
  ASSERT_EQ(produced.size(), 10u) << "5000 elements in pieces of 1024, for each of two roles";
  for (size_t i = 0; i < produced.size(); ++i) {
    EXPECT_EQ(produced[i].first, int64_t(i % 5) * 1024);
    EXPECT_EQ(produced[i].second, std::min<int64_t>(1024, 5000 - int64_t(i % 5) * 1024));
  }
  // A write failing in the middle of a streamed tensor (the header is the first write, then one
  // per piece) publishes nothing.
  zt::FaultInjectingFileSystem faulty(zt::FileSystem::real(), zt::FaultInjectingFileSystem::Fault::Write, 4);
  EXPECT_THROW(zt::save_sharded_checkpoint(*comm, dir, "faulty", contents, streamed(), 0, faulty), zt::Error);
  EXPECT_TRUE(faulty.fault_hit());
  EXPECT_FALSE(fs::exists(dir / "faulty"));
  EXPECT_FALSE(fs::exists(dir / ".partial-faulty"));
  EXPECT_EQ(read_bytes(dir / "latest"), "streamed\n");

  // Loading "w" of the "whole" checkpoint (saved as tensors) through sinks, in two fragments
  // that cut a saved piece, as another world size would.
  std::map<std::string, torch::Tensor> received;
  std::map<std::string, int64_t> next;  // the offset each sink expects next
  auto sinks = [&] {
    std::vector<zt::StateFragment> fragments = {{"w", 0, 3000, {}}, {"w", 3000, 2000, {}}, {"b", 0, 7, {{"master", torch::zeros({7})}}}};
    received.clear();
    next.clear();
    for (int i = 0; i < 2; ++i)
      for (const std::string role : {"master", "exp_avg"}) {
        const std::string key = role + std::to_string(i);
        received[key] = torch::full({fragments[size_t(i)].numel}, -1.0f);
        fragments[size_t(i)].sinks[role] = [&, key](int64_t offset, int64_t count, const float* values) {
          EXPECT_EQ(offset, next[key]) << key << ": pieces in order, each element once";
          EXPECT_LE(count, 1024) << key;
          next[key] = offset + count;
          std::memcpy(received[key].data_ptr<float>() + offset, values, size_t(count) * sizeof(float));
        };
      }
    return fragments;
  };
  auto loaded = sinks();
  zt::load_sharded_checkpoint(*comm, dir, "whole", parameters, loaded);
  EXPECT_TRUE(torch::equal(received["master0"], w_master.narrow(0, 0, 3000)));
  EXPECT_TRUE(torch::equal(received["master1"], w_master.narrow(0, 3000, 2000)));
  EXPECT_TRUE(torch::equal(received["exp_avg0"], w_avg.narrow(0, 0, 3000)));
  EXPECT_TRUE(torch::equal(received["exp_avg1"], w_avg.narrow(0, 3000, 2000)));
  EXPECT_TRUE(torch::equal(loaded[2].roles.at("master"), b_master));

  // The last byte of w's master (the tensors are exp_avg:w, master:w, master:b) flipped: the load
  // fails naming the file and the checksum, after the sinks received the first pieces of it.
  {
    std::fstream f(dir / "whole" / file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-(7 * 4 + 1), std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-(7 * 4 + 1), std::ios::end);
    f.put(char(c ^ 0x10));
  }
  auto damaged = sinks();
  try {
    zt::load_sharded_checkpoint(*comm, dir, "whole", parameters, damaged);
    ADD_FAILURE() << "a flipped byte must fail the load";
  } catch (const zt::DataError& e) {
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'master:w:0' fails its checksum"), std::string::npos) << e.what();
  }
  EXPECT_EQ(next["master0"], 3000) << "streamed: the first fragment had its elements before the piece was verified";
  // A role given twice, or a source to a load, is a programming error, not a silent choice.
  auto twice = whole();
  twice[1].sources["master"] = [](int64_t, int64_t, float*) {};
  EXPECT_THROW(zt::save_sharded_checkpoint(*comm, dir, "twice", contents, twice, 0), zt::Error);
  auto sourced = streamed();
  EXPECT_THROW(zt::load_sharded_checkpoint(*comm, dir, "streamed", parameters, sourced), zt::Error);
}

// Hostile checkpoints, crafted with valid checksums: each refused by load and by export with a
// zt::DataError (zt::ConfigError for a tag argument) naming the file, without a crash, an
// allocation by a claimed size, or a file read or written outside the checkpoint's directory.
TEST(Checkpoint, HostileCheckpointsAreRefused) {
  const fs::path base = fresh_dir("hostile");
  {
    SingleRank saver;
    saver.step();
    saver.engine->save_checkpoint(base.string(), "only");
  }
  const std::string rank_file = "rank-00000-of-00001.safetensors";
  // A file outside the checkpoint that a path-following reader would open: a valid copy.
  fs::copy_file(base / "only" / rank_file, base / "outside.safetensors");
  using Manifest = std::function<void(nlohmann::json&)>;
  using Pieces = std::function<void(std::vector<std::pair<std::string, torch::Tensor>>&)>;
  struct Case {
    std::string what, expected;
    Manifest manifest;
    Pieces pieces;
    bool exported = true;  // export reads it too (the counters among the scalars only load reads)
  };
  auto set = [](const std::string& key, nlohmann::json value) -> Manifest {
    return [key, value](nlohmann::json& m) { m[key] = value; };
  };
  auto first_parameter = [](const std::function<void(nlohmann::json&)>& change) -> Manifest {
    return [change](nlohmann::json& m) { change(m["parameters"][0]); };
  };
  const std::vector<Case> cases = {
      {"a file name leading out", "is not one of its rank files", set("files", {"../outside.safetensors"})},
      {"an absolute file name", "is not one of its rank files", set("files", {(base / "outside.safetensors").string()})},
      {"a file name with NUL", "is not one of its rank files", set("files", {std::string("rank-00000-of-00001.safetensors\0x", 33)})},
      {"a rank beyond the world", "is not one of its rank files", set("files", {"rank-00001-of-00001.safetensors"})},
      {"a file listed twice", "not a list of at most world_size", set("files", {rank_file, rank_file})},
      {"a file name that is a number", "is not one of its rank files", set("files", {7})},
      {"files not a list", "'files' is not a list", set("files", nlohmann::json::object())},
      {"world size 0", "world_size 0", set("world_size", 0)},
      {"world size 2^63", "world_size", set("world_size", uint64_t(1) << 63)},
      {"world size a string", "world_size", set("world_size", "1")},
      {"no format", "not a zerotrain checkpoint", [](nlohmann::json& m) { m.erase("format"); }},
      {"no parameters", "not a zerotrain manifest", [](nlohmann::json& m) { m.erase("parameters"); }},
      {"negative dimension", "has shape", first_parameter([](nlohmann::json& p) { p["shape"] = {-256, -64}; })},
      {"element count overflow", "more elements than a 64-bit count holds",
       first_parameter([](nlohmann::json& p) { p["shape"] = {int64_t(1) << 32, int64_t(1) << 32}; })},
      {"parameter name with ..", "contains '..'", first_parameter([](nlohmann::json& p) { p["name"] = "wte..weight"; })},
      {"parameter name with NUL", "control character", first_parameter([](nlohmann::json& p) { p["name"] = std::string("wte\0.weight", 11); })},
      {"parameter listed twice", "is listed twice",
       [](nlohmann::json& m) { m["parameters"].push_back(m["parameters"][0]); }},
      {"parameter without a name", "is not {", first_parameter([](nlohmann::json& p) { p.erase("name"); })},
      {"slices in a version 1 manifest", "is saved as slices, which version 1 does not have",
       first_parameter([](nlohmann::json& p) { p["split"] = {{"dim", 0}, {"parts", 1}, {"ranks", 2}}; })},
      {"an unknown version", "not a zerotrain checkpoint of version 1 or 2", set("version", 3)},
      {"a split along a dimension it lacks", "expected a split dimension below 2, found 2",
       [](nlohmann::json& m) {
         m["version"] = 2;
         m["parameters"][0]["split"] = {{"dim", 2}, {"parts", 1}, {"ranks", 2}};
       }},
      {"a split into uneven slices", "equal slices",
       [](nlohmann::json& m) {
         m["version"] = 2;
         m["parameters"][0]["split"] = {{"dim", 1}, {"parts", 3}, {"ranks", 7}};
       }},
      {"a split of one rank", "expected 'ranks' an integer in [2, 99999]",
       [](nlohmann::json& m) {
         m["version"] = 2;
         m["parameters"][0]["split"] = {{"dim", 0}, {"parts", 1}, {"ranks", 1}};
       }},
      {"a split that is not an object", "expected 'dim' an integer",
       [](nlohmann::json& m) {
         m["version"] = 2;
         m["parameters"][0]["split"] = "rows";
       }},
      {"scalar not a string", "is not a string", [](nlohmann::json& m) { m["scalars"]["global_step"] = 3; }},
      {"step not a number", "scalar 'global_step' is 'abc'", [](nlohmann::json& m) { m["scalars"]["global_step"] = "abc"; }, nullptr, false},
      {"step beyond a count", "scalar 'global_step' is '1e400'", [](nlohmann::json& m) { m["scalars"]["global_step"] = "1e400"; }, nullptr, false},
      {"negative step", "scalar 'global_step' is '-3'", [](nlohmann::json& m) { m["scalars"]["global_step"] = "-3"; }, nullptr, false},
      {"piece beyond its parameter", "unexpected tensor 'master:wpe.weight:9999'", nullptr,
       [](auto& t) { t.emplace_back("master:wpe.weight:9999", torch::zeros({4})); }},
      {"piece at a huge offset", "unexpected tensor 'master:wte.weight:9223372036854775807'", nullptr,
       [](auto& t) { t.emplace_back("master:wte.weight:9223372036854775807", torch::zeros({4})); }},
      {"piece at a negative offset", "unexpected tensor 'master:wte.weight:-4'", nullptr,
       [](auto& t) { t.emplace_back("master:wte.weight:-4", torch::zeros({4})); }},
      {"overlapping pieces", "overlaps", nullptr,
       [](auto& t) { t.emplace_back("master:wpe.weight:3", torch::zeros({4})); }},
      {"piece of an unknown role", "unexpected tensor 'momentum:wpe.weight:0'", nullptr,
       [](auto& t) { t.emplace_back("momentum:wpe.weight:0", torch::zeros({4})); }},
      {"piece of an unknown parameter", "unexpected tensor 'master:nothing:0'", nullptr,
       [](auto& t) { t.emplace_back("master:nothing:0", torch::zeros({4})); }},
      {"piece in bf16", "unexpected tensor 'master:wpe.weight:0'", nullptr,
       [](auto& t) {
         for (auto& [name, tensor] : t)
           if (name == "master:wpe.weight:0") tensor = tensor.to(torch::kBFloat16);
       }},
  };
  for (const Case& c : cases) {
    const fs::path dir = fresh_dir("hostile-case");
    fs::copy(base, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    if (c.manifest) rewrite_manifest(dir / "only" / "manifest.json", c.manifest);
    if (c.pieces) rewrite_rank_file(dir / "only" / rank_file, c.pieces);
    const auto before = snapshot(dir);
    SingleRank loader(99);
    const auto parameters = loader.parameters();
    for (const std::string operation : {"load", "export"}) {
      if (operation == "export" && !c.exported) continue;
      try {
        if (operation == "load") loader.engine->load_checkpoint(dir.string());
        else zt::export_checkpoint(dir, "", dir / "exported.safetensors", torch::kFloat);
        ADD_FAILURE() << c.what << ": " << operation << " must refuse it";
      } catch (const zt::DataError& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find(c.expected), std::string::npos) << c.what << " (" << operation << "): " << message;
        EXPECT_NE(message.find(dir.string()), std::string::npos) << c.what << " must name the file: " << message;
        EXPECT_EQ(message.find('\n'), std::string::npos) << c.what << ": one line";
      }
    }
    EXPECT_TRUE(torch::equal(loader.parameters(), parameters)) << c.what << ": the engine must be unchanged";
    EXPECT_EQ(snapshot(dir), before) << c.what << ": nothing may be written";
  }
  // Sizes and nesting are bounded before a manifest is parsed.
  const fs::path dir = fresh_dir("hostile-size");
  fs::copy(base, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  SingleRank loader(99);
  std::ofstream(dir / "only" / "manifest.json", std::ios::binary | std::ios::trunc)
      << std::string(1'000'000, '[') << std::string(1'000'000, ']');
  EXPECT_THROW(loader.engine->load_checkpoint(dir.string()), zt::DataError);
  fs::resize_file(dir / "only" / "manifest.json", (int64_t(64) << 20) + 1);
  try {
    loader.engine->load_checkpoint(dir.string());
    ADD_FAILURE() << "an oversized manifest must be refused";
  } catch (const zt::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("at most 67108864 bytes"), std::string::npos) << e.what();
  }
  // A `latest` naming a path, and tags that are paths.
  std::ofstream(dir / "latest", std::ios::binary | std::ios::trunc) << "../hostile-size/only\n";
  EXPECT_THROW(loader.engine->load_checkpoint(dir.string()), zt::DataError);
  EXPECT_THROW(loader.engine->load_checkpoint(dir.string(), "../only"), zt::ConfigError);
  EXPECT_THROW(zt::export_checkpoint(dir, "/etc", dir / "x.safetensors", torch::kFloat), zt::ConfigError);
  EXPECT_FALSE(fs::exists(dir / "x.safetensors"));
}

// `zerotrain export` of a checkpoint in which part of a parameter is in no file: one line naming
// the parameter, exit 2, nothing written.
TEST(Checkpoint, ExportRefusesAParameterNotFullyCovered) {
  const fs::path dir = fresh_dir("uncovered");
  {
    SingleRank saver;
    saver.step();
    saver.engine->save_checkpoint(dir.string(), "only");
  }
  auto r = zt::testing::run_process({zt::testing::cli_path(), "export", dir.string(), "--out", (dir / "ok.safetensors").string()},
                                    {}, std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.output << ": the intact checkpoint exports";
  // The master values of wpe.weight from element 100 on are dropped (its moments stay).
  rewrite_rank_file(dir / "only" / "rank-00000-of-00001.safetensors", [](auto& tensors) {
    for (auto& [name, t] : tensors)
      if (name == "master:wpe.weight:0") t = t.narrow(0, 0, 100).clone();
  });
  const fs::path out = dir / "model.safetensors";
  r = zt::testing::run_process({zt::testing::cli_path(), "export", dir.string(), "--out", out.string()}, {},
                               std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("parameter 'wpe.weight' has"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("100 of them in the listed files"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(out.string() + ".partial"));
}
