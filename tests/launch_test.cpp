// Tests of the local launcher: rank environment, per-rank logs, rank 0
// echoed to stdout, exit-code propagation, signal forwarding, and that no process outlives it.
//
// launch_local installs signal handlers and forks, so most tests run it in a separate process:
// this test binary started again in "helper mode" (ZT_LAUNCH_HELPER=1, see below), with its
// stdout and stderr in files. The rank programs are small /bin/sh scripts.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/process.h"
#include "zerotrain/error.h"
#include "zerotrain/launch/launch.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---- Helper mode: runs before gtest's main when the environment asks for it, calls
// launch_local with options read from ZT_HELPER_* variables and exits with its return value.
const bool kHelperMode = [] {
  if (!std::getenv("ZT_LAUNCH_HELPER")) return false;
  auto get = [](const char* name, const char* fallback) {
    const char* v = std::getenv(name);
    return std::string(v ? v : fallback);
  };
  zt::LaunchOptions options;
  options.nproc = std::stoi(get("ZT_HELPER_NPROC", "1"));
  options.master_port = std::stoi(get("ZT_HELPER_PORT", "0"));
  options.log_dir = get("ZT_HELPER_LOG_DIR", "logs");
  options.kill_grace = std::chrono::milliseconds(std::stoi(get("ZT_HELPER_GRACE_MS", "3000")));
  options.echo_rank0 = get("ZT_HELPER_ECHO", "1") == "1";
  options.command = {"/bin/sh", "-c", get("ZT_HELPER_SCRIPT", "true")};
  options.nnodes = std::stoi(get("ZT_HELPER_NNODES", "1"));
  options.node_rank = std::stoi(get("ZT_HELPER_NODE_RANK", "0"));
  options.heartbeat_timeout = std::chrono::milliseconds(std::stoi(get("ZT_HELPER_HEARTBEAT_MS", "10000")));
  options.join_timeout = std::chrono::milliseconds(30000);
  for (const char* name : {"ZT_LAUNCH_HELPER", "ZT_HELPER_NPROC", "ZT_HELPER_PORT", "ZT_HELPER_LOG_DIR",
                           "ZT_HELPER_GRACE_MS", "ZT_HELPER_ECHO", "ZT_HELPER_SCRIPT", "ZT_HELPER_NNODES",
                           "ZT_HELPER_NODE_RANK", "ZT_HELPER_HEARTBEAT_MS"})
    unsetenv(name);
  int code = 1;
  try {
    code = zt::launch_local(options);
  } catch (const std::exception& e) {
    fprintf(stderr, "helper: %s\n", e.what());
  }
  fflush(nullptr);
  _exit(code);  // skip static destructors of the test binary
}();

