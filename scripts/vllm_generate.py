"""Greedy generation with vLLM, as one JSON object on stdout (used by tests/test_vllm.py
and scripts/bench_vllm.py; needs vLLM, e.g. the venv of `make vllm-test`).

    python scripts/vllm_generate.py MODEL --prompt-ids IDS.json [--tp N] [--max-tokens N]
        [--dtype float32] [--enforce-eager] [--text PROMPTS.json] [--out RESULT.json]

IDS.json holds a list of token-id lists (PROMPTS.json a list of strings, tokenized with
the model's tokenizer). Prints {"tokens", "load_s", "generate_s", "generated",
"tokens_per_s", "max_rss_mb"}. The `__main__` guard matters: vLLM's engine starts worker
processes that import this file again.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-ids", help="JSON file: a list of token-id lists")
    ap.add_argument("--text", help="JSON file: a list of prompt strings")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", help="write the JSON here instead of stdout (vLLM logs to stdout)")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    if args.prompt_ids:
        with open(args.prompt_ids, encoding="utf-8") as f:
            ids = json.load(f)
    else:
        from transformers import AutoTokenizer

        with open(args.text, encoding="utf-8") as f:
            texts = json.load(f)
        tok = AutoTokenizer.from_pretrained(args.model)
        ids = [tok(t)["input_ids"] for t in texts]
    t0 = time.perf_counter()
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, dtype=args.dtype,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              skip_tokenizer_init=args.prompt_ids is not None, seed=0)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in ids]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2,
                                             detokenize=False), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(len(t) for t in tokens)
    result = json.dumps({
        "tokens": tokens, "load_s": round(load_s, 2), "generate_s": round(gen_s, 3),
        "generated": generated, "tokens_per_s": round(generated / gen_s, 2),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    })
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(result + "\n")
    else:
        print(result)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
