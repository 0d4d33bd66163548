"""The `tokenbus` command: submit, get, wait, cancel, info, models list|add|remove|default, adapters
list|add|remove, exporter, batch submit|status|wait|export|cancel, and bench (handed to the bench package, which
needs the worker extra: nothing here imports it)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from typing import Any

import redis
import structlog

from producer import adapters, batch_cli, exporter, models, vectors
from producer.batch_cli import print_json as _print_json
from producer.client import Client
from protocol.errors import TokenbusError
from protocol.keys import DEFAULT_NAMESPACE
from protocol.models import DEFAULT_REDIS_URL, GenerationParams, Job, JobStatus
from protocol.priority import PRIORITIES
from protocol.records import ModelInfo, QueueInfo
from protocol.redaction import redact_url, scrub, secrets_of

EXIT_ERROR = 1
EXIT_JOB_NOT_FINISHED = 3  # wait: the job ended failed or cancelled

EPILOG = """exit status: 0 ok; 1 error (printed on stderr); 2 bad arguments; 3 `wait` saw the job end failed
or cancelled. The Redis URL and namespace default to $TOKENBUS_REDIS_URL (or $TOKENBUS_URL) and $TOKENBUS_NAMESPACE."""


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, huge integers, deep nesting
        raise argparse.ArgumentTypeError(f"not valid JSON: {text[:80]!r}") from None


def _int_list(text: str) -> list[int]:
    value = _json_value(text) if text.lstrip().startswith("[") else [int(t) for t in text.split(",") if t]
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"expected a list of ints like 1,2,3 or [1,2,3], got {text!r}")
    return value


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    """One flag per generation field (--max-tokens ...), typed after the pydantic field."""
    g = p.add_argument_group("generation (SamplingParams fields; omitted = the default)")
    for name, field in GenerationParams.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = field.annotation
        if name == "stop":
            g.add_argument(flag, action="append", dest=name, metavar="TEXT", help="stop string (repeatable)")
        elif name == "stop_token_ids":
            g.add_argument(flag, type=_int_list, dest=name, metavar="IDS", help="1,2,3 or [1,2,3]")
        elif name == "response_format":
            g.add_argument(flag, type=_json_value, dest=name, metavar="JSON",
                           help='\'{"type": "json_object"}\' or \'{"type": "json_schema", "json_schema": '
                                '{"name": "x", "schema": {...}}}\'')
        elif name == "regex":
            g.add_argument(flag, dest=name, metavar="REGEX", help="the output must match it as a whole")
        elif name == "choice":
            g.add_argument(flag, action="append", dest=name, metavar="TEXT",
                           help="the output is one of these strings (repeatable)")
        elif kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, dest=name, default=None)
        elif "float" in str(kind):
            g.add_argument(flag, type=float, dest=name, metavar="X")
        else:
            g.add_argument(flag, type=int, dest=name, metavar="N")
    g.add_argument("--model", help="a declared model's name (tokenbus models list); none: the default model")
    g.add_argument("--metadata", type=_json_value, help='JSON object of strings, e.g. \'{"run": "a"}\'')


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenbus", description="Bulk LLM generation jobs over Redis streams.",
                                epilog=EPILOG)
    default_url = os.environ.get("TOKENBUS_REDIS_URL") or os.environ.get("TOKENBUS_URL", DEFAULT_REDIS_URL)
    p.add_argument("--url", default=default_url)
    p.add_argument("--namespace", default=os.environ.get("TOKENBUS_NAMESPACE", DEFAULT_NAMESPACE))
    p.add_argument("-v", "--verbose", action="store_true", help="log at info level (stderr)")
    sub = p.add_subparsers(dest="command", required=True)
    # listed for --help; main() hands `bench` off before parsing (its flags are the bench package's)
    sub.add_parser("bench", help="benchmarks that size a deployment: engine | e2e | queue (tokenbus[worker]); "
                   "`tokenbus bench --help`")

    s = sub.add_parser("submit", help="queue one job and print its id")
    s.add_argument("prompt", nargs="?", help="the prompt text")
    s.add_argument("--messages", type=_json_value,
                   help='JSON list, e.g. \'[{"role":"user","content":"hi"}]\'')
    s.add_argument("--prompt-token-ids", type=_int_list, metavar="IDS")
    s.add_argument("--request", type=_json_value, help="a whole JobRequest as JSON (flags override it)")
    s.add_argument("--job-id", help="your own id: submitting it again yields the same job")
    s.add_argument("--wait", action="store_true", help="then wait and print the job")
    s.add_argument("--timeout", type=float, help="seconds for --wait")
    s.add_argument("--priority", choices=[p.value for p in PRIORITIES],
                   help="which queue: workers read interactive first, then default (the default), then bulk")
    _add_generation_flags(s)

    em = sub.add_parser("embed", help="embed texts (one embedding job) and print OpenAI's embeddings response")
    em.add_argument("input", nargs="+", help="the texts, one vector each")
    em.add_argument("--model", help="a model that embeds (tokenbus models list shows kinds)")
    em.add_argument("--dimensions", type=int, help="keep the first N entries (Matryoshka), renormalized")
    em.add_argument("--truncate", action="store_true", help="cut inputs longer than the model's context")
    em.add_argument("--encoding-format", choices=["float", "base64"], default="float")
    em.add_argument("--float16", action="store_true", help="store the vectors in Redis as float16 (half the bytes)")
    em.add_argument("--timeout", type=float, help="seconds to wait")

    for name, helptext in (("get", "print a job record as JSON"), ("wait", "wait for a job to end"),
                           ("cancel", "cancel a job (queued: at once; running: its worker aborts it)")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("job_id")
        if name == "wait":
            c.add_argument("--timeout", type=float)

    i = sub.add_parser("info", help="queue depth, pending, workers, dead letters")
    i.add_argument("--json", action="store_true")

    m = sub.add_parser("models", help="the declared models: list, add, remove, default").add_subparsers(
        dest="models_command", required=True)
    ml = m.add_parser("list", help="every declared model: names, kind, jobs, live workers")
    ml.add_argument("--json", action="store_true")
    ma = m.add_parser("add", help="declare a model by hand (jobs naming it wait until a worker serves it)")
    ma.add_argument("name", help="its id")
    ma.add_argument("--alias", action="append", default=[], help="another name jobs may give (repeatable)")
    ma.add_argument("--kind", default="generate", choices=["generate", "embed"])
    ma.add_argument("--context-length", type=int)
    ma.add_argument("--default", action="store_true", help="also make it the namespace's default model")
    mr = m.add_parser("remove", help="retire a model (refused while jobs are queued or workers serve it)")
    mr.add_argument("name")
    mr.add_argument("--force", action="store_true", help="even with jobs queued or live workers")
    md = m.add_parser("default", help="make a declared model the default (the model of jobs naming none)")
    md.add_argument("name")
    adapters.add_parser(sub)
    e = sub.add_parser("exporter", help="serve the jobs waiting and pending per model as Prometheus metrics "
                       "(for an autoscaler: it runs while no worker does)")
    e.add_argument("--model", default="", help="the `model` label of the default queues' jobs while no model is "
                   "declared (then: the default model's id; every declared model has its own series)")
    e.add_argument("--port", type=int, default=exporter.DEFAULT_PORT)

    batch_cli.add_parser(sub)
    return p


def _submit(c: Client, a: argparse.Namespace) -> int:
    fields: dict[str, Any] = dict(a.request or {})
    names = ("prompt", "messages", "prompt_token_ids", "model", "metadata", "priority",
             *GenerationParams.model_fields)
    for name in names:
        value = getattr(a, name, None)
        if value is not None:
            fields[name] = value
    jid = c.submit(job_id=a.job_id, **fields)
    print(jid)
    if a.wait:
        return _show_ended(c.wait(jid, timeout=a.timeout))
    return 0


def _embed(c: Client, a: argparse.Namespace) -> int:
    params: dict[str, Any] = {k: v for k, v in (("model", a.model), ("dimensions", a.dimensions)) if v is not None}
    if a.truncate:
        params["truncate"] = True
    if a.float16:
        params["embedding_dtype"] = "float16"
    job = c.wait(c.submit_embedding(a.input if len(a.input) > 1 else a.input[0], **params), timeout=a.timeout)
    if job.status != JobStatus.finished:
        return _show_ended(job)
    blob = vectors.read_blobs(c.redis, c.keys, [job.id])[0]
    print(json.dumps(vectors.embeddings_response(job, blob, a.encoding_format)))
    return 0


def _show_ended(job: Job) -> int:
    _print_json(job)
    return 0 if job.status == JobStatus.finished else EXIT_JOB_NOT_FINISHED


def format_info(info: QueueInfo) -> str:
    lines = [
        f"namespace       {info.namespace}",
        f"queue depth     {info.queue_depth}  (waiting {info.waiting}, pending {info.pending}; "
        f"max {info.max_queue_len or 'unlimited'})",
        "by priority     " + "  ".join(f"{p} {n}" for p, n in info.by_priority.items())
        + f"  ({info.queues} non-empty queues)",
        f"consumers       {info.consumers}",
        f"dead letters    {info.dead_letters}",
        f"cancel requests {info.cancel_requested}",
        f"result ttl      {info.result_ttl} s",
        f"workers         {len(info.workers)} ({sum(w.alive for w in info.workers)} alive)",
    ]
    if info.models:
        lines.append(f"models          {len([m for m in info.models if m.id])}")
        lines += ["  " + format_model(m) for m in info.models]
    now = time.time()
    for w in info.workers:
        hb = w.heartbeat
        if hb is None:
            lines.append(f"  {w.name:<24} {'alive' if w.alive else 'gone':<6}")
            continue
        seen = f"{now - hb.last_seen:.1f}s ago" if hb.last_seen else "never"
        lines.append(f"  {w.name:<24} {'alive' if w.alive else 'gone':<6} model={hb.model} "
                     f"path={hb.model_path or '-'} backend={hb.backend or '-'} device={hb.device or '-'} "
                     f"last_seen={seen} "
                     f"running={hb.running} waiting={hb.waiting} free_blocks={hb.free_blocks} "
                     f"jobs_done={hb.jobs_done} prefix_hits={_hit_rate(hb)}")
    return "\n".join(lines)


def format_model(m: ModelInfo) -> str:
    """One model's line: depth, pending, workers, and a flag when jobs wait with no live worker."""
    name = m.id or "(default queues)"
    flags = (" default" if m.default else "") + (
        "  UNSERVED: jobs wait, no live worker serves it" if m.unserved else "")
    aliases = ",".join(n for n in m.names if n != m.id)
    return (f"{name:<24} depth={m.queue_depth} pending={m.pending} workers={m.workers} "
            + " ".join(f"{p}={n}" for p, n in m.by_priority.items())
            + (f" kind={'+'.join(m.kinds or [m.kind])}" if m.kind else "") + (f" parent={m.parent}" if m.parent else "")
            + (f" aliases={aliases}" if aliases else "") + flags)


