// Collective bandwidth between local ranks, through shared memory (the communicator's default on
// one machine) and through Gloo over loopback, beside a memcpy of the same bytes, and the cost of
// each emulation the communicator can fall back to (docs/comm.md).
//
//   build/bin/comm_bench [max_mib=256]
//
// Started without RANK it starts itself as 2 ranks (like the tests); rank 0 prints a markdown
// table. Each rank uses one intra-op thread: the two ranks share the machine's cores.
#ifndef FMT_HEADER_ONLY
#define FMT_HEADER_ONLY 1  // LibTorch's bundled fmt 12 headers shadow the system fmt library
#endif
#include <fmt/format.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "comm/collective_paths.h"
#include "zerotrain/comm/comm.h"

namespace {

constexpr int kWorld = 2;

// Starts this program as ranks 0..kWorld-1 with launcher variables; returns the worst exit code.
int spawn_ranks(int argc, char** argv) {
  std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  int port = 20000 + int(getpid() % 20000);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < kWorld; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(kWorld).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(kWorld).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      std::vector<char*> args{exe.data()};
      for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
      args.push_back(nullptr);
      execv(exe.c_str(), args.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  int worst = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    worst = std::max(worst, code);
  }
  return worst;
}

struct Row {
  int64_t mib;
  std::string op, dtype, path;
  int64_t bytes;
  double seconds;
};

}  // namespace

