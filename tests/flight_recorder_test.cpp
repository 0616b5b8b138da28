// Flight recorder (docs/comm.md "Flight recorder"): the ring and its file, the divergence analysis
// over synthetic rings, and end to end under `zerotrain launch`: a rank killed mid-collective is
// named with its signal and leaves nothing behind; a stage-3 rank that skips a block ends the job
// within seconds with one line naming it and the collective.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm/flight_recorder.h"
#include "support/multirank.h"
#include "support/process.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"

using namespace zt;
using namespace zt::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

FlightRecord record(std::uint64_t seq, const std::string& kind, const std::string& label,
                    CollectiveState state = CollectiveState::Completed) {
  FlightRecord r;
  r.commit = seq + 1;
  r.sequence = seq;
  r.start_ns = 1'700'000'000'000'000'000 + std::int64_t(seq) * 1'000'000;
  r.end_ns = state == CollectiveState::Issued ? 0 : r.start_ns + 500'000;
  r.bytes = 4096;
  r.state = static_cast<std::uint32_t>(state);
  std::snprintf(r.kind, sizeof(r.kind), "%s", kind.c_str());
  std::snprintf(r.label, sizeof(r.label), "%s", label.c_str());
  return r;
}

// A ring of `labels` from sequence `first` on (all_gather), the last one in `last_state`.
FlightRing ring(int rank, int world, std::uint64_t first, const std::vector<std::string>& labels,
                CollectiveState last_state = CollectiveState::TimedOut) {
  FlightRing out{rank, world, {}};
  for (size_t i = 0; i < labels.size(); ++i)
    out.records.push_back(record(first + i, "all_gather", labels[i],
                                 i + 1 == labels.size() ? last_state : CollectiveState::Completed));
  return out;
}

}  // namespace

// ---------------------------------------------------------------- the ring

TEST(FlightRecorder, KeepsTheLast64CollectivesOldestFirstWithTheirState) {
  FlightRecorder recorder(1, 2);
  for (std::uint64_t s = 0; s < 100; ++s) {
    recorder.issued(s, "all_reduce", "grads.bucket" + std::to_string(s), 4 * s);
    if (s != 99) recorder.finished(s, CollectiveState::Completed);
  }
  recorder.finished(98, CollectiveState::Failed);
  recorder.finished(3, CollectiveState::TimedOut);  // long gone from the ring: ignored
  auto records = recorder.records();
  ASSERT_EQ(records.size(), size_t(kFlightRecorderCapacity));
  EXPECT_EQ(records.front().sequence, 36u);
  EXPECT_EQ(records.back().sequence, 99u);
  for (size_t i = 1; i < records.size(); ++i) EXPECT_EQ(records[i].sequence, records[i - 1].sequence + 1);
  EXPECT_EQ(records.back().collective_state(), CollectiveState::Issued);
  EXPECT_EQ(records.back().end_ns, 0);
  EXPECT_EQ(records[records.size() - 2].collective_state(), CollectiveState::Failed);
  EXPECT_EQ(records.front().collective_state(), CollectiveState::Completed);
  EXPECT_EQ(records.front().label_text(), "grads.bucket36");
  EXPECT_EQ(records.front().kind_text(), "all_reduce");
  EXPECT_EQ(records.front().bytes, 144u);
  EXPECT_GE(records.front().end_ns, records.front().start_ns);

  const std::string dump = recorder.dump();
  EXPECT_TRUE(contains(dump, "flight recorder of rank 1/2: the last 64 collectives, oldest first")) << dump;
  EXPECT_TRUE(contains(dump, "issued     all_reduce     'grads.bucket99'")) << dump;
  EXPECT_TRUE(contains(dump, "failed     all_reduce     'grads.bucket98'")) << dump;
  EXPECT_FALSE(contains(dump, "'grads.bucket35'")) << dump;
}

TEST(FlightRecorder, LongLabelsAreCutToTheirField) {
  FlightRecorder recorder(0, 1);
  recorder.issued(0, "reduce_scatter", std::string(200, 'x'), 8);
  auto records = recorder.records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].label_text(), std::string(sizeof(FlightRecord::label) - 1, 'x'));
}

