// Checkpoints through the engine: an exact resume in a fresh process at every stage, resuming on
// another world size and stage, and damaged or foreign checkpoints refused without harm.
//
// Each case runs its ranks several times (a separate process per phase); the rank body reads
// what to do from ZT_CKPT_* variables and writes its global losses to a file the parent compares.
#include <gtest/gtest.h>

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
#include "checkpoint/safetensors.h"
#include "support/counting_allocator.h"
#include "support/multirank.h"
#include "zerotrain/comm.h"
#include "zerotrain/config.h"
#include "zerotrain/engine.h"
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
  auto r = run_ranks(world, "CheckpointRank.Body",
                     {{"ZT_CKPT_STAGE", std::to_string(stage)}, {"ZT_CKPT_STEPS", std::to_string(steps)},
                      {"ZT_CKPT_LOAD", load_dir}, {"ZT_CKPT_SAVE", save_dir}, {"ZT_CKPT_LOSSES", losses_file},
                      {"ZT_COMM_TIMEOUT_SECONDS", "60"}},
                     std::chrono::seconds(240));
  ASSERT_TRUE(r.all_succeeded()) << "world " << world << " stage " << stage << ":\n" << r.describe();
}

std::string fresh_dir(const std::string& name) { return zt::testing::make_temp_dir("checkpoint-" + name); }

}  // namespace

// The rank body of every case below (does nothing when run directly).
TEST(CheckpointRank, Body) {
  if (!is_rank_process()) return;
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
  explicit SingleRank(int seed = 7, int64_t vocab = 256) {
    torch::manual_seed(seed);
    auto gpt_config = zt::gpt_preset("tiny");
    gpt_config.vocab_size = vocab;
    model = zt::GPT(gpt_config);
    auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})", {}, 1);
    engine = std::make_unique<zt::Engine>(model.ptr(), config, comm);
  }
  void step() {
    auto tokens = torch::randint(0, 256, {2, 17}, torch::kLong);
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

// The saver of the crash test (does nothing unless ZT_CKPT_CRASH_DIR is set): one checkpoint,
// a "ready" mark, then checkpoints back to back (keeping 3) until it is killed.
TEST(CheckpointCrash, SaverBody) {
  const std::string dir = env("ZT_CKPT_CRASH_DIR");
  if (dir.empty()) return;
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
      ::execl(self.c_str(), self.c_str(), "--gtest_filter=CheckpointCrash.SaverBody", static_cast<char*>(nullptr));
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
