"""Command line: ``hylo generate``, ``hylo serve``, ``hylo bench`` (and ``python -m hylo ...``)."""

from __future__ import annotations

import argparse
import sys
import time

from .bench.shapes import ALIASES, BENCH_MODELS, canonical_name
from .config import EngineConfig

SHUTDOWN_GRACE_S = 10  # seconds a stopping server gives its running responses


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="checkpoint directory of a supported family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Nemotron-H, "
                        "Granite-4.0-H, Falcon-H1) or a Hugging Face Hub id (default: the embedded default model)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto", help="auto (CPU float32, CUDA bfloat16), float32, bfloat16, float16")
    d = EngineConfig()
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="concurrent requests (default %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit per request (default: the model's, or what the KV pool holds)")
    g.add_argument("--chunk-size", type=int, default=d.chunk_size, help="prefill tokens per step (default %(default)s)")
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens (default: from the memory budget)")
    g.add_argument("--memory-budget-gb", type=float, default=None, help="cache memory budget in GiB (default: CPU 2, CUDA 90%% of free memory less 2)")
    g.add_argument("--state-dtype", default=d.state_dtype,
                   help="recurrent state dtype of the linear-attention layers (default float32)")
    g.add_argument("--speculative", choices=["mtp", "ngram"], default=None,
                   help="speculative decoding: the checkpoint's MTP head, or n-gram prompt lookup")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"drafts per verify step (default {d.num_speculative_tokens})")
    g.add_argument("--spec-policy", choices=["adaptive", "fixed"], default=None,
                   help="adaptive (default): verify drafts only while the requests accept enough of them to beat plain "
                   "decoding, else decode plainly and probe now and then; fixed: verify k drafts at every step")
    g.add_argument("--spec-commit", choices=["replay", "checkpoints"], default=None,
                   help="how a verify's accepted GDN state reaches the slot: replay the kept step inputs (default; "
                   "less state traffic and memory) or copy the per-step state checkpoint")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model across N processes (one GPU each on CUDA; default %(default)s)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="read each step's results before launching the next (default: overlap them)")
    g.add_argument("--simulate-accept-length", type=float, default=None,
                   help="benchmarks only: force this mean accept length (breaks losslessness)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV and linear-attention state of earlier requests' tokens (default: reuse)")
    g.add_argument("--prefix-state-interval", type=int, default=None,
                   help="keep a state snapshot every N prefill tokens of a long prompt (default: --chunk-size)")
    g.add_argument("--prefix-snapshots", type=int, default=None,
                   help="state slots the prefix cache may hold (default: up to 2 per request slot, within a "
                        "quarter of the cache budget)")


def _engine_options(args) -> dict:
    # the speculation flags default to None: EngineConfig's defaults apply, and one given alone can be refused
    spec = {name: getattr(args, name) for name in ("num_speculative_tokens", "spec_policy", "spec_commit")
            if getattr(args, name) is not None}
    if spec and args.speculative is None:
        flag = "--" + next(iter(spec)).replace("_", "-")
        raise ValueError(f"{flag} tunes speculative decoding: give --speculative mtp or ngram too")
    if not args.enable_prefix_caching:
        tuned = [f for f in ("prefix_state_interval", "prefix_snapshots") if getattr(args, f) is not None]
        if tuned:
            raise ValueError(f"--{tuned[0].replace('_', '-')} tunes the prefix cache, which --no-prefix-caching "
                             f"turns off: give one of them")
    return dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, chunk_size=args.chunk_size,
                kv_cache_tokens=args.kv_cache_tokens, memory_budget_gb=args.memory_budget_gb,
                state_dtype=args.state_dtype, speculative=args.speculative,
                simulate_accept_length=args.simulate_accept_length, overlap=args.overlap,
                tensor_parallel_size=args.tensor_parallel_size, enable_prefix_caching=args.enable_prefix_caching,
                prefix_state_interval=args.prefix_state_interval, prefix_snapshots=args.prefix_snapshots, **spec)


def _constraint(args):
    """The output constraint the generate options ask for (``hylo.constrain``), or None."""
    from .constrain.spec import Constraint

    def text(value: str, option: str) -> str:
        if value.startswith("@"):
            try:
                with open(value[1:], encoding="utf-8") as f:
                    return f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"{option} {value}: cannot read {value[1:]!r} as UTF-8 text "
                                 f"({getattr(e, 'strerror', None) or e})") from None
        return value

    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.json_schema is not None:
        return Constraint.json_schema(text(args.json_schema, "--json-schema"))
    if args.json:
        return Constraint.json_object()
    if args.choice:
        return Constraint.choice(args.choice)
    if args.grammar is not None:
        return Constraint.grammar(text(args.grammar, "--grammar"))
    return None


