// Running the real fitmoe binary from a test: exit code, stdout and stderr (shared by the CLI tests).
#pragma once
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace fitmoe::test {

struct RunResult {
  int code;
  std::string out, err;
};

// A per-process path in the test temp folder; `prefix` keeps test files apart.
inline std::string temp_path(const std::string& prefix, const std::string& name) {
  return ::testing::TempDir() + "/" + prefix + "_" + std::to_string(::getpid()) + "_" + name;
}

inline std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Runs `fitmoe ARGS` through the shell. With `input`, that text is its standard input (a file, not a
// terminal, as in a pipe); without, stdin is left as the test's.
inline RunResult run_fitmoe(const std::string& args, const std::string* input = nullptr) {
  static int n = 0;
  const std::string base = temp_path("fitmoe_run", std::to_string(n++));
  const std::string i = base + ".in", o = base + ".out", e = base + ".err";
  std::string cmd = std::string(FITMOE_BINARY) + " " + args + " >" + o + " 2>" + e;
  if (input) {
    std::ofstream(i, std::ios::binary) << *input;
    cmd += " <" + i;
  }
  const int status = std::system(cmd.c_str());
  RunResult r{WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), slurp(o), slurp(e)};
  std::remove(i.c_str());
  std::remove(o.c_str());
  std::remove(e.c_str());
  return r;
}

}  // namespace fitmoe::test
