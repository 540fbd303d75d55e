// A small Jinja2 interpreter for the chat templates GGUF files carry (tokenizer.chat_template).
//
// Semantics follow Jinja2 as Hugging Face transformers configures it for chat templates:
// trim_blocks and lstrip_blocks on, the loopcontrols extension (break/continue), Python-style values,
// `tojson` as transformers defines it (json.dumps with ensure_ascii=False, keys in insertion order),
// and the globals raise_exception(), strftime_now(), namespace(), range(), dict().
//
// Supported: {{ }}, {% %}, {# #} with -/+ whitespace control; if/elif/else; for (tuple targets, `if`
// filter, else, loop.index/index0/revindex/revindex0/first/last/length/previtem/nextitem/cycle/depth);
// set (names, namespace attributes, tuples, block set); macro (defaults, keyword arguments); call of
// macros from expressions; filter blocks; raw; do; break/continue; generation (rendered as is).
// Expressions: literals (strings, ints, floats, true/false/none in both cases, lists, tuples, dicts),
// attribute/item access, slices [a:b:c], calls with keyword args, filters, tests (`is`, `is not`),
// conditional expressions, and/or/not, in/not in, comparisons (chained), + - * / // % ** ~ and unary -.
// Filters: abs attr capitalize count default/d dictsort escape/e first float indent int items join last
// length list lower map max min reject rejectattr replace reverse round safe select selectattr sort
// string sum title tojson trim unique upper wordcount.
// Tests: boolean callable defined divisibleby eq/equalto/== even false float ge/>= gt/>/greaterthan in
// integer iterable le/<= lower lt/</lessthan mapping ne/!= none number odd sameas sequence string true
// undefined upper.
// String methods: strip lstrip rstrip split rsplit startswith endswith upper lower title capitalize
// replace find rfind index count join format (plain {} / {0} / {name} fields) isspace isdigit
// isalpha isalnum isupper islower; dict methods: get items keys values; list methods: append
// extend pop insert index count.
//
// Anything else (include, extends, import, call blocks, unknown filters/tests, ...) fails with a
// fitmoe::Error naming the construct and its line. Lenient where Hugging Face's environment would fail
// late: an attribute of an undefined value is undefined.
//
// A GGUF's template is untrusted input, so one render is bounded (Limits below): evaluation steps
// (counting the elements builtins visit), bytes of strings and list slots made or copied over the whole
// render, the size of the output and of any one string or list, macro recursion, how deeply evaluation
// and values nest. Past a bound rendering stops with a fitmoe::Error naming it ("chat template: output
// exceeds 33554432 bytes"). Integer overflow is an error too (Python would switch to big integers).
// Templates nesting deeper than 200 levels are rejected when parsed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace fitmoe::jinja {

// Bounds on one render. The defaults leave real chat templates (Qwen3, Qwen3.5, Gemma 3 / 4) rendering a
// conversation of several megabytes far from every bound, and keep a hostile one within about 1 GiB of
// memory and a few seconds.
struct Limits {
  uint64_t max_steps = 5'000'000;       // expressions, statements, loop iterations, elements visited
  uint64_t max_bytes = 1ull << 30;      // bytes of strings and list slots made or copied, in total
  size_t max_output = 32u << 20;        // bytes of the rendered text (and of a block set or macro's text)
  size_t max_string = 32u << 20;        // bytes of any one string value
  size_t max_items = 1u << 20;          // elements of any one list
  int max_macro_depth = 64;             // macro calls within macro calls
  int max_nesting = 1000;               // expressions and statements being evaluated within each other
  int max_value_depth = 500;            // lists and dicts within each other, when printed or compared
};

class Template {
 public:
  // Parses the template; throws fitmoe::Error("chat template, line N: ...") on syntax errors and
  // unsupported constructs.
  explicit Template(std::string_view source);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with the given variables (a JSON object; keys become template variables). Throws
  // fitmoe::Error on runtime errors, including raise_exception() from the template.
  std::string render(const nlohmann::ordered_json& context, const Limits& limits = {}) const;

  struct Program;

 private:
  std::unique_ptr<Program> prog_;
};

}  // namespace fitmoe::jinja
