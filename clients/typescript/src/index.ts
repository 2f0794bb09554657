/**
 * yieldloop's TypeScript client: the four services' generated stubs (protos/, `./generate.sh`) over real gRPC
 * (HTTP/2, @connectrpc/connect-node's gRPC transport), with the same thin layer as the Python client:
 *
 * - typed errors: every failed call throws a {@link YieldloopError} subclass named after its gRPC code, carrying
 *   the `google.rpc.ErrorInfo` reason (`MODEL_NOT_FOUND`, `API_KEY_MISSING`, ...) and the offending field;
 * - an API key sent with every call (`authorization: Bearer`), and TLS with the stack's CA;
 * - streams as async iterators, and an {@link Episode} for EnvService's bidirectional StreamEpisode;
 * - {@link Client.fromDataDir} finds a running `yieldloop up` (its ready files, its key, its CA).
 */

import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";

import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Client as Stub, type Interceptor } from "@connectrpc/connect";
import { Http2SessionManager, createGrpcTransport } from "@connectrpc/connect-node";

import { BadRequestSchema, ErrorInfoSchema } from "../gen/google/rpc/error_details_pb.js";
import { CheckpointService } from "../gen/yieldloop/checkpoint/v1/checkpoint_service_pb.js";
import { TaskSchema } from "../gen/yieldloop/common/v1/common_pb.js";
import {
  EnvService,
  type EpisodeGraded,
  type EpisodeStarted,
  type StreamEpisodeRequest,
  StreamEpisodeRequestSchema,
  type StreamEpisodeResponse,
  type ToolResult,
} from "../gen/yieldloop/env/v1/env_service_pb.js";
import { RolloutService } from "../gen/yieldloop/rollout/v1/rollout_service_pb.js";
import { TrainerService } from "../gen/yieldloop/trainer/v1/trainer_service_pb.js";

export * as checkpoint from "../gen/yieldloop/checkpoint/v1/checkpoint_service_pb.js";
export * as common from "../gen/yieldloop/common/v1/common_pb.js";
export * as env from "../gen/yieldloop/env/v1/env_service_pb.js";
export * as rollout from "../gen/yieldloop/rollout/v1/rollout_service_pb.js";
export * as trainer from "../gen/yieldloop/trainer/v1/trainer_service_pb.js";
export { create } from "@bufbuild/protobuf";

/** A failed call: its gRPC code name, the ErrorInfo reason, the field it blames, the server's message. */
export class YieldloopError extends Error {
  constructor(
    message: string,
    readonly code: string,
    readonly reason: string,
    readonly field: string = "",
  ) {
    super(message);
    this.name = new.target.name;
  }
}
export class InvalidArgumentError extends YieldloopError {}
export class NotFoundError extends YieldloopError {}
export class AlreadyExistsError extends YieldloopError {}
export class PermissionDeniedError extends YieldloopError {}
export class UnauthenticatedError extends YieldloopError {}
export class FailedPreconditionError extends YieldloopError {}
export class AbortedError extends YieldloopError {}
export class ResourceExhaustedError extends YieldloopError {}
export class UnavailableError extends YieldloopError {}
export class DeadlineExceededError extends YieldloopError {}
export class CancelledError extends YieldloopError {}
export class DataLossError extends YieldloopError {}
export class InternalError extends YieldloopError {}

const ERRORS: Partial<Record<Code, [string, typeof YieldloopError]>> = {
  [Code.InvalidArgument]: ["INVALID_ARGUMENT", InvalidArgumentError],
  [Code.NotFound]: ["NOT_FOUND", NotFoundError],
  [Code.AlreadyExists]: ["ALREADY_EXISTS", AlreadyExistsError],
  [Code.PermissionDenied]: ["PERMISSION_DENIED", PermissionDeniedError],
  [Code.Unauthenticated]: ["UNAUTHENTICATED", UnauthenticatedError],
  [Code.FailedPrecondition]: ["FAILED_PRECONDITION", FailedPreconditionError],
  [Code.Aborted]: ["ABORTED", AbortedError],
  [Code.ResourceExhausted]: ["RESOURCE_EXHAUSTED", ResourceExhaustedError],
  [Code.Unavailable]: ["UNAVAILABLE", UnavailableError],
  [Code.DeadlineExceeded]: ["DEADLINE_EXCEEDED", DeadlineExceededError],
  [Code.Canceled]: ["CANCELLED", CancelledError],
  [Code.DataLoss]: ["DATA_LOSS", DataLossError],
};

/** The typed error for anything a call threw (a ConnectError's details read for reason and field). */
export function toYieldloopError(err: unknown): unknown {
  if (err instanceof YieldloopError || !(err instanceof ConnectError)) return err;
  const [codeName, Kind] = ERRORS[err.code] ?? ["INTERNAL", InternalError];
  let reason = codeName;
  let field = "";
  for (const info of err.findDetails(ErrorInfoSchema)) {
    reason = info.reason || reason;
    field = info.metadata.field ?? field;
  }
  for (const bad of err.findDetails(BadRequestSchema)) {
    field = field || (bad.fieldViolations[0]?.field ?? "");
  }
  return new Kind(err.rawMessage, codeName, reason, field);
}