def _generate(args) -> int:
    from .api import LLM
    from .sampling_params import SamplingParams

    given = [x for x in (args.text, args.prompt, args.prompt_file) if x is not None]
    if len(given) > 1:
        print("error: give the prompt once: as text, --prompt TEXT or --prompt-file F", file=sys.stderr)
        return 2
    if args.prompt_file is not None:
        try:
            if args.prompt_file == "-":  # standard input
                prompt = sys.stdin.read()
            else:
                with open(args.prompt_file, encoding="utf-8") as f:
                    prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            print(f"error: --prompt-file {args.prompt_file!r}: {e}", file=sys.stderr)
            return 2
    else:
        prompt = args.prompt if args.prompt is not None else args.text
    if prompt is None:
        print("error: give a prompt (hylo generate \"text\", --prompt TEXT or --prompt-file F)", file=sys.stderr)
        return 2
    try:
        constraint = _constraint(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
                            constraint=constraint)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, **_engine_options(args))
    t0 = time.perf_counter()
    shown = 0  # characters of the completion printed: it is printed as it comes (LLM.stream)
    echo = sys.stdout.isatty()  # on a terminal the prompt comes first, for reading; piped, the completion alone
    for out in llm.stream(prompt, params):
        if out.text is not None:
            if not shown and out.text and echo:
                print(prompt, end="")
            print(out.text[shown:], end="", flush=True)
            shown = max(shown, len(out.text))
    dt = time.perf_counter() - t0
    if out.text is not None:
        print(prompt if not shown and echo else "")
    else:
        print(out.token_ids)
    n = len(out.token_ids)
    print(f"[hylo] {_count(n, 'token')} in {dt:.2f}s ({n / dt:.1f} tokens/s), prompt "
          f"{_count(len(out.prompt_token_ids), 'token')}, finish reason: {out.finish_reason}", file=sys.stderr)
    if out.spec is not None:
        s = out.spec
        mean = (f"mean accept length {s.mean_accept_length:.2f} tokens per step" if s.verify_steps
                else "no verify step ran")
        print(f"[hylo] speculative ({args.speculative}, k={llm.engine.ec.num_speculative_tokens}): "
              f"{_count(s.verify_steps, 'verify step')}, {s.plain_steps} plain, {s.accepted_tokens}/{s.draft_tokens} "
              f"drafts accepted, {mean}", file=sys.stderr)
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _bench(args) -> int:
    args.model_name = canonical_name(args.model_name)
    if args.tensor_parallel_size > 1:
        from .bench.tp import run_tp_bench

        run_tp_bench(args.model_name, args.tensor_parallel_size, out_dir=args.out, quick=args.quick)
        return 0
    if args.spec_policy:
        from .bench.spec_policy import run_spec_policy_bench

        run_spec_policy_bench(args.model_name, out_dir=args.out, quick=args.quick)
        return 0
    if args.structured:
        from .bench.structured import run_structured_bench

        run_structured_bench(args.model_name, out_dir=args.out, quick=args.quick)
        return 0
    if args.prefix_replay:
        from .bench.prefix import run_prefix_bench

        run_prefix_bench(args.model_name, out_dir=args.out, quick=args.quick, conversations=args.conversations,
                         turns=args.turns)
        return 0
    from .bench.run import run_bench

    run_bench(args.model_name, vs_hf=args.vs_hf, quick=args.quick, out_dir=args.out, pdl=args.pdl, short=args.short)
    return 0


