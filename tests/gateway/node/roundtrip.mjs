// The official Node SDK (openai, npm) against a tokenbus gateway: /v1/responses (plain, streamed, json_schema),
// a /v1/responses batch with usage, output_expires_after, Idempotency-Key replays, a retry batch, and one
// webhook event per ended batch verified with client.webhooks.unwrap(). Run by tests/gateway/test_gw_node_sdk.py,
// which ends the jobs as a worker would; exits non-zero naming the first check that failed.
import http from 'node:http';
import OpenAI, { toFile } from 'openai';

const client = new OpenAI({ apiKey: process.env.TOKENBUS_API_KEY, baseURL: `${process.env.TOKENBUS_BASE_URL}/v1`,
                            maxRetries: 0 });
const MODEL = 'smollm2-135m';
const PERSON = { type: 'object', properties: { name: { type: 'string' }, age: { type: 'integer' } },
                 required: ['name', 'age'], additionalProperties: false };
const check = (ok, what) => { if (!ok) throw new Error(`check failed: ${what}`); };
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const line = (cid, body = {}) => JSON.stringify({ custom_id: cid, method: 'POST', url: '/v1/responses',
  body: { model: MODEL, input: `question ${cid}`, max_output_tokens: 8, ...body } });
const upload = async (lines, options) => client.files.create(
  { file: await toFile(Buffer.from(lines.join('\n') + '\n'), 'in.jsonl'), purpose: 'batch' }, options);
const refused = async (call, status) => {
  try { await call(); } catch (err) { return err.status === status ? err : check(false, `${status}: ${err}`); }
  return check(false, `expected a ${status}`);
};

async function waitStatus(id, statuses, timeoutMs = 30000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const batch = await client.batches.retrieve(id);
    if (statuses.includes(batch.status)) return batch;
    check(Date.now() < deadline, `batch ${id} to reach ${statuses} (is ${batch.status})`);
    await sleep(100);
  }
}

const ask = { model: MODEL, input: 'Describe a person.', instructions: 'JSON only.', max_output_tokens: 20 };
const plain = await client.responses.create(ask);
check(plain.object === 'response' && plain.output_text.length > 0, 'a plain response with output_text');
check(plain.usage.input_tokens_details.cached_tokens === 16 && plain.usage.total_tokens === 35, 'its usage');
const types = [];
let streamed = '';
for await (const event of await client.responses.create({ ...ask, stream: true })) {
  types.push(event.type);
  if (event.type === 'response.output_text.delta') streamed += event.delta;
}
check(types[0] === 'response.created' && types.at(-1) === 'response.completed', `stream events ${types}`);
check(streamed === plain.output_text, 'the streamed text is the plain one');
const structured = await client.responses.create(
  { ...ask, text: { format: { type: 'json_schema', name: 'person', schema: PERSON, strict: true } } });
const person = JSON.parse(structured.output_text);
check(typeof person.name === 'string' && Number.isInteger(person.age), 'the json_schema output validates');
const tools = await refused(() => client.responses.create(
  { ...ask, tools: [{ type: 'function', name: 'f', parameters: {} }] }), 400);
check(tools.code === 'unsupported_parameter' && tools.param === 'tools', 'tools refused naming the field');

const fileKey = { headers: { 'Idempotency-Key': `node-file-${Date.now()}` } };
const lines = ['a', 'b', 'c'].map((cid) => line(cid));
const f1 = await upload(lines, fileKey);
check((await upload(lines, fileKey)).id === f1.id, 'an upload replayed by its Idempotency-Key');
const create = { input_file_id: f1.id, endpoint: '/v1/responses', completion_window: '24h',
                 output_expires_after: { anchor: 'created_at', seconds: 2 } };
const batchKey = { headers: { 'Idempotency-Key': `node-batch-${Date.now()}` } };
const b1 = await client.batches.create(create, batchKey);
check((await client.batches.create(create, batchKey)).id === b1.id, 'a batch replayed by its Idempotency-Key');
await refused(() => client.batches.create({ ...create, metadata: { other: 'body' } }, batchKey), 409);
const done = await waitStatus(b1.id, ['completed']);
check(done.model === MODEL && done.usage.input_tokens === 90 && done.usage.output_tokens === 15, 'batch usage');
check(done.usage.input_tokens_details.cached_tokens === 48, 'batch cached_tokens');
const output = (await (await client.files.content(done.output_file_id)).text()).trim().split('\n');
check(output.length === 3 && JSON.parse(output[0]).response.body.object === 'response', 'the output file');
await sleep(3500);
await refused(() => client.files.content(done.output_file_id), 404);
await refused(() => client.files.retrieve(done.output_file_id), 404);

const f3 = await upload([line('ok0'), line('bad1'), line('ok2')]);
const b3 = await client.batches.create({ input_file_id: f3.id, endpoint: '/v1/responses', completion_window: '24h' });
const ended = await waitStatus(b3.id, ['completed']);
check(ended.request_counts.failed === 1, 'one line failed');
const retry = await client.post(`/batches/${b3.id}/retry`, { body: {} });
check(retry.retry_of === b3.id && retry.request_counts.total === 1, 'the retry batch has the failed line');
const retried = await waitStatus(retry.id, ['completed']);
check(retried.request_counts.completed === 1 && retried.request_counts.failed === 0, 'the retry finished it');
const rerun = JSON.parse((await (await client.files.content(retried.output_file_id)).text()).trim());
check(rerun.custom_id === 'bad1', 'the retried line keeps its custom_id');
check((await client.batches.retrieve(b3.id)).retried_by === retry.id, 'linked both ways');

const { secret } = await client.get('/webhook_secret');
const received = [];
const server = http.createServer((req, res) => {
  const chunks = [];
  req.on('data', (c) => chunks.push(c));
  req.on('end', () => { received.push({ body: Buffer.concat(chunks).toString(), headers: req.headers });
                        res.writeHead(200).end(); });
});
await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
const hook = { webhook_url: `http://127.0.0.1:${server.address().port}/hook` };
const batchOf = async (fileLines, extra = {}) => client.batches.create(
  { input_file_id: (await upload(fileLines)).id, endpoint: '/v1/responses', completion_window: '24h',
    ...hook, ...extra });
const made = {
  completed: await batchOf([line('w')]),
  failed: await batchOf(['not json']),
  cancelled: await batchOf([line('w')], { metadata: { hold: '1' } }),
  expired: await batchOf([line('w')], { metadata: { hold: '1', expire: '1' } }),
};
await waitStatus(made.cancelled.id, ['in_progress']);
await client.batches.cancel(made.cancelled.id);
for (const [status, batch] of Object.entries(made)) await waitStatus(batch.id, [status]);
const deadline = Date.now() + 20000;
while (received.length < 4) { check(Date.now() < deadline, 'four webhook deliveries'); await sleep(100); }
await sleep(2500); // a duplicate delivery would have come by now
server.close();
const events = await Promise.all(received.map((r) => client.webhooks.unwrap(r.body, r.headers, secret)));
const got = events.map((e) => `${e.type} ${e.data.id}`).sort();
const want = Object.entries(made).map(([status, b]) => `batch.${status} ${b.id}`).sort();
check(JSON.stringify(got) === JSON.stringify(want), `one verified event per batch: ${got}`);
let forged = false;
try { await client.webhooks.unwrap(received[0].body.replace('batch', 'Batch'), received[0].headers, secret); }
catch { forged = true; }
check(forged, 'a tampered event is refused');
console.log(JSON.stringify({ ok: true, events: got.length, stream_events: types.length }));
