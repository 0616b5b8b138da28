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
#include "zerotrain/launch/launch.h"

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

namespace {

// Phase 1: bad options give one clear message before anything starts.
void validate(const LaunchOptions& options) {
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
}

// One launch over this node's ranks, phases 2-4 of the file comment, and its exit code. The
// state the phases share (the ranks, the stop in progress, the signals sent) lives here; the
// members are destroyed in reverse order, so the tee is joined and the signal handlers restored
// before the descriptors close.
class LocalLaunch {
 public:
  LocalLaunch(const LaunchOptions& options, Resolved program)
      : options_(options), program_(std::move(program)), nproc_(options.nproc), several_nodes_(options.nnodes > 1),
        node_name_("node " + std::to_string(options.node_rank)), first_rank_(options.node_rank * options.nproc) {}

  int run() {
    open_log_directory();
    meet_other_nodes();
    open_logs_and_pipe();
    announce();
    signal_scope_.emplace();  // installed before the first fork: no signal is lost in between
    if (options_.echo_rank0) tee_.emplace(tee_read_, log_fds_[0]);
    start_ranks();
    watch();
    end_leftover_groups();
    if (tee_) tee_->stop_and_join();
    return exit_code();
  }

 private:
  void open_log_directory() {
    std::error_code ec;
    fs::create_directories(options_.log_dir, ec);
    if (ec) throw ConfigError("launch: cannot create log directory '" + options_.log_dir + "': " + ec.message());
    log_dir_ = fs::absolute(options_.log_dir, ec).lexically_normal();
    if (ec) log_dir_ = options_.log_dir;
  }

  // Several nodes: the launchers meet at node 0's control store (launch/job_control.h), which
  // hands out the ranks' rendezvous port; one node: a free port when none is given.
  void meet_other_nodes() {
    if (several_nodes_) {
      say(node_name_ + " of " + std::to_string(options_.nnodes) + ": meeting the other nodes' launchers at " +
          options_.master_addr + ":" + std::to_string(options_.master_port));
      control_.emplace(JobControlOptions{.nnodes = options_.nnodes,
                                         .node_rank = options_.node_rank,
                                         .master_addr = options_.master_addr,
                                         .master_port = options_.master_port,
                                         .join_timeout = options_.join_timeout,
                                         .heartbeat_timeout = options_.heartbeat_timeout});
      rendezvous_socket_.fd = control_->take_rendezvous_socket();  // node 0 only
      rendezvous_socket_.port = control_->rendezvous_port();
    } else if (options_.master_port == 0) {
      rendezvous_socket_ = open_rendezvous_socket(options_.master_addr);
    }
    port_ = rendezvous_socket_.port > 0 ? rendezvous_socket_.port : options_.master_port;
  }