/** The typed error for a call's failure; the call's own deadline passing is DEADLINE_EXCEEDED, not a cancel. */
function callError(err: unknown, deadline?: AbortSignal): unknown {
  if (deadline?.aborted && err instanceof ConnectError && err.code === Code.Canceled) {
    return new DeadlineExceededError("the call did not finish before its deadline", "DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED");
  }
  return toYieldloopError(err);
}

async function* typedErrors<T>(messages: AsyncIterable<T>, deadline?: AbortSignal): AsyncIterable<T> {
  try {
    yield* messages;
  } catch (err) {
    throw callError(err, deadline);
  }
}

/**
 * The stub with every failure of its calls (a unary call's promise, a stream's iteration) a
 * {@link YieldloopError}, and with a deadline of `timeoutMs` on every call that names none: the server hears it
 * (`grpc-timeout`) and the call is aborted here when it passes (connect's own deadline timers can outlive the
 * call and hold the process open).
 */
function typedStub<S extends object>(stub: S, timeoutMs?: number): S {
  return new Proxy(stub, {
    get(target, name, receiver) {
      const method = Reflect.get(target, name, receiver);
      if (typeof method !== "function") return method;
      return (request: unknown, options: { signal?: AbortSignal; timeoutMs?: number } = {}) => {
        let deadline: AbortSignal | undefined;
        if (timeoutMs && options.timeoutMs === undefined) {
          deadline = AbortSignal.timeout(timeoutMs);
          options = { ...options, signal: options.signal ? AbortSignal.any([options.signal, deadline]) : deadline };
        }
        const result = method.call(target, request, options);
        if (result instanceof Promise) return result.catch((err: unknown) => Promise.reject(callError(err, deadline)));
        if (result && typeof result[Symbol.asyncIterator] === "function") return typedErrors(result, deadline);
        return result;
      };
    },
  });
}

function apiKeyInterceptor(apiKey: string): Interceptor {
  return (next) => async (request) => {
    request.header.set("authorization", `Bearer ${apiKey}`);
    return next(request);
  };
}

function deadlineInterceptor(timeoutMs: number): Interceptor {
  return (next) => async (request) => {
    if (!request.header.has("grpc-timeout")) request.header.set("grpc-timeout", `${Math.ceil(timeoutMs)}m`);
    return next(request);
  };
}

export interface ClientOptions {
  /** `host:port` of each service (a service left out throws when used). */
  env?: string;
  rollout?: string;
  trainer?: string;
  checkpoint?: string;
  /** Sent with every call as `authorization: Bearer <key>` (`yieldloop keys create` makes one). */
  apiKey?: string;
  /** TLS: the CA that signed the services' certificates (PEM). Without it the channels are plaintext. */
  tlsCa?: string | Buffer;
  /** Deadline of every call, in milliseconds (none by default). */
  timeoutMs?: number;
}

/** A pushable async iterable: the request side of a bidirectional stream written one message at a time. */
class Outbox<T> implements AsyncIterable<T> {
  private queue: T[] = [];
  private waiting?: (result: IteratorResult<T>) => void;
  private closed = false;

  push(message: T): void {
    if (this.waiting) {
      const resolve = this.waiting;
      this.waiting = undefined;
      resolve({ value: message, done: false });
    } else this.queue.push(message);
  }

  close(): void {
    this.closed = true;
    this.waiting?.({ value: undefined, done: true });
    this.waiting = undefined;
  }

  [Symbol.asyncIterator](): AsyncIterator<T> {
    const finish = (): Promise<IteratorResult<T>> => {
      this.close();
      return Promise.resolve({ value: undefined, done: true });
    };
    return {
      next: () => {
        const message = this.queue.shift();
        if (message !== undefined) return Promise.resolve({ value: message, done: false });
        if (this.closed) return Promise.resolve({ value: undefined, done: true });
        return new Promise((resolve) => (this.waiting = resolve));
      },
      return: finish, // the call ended: nothing more is sent
      throw: finish,
    };
  }
}

type EpisodeAction = MessageInitShape<typeof StreamEpisodeRequestSchema>["action"];

/** One episode on EnvService (StreamEpisode): start, call tools, submit the answer; always close. */
export class Episode {
  private readonly outbox = new Outbox<StreamEpisodeRequest>();
  private readonly inbox: AsyncIterator<StreamEpisodeResponse>;
  private readonly abort = new AbortController();

  constructor(stub: Stub<typeof EnvService>, private readonly task: MessageInitShape<typeof TaskSchema>) {
    this.inbox = stub.streamEpisode(this.outbox, { signal: this.abort.signal })[Symbol.asyncIterator]();
  }

