// The official OpenAI client for Node (npm `openai`, pinned in package.json)
// against a real `kvcodec serve`: models, completions, chat, streaming with
// usage, logprobs and echo, and the error cases the client maps to its
// APIError classes (400, 404, 401). Run by tests/node/run.sh.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { createInterface } from 'node:readline';
import OpenAI from 'openai';

const kvcodec = process.env.KVCODEC_CLI;
const modelDir = process.env.KVCODEC_MODEL_DIR;
if (!kvcodec || !modelDir) throw new Error('set KVCODEC_CLI and KVCODEC_MODEL_DIR (tests/node/run.sh does)');

// Starts `kvcodec serve` on a free port; resolves with {proc, url} at its ready line.
function serve(args = [], env = {}) {
  const proc = spawn(kvcodec, ['serve', '--model', modelDir, '--port', '0', '--threads', '1',
                               '--max-prompt-tokens', '256', '--prefix-block', '16', ...args],
                     { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'inherit'] });
  return new Promise((resolve, reject) => {
    const lines = createInterface({ input: proc.stdout });
    let seen = '';
    lines.on('line', (line) => {
      seen += line + '\n';
      const m = line.match(/ready on (http:\/\/[^\s]+)/);
      if (m) resolve({ proc, url: m[1], log: seen });
    });
    proc.on('exit', (code) => reject(new Error(`kvcodec serve exited with ${code} before its ready line:\n${seen}`)));
  });
}

function stop(server) {
  if (server && server.proc.exitCode === null) server.proc.kill('SIGKILL');
}

let open;    // no API key
let keyed;   // --api-key from KVCODEC_API_KEY
let client;
const model = 'tinycode';

before(async () => {
  open = await serve();
  keyed = await serve([], { KVCODEC_API_KEY: 'sk-node-test' });
  client = new OpenAI({ baseURL: open.url + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 120000 });
});

after(() => {
  stop(open);
  stop(keyed);
});

test('models list', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [model]);
});

test('completion', async () => {
  const r = await client.completions.create({ model, prompt: 'def add(a, b):', max_tokens: 4 });
  assert.equal(r.object, 'text_completion');
  assert.equal(typeof r.choices[0].text, 'string');
  assert.equal(r.usage.completion_tokens, 4);
  assert.equal(r.choices[0].finish_reason, 'length');
});

test('chat, and streaming with usage gives the same reply', async () => {
  const body = { model, messages: [{ role: 'user', content: 'write a loop' }], max_tokens: 6 };
  const whole = await client.chat.completions.create(body);
  assert.equal(whole.choices[0].message.role, 'assistant');
  const stream = await client.chat.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.delta.content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 6);
  assert.equal(usage.prompt_tokens, whole.usage.prompt_tokens);
});

test('completion streaming', async () => {
  const body = { model, prompt: 'import os\n', max_tokens: 5 };
  const whole = await client.completions.create(body);
  let text = '';
  for await (const chunk of await client.completions.create({ ...body, stream: true })) text += chunk.choices[0]?.text ?? '';
  assert.equal(text, whole.choices[0].text);
});

test('logprobs: echo scores the prompt; chat top_logprobs', async () => {
  const prompt = 'for i in range(3):\n    print(i)\n';
  const r = await client.completions.create({ model, prompt, max_tokens: 0, echo: true, logprobs: 2 });
  const lp = r.choices[0].logprobs;
  assert.equal(r.choices[0].text, prompt);
  assert.equal(lp.tokens.join(''), prompt);
  assert.equal(lp.token_logprobs[0], null);
  assert.equal(lp.tokens.length, r.usage.prompt_tokens);
  for (let i = 1; i < lp.tokens.length; ++i) {
    assert.ok(lp.token_logprobs[i] < 0);
    assert.equal(Object.keys(lp.top_logprobs[i]).length, 2);
  }
  const c = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 3,
                                                   logprobs: true, top_logprobs: 3 });
  const content = c.choices[0].logprobs.content;
  assert.equal(content.length, 3);
  assert.equal(content.map((t) => t.token).join(''), c.choices[0].message.content);
  for (const t of content) {
    assert.equal(t.top_logprobs.length, 3);
    assert.equal(t.logprob, t.top_logprobs[0].logprob);  // greedy takes the most likely token
  }
});

// Resolves with the error the call rejects with.
async function rejection(promise) {
  try {
    await promise;
  } catch (e) {
    return e;
  }
  assert.fail('the call succeeded');
}

test('errors are the client\'s APIError classes', async () => {
  const notFound = await rejection(client.completions.create({ model: 'no-such-model', prompt: 'x', max_tokens: 1 }));
  assert.ok(notFound instanceof OpenAI.NotFoundError, String(notFound));
  assert.equal(notFound.status, 404);
  const badLogprobs = await rejection(client.completions.create({ model, prompt: 'x', logprobs: 6 }));
  assert.ok(badLogprobs instanceof OpenAI.BadRequestError, String(badLogprobs));
  assert.equal(badLogprobs.status, 400);
  assert.match(badLogprobs.message, /'logprobs'/);
  const badTemperature = await rejection(client.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }],
                                                                          temperature: -1 }));
  assert.ok(badTemperature instanceof OpenAI.BadRequestError);
  assert.match(badTemperature.message, /'temperature'/);
  const badTop = await rejection(client.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }],
                                                                  logprobs: true, top_logprobs: 21 }));
  assert.equal(badTop.status, 400);
  assert.match(badTop.message, /'top_logprobs'/);
});

test('API key: wrong key is AuthenticationError 401, the right one works', async () => {
  const wrong = new OpenAI({ baseURL: keyed.url + '/v1', apiKey: 'sk-wrong', maxRetries: 0 });
  const e = await rejection(wrong.models.list());
  assert.ok(e instanceof OpenAI.AuthenticationError, String(e));
  assert.equal(e.status, 401);
  const right = new OpenAI({ baseURL: keyed.url + '/v1', apiKey: 'sk-node-test', maxRetries: 0, timeout: 120000 });
  const r = await right.completions.create({ model, prompt: 'x = ', max_tokens: 2 });
  assert.equal(r.usage.completion_tokens, 2);
});

test('a non-loopback --host without a key refuses to start (exit 2)', () => {
  const r = spawnSync(kvcodec, ['serve', '--model', modelDir, '--host', '0.0.0.0', '--port', '0'],
                      { encoding: 'utf8', env: { ...process.env, KVCODEC_API_KEY: '' }, timeout: 60000 });
  assert.equal(r.status, 2, r.stderr);
  assert.match(r.stderr, /--host/);
  assert.match(r.stderr, /--insecure-no-api-key/);
});