TEST(FlightRecorder, TheFileKeepsTheRingAfterTheProcessIsKilled) {
  auto dir = make_temp_dir("flight-file");
  const std::string path = dir + "/rank3.flight";
  std::ofstream(path) << "stale content of an earlier job";
  pid_t pid = fork();
  if (pid == 0) {
    FlightRecorder recorder(3, 4, path);
    for (std::uint64_t s = 0; s < 70; ++s) {
      recorder.issued(s, "broadcast", "step" + std::to_string(s), 12);
      if (s < 69) recorder.finished(s, CollectiveState::Completed);
    }
    raise(SIGKILL);  // no destructor, no flush: only what the mapping holds survives
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  auto ring = read_flight_ring(path);
  ASSERT_TRUE(ring.has_value());
  EXPECT_EQ(ring->rank, 3);
  EXPECT_EQ(ring->world_size, 4);
  ASSERT_EQ(ring->records.size(), size_t(kFlightRecorderCapacity));
  EXPECT_EQ(ring->records.front().sequence, 6u);
  EXPECT_EQ(ring->records.back().sequence, 69u);
  EXPECT_EQ(ring->records.back().collective_state(), CollectiveState::Issued);
  EXPECT_EQ(ring->records.back().label_text(), "step69");
  EXPECT_EQ(ring->records[0].collective_state(), CollectiveState::Completed);
  EXPECT_TRUE(contains(format_flight_ring(*ring), "flight recorder of rank 3/4")) << format_flight_ring(*ring);
}

// A ring still being written is never taken over: not by a second recorder of this process (a
// second communicator of the rank), nor by another process that inherited the variable (a child
// of the rank); the file of a recorder that is gone (destroyed, or its process dead) is reused.
TEST(FlightRecorder, AFileInUseIsNotTakenOver) {
  auto dir = make_temp_dir("flight-claim");
  const std::string path = dir + "/rank0.flight";
  {
    FlightRecorder first(0, 2, path);
    first.issued(0, "all_reduce", "mine", 4);
    EXPECT_THROW(FlightRecorder(0, 2, path), Error);
    auto ring = read_flight_ring(path);
    ASSERT_TRUE(ring.has_value());
    ASSERT_EQ(ring->records.size(), 1u);
    EXPECT_EQ(ring->records[0].label_text(), "mine");
  }
  EXPECT_NO_THROW(FlightRecorder(0, 2, path));

  int ready[2], release[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(release), 0);
  pid_t pid = fork();
  if (pid == 0) {
    try {
      FlightRecorder holder(1, 2, path);
      char c = 1;
      if (write(ready[1], &c, 1) != 1) _exit(2);
      if (read(release[0], &c, 1) != 1) _exit(3);
    } catch (...) {
      _exit(4);
    }
    _exit(0);
  }
  close(ready[1]);  // a child that ends early closes the pipe: no waiting forever
  close(release[0]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1) << "the child could not take the free file";
  try {
    FlightRecorder(0, 2, path);
    ADD_FAILURE() << "a ring another live process writes was taken over";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "in use by process " + std::to_string(pid))) << e.what();
  }
  ASSERT_EQ(write(release[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_NO_THROW(FlightRecorder(0, 2, path));  // its process is gone
  for (int fd : {ready[0], release[1]}) close(fd);
}

TEST(FlightRecorder, ReadingAMissingOrForeignFile) {
  auto dir = make_temp_dir("flight-read");
  EXPECT_FALSE(read_flight_ring(dir + "/absent.flight").has_value());
  std::ofstream(dir + "/foreign.flight") << std::string(20000, 'z');
  try {
    read_flight_ring(dir + "/foreign.flight");
    ADD_FAILURE() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_TRUE(contains(e.what(), dir + "/foreign.flight")) << e.what();
    EXPECT_TRUE(contains(e.what(), "expected a version 1 ring")) << e.what();
  }
  std::ofstream(dir + "/short.flight") << "ZT";
  EXPECT_THROW(read_flight_ring(dir + "/short.flight"), DataError);
  EXPECT_THROW(FlightRecorder(0, 1, dir + "/no/such/dir/rank0.flight"), Error);
}

// ---------------------------------------------------------------- divergence over synthetic rings

TEST(FlightDivergence, AllEqualIsNoDivergence) {
  std::vector<std::string> labels = {"params.a", "params.b", "grads.bucket0"};
  EXPECT_FALSE(find_divergence({ring(0, 3, 0, labels), ring(1, 3, 0, labels), ring(2, 3, 0, labels)}));
  EXPECT_FALSE(find_divergence({ring(0, 1, 0, labels)})) << "one ring has nothing to compare with";
  EXPECT_FALSE(find_divergence({}));
}

TEST(FlightDivergence, ALabelMismatchNamesTheRankOutsideTheMajority) {
  auto d = find_divergence({ring(0, 3, 0, {"warmup", "params.a", "params.b"}),
                            ring(1, 3, 0, {"warmup", "params.a", "params.b"}),
                            ring(2, 3, 0, {"warmup", "params.x", "params.b"})});
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->kind, Divergence::Kind::Mismatch);
  EXPECT_EQ(d->rank, 2);
  EXPECT_EQ(d->sequence, 1u);
  EXPECT_EQ(d->label, "params.a");
  EXPECT_EQ(d->kind_name, "all_gather");
  EXPECT_EQ(d->description,
            "rank 2 issued all_gather 'params.x' at seq 1 where rank 0 issued all_gather 'params.a' (rank 2: completed, "
            "rank 0: completed)");
  // Two ranks: no majority; the rank other than the lowest one is named.
  auto two = find_divergence({ring(0, 2, 0, {"warmup", "params.a"}), ring(1, 2, 0, {"warmup", "params.x"})});
  ASSERT_TRUE(two.has_value());
  EXPECT_EQ(two->rank, 1);
  EXPECT_EQ(two->sequence, 1u);
  // A differing kind under the same label also counts.
  auto kinds = ring(1, 2, 0, {"warmup", "params.a"});
  std::snprintf(kinds.records[1].kind, sizeof(kinds.records[1].kind), "broadcast");
  auto k = find_divergence({ring(0, 2, 0, {"warmup", "params.a"}), kinds});
  ASSERT_TRUE(k.has_value());
  EXPECT_EQ(k->rank, 1);
  EXPECT_TRUE(contains(k->description, "broadcast 'params.a'")) << k->description;
}

TEST(FlightDivergence, ARankThatStoppedIssuingIsNamedWithWhereTheOthersWait) {
  auto d = find_divergence({ring(0, 3, 0, {"a", "b", "c", "d"}), ring(1, 3, 0, {"a", "b"}, CollectiveState::Completed),
                            ring(2, 3, 0, {"a", "b", "c"})});
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->kind, Divergence::Kind::Stopped);
  EXPECT_EQ(d->rank, 1);
  EXPECT_EQ(d->sequence, 2u);
  EXPECT_EQ(d->label, "c");
  EXPECT_EQ(d->description,
            "rank 1 stopped issuing collectives before seq 2 all_gather 'c', which rank 0 issued (completed); its last "
            "was seq 1 all_gather 'b' (completed)");
  // A rank whose ring exists but holds nothing (it never issued a collective).
  auto none = find_divergence({ring(0, 2, 0, {"a"}), FlightRing{1, 2, {}}});
  ASSERT_TRUE(none.has_value());
  EXPECT_EQ(none->rank, 1);
  EXPECT_EQ(none->sequence, 0u);
  EXPECT_TRUE(contains(none->description, "it issued none")) << none->description;
}

