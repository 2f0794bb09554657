// The TypeScript client against a real `yieldloop up --tls` (auth on), with node's own test runner: `npm test`
// starts one (YIELDLOOP names the command when it is not on PATH), or attaches to YIELDLOOP_DATA_DIR's.
import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { existsSync, mkdtempSync, readdirSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import {
  Client,
  DeadlineExceededError,
  InvalidArgumentError,
  NotFoundError,
  PermissionDeniedError,
  UnauthenticatedError,
  type common,
} from "../src/index.js";

let stack: ChildProcess | undefined;
let dataDir: string;
let client: Client;
let output = "";

async function waitFor(ready: () => boolean, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!ready()) {
    if (stack && stack.exitCode !== null) throw new Error(`yieldloop up exited: ${output}`);
    if (Date.now() > deadline) throw new Error(`the stack did not start in time: ${output}`);
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
}

before(async () => {
  if (process.env.YIELDLOOP_DATA_DIR) {
    dataDir = process.env.YIELDLOOP_DATA_DIR; // a running stack (the Python tests' own, in tests/test_polyglot.py)
  } else {
    dataDir = mkdtempSync(join(tmpdir(), "yieldloop-ts-"));
    stack = spawn(process.env.YIELDLOOP ?? "yieldloop", ["up", "--data-dir", dataDir, "--tls", "--no-hud"], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    stack.stdout?.on("data", (chunk) => (output += chunk));
    stack.stderr?.on("data", (chunk) => (output += chunk));
    const run = join(dataDir, "run");
    await waitFor(() => existsSync(run) && readdirSync(run).filter((name) => name.endsWith(".json")).length >= 4, 300_000);
  }
  client = Client.fromDataDir(dataDir, { timeoutMs: 120_000 });
});

after(async () => {
  client.close();
  if (stack && stack.exitCode === null) {
    stack.kill("SIGINT");
    await once(stack, "exit");
  }
});

test("lists models and forks one", async () => {
  const models = await client.checkpoint.listModels({});
  assert.ok(models.models.some((model) => model.slug === "tiny"));
  const forked = await client.checkpoint.forkModel({ source: "tiny", name: "ts-fork" });
  assert.equal(forked.model?.slug, "ts-fork");
  assert.equal((await client.checkpoint.getModel({ model: "ts-fork" })).model?.parent, "tiny");
});

test("Generate streams token ids, logprobs and the weight version", async () => {
  const tokens: number[] = [];
  const logprobs: number[] = [];
  const versions = new Set<string>();
  for await (const response of client.rollout.generate({
    model: "tiny",
    prompt: { case: "promptTokenIds", value: { tokenIds: [1, 40, 41] } },
    sampling: { maxTokens: 8, temperature: 1, ignoreEos: true, seed: 3n },
  })) {
    tokens.push(...response.tokenIds);
    logprobs.push(...response.logprobs);
    versions.add(response.weightVersion);
  }
  assert.equal(tokens.length, 8);
  assert.equal(logprobs.length, 8);
  assert.ok(logprobs.every((lp) => lp <= 0 && Number.isFinite(lp)));
  assert.deepEqual([...versions], ["base"]);
});

test("a whole episode over the bidirectional StreamEpisode", async () => {
  const episode = client.episode({ env: "letters", scenario: "repeat", argsJson: JSON.stringify({ letter: "a" }) });
  try {
    const started = await episode.start();
    assert.ok(started.episodeId);
    assert.match(started.prompt + started.messages.map((m) => m.content).join(" "), /a/);
    const unknown = await episode.callTool("no-such-tool", {});
    assert.ok(unknown.isError);
    const graded = await episode.submit("aaaaaaaaaa");
    assert.equal(graded.reward, 1);
  } finally {
    episode.close();
  }
});

test("StreamRollouts, then ForwardBackward and OptimStep move the head, which WatchHead sees", async () => {
  const runs: common.Run[] = [];
  for await (const response of client.rollout.streamRollouts({
    model: "ts-fork",
    tasks: [{ env: "letters", scenario: "repeat", argsJson: JSON.stringify({ letter: "b" }) }],
    groupSize: 2,
    sampling: { maxTokens: 8, temperature: 1 },
  })) {
    if (response.run) runs.push(response.run);
  }
  assert.equal(runs.length, 2);
  assert.ok(runs.every((run) => run.traceId && run.turns.length > 0 && run.turns[0].completionTokenIds.length > 0));

  const head = await client.checkpoint.getHead({ model: "ts-fork" });
  const watcher = new AbortController();
  const watched = (async () => {
    for await (const response of client.checkpoint.watchHead(
      { model: "ts-fork", afterSequence: head.head!.sequence },
      { signal: watcher.signal },
    )) {
      return response.head;
    }
  })();

  async function* requests() {
    yield { item: { case: "config" as const, value: { lossFn: "importance_sampling", groupSize: 2, model: "ts-fork" } } };
    for (const run of runs) yield { item: { case: "run" as const, value: run } };
  }
  const result = await client.trainer.forwardBackward(requests());
  assert.equal(result.numDatums, 2n);
  const step = await client.trainer.optimStep({
    adam: { learningRate: 1e-3 },
    setHead: true,
    model: "ts-fork",
    idempotencyKey: `ts-${Date.now()}`,
  });
  assert.match(step.checkpoint!.checkpointId, /^step-000001-/);
  const moved = await watched;
  watcher.abort();
  assert.equal(moved?.checkpointId, step.checkpoint!.checkpointId);
  assert.equal(moved?.sequence, head.head!.sequence + 1n);
});

test("errors are typed, with the reason and field of ErrorInfo", async () => {
  await assert.rejects(client.checkpoint.getModel({ model: "no-such-model" }), (err: unknown) => {
    assert.ok(err instanceof NotFoundError);
    assert.equal(err.code, "NOT_FOUND");
    assert.equal(err.reason, "MODEL_NOT_FOUND");
    return true;
  });
  async function* badLoss() {
    yield { item: { case: "config" as const, value: { lossFn: "no-such-loss", model: "ts-fork" } } };
  }
  await assert.rejects(client.trainer.forwardBackward(badLoss()), (err: unknown) => {
    assert.ok(err instanceof InvalidArgumentError);
    assert.equal(err.reason, "LOSS_UNKNOWN");
    return true;
  });
  const stream = client.rollout.generate({
    model: "tiny",
    prompt: { case: "promptTokenIds", value: { tokenIds: [1] } },
    sampling: { maxTokens: 0 },
  });
  await assert.rejects(
    (async () => {
      for await (const _ of stream) void _;
    })(),
    (err: unknown) => err instanceof InvalidArgumentError && err.field.includes("max_tokens"),
  );
});

test("a call past its deadline is DEADLINE_EXCEEDED", async () => {
  const hasty = Client.fromDataDir(dataDir, { timeoutMs: 300 });
  after(() => hasty.close());
  const heads = hasty.checkpoint.watchHead({ model: "tiny", afterSequence: 1_000_000n }); // never comes
  await assert.rejects(
    (async () => {
      for await (const _ of heads) void _;
    })(),
    (err: unknown) => err instanceof DeadlineExceededError && err.reason === "DEADLINE_EXCEEDED",
  );
});

test("auth: no key, a bad key and another team's model are refused", async () => {
  const ca = readFileSync(join(dataDir, "tls", "ca.pem"));
  const addresses = { checkpoint: Client.fromDataDir(dataDir).options.checkpoint, tlsCa: ca };
  const anonymous = new Client(addresses);
  after(() => anonymous.close());
  await assert.rejects(anonymous.checkpoint.listModels({}), (err: unknown) => {
    assert.ok(err instanceof UnauthenticatedError);
    assert.equal(err.reason, "API_KEY_MISSING");
    return true;
  });
  const forged = new Client({ ...addresses, apiKey: "yl_000000000000_forged" });
  after(() => forged.close());
  await assert.rejects(forged.checkpoint.listModels({}), (err: unknown) => err instanceof UnauthenticatedError && err.reason === "API_KEY_INVALID");
  const made = await client.checkpoint.createApiKey({ team: "ts-team", role: "train" });
  const team = new Client({ ...addresses, apiKey: made.apiKey });
  after(() => team.close());
  await assert.rejects(team.checkpoint.setHead({ model: "ts-fork", checkpointId: "base" }), (err: unknown) => {
    assert.ok(err instanceof PermissionDeniedError);
    assert.equal(err.reason, "MODEL_NOT_OWNED");
    return true;
  });
});