struct LaunchRun {
  int exit_code = -1;
  double seconds = 0;  // from start (or from the signal, when one was sent) to exit
  std::string out;     // the launcher's stdout
  std::string err;     // the launcher's stderr
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Starts this binary as a launcher. `vars` are added to (and `unset` removed from) the
// environment. Returns its pid; it is in its own process group.
pid_t spawn_launcher(const std::string& dir, const std::map<std::string, std::string>& vars,
                     const std::vector<std::string>& unset = {}) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    std::string key = entry.substr(0, entry.find('='));
    if (vars.count(key) || std::find(unset.begin(), unset.end(), key) != unset.end()) continue;
    env.push_back(entry);
  }
  env.push_back("ZT_LAUNCH_HELPER=1");
  for (const auto& [k, v] : vars) env.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string self = zt::testing::self_executable();
  std::vector<char*> argv = {self.data(), nullptr};
  int out = open((dir + "/launcher.out").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int err = open((dir + "/launcher.err").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    dup2(out, 1);
    dup2(err, 2);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(out);
  close(err);
  return pid;
}

// Waits for the launcher; kills it (and fails) after `timeout`.
LaunchRun wait_launcher(pid_t pid, const std::string& dir, Clock::time_point since,
                        std::chrono::seconds timeout = 30s) {
  LaunchRun run;
  int status = 0;
  auto deadline = Clock::now() + timeout;
  while (true) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (Clock::now() > deadline) {
      ADD_FAILURE() << "launcher did not exit within " << timeout.count() << " s";
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  run.seconds = std::chrono::duration<double>(Clock::now() - since).count();
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  run.out = read_text(dir + "/launcher.out");
  run.err = read_text(dir + "/launcher.err");
  return run;
}

LaunchRun run_launcher(const std::string& dir, std::map<std::string, std::string> vars,
                       const std::vector<std::string>& unset = {}) {
  if (!vars.count("ZT_HELPER_LOG_DIR")) vars["ZT_HELPER_LOG_DIR"] = dir + "/logs";
  auto start = Clock::now();
  pid_t pid = spawn_launcher(dir, vars, unset);
  return wait_launcher(pid, dir, start);
}

// A process is gone when it does not exist or is a zombie (dead, waiting for a parent that
// may never reap it: pid 1 of some containers does not).
bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
  size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return true;
  char state = stat[close + 2];
  return state == 'Z' || state == 'X';
}

bool eventually_gone(pid_t pid, std::chrono::milliseconds within = 2000ms) {
  auto deadline = Clock::now() + within;
  while (!process_gone(pid)) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// Pids the ranks wrote to <dir>/*.pid; each must be gone.
void expect_all_gone(const std::string& dir, size_t expected_count) {
  size_t count = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".pid") continue;
    std::string text = read_text(entry.path().string());
    ASSERT_FALSE(text.empty()) << entry.path();
    pid_t pid = std::stoi(text);
    ++count;
    EXPECT_TRUE(eventually_gone(pid)) << "process " << pid << " from " << entry.path() << " outlived the launcher";
    if (!process_gone(pid)) kill(pid, SIGKILL);  // do not leave it behind for the next tests
  }
  EXPECT_EQ(count, expected_count);
}