TEST(FlightDivergence, ARankThatSkippedACollectiveIsNamedAsSkipping) {
  // Rank 1 left out 'params.b': its seq 2 is what the others issued as seq 3.
  auto d = find_divergence({ring(0, 3, 0, {"warmup", "params.a", "params.b", "params.c", "params.d"}),
                            ring(1, 3, 0, {"warmup", "params.a", "params.c", "params.d"}),
                            ring(2, 3, 0, {"warmup", "params.a", "params.b", "params.c", "params.d"})});
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->kind, Divergence::Kind::Skipped);
  EXPECT_EQ(d->rank, 1);
  EXPECT_EQ(d->sequence, 2u);
  EXPECT_EQ(d->label, "params.b");
  EXPECT_EQ(d->description,
            "rank 1 skipped all_gather 'params.b' at seq 2: it issued all_gather 'params.c' there, which rank 0 issued "
            "as seq 3 (rank 1: completed, rank 0: completed)");
}

TEST(FlightDivergence, FullRingsAreComparedWhereTheyOverlap) {
  // 200 collectives; each ring holds its last 64 (rank 1's window starts later: it ran ahead
  // after diverging). The first difference inside the common window is found.
  auto labels = [](int first, int count, int diverge_at) {
    std::vector<std::string> out;
    for (int s = first; s < first + count; ++s) out.push_back(s == diverge_at ? "odd" : "op" + std::to_string(s));
    return out;
  };
  auto d = find_divergence({ring(0, 2, 136, labels(136, 64, -1)), ring(1, 2, 140, labels(140, 64, 150))});
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->rank, 1);
  EXPECT_EQ(d->sequence, 150u);
  EXPECT_EQ(d->label, "op150");
  // Records before the newest full ring's window are not compared (nothing to compare them to):
  // rank 0's odd seq 137 is not seen; that it stopped at 200 is.
  auto late = find_divergence({ring(0, 2, 136, labels(136, 64, 137)), ring(1, 2, 140, labels(140, 64, -1))});
  ASSERT_TRUE(late.has_value());
  EXPECT_EQ(late->kind, Divergence::Kind::Stopped);
  EXPECT_EQ(late->rank, 0);
  EXPECT_EQ(late->sequence, 200u);
}

