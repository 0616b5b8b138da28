// Local launcher: it never swallows exit codes or logs, and it sets OpenMP up for few cores
// (docs/design.md "Lessons from their users", "Platform facts").
//
// Shape of a launch:
//   1. Validate the options and resolve the program in PATH *before* anything starts, so bad
//      input gives one clear message and no half-started job.
//   2. Open every rank's log file, then fork+exec each rank in its own process group, with
//      stdin from /dev/null and stdout+stderr to its log (rank 0: to a pipe that a thread tees
//      to its log and to our stdout).
//   3. Poll the ranks. The first failure (non-zero exit or death by signal) or a forwarded
//      SIGINT/SIGTERM/SIGHUP starts the stop: SIGTERM to every rank's process group, SIGKILL to
//      whatever is left after kill_grace.
//   4. When every rank has been reaped, clean up what ranks left behind in their groups (a
//      background child of a rank that exited 0 must not outlive the launch either).
//
// Everything between fork() and exec() in the child uses only async-signal-safe calls on data
// prepared beforehand: the launcher may live in a multi-threaded process (tests, the CLI).
#include "zerotrain/launch.h"

#include "launch/launch_parts.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/flight_recorder.h"
#include "launch/job_control.h"
#include "zerotrain/error.h"

extern char** environ;