  private async exchange(action: EpisodeAction): Promise<StreamEpisodeResponse> {
    this.outbox.push(create(StreamEpisodeRequestSchema, { action }));
    const next = await this.inbox.next();
    if (next.done) throw new FailedPreconditionError("episode stream closed early", "FAILED_PRECONDITION", "EPISODE_PROTOCOL");
    return next.value;
  }

  async start(): Promise<EpisodeStarted> {
    const response = await this.exchange({ case: "start", value: { task: this.task } });
    if (response.event.case !== "started") throw new FailedPreconditionError("no EpisodeStarted", "FAILED_PRECONDITION", "EPISODE_PROTOCOL");
    return response.event.value;
  }

  async callTool(name: string, args: Record<string, unknown>, callId = ""): Promise<ToolResult> {
    const response = await this.exchange({
      case: "callTool",
      value: { callId, name, argumentsJson: JSON.stringify(args), errorsAsResults: true },
    });
    if (response.event.case !== "toolResult") throw new FailedPreconditionError("no ToolResult", "FAILED_PRECONDITION", "EPISODE_PROTOCOL");
    return response.event.value;
  }

  async submit(answer: string): Promise<EpisodeGraded> {
    const response = await this.exchange({
      case: "submit",
      value: { answer },
    });
    this.outbox.close(); // the server ends the stream once we half-close
    if (response.event.case !== "graded") throw new FailedPreconditionError("no EpisodeGraded", "FAILED_PRECONDITION", "EPISODE_PROTOCOL");
    return response.event.value;
  }

  /** Ends the episode (cancels the stream when it was not submitted). */
  close(): void {
    this.outbox.close();
    this.abort.abort();
  }
}

/** Clients of the four services, sharing the options (key, TLS, deadline). */
export class Client {
  readonly env: Stub<typeof EnvService>;
  readonly rollout: Stub<typeof RolloutService>;
  readonly trainer: Stub<typeof TrainerService>;
  readonly checkpoint: Stub<typeof CheckpointService>;
  private readonly sessions: Http2SessionManager[] = [];

  constructor(readonly options: ClientOptions) {
    const interceptors = [
      ...(options.apiKey ? [apiKeyInterceptor(options.apiKey)] : []),
      ...(options.timeoutMs ? [deadlineInterceptor(options.timeoutMs)] : []),
    ];
    const stub = <S extends Parameters<typeof createClient>[0]>(service: S, address?: string): Stub<S> => {
      if (!address) {
        return new Proxy({} as Stub<S>, {
          get: () => () => {
            throw new FailedPreconditionError(`no address given for ${service.typeName}`, "FAILED_PRECONDITION", "INVALID_FIELD");
          },
        });
      }
      const baseUrl = `${options.tlsCa ? "https" : "http"}://${address}`;
      const sessions = new Http2SessionManager(baseUrl, {}, options.tlsCa ? { ca: options.tlsCa } : {});
      this.sessions.push(sessions);
      const transport = createGrpcTransport({ baseUrl, interceptors, sessionManager: sessions });
      return typedStub(createClient(service, transport), options.timeoutMs);
    };
    this.env = stub(EnvService, options.env);
    this.rollout = stub(RolloutService, options.rollout);
    this.trainer = stub(TrainerService, options.trainer);
    this.checkpoint = stub(CheckpointService, options.checkpoint);
  }

  /** A client of the stack `yieldloop up --data-dir DIR` runs: its ready files, admin key and CA. */
  static fromDataDir(dataDir: string, options: Partial<ClientOptions> = {}): Client {
    const addresses: Record<string, string> = {};
    let tls = false;
    for (const name of readdirSync(join(dataDir, "run"))) {
      const service = name.replace(/\.json$/, "");
      if (!name.endsWith(".json") || !["env", "rollout", "trainer", "checkpoint"].includes(service)) continue;
      const ready = JSON.parse(readFileSync(join(dataDir, "run", name), "utf8"));
      addresses[service] = ready.address;
      tls ||= Boolean(ready.tls);
    }
    let apiKey: string | undefined;
    try {
      apiKey = readFileSync(join(dataDir, "api_key"), "utf8").trim();
    } catch {
      apiKey = undefined; // a stack without auth
    }
    const tlsCa = tls ? readFileSync(join(dataDir, "tls", "ca.pem")) : undefined;
    return new Client({ ...addresses, apiKey, tlsCa, ...options });
  }

  /** Closes the connections (calls in flight fail); a client is not usable after it. */
  close(): void {
    for (const sessions of this.sessions) sessions.abort();
  }

  /** An episode of `task` (`{env, scenario, argsJson}`); `await episode.start()` begins it. */
  episode(task: MessageInitShape<typeof TaskSchema>): Episode {
    return new Episode(this.env, task);
  }
}
