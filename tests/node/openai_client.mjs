// The official openai npm client against the real `fitmoe serve` on 127.0.0.1 (CTest runs this through
// node; scripts/test.sh installs the client): chat, streaming, completions, models and error cases.
// Usage: node openai_client.mjs FITMOE_BINARY MODEL.gguf   (exit 77: the client is not installed)
import { spawn } from 'node:child_process';
import assert from 'node:assert/strict';

let OpenAI;
try {
  OpenAI = (await import('openai')).default;
} catch {
  console.log('the openai npm client is not installed (npm install in tests/node): skipped');
  process.exit(77);
}

const [bin, defaultModel] = process.argv.slice(2);
// (FITMOE_TESTDATA moves the fixtures, as for the C++ tests)
const model = process.env.FITMOE_TESTDATA ? `${process.env.FITMOE_TESTDATA}/qwen3moe-tiny/qwen3moe-tiny-f32.gguf` : defaultModel;
const srv = spawn(bin, ['serve', '-m', model, '--gpu', 'none', '--port', '0', '-c', '512', '--alias', 'tiny', '-t', '2'],
                  { stdio: ['ignore', 'pipe', 'inherit'] });
const exited = new Promise((resolve) => srv.on('exit', (code, signal) => resolve({ code, signal })));
const port = await new Promise((resolve, reject) => {
  let out = '';
  srv.stdout.on('data', (d) => {
    out += d;
    const m = out.match(/listening on http:\/\/[^:]+:(\d+)/);
    if (m) resolve(Number(m[1]));
  });
  srv.on('exit', () => reject(new Error('fitmoe serve exited before listening: ' + out)));
});

try {
  const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: 'unused', maxRetries: 0 });
  const messages = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Say something.' }];

  const r = await client.chat.completions.create({ model: 'tiny', messages, max_tokens: 10, temperature: 0 });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);

  // Streaming: the same text, then the usage chunk.
  const stream = await client.chat.completions.create({ model: 'tiny', messages, max_tokens: 10, temperature: 0, stream: true,
                                                        stream_options: { include_usage: true } });
  let text = '';
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length && chunk.choices[0].delta?.content) text += chunk.choices[0].delta.content;
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, r.choices[0].message.content);
  assert.equal(usage.prompt_tokens, r.usage.prompt_tokens);

  const c = await client.completions.create({ model: 'tiny', prompt: 'Once upon a time', max_tokens: 5, temperature: 0 });
  assert.equal(c.object, 'text_completion');
  assert.equal(c.usage.completion_tokens, 5);

  const models = await client.models.list();
  assert.equal(models.data[0].id, 'tiny');

  // Errors arrive as the client's typed errors with the server's message.
  await assert.rejects(client.chat.completions.create({ model: 'gpt-9', messages }),
                       (e) => e instanceof OpenAI.NotFoundError && /gpt-9/.test(e.message));
  await assert.rejects(client.chat.completions.create({ model: 'tiny', messages, max_tokens: -1 }),
                       (e) => e instanceof OpenAI.BadRequestError && /max_tokens/.test(e.message));
  await assert.rejects(client.chat.completions.create({ model: 'tiny', messages: [] }),
                       (e) => e instanceof OpenAI.BadRequestError && /messages/.test(e.message));
  console.log('openai client: chat, stream, completions, models and errors as expected');
} finally {
  srv.kill('SIGTERM');
}
const { code } = await exited;
assert.equal(code, 0, 'fitmoe serve exits 0 on SIGTERM');