def _serve(args) -> int:
    try:
        import uvicorn

        from .server.app import check_api_key, create_app
    except ImportError as e:
        print(f"error: the server needs fastapi and uvicorn ({e}); install hylo with its dependencies", file=sys.stderr)
        return 2
    from .launch import create_engine

    if args.max_body_bytes < 1:
        print(f"error: --max-body-bytes must be at least 1, got {args.max_body_bytes}", file=sys.stderr)
        return 2
    _check_port(args.host, args.port)  # before the model loads: a busy or bad port should not cost a load
    check_api_key(args.api_key)
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty: give the id clients will send, or leave it out")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"[hylo] warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    engine = create_engine(args.model, args.device, args.dtype, EngineConfig(**_engine_options(args)))
    app = create_app(engine, api_key=args.api_key, served_model_name=args.served_model_name,
                     max_body_bytes=args.max_body_bytes)
    host = f"[{args.host}]" if ":" in args.host else args.host  # (an IPv6 address in a URL)
    print(f"[hylo] serving {args.served_model_name or engine.model_name} on http://{host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    # Ctrl-C (or SIGTERM) lets running responses finish for SHUTDOWN_GRACE_S, then ends them: without a bound the
    # server went on generating every request, queued ones too, for minutes
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return 0


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _check_port(host: str, port: int) -> None:
    """Refuse a port out of range, or one another process listens on, with a ValueError naming it."""
    import socket

    if not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range (1-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"host {host!r} cannot be resolved: {e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"port {port} on {host} is in use or not available ({e.strerror})") from None


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="hylo", description="Inference engine for hybrid linear-attention models")
    parser.add_argument("--version", action="version", version=f"hylo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("text", nargs="?", default=None, help="the prompt (or use --prompt / --prompt-file)")
    g.add_argument("--prompt", default=None, help="the prompt, as an option instead of the positional TEXT")
    g.add_argument("--prompt-file", default=None, help="read the prompt from this file ('-': standard input)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches P (default %(default)s: "
                        "all)")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample from the K most likely tokens (default %(default)s: all)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling noise: the same seed gives the same output (default: drawn from "
                        "the engine's generator, itself seeded 0, so an unseeded run repeats too)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    c = g.add_mutually_exclusive_group()
    c.add_argument("--regex", default=None, help="constrain the output to full matches of this regular expression")
    c.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="constrain the output to JSON valid against this schema (JSON text, or @FILE)")
    c.add_argument("--json", action="store_true", help="constrain the output to a JSON object")
    c.add_argument("--choice", action="append", default=None, help="constrain the output to one of these strings "
                                                                   "(repeatable)")
    c.add_argument("--grammar", default=None, metavar="GRAMMAR",
                   help="constrain the output to a Lark or GBNF grammar (text, or @FILE; matched on the host)")
    _add_engine_args(g)
    g.set_defaults(func=_generate)
    b = sub.add_parser("bench", help="benchmark on the GPU (random-weight benchmark model, no checkpoint; on a CPU "
                                     "the tiny shapes only)")
    b.add_argument("--model-name", default="bench-6b", choices=BENCH_MODELS + tuple(ALIASES), metavar="NAME",
                   help="benchmark model (random weights at a real shape): bench-6b, qwen3.5-9b, qwen3.5-35b-a3b, "
                        "or qwen3-next-80b (also qwen3-next-80b-a3b; needs --tensor-parallel-size), each also with "
                        "-fp8 (block-FP8 projections kept FP8: qwen3-next-80b-fp8 fits one H200); the Mamba2 shapes "
                        "nemotron-h-8b and nemotron-3-nano-30b-a3b; on a CPU the tiny shapes tiny, tiny-dense, "
                        "tiny-mamba2 (tiny and tiny-dense also with -fp8); default %(default)s")
    b.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="also time decode sharded across this many GPUs (and the collectives' share)")
    b.add_argument("--vs-hf", action="store_true", help="also time HF transformers generate on the same weights")
    b.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    b.add_argument("--short", action="store_true",
                   help="the core records only: prefill 8192, decode at batch 1 / 8 / 64 (and from 32k at 1 and 8), "
                        "MTP k=3 at accept 3.0 (what a large model's one-GPU run fits)")
    b.add_argument("--prefix-replay", action="store_true",
                   help="instead: multi-turn conversations sharing a system prompt, replayed with the prefix cache on "
                        "and off (hit rate against the ideal, first-token times, decode step on against off)")
    b.add_argument("--structured", action="store_true",
                   help="instead: constrained decoding's cost: a JSON schema's compile time, then per token the same "
                        "batch free and with half its requests under the schema, greedy and sampled, batch 8 / 64")
    b.add_argument("--spec-policy", action="store_true",
                   help="instead: per generated token, plain decoding against fixed-k and adaptive speculation (MTP "
                        "and n-gram) at simulated accept lengths 1.0-4.0 and in a mixed batch, batch 1 / 8 / 64")
    b.add_argument("--conversations", type=_at_least_one, default=None,
                   help="--prefix-replay: conversations replayed at once (default 32; 6 with --quick)")
    b.add_argument("--turns", type=_at_least_one, default=None,
                   help="--prefix-replay: turns per conversation (default 5)")
    b.add_argument("--pdl", action="store_true",
                   help="also time decode with programmatic dependent launch off, and on with its L2 weight prefetch "
                        "(HYLO_PDL, HYLO_PDL_PREFETCH; PDL is on by default on Hopper+) in the same run")
    b.add_argument("--out", default="bench/results", help="folder for the JSON results")
    b.set_defaults(func=_bench)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--served-model-name", default=None, help="model id clients use (default: the directory name)")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (default 4 MiB)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the HTTP server's log level (default %(default)s)")
    _add_engine_args(s)
    s.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # (FileNotFoundError among them)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[hylo] interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
