// fitmoe chat through the real binary with piped input: the conversation survives a small context
// (oldest turns dropped, said on stderr), answers are capped to the room left and say when the context
// cut them off, /help and unknown commands, """ blocks as one turn, and range checks of chat's options.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "cli_util.h"
#include "testdata.h"

namespace {

using fitmoe::test::RunResult;

std::string tmp(const std::string& name) { return fitmoe::test::temp_path("fitmoe_cli_chat", name); }

// Runs fitmoe with `input` on its standard input (a file: not a terminal, as in a pipe).
RunResult run_fitmoe(const std::string& args, const std::string& input) { return fitmoe::test::run_fitmoe(args, &input); }

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + what.size())) ++n;
  return n;
}

// A tiny model whose GGUF carries Qwen3's chat template.
std::string model() { return fitmoe::test::testdata("qwen3moe-tiny/qwen3moe-tiny-q4_k_m.gguf"); }

}  // namespace

TEST(ChatCli, ConversationOutlivesASmallContext) {
  // Seven messages (one a """ block of three lines) in a 160-token context with 24-token answers:
  // the conversation outgrows the context after a few turns.
  const std::string input =
      "hello there, how are you today?\n"
      "/help\n"
      "/frobnicate\n"
      "\"\"\"\n"
      "first line of a block\n"
      "/not a command inside a block\n"
      "third line\n"
      "\"\"\"\n"
      "tell me a story about a cat who lives on a boat\n"
      "what is the capital of France and why is it famous\n"
      "another message with several words in it\n"
      "and one more, to be sure that the oldest turns go\n"
      "the last message\n";
  auto r = run_fitmoe("chat -m " + model() + " -c 160 -n 24 --temp 0", input);
  EXPECT_EQ(r.code, 0) << r.err;
  // One answer per message: the block is one turn, the commands are none.
  EXPECT_EQ(count(r.err, " prompt tokens at "), 7) << r.err;
  EXPECT_NE(r.err.find("(context full: dropped the oldest "), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("does not fit"), std::string::npos) << r.err;
  // /help lists the commands and the block syntax; an unknown command points to /help.
  for (const char* c : {"/help", "/reset", "/exit", "/quit", "\"\"\""})
    EXPECT_NE(r.out.find(c), std::string::npos) << c << "\n" << r.out;
  EXPECT_NE(r.err.find("unknown command '/frobnicate' (/help lists the commands"), std::string::npos) << r.err;
}

TEST(ChatCli, AnswerIsCappedToTheContextAndSaysSo) {
  // -n far beyond the context: the first answer gets the room left (the old chat exited at once), and
  // unless the model ends its answer first (greedy here: it does not), it says the context cut it off.
  auto r = run_fitmoe("chat -m " + model() + " -c 64 --temp 0", "hi\nhello again\n");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count(r.err, " prompt tokens at "), 2) << r.err;
  EXPECT_NE(r.err.find("context full: the answer was cut off"), std::string::npos) << r.err;
}

TEST(ChatCli, MessageThatCannotFitIsRefusedForThatTurnOnly) {
  std::string big;
  for (int i = 0; i < 200; ++i) big += "word ";
  auto r = run_fitmoe("chat -m " + model() + " -c 64 -n 8 --temp 0", "hello\n" + big + "\nhello again\n/exit\n");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("(this message does not fit"), std::string::npos) << r.err;
  EXPECT_EQ(count(r.err, " prompt tokens at "), 2) << r.err;  // the turns before and after it
}

TEST(ChatCli, ResetAndEndOfInput) {
  auto r = run_fitmoe("chat -m " + model() + " -c 128 -n 4 --temp 0", "hello\n/reset\nhello\n");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("(conversation reset)"), std::string::npos) << r.err;
  EXPECT_EQ(count(r.err, " prompt tokens at "), 2) << r.err;
  // An unterminated block at the end of input is still a message.
  r = run_fitmoe("chat -m " + model() + " -c 128 -n 4 --temp 0", "\"\"\"\nline one\nline two\n");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count(r.err, " prompt tokens at "), 1) << r.err;
}

TEST(ChatCli, OptionsAreRangeChecked) {
  for (const char* bad : {"-n 0", "-n -5"}) {
    auto r = run_fitmoe("chat -m " + model() + " " + bad, "hello\n");
    EXPECT_NE(r.code, 0) << bad;
    EXPECT_NE(r.err.find("at least 1"), std::string::npos) << bad << ": " << r.err;
    EXPECT_EQ(count(r.err, " prompt tokens at "), 0) << bad;
  }
}

TEST(ChatCli, RandomSamplingPrintsItsSeedAndTheSeedRepeatsTheConversation) {
  auto r = run_fitmoe("chat -m " + model() + " -c 128 -n 6", "hello\n");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("seed: "), std::string::npos) << r.err;
  auto a = run_fitmoe("chat -m " + model() + " -c 128 -n 6 --seed 7", "hello\nand again\n");
  auto b = run_fitmoe("chat -m " + model() + " -c 128 -n 6 --seed 7", "hello\nand again\n");
  EXPECT_NE(a.err.find("seed: 7 "), std::string::npos) << a.err;
  EXPECT_EQ(a.out, b.out);
  // Greedy decoding has no seed to print.
  r = run_fitmoe("chat -m " + model() + " -c 128 -n 2 --temp 0", "hello\n");
  EXPECT_EQ(r.err.find("seed: "), std::string::npos) << r.err;
}

TEST(ChatCli, RecurrentModelKeepsTheConversationAcrossTurnsAndDrops) {
  // qwen35moe (DeltaNet layers: a state that is restored from checkpoints, not cut back): several turns
  // in a small context, so that old turns are dropped and the state is rewound, in a second run too.
  const std::string m = fitmoe::test::testdata("qwen35moe-tiny/qwen35moe-tiny-q4_k_m.gguf");
  const std::string input = "hello there\nhow are you today\ntell me about cats and boats\nand one more message\nlast\n";
  auto a = run_fitmoe("chat -m " + m + " -c 128 -n 12 --temp 0", input);
  auto b = run_fitmoe("chat -m " + m + " -c 128 -n 12 --temp 0", input);
  EXPECT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(count(a.err, " prompt tokens at "), 5) << a.err;
  EXPECT_NE(a.err.find("(context full: dropped the oldest "), std::string::npos) << a.err;
  EXPECT_EQ(a.out, b.out);
}
