#!/usr/bin/env bash
# The test command (CI runs it through .ci/run): installs dependencies, builds (the CUDA code too when
# nvcc is present, so GPU code cannot rot unseen), runs every test with CTest, then fuzzes the GGUF
# parser, the chat-template interpreter and the tokenizers for a bounded time.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# The official openai npm client for the HTTP API's integration test (tests/node; the test skips itself
# where node or the registry is not there).
if command -v npm >/dev/null 2>&1; then
  (cd tests/node && npm install --no-audit --no-fund --loglevel=error >/dev/null) || echo "npm install failed: the openai client test will skip"
fi
scripts/build.sh
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 900)
if command -v clang++ >/dev/null 2>&1; then
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DFITMOE_FUZZ=ON -DFITMOE_TESTS=OFF -DFITMOE_BENCH=OFF \
    -DFITMOE_CUDA=OFF >/dev/null
  cmake --build build-fuzz --target fuzz_gguf fuzz_template fuzz_tokenizer
  mkdir -p build-fuzz/corpus
  cp tests/data/*.gguf build-fuzz/corpus/ 2>/dev/null || true
  build-fuzz/fuzz/fuzz_gguf -max_total_time="${FITMOE_FUZZ_SECONDS:-60}" -max_len=4096 -rss_limit_mb=2048 \
    build-fuzz/corpus 2>&1 | tail -n 3
  # The chat-template interpreter and the tokenizers, half that time each (GGUF templates and text are
  # untrusted input too). The corpora grow in build-fuzz across runs; the template one starts from
  # fuzz/corpus_template.
  half=$(( ${FITMOE_FUZZ_SECONDS:-60} / 2 ))
  mkdir -p build-fuzz/corpus_template build-fuzz/corpus_tokenizer
  cp fuzz/corpus_template/* build-fuzz/corpus_template/
  build-fuzz/fuzz/fuzz_template -max_total_time="$half" -max_len=2048 -rss_limit_mb=2048 -timeout=10 \
    build-fuzz/corpus_template 2>&1 | tail -n 3
  vocabs=""
  for v in ../shared/testdata/tokenizers/qwen3-vocab.gguf ../shared/testdata/tokenizers/gemma3-vocab.gguf; do
    [ -f "$v" ] && vocabs="${vocabs:+$vocabs:}$v"
  done
  if [ -n "$vocabs" ]; then
    printf 'Hello world <|im_start|>user\n h\xc3\xa9llo 123 \t\r\n' > build-fuzz/corpus_tokenizer/seed
    FITMOE_FUZZ_VOCABS="$vocabs" build-fuzz/fuzz/fuzz_tokenizer -max_total_time="$half" -max_len=1024 \
      -rss_limit_mb=2048 -timeout=10 build-fuzz/corpus_tokenizer 2>&1 | tail -n 3
  fi
fi