int main(int argc, char** argv) {
  if (std::getenv("RANK") == nullptr) return spawn_ranks(argc, argv);
  int64_t max_mib = argc > 1 ? std::atoll(argv[1]) : 256;
  torch::set_num_threads(1);

  auto info = zt::rendezvous_from_environment();
  // Gloo's own paths ("native"), with the shared-memory path turned off.
  zt::CommOptions native_options;
  native_options.shared_memory = false;
  auto native = zt::make_communicator(info, native_options);
  // A second communicator, on the next port, with every emulation forced on and Gloo's own
  // allgather instead of the default broadcast per rank.
  zt::CollectivePaths emulated_paths;
  emulated_paths.emulate_avg = emulated_paths.emulate_low_precision = emulated_paths.emulate_reduce_scatter = true;
  emulated_paths.native_gloo_all_gather = true;
  auto emulated_info = info;
  emulated_info.master_port += 1;
  auto emulated = zt::make_communicator(emulated_info, zt::CommOptions{}, emulated_paths);
  // The default: ranks on one machine meet in shared memory.
  auto shared_info = info;
  shared_info.master_port += 2;
  auto shared = zt::make_communicator(shared_info, zt::CommOptions{});
  const int rank = info.rank;

  std::vector<Row> rows;
  std::map<int64_t, double> memcpy_seconds;  // by bytes
  for (int64_t mib = 1; mib <= max_mib; mib *= 4) {
    const int64_t bytes = mib << 20;
    const int64_t n = bytes / 4;  // element count of the fp32 buffer; bf16 rows use the same count
    const int reps = int(std::clamp<int64_t>((512LL << 20) / bytes, 3, 30));
    // Both ranks run every measurement together; rank 0's clock is reported.
    auto time = [&](const std::function<void()>& fn) {
      fn();  // warm up: first-touch page faults, connection buffers
      native->barrier("bench");
      auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) fn();
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / reps;
      native->barrier("bench");
      return s;
    };
    auto add = [&](std::string op, at::ScalarType dtype, std::string path, int64_t row_bytes, double s) {
      rows.push_back({mib, std::move(op), dtype == at::kFloat ? "fp32" : "bf16", std::move(path), row_bytes, s});
    };

    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      auto src = torch::randn({n}).to(dtype);
      auto dst = torch::empty_like(src);
      int64_t row_bytes = n * src.element_size();
      double s = time([&] { dst.copy_(src); });
      memcpy_seconds[row_bytes] = s;
      add("memcpy", dtype, "-", row_bytes, s);
    }

    auto f32 = torch::randn({n});
    auto b16 = torch::randn({n}).to(at::kBFloat16);
    using zt::ReduceOp;
    add("all_reduce sum", at::kFloat, "native", bytes, time([&] { native->all_reduce(f32, ReduceOp::Sum, "b").wait(); }));
    add("all_reduce avg", at::kFloat, "native", bytes, time([&] { native->all_reduce(f32, ReduceOp::Avg, "b").wait(); }));
    add("all_reduce avg", at::kFloat, "emulated: sum + divide", bytes,
        time([&] { emulated->all_reduce(f32, ReduceOp::Avg, "b").wait(); }));
    add("all_reduce sum", at::kFloat, "shared memory", bytes,
        time([&] { shared->all_reduce(f32, ReduceOp::Sum, "b").wait(); }));
    add("all_reduce sum", at::kBFloat16, "native", bytes / 2,
        time([&] { native->all_reduce(b16, ReduceOp::Sum, "b").wait(); }));
    add("all_reduce sum", at::kBFloat16, "emulated: via fp32", bytes / 2,
        time([&] { emulated->all_reduce(b16, ReduceOp::Sum, "b").wait(); }));
    add("all_reduce sum", at::kBFloat16, "shared memory", bytes / 2,
        time([&] { shared->all_reduce(b16, ReduceOp::Sum, "b").wait(); }));

    auto rs_out32 = torch::empty({n / kWorld});
    auto rs_out16 = torch::empty({n / kWorld}, at::kBFloat16);
    add("reduce_scatter sum", at::kFloat, "native", bytes,
        time([&] { native->reduce_scatter(f32, rs_out32, ReduceOp::Sum, "b").wait(); }));
    add("reduce_scatter sum", at::kFloat, "emulated: all_reduce + slice", bytes,
        time([&] { emulated->reduce_scatter(f32, rs_out32, ReduceOp::Sum, "b").wait(); }));
    add("reduce_scatter sum", at::kFloat, "scratch input: in-place all_reduce + slice", bytes,
        time([&] { native->reduce_scatter(f32, rs_out32, ReduceOp::Sum, "b", zt::InputUse::Scratch).wait(); }));
    add("reduce_scatter sum", at::kFloat, "shared memory", bytes,
        time([&] { shared->reduce_scatter(f32, rs_out32, ReduceOp::Sum, "b", zt::InputUse::Scratch).wait(); }));
    add("reduce_scatter sum", at::kBFloat16, "native", bytes / 2,
        time([&] { native->reduce_scatter(b16, rs_out16, ReduceOp::Sum, "b").wait(); }));
    add("reduce_scatter sum", at::kBFloat16, "emulated: fp32 all_reduce + slice", bytes / 2,
        time([&] { emulated->reduce_scatter(b16, rs_out16, ReduceOp::Sum, "b").wait(); }));
    add("reduce_scatter sum", at::kBFloat16, "scratch input: in-place all_reduce + slice", bytes / 2,
        time([&] { native->reduce_scatter(b16, rs_out16, ReduceOp::Sum, "b", zt::InputUse::Scratch).wait(); }));
    add("reduce_scatter sum", at::kBFloat16, "shared memory", bytes / 2,
        time([&] { shared->reduce_scatter(b16, rs_out16, ReduceOp::Sum, "b", zt::InputUse::Scratch).wait(); }));

    auto shard32 = torch::randn({n / kWorld});
    auto shard16 = shard32.to(at::kBFloat16);
    add("all_gather", at::kFloat, "Gloo: broadcast per rank", bytes,
        time([&] { native->all_gather(shard32, f32, "b").wait(); }));
    add("all_gather", at::kFloat, "Gloo _allgather_base", bytes,
        time([&] { emulated->all_gather(shard32, f32, "b").wait(); }));
    add("all_gather", at::kFloat, "shared memory", bytes, time([&] { shared->all_gather(shard32, f32, "b").wait(); }));
    add("all_gather", at::kBFloat16, "Gloo: broadcast per rank", bytes / 2,
        time([&] { native->all_gather(shard16, b16, "b").wait(); }));
    add("all_gather", at::kBFloat16, "Gloo _allgather_base", bytes / 2,
        time([&] { emulated->all_gather(shard16, b16, "b").wait(); }));
    add("all_gather", at::kBFloat16, "shared memory", bytes / 2,
        time([&] { shared->all_gather(shard16, b16, "b").wait(); }));
  }

  if (rank == 0) {
    fmt::print("comm_bench: {} ranks on one machine (shared memory and Gloo over loopback), 1 intra-op thread per rank, "
               "LibTorch {}\n\n",
               kWorld, TORCH_VERSION);
    fmt::print("| fp32 size | op | dtype | path | bytes | time (ms) | algbw (GB/s) | × memcpy time |\n");
    fmt::print("| ---: | --- | --- | --- | ---: | ---: | ---: | ---: |\n");
    for (const auto& r : rows) {
      double ratio = r.seconds / memcpy_seconds.at(r.bytes);
      fmt::print("| {} MiB | {} | {} | {} | {} | {:.3f} | {:.2f} | {:.1f} |\n", r.mib, r.op, r.dtype, r.path, r.bytes,
                 r.seconds * 1e3, double(r.bytes) / r.seconds / 1e9, ratio);
    }
  }
  native->barrier("done");
  emulated->barrier("done");
  shared->barrier("done");
  return 0;
}