// ---------------------------------------------------------------- end to end under the launcher

namespace {

struct Launched {
  ProcessResult result;
  double seconds = 0;
  std::string dir;
};

// Runs `zerotrain launch --nproc 2` with this test binary as the rank program, filtered to `test`.
Launched launch_ranks(const std::string& test, const std::string& dir, std::map<std::string, std::string> env) {
  env["ZT_TEST_RANK_ROLE"] = "1";
  env["ZT_FR_TEST_DIR"] = dir;
  auto start = std::chrono::steady_clock::now();
  Launched out;
  out.result = run_process({cli_path(), "launch", "--nproc", "2", "--log-dir", dir + "/logs", "--", self_executable(),
                            "--gtest_filter=" + test},
                           env, 90s);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.dir = dir;
  return out;
}

std::shared_ptr<Communicator> launched_communicator() {
  std::ofstream(std::string(std::getenv("ZT_FR_TEST_DIR")) + "/rank" + std::getenv("RANK") + ".pid") << getpid();
  return make_communicator(rendezvous_from_environment(), comm_options_from_environment());
}

// Every rank wrote its pid; each process and its process group (the launcher made each rank a
// group leader) must be gone.
void expect_nothing_left(const std::string& dir) {
  for (int rank = 0; rank < 2; ++rank) {
    std::string text = read_text(dir + "/rank" + std::to_string(rank) + ".pid");
    ASSERT_FALSE(text.empty()) << "rank " << rank << " never started";
    pid_t pid = std::stoi(text);
    EXPECT_NE(kill(pid, 0), 0) << "rank " << rank << " (pid " << pid << ") outlived the launcher";
    EXPECT_NE(kill(-pid, 0), 0) << "rank " << rank << "'s process group " << pid << " outlived the launcher";
    if (kill(-pid, 0) == 0) kill(-pid, SIGKILL);
  }
}

}  // namespace