bool wait_for_files(const std::vector<std::string>& paths, std::chrono::seconds within = 20s) {
  auto deadline = Clock::now() + within;
  while (Clock::now() < deadline) {
    if (std::all_of(paths.begin(), paths.end(), [](const auto& p) { return fs::exists(p); })) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

// KEY=VALUE lines of `env` output in a log.
std::map<std::string, std::string> parse_env(const std::string& text) {
  std::map<std::string, std::string> env;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    size_t eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

bool has_line(const std::string& text, const std::string& line) {
  std::istringstream in(text);
  std::string l;
  while (std::getline(in, l))
    if (l == line) return true;
  return false;
}

int usable_cores() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

// The shell lines every "long-running" rank starts with: record its pid and a background
// child's (a grandchild of the launcher), then mark itself ready.
std::string record_pids(const std::string& dir) {
  return "echo $$ > " + dir + "/rank$RANK.pid; sleep 60 & echo $! > " + dir + "/child$RANK.pid; touch " + dir +
         "/ready$RANK; ";
}

// ---------------------------------------------------------------------------------------------

TEST(Launch, EveryRankGetsTheRendezvousEnvironment) {
  auto dir = zt::testing::make_temp_dir("launch-env");
  // A RANK already in our environment (e.g. a launcher inside a launched job) must be replaced.
  auto run = run_launcher(dir, {{"ZT_HELPER_NPROC", "3"}, {"ZT_HELPER_SCRIPT", "env"}, {"RANK", "99"}},
                          {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MASTER_PORT"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::string port;
  for (int rank = 0; rank < 3; ++rank) {
    auto log = dir + "/logs/rank" + std::to_string(rank) + ".log";
    ASSERT_TRUE(fs::exists(log));
    auto env = parse_env(read_text(log));
    EXPECT_EQ(env["RANK"], std::to_string(rank));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(env["WORLD_SIZE"], "3");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["ZT_LAUNCHED"], "1");
    EXPECT_EQ(env["OMP_WAIT_POLICY"], "PASSIVE");
    EXPECT_EQ(env["OMP_NUM_THREADS"], std::to_string(std::max(1, usable_cores() / 3)));
    EXPECT_EQ(env.count("ZT_LAUNCH_HELPER"), 0u);
    if (rank == 0) port = env["MASTER_PORT"];
    EXPECT_EQ(env["MASTER_PORT"], port) << "every rank must get the same port";
  }
  ASSERT_FALSE(port.empty());
  EXPECT_GT(std::stoi(port), 0);
  EXPECT_LT(std::stoi(port), 65536);
  // Rank 0's output (only) on the launcher's stdout; where the logs are on its stderr.
  EXPECT_TRUE(has_line(run.out, "RANK=0")) << run.out;
  EXPECT_FALSE(has_line(run.out, "RANK=1"));
  EXPECT_NE(run.err.find(dir + "/logs/rank{0..2}.log"), std::string::npos) << run.err;
}

// Rank 0 gets the rendezvous socket the launcher opened, already listening on MASTER_PORT, as
// descriptor 3 (ZT_RENDEZVOUS_LISTEN_FD=3): no other process can take the port between its
// choice and the store's start. No other rank gets it, nor a number left in the launcher's own
// environment.
TEST(Launch, RankZeroHoldsTheRendezvousSocketListeningOnTheMasterPort) {
  auto dir = zt::testing::make_temp_dir("launch-socket");
  const std::string script =
      "echo \"FD=${ZT_RENDEZVOUS_LISTEN_FD:-none}\"; "
      "echo \"FD3=$(readlink /proc/$$/fd/3 2>/dev/null | cut -c1-7)\"; "
      "echo \"LISTENING=$(grep -c \"0100007F:$(printf %04X \"$MASTER_PORT\") 00000000:0000 0A\" /proc/net/tcp)\"";
  auto run = run_launcher(dir, {{"ZT_HELPER_NPROC", "2"}, {"ZT_HELPER_SCRIPT", script}, {"ZT_RENDEZVOUS_LISTEN_FD", "7"}});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto rank0 = parse_env(read_text(dir + "/logs/rank0.log"));
  EXPECT_EQ(rank0["FD"], "3");
  EXPECT_EQ(rank0["FD3"], "socket:");
  EXPECT_EQ(rank0["LISTENING"], "1");
  auto rank1 = parse_env(read_text(dir + "/logs/rank1.log"));
  EXPECT_EQ(rank1["FD"], "none");
  EXPECT_NE(rank1["FD3"], "socket:");

  // With a port of the user's choosing, rank 0 binds it itself.
  auto dir2 = zt::testing::make_temp_dir("launch-socket-port");
  auto run2 = run_launcher(dir2, {{"ZT_HELPER_NPROC", "2"},
                                  {"ZT_HELPER_PORT", std::to_string(zt::testing::free_port())},
                                  {"ZT_HELPER_SCRIPT", script}});
  ASSERT_EQ(run2.exit_code, 0) << run2.err;
  EXPECT_EQ(parse_env(read_text(dir2 + "/logs/rank0.log"))["FD"], "none");
}

TEST(Launch, UserSettingsForOpenMpAndAnExplicitPortAreKept) {
  auto dir = zt::testing::make_temp_dir("launch-env2");
  int port = zt::testing::free_port();
  auto run = run_launcher(dir, {{"ZT_HELPER_NPROC", "2"},
                                {"ZT_HELPER_PORT", std::to_string(port)},
                                {"ZT_HELPER_SCRIPT", "env"},
                                {"OMP_NUM_THREADS", "5"},
                                {"OMP_WAIT_POLICY", "ACTIVE"}});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  for (int rank = 0; rank < 2; ++rank) {
    auto env = parse_env(read_text(dir + "/logs/rank" + std::to_string(rank) + ".log"));
    EXPECT_EQ(env["MASTER_PORT"], std::to_string(port));
    EXPECT_EQ(env["OMP_NUM_THREADS"], "5");
    EXPECT_EQ(env["OMP_WAIT_POLICY"], "ACTIVE");
  }
}

TEST(Launch, RankZeroIsEchoedAndEveryRankHasItsOwnFreshLog) {
  auto dir = zt::testing::make_temp_dir("launch-logs");
  fs::create_directories(dir + "/logs");
  std::ofstream(dir + "/logs/rank1.log") << "stale output of an earlier run\n";
  auto run = run_launcher(dir, {{"ZT_HELPER_NPROC", "2"},
                                {"ZT_HELPER_SCRIPT", "echo \"out of rank $RANK\"; echo \"err of rank $RANK\" >&2"}});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("out of rank 0"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("err of rank 0"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("rank 1"), std::string::npos) << run.out;
  auto log0 = read_text(dir + "/logs/rank0.log");
  auto log1 = read_text(dir + "/logs/rank1.log");
  EXPECT_NE(log0.find("out of rank 0"), std::string::npos);
  EXPECT_NE(log0.find("err of rank 0"), std::string::npos);
  EXPECT_NE(log1.find("out of rank 1"), std::string::npos);
  EXPECT_NE(log1.find("err of rank 1"), std::string::npos);
  EXPECT_EQ(log1.find("stale"), std::string::npos) << "logs are truncated at start";
}

TEST(Launch, EchoOfRankZeroCanBeTurnedOff) {
  auto dir = zt::testing::make_temp_dir("launch-noecho");
  auto run = run_launcher(dir, {{"ZT_HELPER_NPROC", "1"}, {"ZT_HELPER_ECHO", "0"},
                                {"ZT_HELPER_SCRIPT", "echo \"out of rank $RANK\""}});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out.find("out of rank 0"), std::string::npos);
  EXPECT_NE(read_text(dir + "/logs/rank0.log").find("out of rank 0"), std::string::npos);
}

TEST(Launch, AFailingRankStopsTheOthersAndItsExitCodeIsReturned) {
  auto dir = zt::testing::make_temp_dir("launch-fail");
  // Rank 1 waits until the others are up (with their background children), then exits 3; the
  // others would sleep for a minute.
  std::string script = record_pids(dir) +
                       "if [ \"$RANK\" = 1 ]; then"
                       "  i=0; while [ ! -f " + dir + "/ready0 ] || [ ! -f " + dir + "/ready2 ]; do"
                       "    sleep 0.05; i=$((i+1)); [ $i -gt 400 ] && break; done;"
                       "  echo 'rank 1 gives up'; exit 3; "
                       "fi; wait";
  auto run = run_launcher(dir, {{"ZT_HELPER_NPROC", "3"}, {"ZT_HELPER_SCRIPT", script}});
  EXPECT_EQ(run.exit_code, 3) << run.err;
  EXPECT_LT(run.seconds, 10.0) << "the other ranks must be stopped, not awaited";
  EXPECT_NE(run.err.find("rank 1 exited with code 3"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find(dir + "/logs/rank1.log"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("rank 1 gives up"), std::string::npos) << "the end of the failing log is shown";
  expect_all_gone(dir, 6);  // 3 ranks + 3 background children
}

TEST(Launch, ARankKilledBySignalGives128PlusSigno) {
  auto dir = zt::testing::make_temp_dir("launch-sig");
  auto run = run_launcher(dir, {{"ZT_HELPER_NPROC", "2"},
                                {"ZT_HELPER_SCRIPT", "if [ \"$RANK\" = 1 ]; then kill -USR1 $$; fi; sleep 60"}});
  EXPECT_EQ(run.exit_code, 128 + SIGUSR1) << run.err;
  EXPECT_LT(run.seconds, 10.0);
  EXPECT_NE(run.err.find("rank 1 was killed by SIGUSR1"), std::string::npos) << run.err;
}

// Rank 0 fails first with 3; rank 1 ignores the launcher's SIGTERM and then ends badly by
// itself (`rank1_end`). The launch must return the worse of the two.
LaunchRun worst_of_two(const std::string& dir, const std::string& rank1_end) {
  std::string script = "if [ \"$RANK\" = 0 ]; then"
                       "  i=0; while [ ! -f " + dir + "/ready1 ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done;"
                       "  echo 'rank 0 gives up'; exit 3; "
                       "fi; trap '' TERM; touch " + dir + "/ready1; sleep 1; " + rank1_end;
  return run_launcher(dir, {{"ZT_HELPER_NPROC", "2"}, {"ZT_HELPER_SCRIPT", script}});
}

TEST(Launch, TheWorstExitCodeOfTheRanksWinsOverTheFirst) {
  auto dir = zt::testing::make_temp_dir("launch-worst");
  auto run = worst_of_two(dir, "exit 7");
  EXPECT_EQ(run.exit_code, 7) << run.err;
  EXPECT_NE(run.err.find("rank 0 exited with code 3"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("rank 1 also failed: it exited with code 7"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("exit code 7, the worst of the failures: rank 1"), std::string::npos) << run.err;
}

TEST(Launch, ARankKilledBySigkillByItselfCountsAs137) {
  auto dir = zt::testing::make_temp_dir("launch-worst-kill");
  auto run = worst_of_two(dir, "kill -KILL $$");
  EXPECT_EQ(run.exit_code, 128 + SIGKILL) << run.err;
  EXPECT_NE(run.err.find("rank 1 also failed: it was killed by SIGKILL"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("(not sent by the launcher: the kernel's out-of-memory killer ends processes so)"),
            std::string::npos)
      << run.err;
}

// Sends `signo` to a launcher once all its ranks are up; checks the code and that nothing is left.
void check_signal_forwarded(int signo, bool ranks_ignore_sigterm) {
  auto dir = zt::testing::make_temp_dir("launch-fwd");
  std::string script = (ranks_ignore_sigterm ? std::string("trap '' TERM INT; ") : std::string()) +
                       record_pids(dir) + "wait";
  auto start = Clock::now();
  pid_t pid = spawn_launcher(dir, {{"ZT_HELPER_NPROC", "2"},
                                   {"ZT_HELPER_GRACE_MS", "500"},
                                   {"ZT_HELPER_LOG_DIR", dir + "/logs"},
                                   {"ZT_HELPER_SCRIPT", script}});
  if (!wait_for_files({dir + "/ready0", dir + "/ready1"})) {
    kill(-pid, SIGKILL);
    auto run = wait_launcher(pid, dir, start);
    FAIL() << "ranks did not start: " << run.err;
  }
  auto signalled = Clock::now();
  ASSERT_EQ(kill(pid, signo), 0);
  auto run = wait_launcher(pid, dir, signalled);
  EXPECT_EQ(run.exit_code, 128 + signo) << run.err;
  EXPECT_LT(run.seconds, 5.0) << run.err;
  EXPECT_NE(run.err.find(std::string("received SIG") + sigabbrev_np(signo)), std::string::npos) << run.err;
  if (ranks_ignore_sigterm) {
    EXPECT_GE(run.seconds, 0.4) << "SIGKILL only after the grace";
    EXPECT_NE(run.err.find("SIGKILL"), std::string::npos) << run.err;
  }
  expect_all_gone(dir, 4);
  EXPECT_TRUE(fs::exists(dir + "/logs/rank0.log"));
  EXPECT_TRUE(fs::exists(dir + "/logs/rank1.log"));
}

TEST(Launch, SigtermToTheLauncherIsForwardedToEveryRank) { check_signal_forwarded(SIGTERM, false); }

TEST(Launch, SigintToTheLauncherIsForwardedToEveryRank) { check_signal_forwarded(SIGINT, false); }

TEST(Launch, RanksThatIgnoreTheForwardedSignalAreKilledAfterTheGrace) {
  check_signal_forwarded(SIGTERM, true);
}

TEST(Launch, RanksDieWhenTheLauncherIsKilledHard) {
  // SIGKILL cannot be forwarded; the ranks' parent-death signal must end them. (Processes the
  // ranks started are beyond its reach; they are cleaned up here.)
  auto dir = zt::testing::make_temp_dir("launch-pdeath");
  auto start = Clock::now();
  pid_t pid = spawn_launcher(dir, {{"ZT_HELPER_NPROC", "2"},
                                   {"ZT_HELPER_LOG_DIR", dir + "/logs"},
                                   {"ZT_HELPER_SCRIPT", record_pids(dir) + "wait"}});
  bool started = wait_for_files({dir + "/ready0", dir + "/ready1"});
  kill(pid, SIGKILL);
  auto run = wait_launcher(pid, dir, start);
  ASSERT_TRUE(started) << run.err;
  EXPECT_EQ(run.exit_code, 128 + SIGKILL);
  for (int rank = 0; rank < 2; ++rank) {
    pid_t rank_pid = std::stoi(read_text(dir + "/rank" + std::to_string(rank) + ".pid"));
    EXPECT_TRUE(eventually_gone(rank_pid)) << "rank " << rank << " outlived a killed launcher";
    pid_t child = std::stoi(read_text(dir + "/child" + std::to_string(rank) + ".pid"));
    kill(child, SIGKILL);
    if (!process_gone(rank_pid)) kill(rank_pid, SIGKILL);
  }
}

TEST(Launch, ASuccessfulRunLeavesNoBackgroundChildBehind) {
  auto dir = zt::testing::make_temp_dir("launch-ok");
  auto run = run_launcher(dir, {{"ZT_HELPER_NPROC", "2"}, {"ZT_HELPER_SCRIPT", record_pids(dir) + "echo done"}});
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_LT(run.seconds, 10.0);
  EXPECT_NE(run.err.find("processes they started are still running"), std::string::npos) << run.err;
  expect_all_gone(dir, 4);
}

// ---- In-process checks: these fail before anything is started or any handler installed.

TEST(Launch, AMissingProgramGives127AndNamesIt) {
  auto dir = zt::testing::make_temp_dir("launch-missing");
  for (std::string program : {"zt-no-such-program", "/nonexistent/zt-no-such-program"}) {
    zt::LaunchOptions options;
    options.nproc = 2;
    options.log_dir = dir + "/logs";
    options.command = {program, "--flag"};
    ::testing::internal::CaptureStderr();
    int code = zt::launch_local(options);
    std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(code, 127);
    EXPECT_NE(err.find("'" + program + "'"), std::string::npos) << err;
  }
}

TEST(Launch, AFileThatIsNotExecutableGives126) {
  auto dir = zt::testing::make_temp_dir("launch-noexec");
  std::ofstream(dir + "/script.sh") << "#!/bin/sh\necho hi\n";
  fs::permissions(dir + "/script.sh", fs::perms::owner_read | fs::perms::owner_write);
  zt::LaunchOptions options;
  options.log_dir = dir + "/logs";
  options.command = {dir + "/script.sh"};
  ::testing::internal::CaptureStderr();
  int code = zt::launch_local(options);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 126);
  EXPECT_NE(err.find("not an executable file"), std::string::npos) << err;
}

TEST(Launch, BadOptionsAreConfigErrors) {
  zt::LaunchOptions options;
  options.command = {"/bin/true"};
  options.nproc = 0;
  EXPECT_THROW(zt::launch_local(options), zt::ConfigError);
  options.nproc = -2;
  EXPECT_THROW(zt::launch_local(options), zt::ConfigError);
  options.nproc = 1;
  options.master_port = 70000;
  EXPECT_THROW(zt::launch_local(options), zt::ConfigError);
  options.master_port = 0;
  options.command.clear();
  EXPECT_THROW(zt::launch_local(options), zt::ConfigError);
  try {
    options.command = {"/bin/true"};
    options.nproc = 0;
    zt::launch_local(options);
  } catch (const zt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("got 0"), std::string::npos) << e.what();
  }
}

// ---- Several nodes: launchers on 127.0.0.1 acting as nodes (docs/comm.md "Several nodes").

struct NodeLaunch {
  std::string dir;
  pid_t pid = -1;
};

// Starts one launcher per node, node n's in <dir>/node<n>, all meeting at `port`.
std::vector<NodeLaunch> spawn_nodes(const std::string& dir, int nnodes, int nproc, int port,
                                    const std::vector<std::string>& scripts, const std::string& heartbeat_ms = "10000") {
  std::vector<NodeLaunch> nodes;
  for (int n = 0; n < nnodes; ++n) {
    NodeLaunch node{dir + "/node" + std::to_string(n)};
    fs::create_directories(node.dir);
    node.pid = spawn_launcher(node.dir, {{"ZT_HELPER_NPROC", std::to_string(nproc)},
                                         {"ZT_HELPER_NNODES", std::to_string(nnodes)},
                                         {"ZT_HELPER_NODE_RANK", std::to_string(n)},
                                         {"ZT_HELPER_PORT", std::to_string(port)},
                                         {"ZT_HELPER_HEARTBEAT_MS", heartbeat_ms},
                                         {"ZT_HELPER_LOG_DIR", node.dir + "/logs"},
                                         {"ZT_HELPER_SCRIPT", scripts[size_t(n)]}},
                              {"OMP_NUM_THREADS", "MASTER_PORT"});
    nodes.push_back(node);
  }
  return nodes;
}

TEST(LaunchNodes, RanksOfEveryNodeGetTorchrunsVariables) {
  auto dir = zt::testing::make_temp_dir("launch-nodes-env");
  const int port = zt::testing::free_port();
  auto start = Clock::now();
  auto nodes = spawn_nodes(dir, 2, 2, port, {"env", "env"});
  std::string master_port;
  for (int n = 0; n < 2; ++n) {
    auto run = wait_launcher(nodes[size_t(n)].pid, nodes[size_t(n)].dir, start);
    ASSERT_EQ(run.exit_code, 0) << "node " << n << ": " << run.err;
    EXPECT_NE(run.err.find("node " + std::to_string(n) + ": starting ranks " + std::to_string(2 * n) + ".." +
                           std::to_string(2 * n + 1) + " of 4"),
              std::string::npos)
        << run.err;
    for (int local = 0; local < 2; ++local) {
      const int rank = 2 * n + local;
      auto log = nodes[size_t(n)].dir + "/logs/rank" + std::to_string(rank) + ".log";
      ASSERT_TRUE(fs::exists(log)) << log;
      auto env = parse_env(read_text(log));
      EXPECT_EQ(env["RANK"], std::to_string(rank));
      EXPECT_EQ(env["LOCAL_RANK"], std::to_string(local));
      EXPECT_EQ(env["WORLD_SIZE"], "4");
      EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
      EXPECT_EQ(env["GROUP_RANK"], std::to_string(n));
      EXPECT_EQ(env["GROUP_WORLD_SIZE"], "2");
      EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
      if (master_port.empty()) master_port = env["MASTER_PORT"];
      EXPECT_EQ(env["MASTER_PORT"], master_port) << "every rank of every node meets at node 0's rendezvous";
      EXPECT_EQ(env.count("ZT_RENDEZVOUS_LISTEN_FD"), rank == 0 ? 1u : 0u) << "rank " << rank;
    }
  }
  EXPECT_NE(master_port, std::to_string(port)) << "the ranks' rendezvous is not the launchers' meeting point";
}

// A rank failing on node 1 ends the job on node 0 within seconds; both launchers name it and
// return its exit code.
TEST(LaunchNodes, ARankFailingOnOneNodeStopsEveryNode) {
  auto dir = zt::testing::make_temp_dir("launch-nodes-fail");
  const int port = zt::testing::free_port();
  const std::string wait = record_pids(dir) + "wait";
  const std::string fail = record_pids(dir) + "if [ $RANK = 3 ]; then sleep 1; exit 7; fi; wait";
  auto start = Clock::now();
  auto nodes = spawn_nodes(dir, 2, 2, port, {wait, fail});
  for (int n = 0; n < 2; ++n) {
    auto run = wait_launcher(nodes[size_t(n)].pid, nodes[size_t(n)].dir, start);
    EXPECT_EQ(run.exit_code, 7) << "node " << n << ": " << run.err;
    EXPECT_LT(run.seconds, 20.0) << "node " << n;
    EXPECT_NE(run.err.find("rank 3 (node 1) exited with code 7"), std::string::npos) << "node " << n << ": " << run.err;
  }
  expect_all_gone(dir, 8);
}

// A node killed hard (its launcher gets SIGKILL; its ranks die with it) stops beating: node 0
// ends the job and names the node, well within 30 s.
TEST(LaunchNodes, ANodeKilledHardEndsTheJobOnTheOtherNode) {
  auto dir = zt::testing::make_temp_dir("launch-nodes-kill");
  const int port = zt::testing::free_port();
  const std::string wait = record_pids(dir) + "wait";
  // Nothing of node 1 may outlive its launcher's SIGKILL but the rank itself, which its death
  // signal ends.
  const std::string sleeper = "echo $$ > " + dir + "/rank$RANK.pid; touch " + dir + "/ready$RANK; exec sleep 60";
  auto start = Clock::now();
  auto nodes = spawn_nodes(dir, 2, 1, port, {wait, sleeper}, "3000");
  const bool started = wait_for_files({dir + "/ready0", dir + "/ready1"});
  kill(nodes[1].pid, SIGKILL);
  auto killed_at = Clock::now();
  wait_launcher(nodes[1].pid, nodes[1].dir, start);  // reaps it
  auto run = wait_launcher(nodes[0].pid, nodes[0].dir, killed_at);
  ASSERT_TRUE(started) << run.err;
  EXPECT_NE(run.exit_code, 0) << run.err;
  EXPECT_LT(run.seconds, 30.0);
  EXPECT_NE(run.err.find("node 1 stopped responding"), std::string::npos) << run.err;
  expect_all_gone(dir, 3);
}

TEST(LaunchNodes, BadNodeOptionsAreConfigErrors) {
  zt::LaunchOptions options;
  options.command = {"/bin/true"};
  options.nnodes = 2;
  try {
    zt::launch_local(options);
    ADD_FAILURE() << "several nodes need an explicit --master-port";
  } catch (const zt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--master-port is required with --nnodes 2"), std::string::npos) << e.what();
  }
  options.master_port = 29999;
  options.node_rank = 2;
  EXPECT_THROW(zt::launch_local(options), zt::ConfigError);
  options.node_rank = 0;
  options.nnodes = 0;
  EXPECT_THROW(zt::launch_local(options), zt::ConfigError);
  options.nnodes = 1;
  options.master_addr = "";
  EXPECT_THROW(zt::launch_local(options), zt::ConfigError);
}

TEST(Launch, StartedByLauncherRecognisesTorchrunSlurmAndOpenMpi) {
  const char* names[] = {"RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                         "OMPI_COMM_WORLD_SIZE"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    saved[n] = v ? std::optional<std::string>(v) : std::nullopt;
    unsetenv(n);
  }
  EXPECT_FALSE(zt::started_by_launcher());
  setenv("RANK", "0", 1);
  EXPECT_FALSE(zt::started_by_launcher()) << "RANK alone is not enough";
  setenv("WORLD_SIZE", "2", 1);
  EXPECT_TRUE(zt::started_by_launcher());
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  setenv("SLURM_PROCID", "1", 1);
  setenv("SLURM_NTASKS", "4", 1);
  EXPECT_TRUE(zt::started_by_launcher());
  unsetenv("SLURM_PROCID");
  unsetenv("SLURM_NTASKS");
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  EXPECT_TRUE(zt::started_by_launcher());
  for (const auto& [n, v] : saved) {
    if (v) setenv(n.c_str(), v->c_str(), 1);
    else unsetenv(n.c_str());
  }
}

}  // namespace
