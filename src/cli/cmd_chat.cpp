// fitmoe chat: an interactive conversation in the terminal with the GGUF's chat template. The KV
// cache is kept between turns: each turn appends only the new text (the earlier turns are not processed
// again). Ctrl-C stops the current answer; /reset starts over; /exit (or end of input) quits.
//
// The context: each answer may take at most min(-n, room left in the context) tokens. Before a turn the
// conversation must leave room for an answer of min(-n, a quarter of the context) tokens; when it does
// not, the oldest user + assistant pairs after the system prompt are dropped (said on stderr) and the
// conversation is rendered again; the cache keeps the part that is unchanged (the system prompt). A
// message that cannot fit even alone is refused for that turn; the chat goes on.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/common.h"
#include "runtime/error.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace fitmoe::cli {

namespace {

volatile std::sig_atomic_t g_generating = 0;
volatile std::sig_atomic_t g_interrupted = 0;

void on_sigint(int) {
  if (g_generating) {
    g_interrupted = 1;  // stop this answer, keep the program
  } else {
    std::_Exit(130);  // at the prompt, Ctrl-C quits as in any shell program
  }
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

struct ChatArgs {
  ModelOptions model;
  SamplerParams sampler;
  std::string system;
  int n_predict = 2048;
  bool no_think = false;
};

const char* kHelp =
    "commands:\n"
    "  /help          this list\n"
    "  /reset         forget the conversation (the system prompt stays)\n"
    "  /exit, /quit   leave (so does end of input, Ctrl-D)\n"
    "multi-line messages: a line \"\"\" starts a message that runs to the next line \"\"\" (also to send\n"
    "text that starts with /); in a terminal, several lines pasted at once are one message.\n"
    "Ctrl-C stops an answer; at the prompt it quits.";

// Lines from standard input, read straight from fd 0 (not through std::cin's buffer) so that poll() can
// tell whether more input is already waiting: that is how a paste of several lines is told apart from
// lines typed one at a time.
class LineReader {
 public:
  // The next line without its newline (and a '\r' before it); false at the end of input.
  bool next(std::string& line) {
    for (;;) {
      const size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        line.assign(buf_, 0, nl);
        buf_.erase(0, nl + 1);
        if (!line.empty() && line.back() == '\r') line.pop_back();
        return true;
      }
      if (eof_) {
        if (buf_.empty()) return false;
        line.swap(buf_);
        buf_.clear();
        return true;
      }
      fill();
    }
  }
  // Whether another line is there already, without waiting.
  bool more_now() {
    if (buf_.find('\n') != std::string::npos) return true;
    if (eof_) return !buf_.empty();
    pollfd p{0, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP));
  }

 private:
  void fill() {
    char tmp[1 << 16];
    const ssize_t n = ::read(0, tmp, sizeof(tmp));
    if (n > 0) buf_.append(tmp, static_cast<size_t>(n));
    else if (n == 0 || errno != EINTR) eof_ = true;
  }
  std::string buf_;
  bool eof_ = false;
};

enum class Input { Message, Command, End };

// One turn of input: a line, a """ block, or (in a terminal) a pasted run of lines.
Input read_turn(LineReader& in, bool terminal, std::string& text) {
  std::string line;
  if (!in.next(line)) return Input::End;
  if (line == "\"\"\"") {
    text.clear();
    bool first = true;
    while (in.next(line) && line != "\"\"\"") {
      if (!first) text += '\n';
      text += line;
      first = false;
    }
    return Input::Message;
  }
  text = line;
  if (terminal) {
    // A paste arrives faster than anyone types: lines already waiting belong to this message.
    bool joined = false;
    while (in.more_now() && in.next(line)) {
      text += '\n';
      text += line;
      joined = true;
    }
    if (joined) return Input::Message;
  }
  return !text.empty() && text[0] == '/' ? Input::Command : Input::Message;
}

}  // namespace

