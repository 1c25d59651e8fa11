"""The `dspark` command: serve, generate, bench, train-drafter, eval-drafter, average-drafters."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dspark.config import SERVE_DECODE_STALL_MS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None,
                   help="drafter folder (DSpark, DFlash or EAGLE-3 layout), 'ngram' or 'none' "
                        "(default: the shipped one)")
    p.add_argument("--draft-model", default=None,
                   help="a small model of the target's family (HF folder or .gguf, same tokenizer) that drafts "
                        "--block-size tokens autoregressively (default 4); instead of --drafter")
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per step (default: the drafter's)")
    p.add_argument("--draft-p-min", type=float, default=None,
                   help="--draft-model: a request's draft stops once the product of its tokens' draft "
                        "probabilities falls below this (default 0.1; 0: always the whole block)")
    p.add_argument("--tree", action="store_true", help="verify a draft tree instead of a chain")
    p.add_argument("--tree-budget", type=int, default=None, help="draft tree nodes per request (default: 16)")
    p.add_argument("--ngram-assist", type=int, default=None,
                   help="neural drafters: verify the continuation of an earlier occurrence of a request's "
                        "last N+ tokens instead of a drafted block (default: 2; 0: never)")
    p.add_argument("--ngram-assist-max-len", type=int, default=None,
                   help="longest looked-up chain: a chain starts a block long and doubles while "
                        "accepted whole (default and most: 32; an explicit --block-size caps it)")
    p.add_argument("--spec-policy", default=None, choices=["fixed", "threshold", "load-aware"],
                   help="how many draft tokens to verify (default for serve, bench and generate: load-aware)")
    p.add_argument("--threshold", type=float, default=None,
                   help="confidence cut for --spec-policy threshold (default: 0.5)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA and on CPUs with native bf16, else fp32), fp32, bf16, fp16")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="decoder-layer weights on CPU: auto (keep a GGUF's Q4_0/Q4_1/Q4_K as int4 and Q8_0 as "
                        "int8; safetensors stay dense), none (dense, pre-packed), int8, int4 (quantized at "
                        "load when the file is not); CUDA keeps dense weights")
    p.add_argument("--prefill-dense-copy", action="store_true",
                   help="quantized layers also keep a dense bf16 copy for prompt tokens: faster long prompts, "
                        "at 2 bytes per weight more memory (e.g. +3.4 GB for a 1.7B model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the decoder layers over N processes (gloo on CPU, NCCL on CUDA); "
                        "the drafter runs on rank 0")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"])
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-decode-stall-ms", type=_ms_or_none, default=None, metavar="MS",
                   help="while requests decode, cut prefill chunks so that a step's target pass, as the "
                        "measured cost profile predicts it, stays under this many ms, or under "
                        "--decode-stall-factor times the decodes' own pass where that is more; 'none': no "
                        f"bound, the token budget alone (default: none; {SERVE_DECODE_STALL_MS:g} for "
                        "`dspark serve`)")
    p.add_argument("--decode-stall-factor", type=float, default=2.0,
                   help="a step with decoding requests may take prefill tokens up to this many times what "
                        "its decodes alone cost, whatever --max-decode-stall-ms says (>= 1; default 2), so "
                        "prompts keep advancing when the decodes alone fill the bound")
    p.add_argument("--prompt-gemm-min-tokens", type=int, default=256, metavar="N",
                   help="where prompt rows have a kernel of their own (the CPU's AMX prompt GEMM, a dense "
                        "copy), only prompts of at least N tokens take it; shorter ones take the decode "
                        "kernels, which cost no fixed expansion of the weights per pass (0: every prompt; "
                        "default 256)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (used by default on CUDA with the flashinfer backend)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share the KV cache of identical prompt prefixes between requests (default: on where "
                        "a prompt's K/V do not depend on how its prefill is chunked, so outputs stay the "
                        "same bits: the CPU kernels with int4/int8 layers; off elsewhere)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's")


def ignored_flags(args: argparse.Namespace, policy: str, tree_by_method: bool = False) -> list[str]:
    """Warnings for engine flags given where they change nothing (a typo'd setup otherwise runs
    silently with defaults). tree_by_method: `bench` turns trees on per method (dspark-tree)."""
    out = []
    if args.threshold is not None and policy != "threshold":
        out.append(f"--threshold only applies to --spec-policy threshold (this run uses {policy})")
    if args.tree and args.drafter == "ngram":
        out.append("--tree needs a DSpark drafter: the n-gram drafter verifies chains")
    if args.tree_budget is not None and not args.tree and not tree_by_method:
        out.append("--tree-budget only applies with --tree")
    for flag in ("ngram_assist", "ngram_assist_max_len"):
        if getattr(args, flag) is not None and args.drafter in ("none", "ngram"):
            out.append(f"--{flag.replace('_', '-')} only applies to a neural drafter (this run uses {args.drafter})")
    if args.ngram_assist == 0 and args.ngram_assist_max_len is not None:
        out.append("--ngram-assist-max-len has no effect with --ngram-assist 0")
    if args.drafter == "none" and (args.block_size is not None or args.tree or args.spec_policy is not None):
        out.append("--drafter none: --block-size, --tree and --spec-policy have no effect")
    return out


def _ms_or_none(text: str) -> float | None:
    """A --max-decode-stall-ms value: milliseconds, or 'none' for no bound."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'none', got {text!r}") from None


