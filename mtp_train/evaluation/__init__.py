"""What mtp-eval and mtp-clp measure when decoding, against HF generate greedy on the same prompts.
Import from the modules themselves; this package re-exports nothing.

    modes        the decoding-mode registry: one record per eval.modes entry (and HF generate)
    decode       a mode's record made into the decoder's parts; decoding in a named mode
    prompts      prompt files (read as data=jsonl rows are), held-out and unseen prompts, rendering
    runner       HF generate, the timing rounds over every mode, the report they fill, LoRA drift
    metrics      repetition, backbone NLL, divergence from greedy, a mode's summary, plausibility
    planning     the trees to verify: grown from rank statistics, sized by this machine's costs
    machine      the CPU, eval.dtype resolved for it, HF generate timed in both dtypes
    render       the console table, the figures, eval_report.json
    calibration  a span predictor's threshold, chosen by decoding the candidates, tested with their noise
"""