void register_chat(CLI::App& app) {
  auto* cmd = app.add_subcommand("chat", "interactive multi-turn chat with the model's chat template");
  auto a = std::make_shared<ChatArgs>();
  add_model_options(*cmd, a->model);
  add_sampler_options(*cmd, a->sampler);
  cmd->add_option("--system", a->system, "system prompt");
  cmd->add_option("-n,--n-predict", a->n_predict, "most tokens per answer")->check(at_least(1));  // no tokens is no answer
  cmd->add_flag("--no-think", a->no_think, "ask templates that support it to skip the thinking part");
  cmd->callback([a] {
    auto model = load_model(a->model);
    auto tok = Tokenizer::from_gguf(model->file());
    Session s(*model, session_options(a->model));
    Sampler sampler(a->sampler);
    nlohmann::ordered_json extra = nlohmann::ordered_json::object();
    if (a->no_think) extra["enable_thinking"] = false;
    const int n_ctx = s.n_ctx();
    // The room a turn must leave for its answer before older turns are dropped.
    const int reserve = std::max(1, std::min(a->n_predict, n_ctx / 4));

    std::vector<ChatMessage> msgs;
    if (!a->system.empty()) msgs.push_back({"system", a->system, nullptr});
    const size_t first_turn = msgs.size();  // where the droppable turns begin
    // The rendered conversation text that the cache holds exactly (through the last end-of-turn token);
    // empty when the cache holds something else (an interrupted answer), which forces a full re-render.
    std::string cached_text;
    // Tokens of the conversation with a generation prompt: the cache's tokens plus the new text's when
    // the rendering extends what the cache holds, else the whole rendering's.
    auto conversation_tokens = [&](const std::vector<ChatMessage>& m) {
      const std::string full = apply_chat_template(*tok, m, true, extra);
      std::vector<int32_t> tokens;
      if (!cached_text.empty() && full.compare(0, cached_text.size(), cached_text) == 0) {
        tokens = s.history();
        auto delta = tok->encode(full.substr(cached_text.size()), /*add_special=*/false);
        tokens.insert(tokens.end(), delta.begin(), delta.end());
      } else {
        tokens = tok->encode(full, /*add_special=*/true);
      }
      return tokens;
    };

    std::signal(SIGINT, on_sigint);
    std::fprintf(stderr, "chat with %s (%d-token context). /help lists the commands, Ctrl-C stops an answer.\n",
                 model->config().name.c_str(), n_ctx);
    if (a->sampler.temperature > 0)
      std::fprintf(stderr, "seed: %llu (--seed repeats this conversation)\n", static_cast<unsigned long long>(a->sampler.seed));
    LineReader in;
    const bool terminal = ::isatty(0);
    std::string text;
    while (true) {
      std::fprintf(stdout, "\n> ");
      std::fflush(stdout);
      const Input kind = read_turn(in, terminal, text);
      if (kind == Input::End) break;
      if (kind == Input::Command) {
        if (text == "/exit" || text == "/quit") break;
        if (text == "/help") {
          std::fprintf(stdout, "%s\n", kHelp);
        } else if (text == "/reset") {
          msgs.resize(first_turn);
          s.truncate(0);
          cached_text.clear();
          std::fprintf(stderr, "(conversation reset)\n");
        } else {
          std::fprintf(stderr, "unknown command '%s' (/help lists the commands; a \"\"\" block sends text starting with /)\n",
                       text.c_str());
        }
        continue;
      }
      if (text.empty()) continue;
      // A turn that fails (the template raises an error for this conversation, say) is reported and
      // undone; the conversation before it stays.
      size_t turn_start = msgs.size();
      try {
        // Fit the conversation: drop the oldest turns (whole user + assistant pairs) until the answer has
        // room. Worked on a copy, so that a message that cannot fit leaves the conversation as it was.
        std::vector<ChatMessage> trial = msgs;
        trial.push_back({"user", text, nullptr});
        std::vector<int32_t> tokens = conversation_tokens(trial);
        int dropped = 0;
        while (static_cast<int>(tokens.size()) + reserve > n_ctx && trial.size() > first_turn + 1) {
          trial.erase(trial.begin() + static_cast<long>(first_turn));
          while (trial.size() > first_turn + 1 && trial[first_turn].role != "user")
            trial.erase(trial.begin() + static_cast<long>(first_turn));  // the answer(s) of that turn
          ++dropped;
          tokens = conversation_tokens(trial);
        }
        if (static_cast<int>(tokens.size()) + reserve > n_ctx) {
          std::fprintf(stderr, "(this message does not fit: it needs %zu tokens with the template%s, and the %d-token context "
                               "must keep %d for the answer; use a larger -c or a shorter message)\n",
                       tokens.size(), first_turn ? " and the system prompt" : "", n_ctx, reserve);
          continue;
        }
        if (dropped) {
          std::fprintf(stderr, "(context full: dropped the oldest %d turn%s)\n", dropped, dropped == 1 ? "" : "s");
          msgs = std::move(trial);
          msgs.pop_back();
          cached_text.clear();
        }
        turn_start = msgs.size();
        msgs.push_back({"user", text, nullptr});

        // Keep what the cache already holds; evaluate only the rest (at least one token for the logits).
        size_t keep = common_prefix(tokens, s.history());
        if (keep == tokens.size()) --keep;
        s.truncate(static_cast<int>(keep));
        std::vector<int32_t> fresh(tokens.begin() + static_cast<long>(keep), tokens.end());
        const int room = n_ctx - static_cast<int>(tokens.size());
        const int answer_max = std::min(a->n_predict, room);

        StreamDecoder out(*tok);
        std::string answer;
        int32_t last = -1;
        g_interrupted = 0;
        g_generating = 1;
        GenerationStats st;
        s.generate(fresh, answer_max, sampler, [&](int32_t t) {
          last = t;
          if (tok->is_eog(t)) return false;
          std::string piece = out.push(t);
          answer += piece;
          std::fputs(piece.c_str(), stdout);
          std::fflush(stdout);
          return !g_interrupted;
        }, tok->eog_tokens(), &st);
        g_generating = 0;
        std::string tail = out.flush();
        answer += tail;
        std::fputs(tail.c_str(), stdout);
        std::fprintf(stdout, "\n");
        const bool ended = last >= 0 && tok->is_eog(last);
        // Out of context: generate() saw it, or the answer used all the room it was given.
        const bool context_full = !ended && !g_interrupted &&
                                  (st.context_full || (answer_max < a->n_predict && st.n_generated >= answer_max));
        std::fprintf(stderr, "[%d prompt tokens at %.1f tok/s, %d generated at %.1f tok/s%s]\n", st.n_prompt, st.prompt_tps(),
                     st.n_generated, st.generate_tps(),
                     g_interrupted ? ", stopped" : context_full ? ", context full: the answer was cut off" : "");
        msgs.push_back({"assistant", answer, nullptr});
        cached_text.clear();
        if (ended && s.n_past() < n_ctx) {
          // Put the end-of-turn token into the cache too, so the next turn continues from the template's
          // own text of this one.
          s.eval(std::span<const int32_t>(&last, 1), 0);
          // A recurrent state (qwen35) cannot be cut back like a KV cache: keep it here, where the next
          // turn continues, so that turn evaluates only its own text.
          s.checkpoint();
          const std::string rendered = apply_chat_template(*tok, msgs, false, extra);
          const std::string eot = tok->token_piece(last);
          const size_t at = rendered.rfind(eot);
          if (at != std::string::npos) cached_text = rendered.substr(0, at + eot.size());
        }
      } catch (const Error& e) {
        g_generating = 0;
        msgs.resize(std::min(msgs.size(), turn_start));
        cached_text.clear();
        std::fprintf(stderr, "error: %s (this turn is dropped; the conversation goes on)\n", e.what());
      }
    }
  });
}

}  // namespace fitmoe::cli
