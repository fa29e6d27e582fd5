"""`tandem ...` command line."""

from __future__ import annotations

import argparse
import sys

from tandem.worker_setup import DEFAULT_MODEL


def _generate(args) -> int:
    from tandem import LLM, SamplingParams

    k = args.num_speculative_tokens
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              speculative_config=spec)
    if args.prompt_token_ids:
        prompt = {"prompt_token_ids": [int(t) for t in args.prompt_token_ids.split(",")]}
    else:
        prompt = args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    out = llm.generate([prompt], params)[0].outputs[0]
    print("token ids:", out.token_ids)
    if out.text is not None:
        print("text:", out.text)
    print("finish reason:", out.finish_reason)
    st = llm.engine.spec_stats
    if st.num_drafts:
        print(f"speculation: k={st.k} acceptance rate {st.acceptance_rate:.2f}, acceptance length "
              f"{st.acceptance_length:.2f}, accepted per position {st.accepted_per_position}")
    return 0


CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _request(args) -> int:
    from tandem import SamplingParams
    from tandem.client import TandemClient
    from tandem.rpc.convert import finish_reason_name

    prompt = [int(t) for t in args.prompt_token_ids.split(",")] if args.prompt_token_ids else args.prompt
    if prompt is None:
        raise ValueError("give --prompt or --prompt-token-ids")
    if args.chat:
        if not isinstance(prompt, str):
            raise ValueError("--chat needs a text --prompt")
        prompt = CHATML.format(prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    with TandemClient(args.address) as client:
        try:
            client.wait_ready(args.wait)
        except TimeoutError:
            raise UserError(f"nothing ready at {args.address} within {args.wait:g} s: is `tandem serve` running "
                            "there? (--wait waits longer for a server that is starting)") from None
        ids, text, reason = [], "", 0
        for m in client.generate(prompt, params, timeout=args.timeout):
            ids += m.token_ids
            text += m.text
            reason = m.finish_reason
    if args.show_token_ids:
        print("token ids:", ids)
    print(text if text else "(no text)")
    print(f"[{len(ids)} tokens, finish reason: {finish_reason_name(reason)}]")
    return 0


def _component(module: str):
    def run(args):
        import importlib
        import logging
        import os

        rc = importlib.import_module(module).main(args)
        # a server that returns has drained and stopped what it started; the interpreter's own teardown (gRPC's
        # and torch's threads and finalisers) took ~2 s more on every stop, which supervisors and Ctrl-C wait for
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return run


class UserError(Exception):
    """A mistake the user can fix: printed as one line, exit status 2."""


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (argparse adds it only where a flag has help text)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not any(action.default is v for v in (None, argparse.SUPPRESS, False)) and action.option_strings \
                and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    import importlib

    from tandem import __version__

    ap = argparse.ArgumentParser(prog="tandem", description="Serving for Qwen3.5-class hybrid models.")
    ap.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add_parser(name, **kw):
        return sub.add_parser(name, formatter_class=_Help, **kw)

    for name, module, doc in (("serve", "tandem.launch", "router + prefill + decode workers on this machine "
                                                            "(--prefill-workers 0: colocated)"),
                              ("router", "router.main", "the public gRPC endpoint"),
                              ("prefill-worker", "prefill_worker.main", "one prefill worker"),
                              ("decode-worker", "decode_worker.main", "one decode worker")):
        p = add_parser(name, help=doc, description=doc)
        mod = importlib.import_module(module)
        mod.add_args(p)
        p.set_defaults(fn=mod.serve if name == "serve" else _component(module))
    bench = add_parser("bench", help="benchmarks against a running server").add_subparsers(dest="bench",
                                                                                              required=True)
    from tandem.bench import serve as bench_serve

    b = bench.add_parser("serve", help="serving benchmark (vLLM bench serve's report)", formatter_class=_Help)
    bench_serve.add_args(b)
    b.set_defaults(fn=bench_serve.main)
    r = add_parser("request", help="send one request to a router and print the result")
    r.add_argument("--address", default="127.0.0.1:50051", help="the router's gRPC host:port")
    r.add_argument("--prompt", default=None, help="text prompt")
    r.add_argument("--chat", action="store_true", help="send --prompt as one user turn in ChatML (Qwen's format)")
    r.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids")
    r.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most")
    r.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    r.add_argument("--seed", type=int, default=None, help="sampling seed")
    r.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    r.add_argument("--show-token-ids", action="store_true", help="print the generated token ids too")
    r.add_argument("--wait", type=float, default=5.0, help="seconds to wait for the server to be ready")
    r.add_argument("--timeout", type=float, default=120.0, help="request deadline in seconds")
    r.set_defaults(fn=_request)
    g = add_parser("generate", help="offline generation with the colocated engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or preset name")
    g.add_argument("--prompt", default=None, help="text prompt (needs a tokenizer in the model directory)")
    g.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    g.add_argument("--dtype", default="float32", help="weights' dtype")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: a GPU if there is one)")
    g.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + output in tokens")
    g.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP drafts per step (0: off)")
    g.set_defaults(fn=_generate)
    return ap


def main(argv=None) -> int:
    import grpc

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:  # the server refused the request: its status says why
        print(f"error: the server answered {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