  // Phase 2's preparation: everything the children need exists before the first fork.
  void open_logs_and_pipe() {
    if (rendezvous_socket_.fd >= 0) fds_.add(rendezvous_socket_.fd);
    null_fd_ = fds_.add(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (null_fd_ < 0) throw Error(std::string(kPrefix) + "cannot open /dev/null: " + std::strerror(errno));
    ranks_.resize(size_t(nproc_));
    log_fds_.assign(size_t(nproc_), -1);
    std::error_code ec;
    for (int i = 0; i < nproc_; ++i) {
      Rank& r = ranks_[size_t(i)];
      r.index = i;
      const std::string global = std::to_string(first_rank_ + i);
      r.label = "rank " + global + (several_nodes_ ? " (" + node_name_ + ")" : "");
      r.log_path = (log_dir_ / ("rank" + global + ".log")).string();
      r.flight_path = (log_dir_ / ("rank" + global + ".flight")).string();
      // A ring left by an earlier job would be read as this one's by the analysis at the end.
      fs::remove(r.flight_path, ec);
      log_fds_[size_t(i)] = fds_.add(::open(r.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
      if (log_fds_[size_t(i)] < 0)
        throw ConfigError("launch: cannot open log file '" + r.log_path + "': " + std::strerror(errno));
    }
    // Rank 0 writes into a pipe that the tee thread copies to its log and our stdout.
    if (options_.echo_rank0) {
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) throw Error(std::string(kPrefix) + "cannot create a pipe: " + std::strerror(errno));
      tee_read_ = fds_.add(p[0]);
      tee_write_ = p[1];  // closed by hand right after the fork, so EOF arrives when rank 0 ends
    }
  }

  void announce() const {
    const int last_rank = first_rank_ + nproc_ - 1;
    const std::string range = nproc_ == 1 ? "rank" + std::to_string(first_rank_) + ".log"
                                          : "rank{" + std::to_string(first_rank_) + ".." + std::to_string(last_rank) +
                                                "}.log";
    say((several_nodes_ ? node_name_ + ": " : std::string()) + "starting " +
        (several_nodes_ ? "ranks " + std::to_string(first_rank_) + ".." + std::to_string(last_rank) + " of " +
                              std::to_string(options_.nnodes * nproc_)
                        : std::to_string(nproc_) + (nproc_ == 1 ? " rank" : " ranks")) +
        " of " + program_.path + " (master " + options_.master_addr + ":" + std::to_string(port_) + "); logs: " +
        (log_dir_ / range).string());
  }

  // Phase 2: fork and exec each rank in its own process group.
  void start_ranks() {
    std::vector<std::string> args = options_.command;
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string exec_error_prefix = std::string(kPrefix) + "cannot execute '" + program_.path + "': ";
    const pid_t launcher_pid = ::getpid();
    for (int i = 0; i < nproc_; ++i) {
      const int listen_fd = i == 0 ? rendezvous_socket_.fd : -1;
      std::vector<std::string> env = rank_environment(options_, i, port_, ranks_[size_t(i)].flight_path,
                                                      listen_fd >= 0 ? kRendezvousFdInRank : -1);
      std::vector<char*> envp;
      for (auto& e : env) envp.push_back(e.data());
      envp.push_back(nullptr);
      const int out_fd = (i == 0 && options_.echo_rank0) ? tee_write_ : log_fds_[size_t(i)];

      pid_t pid = ::fork();
      if (pid == 0)
        exec_rank(out_fd, null_fd_, listen_fd, launcher_pid, program_.path.c_str(), argv.data(), envp.data(),
                  exec_error_prefix.c_str());
      const int fork_errno = errno;
      if (i == 0) hand_over_to_rank_zero();
      if (pid < 0) {
        // The job cannot run without every rank: stop the ones already started (unstarted ranks
        // keep pid -1 and are skipped everywhere).
        fork_failed_ = true;
        say("cannot start " + ranks_[size_t(i)].label + ": fork failed: " + std::strerror(fork_errno));
        if (control_) control_->report_failure({1, "cannot start " + ranks_[size_t(i)].label + ": fork failed"});
        begin_stop(SIGTERM);
        return;
      }
      // Also set the group from the parent: whichever of parent and child runs first, the group
      // exists before we might signal it.
      ::setpgid(pid, pid);
      ranks_[size_t(i)].pid = pid;
      ranks_[size_t(i)].running = true;
    }
  }

  // After rank 0's fork (whether or not it succeeded), the launcher lets go of what rank 0 owns.
  void hand_over_to_rank_zero() {
    if (tee_write_ >= 0) {
      // Only rank 0 holds the write end now, so the tee sees end of file when rank 0's group
      // is gone (or at once, if the fork failed).
      ::close(tee_write_);
      tee_write_ = -1;
    }
    if (rendezvous_socket_.fd >= 0) {
      // Rank 0 owns the rendezvous socket now: if it dies, the others' connections are refused
      // rather than queued on a copy nobody accepts from.
      std::replace(fds_.fds.begin(), fds_.fds.end(), rendezvous_socket_.fd, -1);
      ::close(rendezvous_socket_.fd);
      rendezvous_socket_.fd = -1;
    }
  }

  void begin_stop(int signo) {
    sent_signals_.push_back(signo);
    signal_groups(ranks_, signo);
    if (!stopping_) {
      stopping_ = true;
      kill_deadline_ = Clock::now() + options_.kill_grace;
    }
  }

  void escalate() {
    if (escalated_) return;
    escalated_ = true;
    std::string still;
    for (const Rank& r : ranks_)
      if (r.running) still += (still.empty() ? "" : ", ") + std::to_string(first_rank_ + r.index);
    say("sending SIGKILL to what is left" + (still.empty() ? std::string() : " (ranks " + still + ")") +
        " after the " + std::to_string(options_.kill_grace.count()) + " ms grace");
    sent_signals_.push_back(SIGKILL);
    signal_groups(ranks_, SIGKILL);
  }

  // A signal to the launcher is forwarded to every rank; a second one kills them.
  void handle_signals() {
    const int count = g_signal_count.load();
    if (count == seen_signals_) return;
    seen_signals_ = count;
    const int signo = g_last_signal.load();
    if (stop_signal_ == 0) {
      stop_signal_ = signo;
      say("received " + signal_name(signo) + "; forwarding it to every rank");
      if (control_) control_->report_failure({128 + signo, node_name_ + "'s launcher received " + signal_name(signo)});
      begin_stop(signo);
    } else {
      say("received " + signal_name(signo) + " again; killing every rank now");
      escalate();
    }
  }

  // Phase 3: poll until every rank is reaped. The first failure, a forwarded signal or another
  // node's failure starts the stop; SIGKILL follows after the grace.
  void watch() {
    while (true) {
      handle_signals();
      if (control_) {
        // Beats this node's heartbeat; a failure elsewhere ends this node's part of the job.
        if (auto failure = control_->poll(); failure && !stopping_) {
          remote_failure_ = failure;
          say("the job failed elsewhere: " + failure->message + "; stopping the ranks of " + node_name_);
          begin_stop(SIGTERM);
        }
      }
      bool any_running = false;
      for (Rank* r : reap_pass(any_running)) report_exit(*r);
      if (!any_running) break;
      if (stopping_ && !escalated_ && Clock::now() >= kill_deadline_) escalate();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  // The ranks that ended since the last pass, the likeliest cause first: a rank killed by a
  // signal (other than SIGPIPE, which a rank gets for writing to a peer that has died) before one
  // that failed by itself, and that before one that succeeded, whatever their order.
  std::vector<Rank*> reap_pass(bool& any_running) {
    std::vector<Rank*> exited;
    for (Rank& r : ranks_) {
      if (!r.running) continue;
      int status = 0;
      const pid_t got = ::waitpid(r.pid, &status, WNOHANG);
      if (got == 0 || (got < 0 && errno == EINTR)) {
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
    auto cause_rank = [](const Rank& r) {
      if (r.exit_code > 128 && r.exit_code != 128 + SIGPIPE) return 2;
      return r.exit_code != 0 ? 1 : 0;
    };
    std::stable_sort(exited.begin(), exited.end(),
                     [&](const Rank* a, const Rank* b) { return cause_rank(*a) > cause_rank(*b); });
    return exited;
  }

  void report_exit(Rank& r) {
    // A rank failed by itself unless it ended by (or with the code of) a signal we sent it:
    // the 143 of a rank we stopped is not a failure of its own, a 7 or a SIGSEGV is.
    const bool by_our_signal = stopping_ && std::any_of(sent_signals_.begin(), sent_signals_.end(),
                                                        [&](int s) { return r.exit_code == 128 + s; });
    r.own_failure = r.exit_code != 0 && !by_our_signal;
    // A SIGKILL nobody here sent is most often the kernel's out-of-memory killer's.
    if (r.own_failure && r.exit_code == 128 + SIGKILL)
      r.status_text += " (not sent by the launcher: the kernel's out-of-memory killer ends processes so" +
                       (options_.memory_note.empty() ? std::string() : "; " + options_.memory_note) + ")";
    if (r.own_failure && stopping_) say(r.label + " also failed: it " + r.status_text + "; log: " + r.log_path);
    if (r.exit_code == 0 || stopping_) return;
    // The first failure is the first thing to look at; everything after it may be a consequence
    // (a peer's collective failing) or our own stopping.
    first_failure_ = r.index;
    std::string message = r.label + " " + r.status_text + "; log: " + r.log_path + "; stopping the other ranks" +
                          (several_nodes_ ? " on every node" : "");
    if (control_) control_->report_failure({r.exit_code, r.label + " " + r.status_text});
    if (r.index != 0 || !options_.echo_rank0) {
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

  // Phase 4: every rank is reaped; end what they left in their process groups (a background
  // child of a rank that exited 0 must not outlive the launch either).
  void end_leftover_groups() {
    if (!any_group_alive(ranks_)) return;
    if (!stopping_) {
      say("every rank has exited, but processes they started are still running; stopping them");
      begin_stop(SIGTERM);
    }
    while (any_group_alive(ranks_) && !escalated_ && Clock::now() < kill_deadline_) {
      handle_signals();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!any_group_alive(ranks_)) return;
    if (!escalated_) {
      escalated_ = true;
      say("sending SIGKILL to processes the ranks left behind");
      signal_groups(ranks_, SIGKILL);
    }
    // SIGKILL is delivered asynchronously; give the kernel a moment so that nothing is still
    // running when we return.
    const auto until = Clock::now() + std::chrono::seconds(1);
    while (any_group_alive(ranks_) && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  // The worst of the ranks' own failures (the largest code, 128 + signo for a death by signal),
  // not the 143 of the ranks we stopped; a signal sent to the launcher counts as 128 + signo
  // (even if the ranks shut down cleanly on it: the job did not finish); else 0.
  int exit_code() {
    int result = 0, worst_rank = -1, own_failures = 0;
    for (const Rank& r : ranks_) {
      if (!r.own_failure) continue;
      ++own_failures;
      if (r.exit_code > result) {
        result = r.exit_code;
        worst_rank = r.index;
      }
    }
    if (stop_signal_ != 0) result = std::max(result, 128 + stop_signal_);
    if (fork_failed_) result = std::max(result, 1);
    if (control_) {
      // Node 0 serves the other launchers until they have finished too; a failure that came
      // meanwhile (or stopped this node) is the job's, and so this launcher's exit code.
      if (auto late = control_->finish(result); late && !remote_failure_) {
        remote_failure_ = late;
        say("the job failed elsewhere: " + late->message);
      }
      if (remote_failure_ && result == 0) result = std::max(1, remote_failure_->code);
    }
    if (result != 0) report_divergence(ranks_, log_dir_);
    if (worst_rank >= 0 && first_failure_ >= 0 && result == ranks_[size_t(worst_rank)].exit_code &&
        result != ranks_[size_t(first_failure_)].exit_code)
      say("exit code " + std::to_string(result) + ", the worst of the failures: " + ranks_[size_t(worst_rank)].label +
          " " + ranks_[size_t(worst_rank)].status_text);
    if (result != 0 && own_failures == 0 && stop_signal_ != 0)
      say("stopped by " + signal_name(stop_signal_) + "; exit code " + std::to_string(result));
    // The first failed rank's own one-line error (a zerotrain program's "zerotrain: error: ..."),
    // repeated as the launcher's last line: what a user reads first, after the launcher's account
    // of which rank ended how.
    if (result != 0 && first_failure_ >= 0) {
      const Rank& r = ranks_[size_t(first_failure_)];
      const std::string error = last_error_line(r.log_path);
      if (!error.empty()) {
        const std::string text = error + " (" + r.label + ")\n";
        write_all(STDERR_FILENO, text.data(), text.size());
      }
    }
    return result;
  }

  const LaunchOptions& options_;
  const Resolved program_;
  const int nproc_;
  const bool several_nodes_;
  const std::string node_name_;
  const int first_rank_;
  fs::path log_dir_;
  ListeningSocket rendezvous_socket_;
  std::optional<JobControl> control_;  // several nodes: the launchers' meeting point
  int port_ = 0;
  FdList fds_;
  int null_fd_ = -1, tee_read_ = -1, tee_write_ = -1;
  std::vector<Rank> ranks_;
  std::vector<int> log_fds_;
  std::optional<SignalScope> signal_scope_;
  std::optional<Tee> tee_;
  bool fork_failed_ = false;
  int first_failure_ = -1;  // index of the first rank that failed (its log tail is shown)
  int stop_signal_ = 0;     // a signal the launcher received and forwarded
  std::vector<int> sent_signals_;  // every signal the launcher sent to the ranks' groups
  bool stopping_ = false, escalated_ = false;
  Clock::time_point kill_deadline_{};
  int seen_signals_ = 0;
  std::optional<JobFailure> remote_failure_;  // another node's, which stopped this one
};

}  // namespace

int launch_local(const LaunchOptions& options) {
  validate(options);
  const Resolved program = resolve_program(options.command.front());
  if (program.path.empty()) {
    say(program.message);
    return program.error_code;
  }
  LocalLaunch launch(options, program);
  return launch.run();
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