def _models(c: Client, a: argparse.Namespace) -> int:
    cmd, r, k = a.models_command, c.redis, c.keys
    if cmd == "list":
        infos = [m for m in models.model_infos(r, k, models.live_heartbeats(r, k)) if m.id]
        if a.json:
            print(json.dumps([m.model_dump() for m in infos], indent=2))
        else:
            print("\n".join(format_model(m) for m in infos) or "no models declared")
    elif cmd == "add":
        record = models.add(r, k, a.name, a.alias, a.kind, a.context_length, a.default)
        print(record.to_json())
    elif cmd == "remove":
        print(models.remove(r, k, a.name, a.force).id)
    elif cmd == "default":
        print(models.set_default(r, k, a.name))
    return 0


def _hit_rate(hb: Any) -> str:
    """Prefix-cache hits as 'tokens% (blocks%)', or '-' before any lookup."""
    if not hb.prefix_queried_tokens:
        return "-"
    blocks = hb.prefix_hit_blocks / hb.prefix_queried_blocks if hb.prefix_queried_blocks else 0.0
    return f"{hb.prefix_hit_rate:.0%}_tokens/{blocks:.0%}_blocks"


def run(a: argparse.Namespace) -> int:
    try:
        client = Client(a.url, namespace=a.namespace)
    except ValueError as err:  # redis-py cannot parse the URL
        raise TokenbusError(f"bad Redis URL {redact_url(a.url)}: {scrub(str(err), a.url)} "
                            "(--url / $TOKENBUS_REDIS_URL)") from None
    with client as c:
        if a.command == "submit":
            return _submit(c, a)
        if a.command == "embed":
            return _embed(c, a)
        if a.command == "get":
            _print_json(c.get(a.job_id))
        elif a.command == "wait":
            return _show_ended(c.wait(a.job_id, timeout=a.timeout))
        elif a.command == "cancel":
            print(c.cancel(a.job_id))
        elif a.command == "info":
            info = c.info()
            print(info.model_dump_json(indent=2) if a.json else format_info(info))
        elif a.command == "exporter":
            return exporter.serve(c.redis, c.keys, a.model, a.port)
        elif a.command == "batch":
            return batch_cli.command(c, a)
        elif a.command == "models":
            return _models(c, a)
        elif a.command == "adapters":
            return adapters.command(c.redis, c.keys, a)
    return 0


