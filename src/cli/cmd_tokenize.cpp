// fitmoe tokenize / detokenize: a GGUF's tokenizer on its own. Only the metadata is read, so vocab-only
// GGUFs (no tensors) work; no model is loaded.
//
//   fitmoe tokenize -m MODEL.gguf --text "Hello" [--add-special] [--no-parse-special] [--pieces]
//   fitmoe tokenize -m MODEL.gguf --file prompt.txt        (the file's raw bytes)
//   fitmoe detokenize -m MODEL.gguf --ids 9707,1879 [--no-special] [--raw]
//
// tokenize prints the ids as a JSON array on its last stdout line (with --pieces, one "id<TAB>piece"
// line per token comes first, the piece JSON-escaped). detokenize prints the bytes the ids stand for,
// then a newline (none with --raw).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/common.h"
#include "format/gguf.h"
#include "runtime/error.h"
#include "text/tokenizer.h"

namespace fitmoe::cli {

void register_tokenize(CLI::App& app) {
  struct Opts {
    std::string model, text, file;
    bool add_special = false, no_parse_special = false, pieces = false;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("tokenize", "turn text into token ids with a GGUF's tokenizer (JSON array on the last line)");
  cmd->add_option("-m,--model", o->model, "GGUF file (a vocab-only GGUF is enough)")->required();
  auto* text_opt = cmd->add_option("--text", o->text, "the text to tokenize");
  auto* file_opt = cmd->add_option("--file", o->file, "a file whose raw bytes are tokenized");
  text_opt->excludes(file_opt);
  file_opt->excludes(text_opt);
  cmd->add_flag("--add-special", o->add_special, "add BOS/EOS where the model's tokenizer metadata asks for them");
  cmd->add_flag("--no-parse-special", o->no_parse_special,
                "treat control-token text (e.g. <|im_start|>) as plain text; user-defined tokens still match");
  cmd->add_flag("--pieces", o->pieces, "first print each id with its piece, one per line");
  cmd->callback([o, text_opt, file_opt] {
    if (text_opt->count() == 0 && file_opt->count() == 0) throw Error("tokenize needs --text or --file");
    auto f = gguf::File::open(o->model);
    auto tok = Tokenizer::from_gguf(*f);
    const std::string input = file_opt->count() ? read_text_file(o->file) : o->text;
    const std::vector<int32_t> ids = tok->encode(input, o->add_special, !o->no_parse_special);
    if (o->pieces) {
      for (int32_t id : ids) {
        // Pieces may be partial UTF-8 (byte tokens); dump them as JSON strings with invalid bytes replaced.
        std::string p = nlohmann::json(tok->token_piece(id)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
        std::printf("%d\t%s\n", id, p.c_str());
      }
    }
    std::string line = "[";
    for (size_t i = 0; i < ids.size(); ++i) line += (i ? "," : "") + std::to_string(ids[i]);
    line += "]";
    std::printf("%s\n", line.c_str());
  });
}

void register_detokenize(CLI::App& app) {
  struct Opts {
    std::string model, ids;
    bool no_special = false, raw = false;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("detokenize", "turn token ids back into text with a GGUF's tokenizer");
  cmd->add_option("-m,--model", o->model, "GGUF file (a vocab-only GGUF is enough)")->required();
  cmd->add_option("--ids", o->ids, "token ids: 1,2,3 (a JSON array works too)")->required();
  cmd->add_flag("--no-special", o->no_special, "do not render control tokens (e.g. <|im_end|>) as text");
  cmd->add_flag("--raw", o->raw, "print the bytes only, without a final newline");
  cmd->callback([o] {
    auto f = gguf::File::open(o->model);
    auto tok = Tokenizer::from_gguf(*f);
    const std::vector<int32_t> ids = parse_token_list(o->ids);
    const std::string text = tok->decode(ids, !o->no_special);
    std::fwrite(text.data(), 1, text.size(), stdout);
    if (!o->raw) std::fputc('\n', stdout);
  });
}

}  // namespace fitmoe::cli
