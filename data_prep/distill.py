"""Self-distillation: the backbone writes the answers its heads will learn to draft.

Heads trained on the backbone's own text accept far more drafts than heads trained on someone
else's (Medusa-2 and EAGLE both regenerate their data). For every selected prompt (the conversation
up to its first answer) the backbone generates an answer, batched with left padding, greedy or
sampled. The row keeps the exact token ids the backbone produced: prompt + answer (+ end of turn).

The backbone's final hidden states over prompt + answer come out of generation for free (a forward
hook on the base model sees every step's; one extra step adds the last token's): with
`data.distill.keep_states` they are stored under `<out>/states/` in the hidden-state cache's layout,
with the per-token stats, and `mtp-prep stage=cache` copies them instead of running the backbone
over these rows a second time (`data_prep.cache.reusable_states`).

Resumable: prompts are cut into fixed shards; each finished shard is written atomically under
`<out>.shards/`, and a rerun skips finished shards, so a killed run neither redoes nor duplicates
rows. Sampling is seeded per shard, so a resumed run writes the same rows as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from jinja2 import TemplateError
from tqdm.auto import tqdm

from data_prep.cache import batch_states, write_shard
from mtp_train.artifacts import (
    config_hash,
    is_up_to_date,
    publish_dir,
    read_json,
    read_manifest,
    temp_dir_for,
    write_json_atomic,
)
from mtp_train.backbone import autocast_to, cut_at_eos, eos_ids, resolve_autocast
from mtp_train.config import DistillConfig
from mtp_train.data.cache import SPLITS, STATES_DTYPE, shard_digests, shard_file, sidecar
from mtp_train.data.prepared import distill_plan, load_prepared
from mtp_train.data.template import IGNORE, render_prompt
from mtp_train.errors import DataError
from mtp_train.layout import MANIFEST, PLAN, SHARD_META, SHARD_STATES, STATES
from mtp_train.layout import shards_dir as layout_shards_dir

log = logging.getLogger(__name__)


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation up to (not including) its first assistant turn."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _shards(n_rows: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, n_rows)) for s in range(0, n_rows, size)]


def distill(source_dir: Path, out_dir: Path, backbone, cfg: DistillConfig, max_length: int,
            force: bool = False, backbone_dir: Path | None = None, stop_at: float | None = None) -> dict:
    """Generate answers for the prompts of `source_dir`; writes a DatasetDict to `out_dir`.
    `backbone_dir`: where the backbone's weights are, for data.distill.engine=vllm (None: a backbone
    built in code, saved for the engine under the shards directory).

    `stop_at` (a unix time; budget.distill_share under a deadline): the validation shards run first,
    then the train shards until the next one would end past `stop_at` (priced at this run's seconds
    per row so far), but never before data.distill.min_train_prompts (at least one) train prompts
    are done. What is done is published, its manifest says how far it got (`stopped_at_budget`) and
    the finished shards are kept: a later run with a deadline reuses the rows, one without distils the rest."""
    from datasets import DatasetDict, concatenate_datasets, load_from_disk

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    src_manifest = read_manifest(source_dir)
    if src_manifest is None:
        raise DataError(f"{source_dir}: no prepared dataset here; run `mtp-prep stage=data` first")
    tok = backbone.tokenizer
    plan = distill_plan(src_manifest, backbone.name, tok, cfg, max_length, backbone.device,
                        backbone.identity)
    wanted = config_hash(plan)
    old = read_manifest(out_dir) or {}
    cut = old.get("stopped_at_budget")
    if not force and (is_up_to_date(out_dir, wanted) or (cut and old.get("plan_hash") == wanted)):
        if cut and (stop_at is None or cut["train_prompts"] < cfg.min_train_prompts):
            log.info("distill: %s holds %d of %d train prompts (a deadline stopped it); distilling the rest%s",
                     out_dir, cut["train_prompts"], cut["planned"], "" if stop_at is None else
                     f" up to data.distill.min_train_prompts={cfg.min_train_prompts}")
        else:
            try:
                load_prepared(out_dir)  # up to date by its manifest, and its files still read whole
                log.info("distill: %s is up to date%s, skipping (force=true regenerates)", out_dir,
                         f" ({cut['train_prompts']} of {cut['planned']} train prompts)" if cut else "")
                return old
            except DataError as e:
                log.warning("distill: %s; distilling again", e)

    shards_dir = layout_shards_dir(out_dir)
    old_plan = read_json(shards_dir / PLAN)
    if force or (old_plan is not None and old_plan.get("config_hash") != wanted):
        if shards_dir.exists():
            log.info("distill: inputs changed, discarding the shards in %s", shards_dir)
        shutil.rmtree(shards_dir, ignore_errors=True)
    shards_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(shards_dir / PLAN, {"config_hash": wanted, **plan})

    source = load_prepared(source_dir)
    caps = {"train": cfg.max_train_prompts, "validation": cfg.max_val_prompts}
    work = []  # (split, shard index, start, end); validation first: a deadline stops train shards only
    for split in ("validation", "train"):
        n = len(source[split]) if caps[split] is None else min(caps[split], len(source[split]))
        work += [(split, i, s, e) for i, (s, e) in enumerate(_shards(n, cfg.shard_size))]
    planned_train = sum(e - s for sp, _, s, e in work if sp == "train")
    total = sum(e - s for _, _, s, e in work)
    done = [w for w in work if (shards_dir / _shard_name(w)).is_dir()]
    rows_done = sum(e - s for _, _, s, e in done)
    if done:
        log.info("distill: resuming, %d of %d shards already finished", len(done), len(work))

    model = backbone.model
    device = backbone.device
    t0, new_tokens, rows_run = time.time(), 0, 0
    train_done = sum(e - s for sp, _, s, e in done if sp == "train")
    stopped = None
    bar = tqdm(total=total, initial=rows_done, unit="row", desc="self-distill", dynamic_ncols=True)
    with _engine(cfg, backbone, backbone_dir, shards_dir, needed=len(done) < len(work)) as engine:
        for w in work:
            if (shards_dir / _shard_name(w)).is_dir():
                continue
            split, idx, start, end = w
            if stop_at is not None and split == "train" and train_done >= max(1, cfg.min_train_prompts) and rows_run:
                now = time.time()
                ends = now + (now - t0) / rows_run * (end - start)
                if ends > stop_at:
                    stopped = {"train_prompts": train_done, "planned": planned_train}
                    log.info("distill: stopping at the budget after %d of %d train prompts (the next shard "
                             "would end %.1f min past its share of the deadline)", train_done, planned_train,
                             (ends - stop_at) / 60)
                    break
            rows = source[split].select(range(start, end))
            records, skipped, n_new, states = _generate_shard(
                model, tok, rows, cfg, max_length, device,
                seed=cfg.seed * 100_003 + idx + (split == "validation") * 50_000, engine=engine)
            new_tokens += n_new
            _save_shard(shards_dir, w, records, skipped, source[split].features, states)
            rows_run += end - start
            train_done += (end - start) * (split == "train")
            bar.update(end - start)
            bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.0f}")
    bar.close()

    work = [w for w in work if (shards_dir / _shard_name(w)).is_dir()]  # all of them unless stopped
    parts, skipped = {s: [] for s in SPLITS}, Counter()
    for w in work:
        path = shards_dir / _shard_name(w)
        meta = read_json(path / SHARD_META)
        skipped.update(meta["skipped"])
        if meta["rows"]:  # datasets cannot load an empty saved dataset back
            parts[w[0]].append(load_from_disk(str(path)))
    result = DatasetDict({s: concatenate_datasets(parts[s]) if parts[s] else _empty(source[s].features)
                          for s in SPLITS})
    for s in SPLITS:
        if len(result[s]) == 0:
            raise DataError(f"distill: no {s} prompt of {source_dir} could be distilled "
                            f"(skipped: {dict(skipped)}; see data.distill.max_prompt_tokens and "
                            f"data.distill.max_{'train' if s == 'train' else 'val'}_prompts)")
    finished = {s: int(sum(result[s]["finished"])) for s in SPLITS}
    manifest = {
        # a stopped run's rows are fewer than the plan's: its hash differs, so that the cache and the
        # runs keyed by it see the change when a later run finishes it (plan_hash is what it reuses by)
        "stage": "distill", "config_hash": config_hash({"plan": wanted, "stopped_at_budget": stopped}) if stopped
        else wanted, "plan_hash": wanted, **plan,
        "splits": {s: len(result[s]) for s in SPLITS},
        "finished_with_eos": finished,
        "skipped": dict(skipped),
        "answer_tokens": {s: int(sum(result[s]["num_assistant_tokens"])) for s in SPLITS},
        "elapsed_s_this_run": round(time.time() - t0, 1),
        "new_tokens_per_s_this_run": round(new_tokens / max(time.time() - t0, 1e-9), 1),
    }
    if stopped:
        manifest["stopped_at_budget"] = stopped
    tmp = temp_dir_for(out_dir)
    result.save_to_disk(str(tmp))
    if cfg.keep_states and cfg.engine == "hf":  # the engine keeps none: the cache stage computes them
        _gather_states(shards_dir, work, tmp / STATES, plan, {s: len(result[s]) for s in SPLITS}, keep=bool(stopped))
    write_json_atomic(tmp / MANIFEST, manifest)
    publish_dir(tmp, out_dir)
    if not stopped:  # a stopped run keeps its shards (their states were copied, not moved) for one that finishes it
        shutil.rmtree(shards_dir, ignore_errors=True)
    return manifest


@contextlib.contextmanager
def _engine(cfg: DistillConfig, backbone, backbone_dir: Path | None, scratch: Path, needed: bool):
    """None for HF generate (or nothing left to distill); for data.distill.engine=vllm, a function
    prompt ids -> greedy answer ids served by the engine (mtp_train/engine/), which is started once
    for every shard and always stopped again."""
    if cfg.engine == "hf" or not needed:
        yield None
        return
    from mtp_train.engine import env as engine_env
    from mtp_train.engine.check import REQUEST_TIMEOUT_S, EngineWorker, check_head_size

    engine_env.check_cpu()
    check_head_size(backbone.config, "data.distill.engine=vllm: the backbone")
    python = engine_env.ensure_env(log=lambda m: log.info("%s", m))
    if backbone_dir is None:  # built in code: the engine reads weights from a directory
        backbone_dir = scratch / "engine-backbone"
        backbone.model.save_pretrained(backbone_dir, safe_serialization=True)
        backbone.tokenizer.save_pretrained(backbone_dir)
    context = getattr(backbone.config, "max_position_embeddings", None) or 10**9
    spec = {"model": str(backbone_dir), "max_tokens": cfg.max_new_tokens, "eos": eos_ids(backbone.model, backbone.tokenizer),
            "max_model_len": min(cfg.max_prompt_tokens + cfg.max_new_tokens, context), "max_num_seqs": cfg.batch_size,
            "dtype": resolve_autocast(backbone.device, cfg.autocast), "memory_fraction": 0.2, "engines": {"distill": {}}}
    log.info("distill: answering with %s (%s, %s, %d sequences at a time)", engine_env.PACKAGE, backbone_dir,
             spec["dtype"], cfg.batch_size)
    with EngineWorker(python, spec, scratch / "engine.log") as worker:
        def answer(prompts: list[list[int]]) -> list[list[int]]:
            batches = -(-len(prompts) // cfg.batch_size)  # a whole shard in one request: it waits for all
            return worker.ask(op="generate_batch", engine="distill", prompts=prompts,
                              timeout=REQUEST_TIMEOUT_S * max(1, batches))["outputs"]

        yield answer


def _shard_name(w) -> str:
    return f"{w[0]}-{w[1]:05d}"


def _features(source_features):
    from datasets import Features, Value

    feats = dict(source_features)
    feats["finished"] = Value("bool")
    return Features(feats)


def _empty(source_features):
    from datasets import Dataset

    feats = _features(source_features)
    return Dataset.from_dict({k: [] for k in feats}, features=feats)


def _gather_states(shards_dir: Path, work, out: Path, plan: dict, rows: dict, keep: bool = False) -> None:
    """The shards' states, renumbered per split in row order, as one `HiddenCache` directory (copied
    with `keep`, for shards a later run finishes from; moved otherwise)."""
    place = shutil.copyfile if keep else shutil.move
    n = dict.fromkeys(SPLITS, 0)
    for w in work:
        src = shards_dir / _shard_name(w) / SHARD_STATES
        if not src.is_file():  # a shard whose prompts were all skipped
            continue
        dst = shard_file(out, w[0], n[w[0]])
        out.mkdir(parents=True, exist_ok=True)
        for what in ("offsets", "stats", "top"):
            place(sidecar(src, what), sidecar(dst, what))
        place(src, dst)
        n[w[0]] += 1
    write_json_atomic(out / MANIFEST, {"stage": "states", "dtype": STATES_DTYPE,
                                       "compute": plan["generation"]["autocast"],
                                       "backbone": plan["backbone_identity"], "rows": rows,
                                       "digests": shard_digests(out) if out.is_dir() else {}})


def _save_shard(shards_dir: Path, w, records: list[dict], skipped: Counter, source_features,
                states: list | None = None) -> None:
    from datasets import Dataset

    feats = _features(source_features)
    cols = {k: [r[k] for r in records] for k in feats}
    ds = Dataset.from_dict(cols, features=feats)
    final = shards_dir / _shard_name(w)
    tmp = temp_dir_for(final)
    with _quiet_datasets():
        ds.save_to_disk(str(tmp))
    if states:
        offsets = np.cumsum([0] + [len(st[0]) for st in states]).astype(np.int64)
        write_shard(tmp / SHARD_STATES, np.concatenate([st[0] for st in states]), offsets,
                    np.concatenate([st[1] for st in states]), np.concatenate([st[2] for st in states]))
    write_json_atomic(tmp / SHARD_META, {"rows": len(records), "skipped": dict(skipped)})
    publish_dir(tmp, final)


def _prompt_items(rows, tok, cfg: DistillConfig) -> tuple[list, Counter]:
    """(row, prompt messages, prompt ids) of the rows that can be distilled, and why the others cannot."""
    items, skipped = [], Counter()
    for r in rows:
        msgs = prompt_messages(r["messages"])
        try:
            ids = render_prompt(tok, msgs)
        except TemplateError:
            skipped["chat template refused the prompt"] += 1
            continue
        if len(ids) > cfg.max_prompt_tokens:
            skipped["prompt longer than data.distill.max_prompt_tokens"] += 1
            continue
        items.append((r, msgs, ids))
    return items, skipped


def _hf_answers(model, tok, items, cfg: DistillConfig, max_length: int, device, seed: int,
                eos: list[int]) -> tuple[dict, dict]:
    """HF generate's answers to `items` ({item: answer ids}) and, with data.distill.keep_states,
    their states ({item: RowStates}), in batches of data.distill.batch_size."""
    autocast = resolve_autocast(device, cfg.autocast)
    keep_states = cfg.keep_states
    # longest first: batches of similar length waste less padding; the order is fixed, so a
    # resumed run builds the same batches
    order = sorted(range(len(items)), key=lambda i: (-len(items[i][2]), i))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    answers: dict[int, list[int]] = {}
    states: dict[int, tuple] = {}
    torch.manual_seed(seed)
    for b in range(0, len(order), cfg.batch_size):
        batch = order[b: b + cfg.batch_size]
        width = max(len(items[i][2]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):  # left padding
            ids = items[i][2]
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attn[row, width - len(ids):] = 1
        gen_kwargs = dict(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.do_sample,
                          pad_token_id=pad_id, eos_token_id=eos)
        if cfg.do_sample:
            gen_kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
        with autocast_to(device, autocast), _HiddenTap(model.base_model if keep_states else None) as tap:
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                                 return_dict_in_generate=True, **gen_kwargs)
            if keep_states:
                _forward_last(model, out, attn.to(device))
        new = out.sequences[:, width:].tolist()  # (B, <= max_new_tokens)
        for row, i in enumerate(batch):
            answers[i] = cut_at_eos(new[row], eos)[0]
        if keep_states:
            hidden = torch.cat(tap.parts, dim=1)  # (B, width + steps, d): every input position's state
            spans = [(width - len(items[i][2]), min(len(items[i][2]) + len(answers[i]), max_length))
                     for i in batch]  # (first real position after the left padding, tokens kept)
            with autocast_to(device, autocast):
                kept_b = batch_states([hidden[row, a: a + n] for row, (a, n) in enumerate(spans)],
                                      model.get_output_embeddings(), STATES_DTYPE)
            states.update(zip(batch, kept_b, strict=True))
    return answers, states


@torch.no_grad()
def _generate_shard(model, tok, rows, cfg: DistillConfig, max_length: int, device, seed: int, engine=None):
    """Answers for one shard; returns (records, skipped reasons, new tokens generated, the records'
    states (`cache.RowStates`, in record order) or None without data.distill.keep_states).
    `engine` (prompt ids -> answer ids, greedy): the serving engine answers instead of HF generate,
    and no states are kept."""
    items, skipped = _prompt_items(rows, tok, cfg)
    eos = eos_ids(model, tok)
    if engine is not None:
        keep_states, states = False, {}
        got = engine([ids for _, _, ids in items]) if items else []
        answers = {i: cut_at_eos(a, eos)[0] for i, a in enumerate(got)}
    else:
        keep_states = cfg.keep_states
        answers, states = _hf_answers(model, tok, items, cfg, max_length, device, seed, eos)
    n_new = sum(map(len, answers.values()))
    records, kept = [], []
    for i, (r, msgs, ids) in enumerate(items):
        ans = answers[i]
        finished = bool(ans) and ans[-1] in eos
        text = tok.decode(ans[:-1] if finished else ans, skip_special_tokens=True)
        input_ids = (ids + ans)[:max_length]
        labels = ([IGNORE] * len(ids) + ans)[:max_length]
        n_ans = sum(1 for x in labels if x != IGNORE)
        if n_ans == 0:
            skipped["no answer token within data.max_length"] += 1
            continue
        records.append({
            **{k: r[k] for k in r if k not in ("messages", "input_ids", "labels")},
            "messages": msgs + [{"role": "assistant", "content": text}],
            "input_ids": input_ids, "labels": labels, "num_tokens": len(input_ids),
            "num_assistant_tokens": n_ans, "has_answer": True, "finished": finished,
        })
        if keep_states:
            kept.append(states[i])
    return records, skipped, n_new, (kept if keep_states else None)


class _HiddenTap:
    """Records the final hidden states of every forward of `module` (the base model) while open."""

    def __init__(self, module):
        self.module, self.parts, self.handle = module, [], None

    def __enter__(self):
        if self.module is not None:
            self.handle = self.module.register_forward_hook(
                lambda mod, args, out: self.parts.append(out.last_hidden_state.detach()))
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.remove()


def _forward_last(model, out, attn: torch.Tensor) -> None:
    """One more decoding step over the last generated token, through generate's own KV cache, so
    that its hidden state is recorded too (generate never runs the token it emits last)."""
    seq = out.sequences  # (B, width + steps)
    full = torch.cat([attn, attn.new_ones(attn.shape[0], seq.shape[1] - attn.shape[1])], 1)  # (B, W + S)
    position = full.sum(-1, keepdim=True) - 1  # (B, 1): generate numbers positions by the mask
    model(input_ids=seq[:, -1:], attention_mask=full, position_ids=position,
          past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)


@contextlib.contextmanager
def _quiet_datasets():
    """No per-shard 'Saving the dataset' bars under the distillation bar."""
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            ds_logging.enable_progress_bar()