namespace zt {

// The parts of a launch (launch_parts.h).
using namespace launch_detail;

int launch_local(const LaunchOptions& options) {
  // ---- 1. Validate before anything starts.
  if (options.nproc < 1)
    throw ConfigError("launch: --nproc must be at least 1, got " + std::to_string(options.nproc));
  if (options.command.empty() || options.command.front().empty())
    throw ConfigError("launch: no program given to run (expected: launch --nproc N -- PROGRAM ARGS...)");
  if (options.master_port < 0 || options.master_port > 65535)
    throw ConfigError("launch: --master-port must be in 0..65535 (0 picks a free port), got " +
                      std::to_string(options.master_port));
  if (options.kill_grace.count() < 0)
    throw ConfigError("launch: kill grace must not be negative, got " +
                      std::to_string(options.kill_grace.count()) + " ms");
  if (options.log_dir.empty()) throw ConfigError("launch: the log directory must not be empty");
  if (options.nnodes < 1) throw ConfigError("launch: --nnodes must be at least 1, got " + std::to_string(options.nnodes));
  if (options.node_rank < 0 || options.node_rank >= options.nnodes)
    throw ConfigError("launch: --node-rank must be in 0.." + std::to_string(options.nnodes - 1) + " (--nnodes " +
                      std::to_string(options.nnodes) + "), got " + std::to_string(options.node_rank));
  if (options.master_addr.empty()) throw ConfigError("launch: --master-addr must not be empty");
  if (options.nnodes > 1 && options.master_port == 0)
    throw ConfigError("launch: --master-port is required with --nnodes " + std::to_string(options.nnodes) +
                      ": every node's launcher must name the port where node 0's launcher serves the job");

  const Resolved program = resolve_program(options.command.front());
  if (program.path.empty()) {
    say(program.message);
    return program.error_code;
  }

  std::error_code ec;
  fs::create_directories(options.log_dir, ec);
  if (ec)
    throw ConfigError("launch: cannot create log directory '" + options.log_dir + "': " + ec.message());
  fs::path log_dir = fs::absolute(options.log_dir, ec).lexically_normal();
  if (ec) log_dir = options.log_dir;

  const int nproc = options.nproc;
  const bool several_nodes = options.nnodes > 1;
  const std::string node_name = "node " + std::to_string(options.node_rank);
  ListeningSocket rendezvous_socket;
  std::optional<JobControl> control;  // several nodes: the launchers' meeting point (launch/job_control.h)
  if (several_nodes) {
    say(node_name + " of " + std::to_string(options.nnodes) + ": meeting the other nodes' launchers at " +
        options.master_addr + ":" + std::to_string(options.master_port));
    control.emplace(JobControlOptions{.nnodes = options.nnodes,
                                      .node_rank = options.node_rank,
                                      .master_addr = options.master_addr,
                                      .master_port = options.master_port,
                                      .join_timeout = options.join_timeout,
                                      .heartbeat_timeout = options.heartbeat_timeout});
    rendezvous_socket.fd = control->take_rendezvous_socket();  // node 0 only
    rendezvous_socket.port = control->rendezvous_port();
  } else if (options.master_port == 0) {
    rendezvous_socket = open_rendezvous_socket(options.master_addr);
  }
  const int port = rendezvous_socket.port > 0 ? rendezvous_socket.port : options.master_port;
  const int first_rank = options.node_rank * nproc;

  // ---- 2. Prepare everything the children need, then start them.
  FdList fds;
  if (rendezvous_socket.fd >= 0) fds.add(rendezvous_socket.fd);
  int null_fd = fds.add(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (null_fd < 0) throw Error(std::string(kPrefix) + "cannot open /dev/null: " + std::strerror(errno));

  std::vector<Rank> ranks(nproc);
  std::vector<int> log_fds(nproc, -1);
  for (int i = 0; i < nproc; ++i) {
    ranks[i].index = i;
    const std::string global = std::to_string(first_rank + i);
    ranks[i].label = "rank " + global + (several_nodes ? " (" + node_name + ")" : "");
    ranks[i].log_path = (log_dir / ("rank" + global + ".log")).string();
    ranks[i].flight_path = (log_dir / ("rank" + global + ".flight")).string();
    // A ring left by an earlier job would be read as this one's by the analysis at the end.
    fs::remove(ranks[i].flight_path, ec);
    log_fds[i] = fds.add(::open(ranks[i].log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (log_fds[i] < 0)
      throw ConfigError("launch: cannot open log file '" + ranks[i].log_path + "': " + std::strerror(errno));
  }

  // Rank 0 writes into a pipe that the tee thread copies to its log and our stdout.
  int tee_read = -1, tee_write = -1;
  if (options.echo_rank0) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0)
      throw Error(std::string(kPrefix) + "cannot create a pipe: " + std::strerror(errno));
    tee_read = fds.add(p[0]);
    tee_write = p[1];  // closed by hand right after the fork, so EOF arrives when rank 0 ends
  }

  std::vector<std::string> args = options.command;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string exec_error_prefix = std::string(kPrefix) + "cannot execute '" + program.path + "': ";

  {
    const int last_rank = first_rank + nproc - 1;
    std::string range = nproc == 1 ? "rank" + std::to_string(first_rank) + ".log"
                                   : "rank{" + std::to_string(first_rank) + ".." + std::to_string(last_rank) + "}.log";
    say((several_nodes ? node_name + ": " : std::string()) + "starting " +
        (several_nodes ? "ranks " + std::to_string(first_rank) + ".." + std::to_string(last_rank) + " of " +
                             std::to_string(options.nnodes * nproc)
                       : std::to_string(nproc) + (nproc == 1 ? " rank" : " ranks")) +
        " of " + program.path + " (master " + options.master_addr + ":" + std::to_string(port) + "); logs: " +
        (log_dir / range).string());
  }

  SignalScope signal_scope;  // installed before the first fork: no signal is lost in between
  std::optional<Tee> tee;
  if (options.echo_rank0) tee.emplace(tee_read, log_fds[0]);

  const pid_t launcher_pid = ::getpid();
  bool fork_failed = false;
  int first_failure = -1;  // index of the first rank that failed (its log tail is shown)
  int stop_signal = 0;     // a signal the launcher received and forwarded
  std::vector<int> sent_signals;  // every signal the launcher sent to the ranks' groups
  bool stopping = false, escalated = false;
  Clock::time_point kill_deadline{};

  auto begin_stop = [&](int signo) {
    sent_signals.push_back(signo);
    signal_groups(ranks, signo);
    if (!stopping) {
      stopping = true;
      kill_deadline = Clock::now() + options.kill_grace;
    }
  };
  auto escalate = [&] {
    if (escalated) return;
    escalated = true;
    std::string still;
    for (const Rank& r : ranks)
      if (r.running) still += (still.empty() ? "" : ", ") + std::to_string(first_rank + r.index);
    say("sending SIGKILL to what is left" + (still.empty() ? std::string() : " (ranks " + still + ")") +
        " after the " + std::to_string(options.kill_grace.count()) + " ms grace");
    sent_signals.push_back(SIGKILL);
    signal_groups(ranks, SIGKILL);
  };

  for (int i = 0; i < nproc; ++i) {
    const int listen_fd = i == 0 ? rendezvous_socket.fd : -1;
    std::vector<std::string> env =
        rank_environment(options, i, port, ranks[i].flight_path, listen_fd >= 0 ? kRendezvousFdInRank : -1);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    int out_fd = (i == 0 && options.echo_rank0) ? tee_write : log_fds[i];

    pid_t pid = ::fork();
    if (pid == 0)
      exec_rank(out_fd, null_fd, listen_fd, launcher_pid, program.path.c_str(), argv.data(), envp.data(),
                exec_error_prefix.c_str());
    const int fork_errno = errno;
    if (i == 0 && tee_write >= 0) {
      // Only rank 0 holds the write end now, so the tee sees end of file when rank 0's group
      // is gone (or at once, if the fork failed).
      ::close(tee_write);
      tee_write = -1;
    }
    if (i == 0 && rendezvous_socket.fd >= 0) {
      // Rank 0 owns the rendezvous socket now: if it dies, the others' connections are refused
      // rather than queued on a copy nobody accepts from.
      std::replace(fds.fds.begin(), fds.fds.end(), rendezvous_socket.fd, -1);
      ::close(rendezvous_socket.fd);
      rendezvous_socket.fd = -1;
    }
    if (pid < 0) {
      // The job cannot run without every rank: stop the ones already started (unstarted ranks
      // keep pid -1 and are skipped everywhere).
      fork_failed = true;
      say("cannot start " + ranks[i].label + ": fork failed: " + std::strerror(fork_errno));
      if (control) control->report_failure({1, "cannot start " + ranks[i].label + ": fork failed"});
      begin_stop(SIGTERM);
      break;
    }
    // Also set the group from the parent: whichever of parent and child runs first, the group
    // exists before we might signal it.
    ::setpgid(pid, pid);
    ranks[i].pid = pid;
    ranks[i].running = true;
  }

  // ---- 3. Watch the ranks.
  int seen_signals = 0;
  auto handle_signals = [&] {
    int count = g_signal_count.load();
    if (count == seen_signals) return;
    seen_signals = count;
    int signo = g_last_signal.load();
    if (stop_signal == 0) {
      stop_signal = signo;
      say("received " + signal_name(signo) + "; forwarding it to every rank");
      if (control) control->report_failure({128 + signo, node_name + "'s launcher received " + signal_name(signo)});
      begin_stop(signo);
    } else {
      say("received " + signal_name(signo) + " again; killing every rank now");
      escalate();
    }
  };

  std::optional<JobFailure> remote_failure;  // another node's, which stopped this one
  while (true) {
    handle_signals();
    if (control) {
      // Beats this node's heartbeat; a failure elsewhere ends this node's part of the job.
      if (auto failure = control->poll(); failure && !stopping) {
        remote_failure = failure;
        say("the job failed elsewhere: " + failure->message + "; stopping the ranks of " + node_name);
        begin_stop(SIGTERM);
      }
    }
    bool any_running = false;
    // Reap first, then report: ranks that ended within one pass are reported cause first (below).
    std::vector<Rank*> exited;
    for (Rank& r : ranks) {
      if (!r.running) continue;
      int status = 0;
      pid_t got = ::waitpid(r.pid, &status, WNOHANG);
      if (got == 0) {
        any_running = true;
        continue;
      }
      if (got < 0 && errno == EINTR) {
        any_running = true;
        continue;
      }
      r.running = false;
      if (got < 0) {  // ECHILD: someone else reaped it (SIGCHLD set to SIG_IGN by the host program)
        r.exit_code = 1;
        r.status_text = "ended but its exit status was lost (was SIGCHLD ignored?)";
      } else {
        r.status_text = describe_status(status, &r.exit_code);
      }
      exited.push_back(&r);
    }
    // A rank killed by a signal (other than SIGPIPE, which a rank gets for writing to a peer that
    // has died) is likelier the cause than one that failed by itself, and that likelier than
    // one that succeeded: of ranks found ended in the same pass, the likeliest cause is named
    // first, whatever their order.
    auto cause_rank = [](const Rank& r) {
      if (r.exit_code > 128 && r.exit_code != 128 + SIGPIPE) return 2;
      return r.exit_code != 0 ? 1 : 0;
    };
    std::stable_sort(exited.begin(), exited.end(),
                     [&](const Rank* a, const Rank* b) { return cause_rank(*a) > cause_rank(*b); });
    for (Rank* exited_rank : exited) {
      Rank& r = *exited_rank;
      // A rank failed by itself unless it ended by (or with the code of) a signal we sent it:
      // the 143 of a rank we stopped is not a failure of its own, a 7 or a SIGSEGV is.
      const bool by_our_signal =
          stopping && std::any_of(sent_signals.begin(), sent_signals.end(), [&](int s) { return r.exit_code == 128 + s; });
      r.own_failure = r.exit_code != 0 && !by_our_signal;
      // A SIGKILL nobody here sent is most often the kernel's out-of-memory killer's.
      if (r.own_failure && r.exit_code == 128 + SIGKILL)
        r.status_text += " (not sent by the launcher: the kernel's out-of-memory killer ends processes so" +
                         (options.memory_note.empty() ? std::string() : "; " + options.memory_note) + ")";
      if (r.own_failure && stopping) {
        say(r.label + " also failed: it " + r.status_text + "; log: " + r.log_path);
      }
      if (r.exit_code != 0 && !stopping) {
        // The first failure is the first thing to look at; everything after it may be a
        // consequence (a peer's collective failing) or our own stopping.
        first_failure = r.index;
        std::string message = r.label + " " + r.status_text + "; log: " + r.log_path + "; stopping the other ranks" +
                              (several_nodes ? " on every node" : "");
        if (control) control->report_failure({r.exit_code, r.label + " " + r.status_text});
        if (r.index != 0 || !options.echo_rank0) {
          // Rank 0's output is already on our stdout; for the others, show the end of the log.
          auto lines = tail_lines(r.log_path, kTailLines);
          if (!lines.empty()) {
            message += "\n  last lines of " + r.label + "'s log:";
            for (const auto& line : lines) message += "\n  | " + line;
          }
        }
        say(message);
        begin_stop(SIGTERM);
      }
    }
    if (!any_running) break;
    if (stopping && !escalated && Clock::now() >= kill_deadline) escalate();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  // ---- 4. Every rank is reaped; end what they left in their process groups.
  if (any_group_alive(ranks)) {
    if (!stopping) {
      say("every rank has exited, but processes they started are still running; stopping them");
      begin_stop(SIGTERM);
    }
    while (any_group_alive(ranks) && !escalated && Clock::now() < kill_deadline) {
      handle_signals();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (any_group_alive(ranks)) {
      if (!escalated) {
        escalated = true;
        say("sending SIGKILL to processes the ranks left behind");
        signal_groups(ranks, SIGKILL);
      }
      // SIGKILL is delivered asynchronously; give the kernel a moment so that nothing is still
      // running when we return.
      auto until = Clock::now() + std::chrono::seconds(1);
      while (any_group_alive(ranks) && Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  if (tee) tee->stop_and_join();

  // ---- Exit code: the worst of the ranks' own failures (the largest
  // code, 128 + signo for a death by signal), not the 143 of the ranks we stopped; a signal
  // sent to the launcher counts as 128 + signo (even if the ranks shut down cleanly on it: the
  // job did not finish); else 0.
  int result = 0;
  int worst_rank = -1;
  int own_failures = 0;
  for (const Rank& r : ranks) {
    if (!r.own_failure) continue;
    ++own_failures;
    if (r.exit_code > result) {
      result = r.exit_code;
      worst_rank = r.index;
    }
  }
  if (stop_signal != 0) result = std::max(result, 128 + stop_signal);
  if (fork_failed) result = std::max(result, 1);
  if (control) {
    // Node 0 serves the other launchers until they have finished too; a failure that came
    // meanwhile (or stopped this node) is the job's, and so this launcher's exit code.
    if (auto late = control->finish(result); late && !remote_failure) {
      remote_failure = late;
      say("the job failed elsewhere: " + late->message);
    }
    if (remote_failure && result == 0) result = std::max(1, remote_failure->code);
  }
  if (result != 0) report_divergence(ranks, log_dir);
  if (worst_rank >= 0 && first_failure >= 0 && result == ranks[worst_rank].exit_code &&
      result != ranks[first_failure].exit_code)
    say("exit code " + std::to_string(result) + ", the worst of the failures: " + ranks[worst_rank].label + " " +
        ranks[worst_rank].status_text);
  if (result != 0 && own_failures == 0 && stop_signal != 0)
    say("stopped by " + signal_name(stop_signal) + "; exit code " + std::to_string(result));
  // The first failed rank's own one-line error (a zerotrain program's "zerotrain: error: ..."),
  // repeated as the launcher's last line: what a user reads first, after the launcher's account
  // of which rank ended how.
  if (result != 0 && first_failure >= 0) {
    const Rank& r = ranks[first_failure];
    const std::string error = last_error_line(r.log_path);
    if (!error.empty()) {
      const std::string text = error + " (" + r.label + ")\n";
      write_all(STDERR_FILENO, text.data(), text.size());
    }
  }
  return result;
}

bool started_by_launcher() {
  auto set = [](const char* name) {
    const char* value = std::getenv(name);
    return value && *value;
  };
  return (set("RANK") && set("WORLD_SIZE")) || (set("SLURM_PROCID") && set("SLURM_NTASKS")) ||
         (set("OMPI_COMM_WORLD_RANK") && set("OMPI_COMM_WORLD_SIZE"));
}

}  // namespace zt