def hand_off_bench(argv: list[str]) -> int:
    """`tokenbus bench ...` is `python -m bench ...` in this interpreter: the benchmarks import torch and the
    worker, which the client never loads. Replaces this process; returns only when the worker extra is missing."""
    missing = [m for m in ("torch", "transformers", "bench", "worker") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: tokenbus bench runs the engine and needs {', '.join(missing)}, which this Python lacks: "
              "pip install 'tokenbus[worker]'", file=sys.stderr)
        return EXIT_ERROR
    os.execv(sys.executable, [sys.executable, "-m", "bench", *argv])
    return EXIT_ERROR  # not reached: execv does not return


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return hand_off_bench(argv[1:])
    a = build_parser().parse_args(argv)
    structlog.configure(
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if a.verbose else logging.WARNING),
    )
    url = redact_url(a.url)  # a URL's password is never printed
    try:
        return run(a)
    except TokenbusError as err:
        print(f"error: {scrub(str(err), a.url)}", file=sys.stderr)
    except redis.AuthenticationError as err:  # a ConnectionError too: test it first
        given = "" if secrets_of(a.url) else " The URL gives no password."
        print(f"error: Redis at {url} refused the credentials ({scrub(str(err), a.url)}).{given} Check the user "
              "and password in --url / $TOKENBUS_REDIS_URL (redis://USER:PASSWORD@HOST:PORT/DB)", file=sys.stderr)
    except (redis.ConnectionError, redis.TimeoutError) as err:
        print(f"error: cannot reach Redis at {url}: {scrub(str(err), a.url)}. Is redis-server running and "
              "reachable at that host and port? (--url / $TOKENBUS_REDIS_URL)", file=sys.stderr)
    except redis.RedisError as err:
        print(f"error: Redis at {url} answered with an error: {scrub(str(err), a.url)}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