TEST(FlightRecorderLaunched, ARankKilledMidCollectiveIsNamedAndNothingIsLeft) {
  if (is_rank_process()) {
    auto comm = launched_communicator();
    auto t = torch::ones({256});
    for (int i = 0; i < 100000; ++i) {
      auto handle = comm->all_reduce(t, ReduceOp::Avg, "step" + std::to_string(i));
      if (comm->rank() == 1 && i == 30) raise(SIGKILL);  // in the middle of a collective
      handle.wait();
    }
    ADD_FAILURE() << "rank 1 was expected to die";
    return;
  }
  auto run = launch_ranks("FlightRecorderLaunched.ARankKilledMidCollectiveIsNamedAndNothingIsLeft",
                          make_temp_dir("flight-killed"), {{"ZT_COMM_TIMEOUT_SECONDS", "20"}});
  const std::string& out = run.result.output;
  EXPECT_FALSE(run.result.timed_out) << out;
  EXPECT_EQ(run.result.exit_code, 128 + SIGKILL) << out;
  EXPECT_TRUE(contains(out, "zerotrain launch: rank 1 was killed by SIGKILL (signal 9, code 137)")) << out;
  EXPECT_LT(run.seconds, 30.0) << out;
  expect_nothing_left(run.dir);
  // The killed rank's ring survived it: seq 30 issued, never completed.
  auto ring = read_flight_ring(run.dir + "/logs/rank1.flight");
  ASSERT_TRUE(ring.has_value());
  ASSERT_FALSE(ring->records.empty());
  EXPECT_EQ(ring->records.back().sequence, 30u);
  EXPECT_EQ(ring->records.back().label_text(), "step30");
  EXPECT_EQ(ring->records.back().collective_state(), CollectiveState::Issued);
}

namespace {
struct TwoBlocks : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  TwoBlocks() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
    zt::mark_block(a.ptr());
    zt::mark_block(b.ptr());
  }
  torch::Tensor forward(const torch::Tensor& x, bool skip_a) {
    auto h = skip_a ? x : zt::run_block(*a, x, [&](const torch::Tensor& in) { return a->forward(in); });
    return zt::run_block(*b, h, [&](const torch::Tensor& in) { return b->forward(in); });
  }
};
}  // namespace

TEST(FlightRecorderLaunched, AStage3RankThatSkipsABlockIsNamedWithinSeconds) {
  if (is_rank_process()) {
    auto comm = launched_communicator();
    auto config = zt::parse_config(
        R"({"train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})",
        {}, comm->world_size());
    torch::manual_seed(3);
    auto net = std::make_shared<TwoBlocks>();
    zt::Engine engine(net, config, comm);
    for (int step = 0; step < 6; ++step) {
      // From the third step on, rank 1 leaves out block 'a' (the first forward checks the
      // order; later ones are trusted, so only the collectives can tell).
      const bool skip = comm->rank() == 1 && step >= 2;
      auto loss = net->forward(torch::randn({2, 4}), skip).pow(2).mean();
      engine.backward(loss);
      engine.step();
    }
    ADD_FAILURE() << "the ranks were expected to fail";
    return;
  }
  auto run = launch_ranks("FlightRecorderLaunched.AStage3RankThatSkipsABlockIsNamedWithinSeconds",
                          make_temp_dir("flight-skip"), {{"ZT_COMM_TIMEOUT_SECONDS", "8"}});
  const std::string& out = run.result.output;
  EXPECT_FALSE(run.result.timed_out) << out;
  EXPECT_NE(run.result.exit_code, 0) << out;
  EXPECT_LT(run.seconds, 30.0) << out;
  // Blocks of equal size: rank 1's gather of 'b' paired with rank 0's gather of 'a' without an
  // error; only the labels in the rings show where rank 1 left the common sequence.
  EXPECT_TRUE(contains(out, "zerotrain launch: collectives diverged: rank 1 skipped all_gather 'params.model.a' at "
                            "seq "))
      << out;
  expect_nothing_left(run.dir);
  for (int rank = 0; rank < 2; ++rank) {
    std::string log = read_text(run.dir + "/logs/rank" + std::to_string(rank) + ".log");
    EXPECT_TRUE(contains(log, "flight recorder of rank " + std::to_string(rank) + "/2")) << log;
  }
}