def engine_config(args: argparse.Namespace, default_policy: str = "fixed",  # noqa: ANN201 - an EngineConfig
                  tree_by_method: bool = False):
    """The EngineConfig the shared engine flags describe (imported late: `dspark --help` stays
    fast); warns on stderr about flags that would have no effect."""
    from dspark.config import EngineConfig, SpecConfig

    policy = args.spec_policy or default_policy
    for note in ignored_flags(args, policy, tree_by_method):
        print(f"warning: {note}", file=sys.stderr)
    given = {k: v for k, v in (("tree_budget", args.tree_budget), ("threshold", args.threshold),
                               ("ngram_assist", args.ngram_assist),
                               ("ngram_assist_max_len", args.ngram_assist_max_len),
                               ("draft_p_min", getattr(args, "draft_p_min", None))) if v is not None}
    spec = SpecConfig(drafter=args.drafter, draft_model=getattr(args, "draft_model", None), block_size=args.block_size,
                      tree=args.tree, policy=policy, **given)
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
                        prefill_dense_copy=args.prefill_dense_copy,
                        attention_backend=args.attention_backend, kv_cache_tokens=args.kv_cache_tokens,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_decode_stall_ms=args.max_decode_stall_ms,
                        decode_stall_factor=args.decode_stall_factor,
                        prompt_gemm_min_tokens=args.prompt_gemm_min_tokens,
                        enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
                        tensor_parallel_size=args.tensor_parallel_size, chat_template=args.chat_template,
                        spec=spec)


def check_at_least(args: argparse.Namespace, **bounds: int) -> None:
    """ValueError naming the first flag below its bound (a flag left at None is not checked), so
    a typo fails at once, not after a model load or an hour of data generation."""
    for name, low in bounds.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def check_output_path(path: str | None) -> None:
    """ValueError when a report could not be written at the end of a long run."""
    folder = Path(path).resolve().parent if path is not None else None
    if folder is not None and not folder.is_dir():
        raise ValueError(f"cannot write {path}: folder {str(folder)!r} does not exist")


def cmd_generate(args: argparse.Namespace) -> int:
    from dspark.config import SamplingParams
    from dspark.llm import LLM

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)  # checked before the model loads
    if not args.chat and args.chat_template is not None:
        raise ValueError("--chat-template has no effect with --raw (the prompt is used as given); drop one")
    config = engine_config(args, default_policy="load-aware")  # as `dspark serve`
    config.validate()  # a wrong path or flag fails here, before any weights load
    llm = LLM.from_config(config)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    out = llm.generate([prompt], params)[0]
    print(out.text)
    s = out.stats
    print(f"\n[{len(out.token_ids)} tokens | ttft {out.ttft * 1000:.0f} ms | decode "
          f"{out.decode_tokens_per_s:.1f} tok/s | tau {s.tau:.2f} | finish {out.finish_reason}]",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print decode speed")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", dest="chat", action="store_false", help="no chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    from dspark.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    try:
        from dspark.server.cli import add_serve_parser

        add_serve_parser(sub, add_engine_args)
    except ImportError:
        pass
    try:
        from dspark.train.cli import add_train_parsers

        add_train_parsers(sub)
    except ImportError:
        pass

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad settings, missing or unreadable files (a folder, no permission)
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
