"""The engine side of `mtp-serve-check`, run by the engine environment's own Python (env.py): it
imports vLLM and the standard library only, never mtp_train, whose pins differ.

Started with a JSON spec as its one argument, it builds one vLLM `LLM` per configuration in the
spec (the backbone alone, and the backbone with the exported drafter), then answers requests, one
JSON object per line, on the stdout it was started with (everything the engine prints goes to
stderr instead):

  {"op": "generate", "engine": NAME, "prompt": [ids]} -> {"tokens": [ids], "seconds": s}
  {"op": "generate_batch", "engine": NAME, "prompts": [[ids], ...]}
                                                        -> {"outputs": [[ids], ...], "seconds": s}
  {"op": "metrics", "engine": NAME}                   -> {"metrics": {name: value or [values]}}
  {"op": "quit"}                                        -> exits

so that the caller can interleave the engines with its own decoder prompt by prompt. Greedy
decoding (temperature 0), in float32 and at most one sequence at a time (batch 1, as the decoder
runs) unless the spec or an engine's own settings say otherwise (`dtype`, `max_num_seqs`: the
distillation benchmark batches).
"""

import json
import os
import sys
import time


def _protocol_stream():
    """A private copy of stdout for the replies; fd 1 becomes stderr, so that nothing the engine
    prints can break a reply line."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _metrics(llm) -> dict:
    """Counters and vectors by name, summed over their label sets."""
    found = {}
    for m in llm.get_metrics():
        if hasattr(m, "values"):
            old = found.get(m.name, [])
            new = list(m.values)
            width = max(len(old), len(new))
            old, new = old + [0] * (width - len(old)), new + [0] * (width - len(new))
            found[m.name] = [a + b for a, b in zip(old, new, strict=True)]
        elif hasattr(m, "value") and isinstance(m.value, (int, float)):
            found[m.name] = found.get(m.name, 0) + m.value
    return found


def main() -> None:
    reply = _protocol_stream()
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engines = {}
    for name, extra in spec["engines"].items():
        t0 = time.perf_counter()
        settings = dict(model=spec["model"], tokenizer=spec.get("tokenizer") or spec["model"],
                        skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"), enforce_eager=True,
                        max_num_seqs=spec.get("max_num_seqs", 1), max_model_len=spec["max_model_len"], seed=0,
                        gpu_memory_utilization=spec.get("memory_fraction", 0.25), disable_log_stats=False)
        engines[name] = LLM(**{**settings, **extra})
        print(f"[worker] engine {name} ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], stop_token_ids=spec["eos"],
                            detokenize=False)
    reply.write(json.dumps({"ready": sorted(engines)}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        llm = engines[req["engine"]]
        if req["op"] == "generate":
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], params, use_tqdm=False)
            secs = time.perf_counter() - t0
            reply.write(json.dumps({"tokens": list(out[0].outputs[0].token_ids), "seconds": secs}) + "\n")
        elif req["op"] == "generate_batch":  # all at once: the engine schedules them max_num_seqs at a time
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
            secs = time.perf_counter() - t0
            reply.write(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in out], "seconds": secs}) + "\n")
        elif req["op"] == "metrics":
            reply.write(json.dumps({"metrics": _metrics(llm)}) + "\n")
        else:
            reply.write(json.dumps({"error": f"unknown op {req['op']!r}"}) + "\n")
    reply.close()


if __name__ == "__main__":  # the engine spawns worker processes: the guard keeps them from rerunning this
    main()
