"""`dflash generate`: the target writes the training text itself.

    dflash generate --config configs/pystd.yaml --model M --data train.jsonl.gz --out gen/
    dflash extract  --config configs/pystd.yaml --model M --data gen/ --out store/

A drafter must predict what the target will say; trained on the target's own text it accepts
far more than on a dataset's text (see BENCHMARKS.md). Chat rows get every assistant turn
rewritten by the target, text rows get continuation windows (`stage1_generate/rows.py`).

Flow: the source rows are cut into chunks of `output.rows_per_chunk`; the launching process
checks the inputs and prepares the output folder (or checks that it resumes one made by the
same settings); each process (one per GPU, data parallel through torchrun's launcher) generates
the chunks `c % world == rank` not done yet and commits each as one file; once all are done the
manifest gets the totals and `complete: true`. Rerunning the same command resumes. A rank that
fails stops the others at their next chunk: torchrun's ranks through `another_rank_failed`
(they meet in failure_shared, which raises its error on every rank; one interrupted by Ctrl-C
leaves at once, and the others end `stopped` without meeting it), a local launch's processes
through the launcher, which ends the others as soon as one exits.
"""

from __future__ import annotations

import gzip
import json
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from common.distributed import (
    WorkerContext,
    another_rank_failed,
    failure_shared,
    finish_worker,
    init_worker,
    launch,
    parse_devices,
    under_torchrun,
)
from common.generated import read_manifest
from common.logging import get_logger, init_logger
from stage1_extract.chat import WROTE_END_OF_TURN
from stage1_extract.data import special_affixes
from stage1_generate.config import GenerateConfig
from stage1_generate.inputs import Inputs, build_manifest, read_inputs
from stage1_generate.output import (
    check_output_folder,
    chunk_file,
    chunk_stats,
    done_chunks,
    finalize_output,
    output_lock,
    prepare_output,
    write_chunk,
)
from stage1_generate.rows import (
    Backend,
    check_settings,
    generate_chat,
    generate_completion,
    generate_text,
    generation_eos,
    special_prefix,
    stop_token_ids,
)

# a rank that finished its chunks waits for the slowest one (failure_shared in _worker: up to one
# rank's whole share on a resume where the others have nothing left: hours); the process-group
# timeout must outlast it. DFLASH_DIST_TIMEOUT_S overrides it (common/distributed.py)
BARRIER_TIMEOUT = timedelta(hours=48)


def _make_backend(
    cfg: GenerateConfig, tokenizer: PreTrainedTokenizerBase, ctx: WorkerContext, devices: list[str]
) -> Backend:
    if cfg.run.backend == "openai":
        from stage1_generate.openai_backend import OpenAIBackend

        # the folder's manifest's stop_ids, which the local backend's stops equal (its model's
        # generation config): vLLM adds the generation config's end of sequence itself, but
        # another server would write past it. A folder begun before they were recorded: the same
        # ids, from the target's files (text past the end of text sends none: generate_text)
        stops = (read_manifest(Path(cfg.output.out).expanduser()) or {}).get("stop_ids")
        if stops is None:
            eos = generation_eos(cfg.target.as_target_config())
            stops = stop_token_ids(tokenizer, eos, cfg.data.chat_template_kwargs)
        return OpenAIBackend(
            cfg.endpoint, cfg.sampling, stops, cfg.target.model, tokenizer.eos_token_id
        )
    from stage1_extract.target import load_target
    from stage1_generate.local_backend import LocalBackend

    if cfg.target.attn_implementation == "sdpa_gqa_decode":  # registers it with transformers
        from stage1_generate import gqa_decode  # noqa: F401

    model = load_target(cfg.target.as_target_config(), ctx.device, devices)
    eos = getattr(model.generation_config, "eos_token_id", None)
    stops = stop_token_ids(tokenizer, eos, cfg.data.chat_template_kwargs)
    return LocalBackend(
        model,
        tokenizer,
        cfg.sampling,
        stops,
        cfg.run.batch_size,
        cfg.run.batch_tokens,
        kv_cache=cfg.run.kv_cache,
    )


def _generate_chunks(
    cfg: GenerateConfig, ctx: WorkerContext, devices: list[str], inputs: Inputs
) -> None:
    """Generate and commit this process's chunks that are not done yet."""
    log = get_logger()
    out = Path(cfg.output.out).expanduser()
    tokenizer, raw, fmt, column = inputs
    per_chunk = cfg.output.rows_per_chunk
    num_chunks = -(-len(raw) // per_chunk)
    done = done_chunks(out)
    todo = [c for c in range(num_chunks) if c % ctx.world_size == ctx.rank and c not in done]
    if not todo:
        return
    backend = _make_backend(cfg, tokenizer, ctx, devices)
    rows_total = sum(min(per_chunk, len(raw) - c * per_chunk) for c in todo)
    bar = tqdm(
        total=rows_total,
        unit="row",
        dynamic_ncols=True,
        desc=f"generate (rank {ctx.rank}/{ctx.world_size}, {len(todo)} chunks)",
        disable=not (cfg.run.progress and ctx.is_main),
    )
    start, new_tokens, finished = time.perf_counter(), 0, 0
    under_way = ""  # the local backend's batch, step by step

    def show() -> None:
        rate = new_tokens / max(time.perf_counter() - start, 1e-9)
        done = f"{new_tokens} new tokens, {rate:.0f} tok/s" if new_tokens else ""
        bar.set_postfix_str("; ".join(s for s in (done, under_way) if s), refresh=True)

    def on_batch(_prompts: int, tokens: int) -> None:
        nonlocal new_tokens, under_way
        new_tokens += tokens
        under_way = ""
        show()

    def on_step(batch: int, batches: int, rows: int, step: int, max_new: int) -> None:
        nonlocal under_way
        under_way = f"batch {batch}/{batches}: {rows} rows at token {step}/{max_new}"
        show()

    if cfg.run.progress and ctx.is_main and hasattr(backend, "on_step"):
        backend.on_step = on_step

    try:
        for chunk in todo:
            if another_rank_failed():  # its error ends this rank too, where the ranks meet
                break
            lo, hi = chunk * per_chunk, min((chunk + 1) * per_chunk, len(raw))
            rows = raw.select(range(lo, hi))[column]
            if not cfg.sampling.greedy:  # each chunk its own seed: a resumed chunk agrees
                import torch

                torch.manual_seed(cfg.sampling.seed + chunk)
            indices = list(range(lo, hi))
            if fmt == "text":
                result = generate_text(rows, indices, cfg, tokenizer, backend, on_batch)
            elif fmt == "completion":
                result = generate_completion(rows, indices, cfg, tokenizer, backend, on_batch)
            else:
                result = generate_chat(rows, indices, fmt, cfg, tokenizer, backend, on_batch)
            stats = {"chunk": chunk, "rows_in": hi - lo, **result.stats()}
            if cfg.run.backend == "openai":  # which server wrote it: a resume may use another
                stats["endpoint"] = cfg.endpoint.url
            write_chunk(out, chunk, result.rows, stats)
            bar.update(hi - lo)
            finished += 1
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    log.info(
        "rank %d: %d chunks, %d new tokens in %.1f s (%.0f new tokens/s)",
        ctx.rank,
        finished,
        new_tokens,
        seconds,
        new_tokens / max(seconds, 1e-9),
    )


def _worker(
    cfg: GenerateConfig,
    devices: list[str],
    error_dir: str,
    prepared: bool,
    inputs: Inputs | None = None,
    model_name: str = "target.model",
) -> None:
    """One process. `prepared`: the launcher prepared the folder and will finalize it; else
    (under torchrun) rank 0 does both, each section ending in failure_shared (every rank
    raises, naming the rank that failed: on another node, a rank waiting in a bare barrier
    after it would only end at the 48-hour timeout). `inputs`: already read by the caller
    when this runs in its process. `model_name`: how the user gave the target (--model or
    target.model), for its errors."""
    init_logger()
    ctx = init_worker(devices, timeout=BARRIER_TIMEOUT)
    try:
        if prepared:
            _generate_chunks(cfg, ctx, devices, inputs or read_inputs(cfg, model_name))
            return
        with ExitStack() as lock:
            with failure_shared():
                inputs = read_inputs(cfg, model_name)
                if ctx.is_main:  # rank 0 holds the lock for the run
                    out = Path(cfg.output.out).expanduser()
                    check_output_folder(out, cfg.output.overwrite, cfg.data.path)
                    manifest = _manifest(cfg, inputs, model_name)
                    lock.enter_context(output_lock(out))
                    prepare_output(out, manifest, cfg.output.overwrite)
            with failure_shared():  # a rank that finished waits here for the slowest
                _generate_chunks(cfg, ctx, devices, inputs)
            with failure_shared():  # the others return the finalized manifest
                if ctx.is_main:
                    _finalize(cfg)
    except ValueError as err:
        Path(error_dir, f"rank-{ctx.rank}.txt").write_text(str(err))
        raise
    finally:
        finish_worker()


def summarize(out: Path, num_chunks: int, chat: bool = False) -> dict[str, Any]:
    """Totals over the committed chunks' counts; `chat`: of chat rows, which count the replies
    ended by another stop than the template's end of turn (`other_stops`)."""
    stats = chunk_stats(out)
    missing = sorted(set(range(num_chunks)) - {s["chunk"] for s in stats})
    if missing:
        raise ValueError(
            f"--out {out}: chunks {missing[:10]} were not generated; rerun the same command"
        )
    skipped: Counter = Counter()
    totals: Counter = Counter()
    for s in stats:
        skipped.update(s["skipped"])
        totals.update({k: v for k, v in s.items() if k not in ("chunk", "skipped", "endpoint")})
    totals.pop("other_stops", None)
    if chat:  # chunks of versions before counted none: their rows tell (rows without the
        # record, of versions before it: unknown, so no total)
        counted = [s["other_stops"] if "other_stops" in s else _other_stops(out, s) for s in stats]
        if None not in counted:
            totals["other_stops"] = sum(counted)
    return {**dict(totals), "skipped": dict(skipped)}


def _other_stops(out: Path, stats: dict[str, Any]) -> int | None:
    """The chat replies of a chunk's rows that a stop id other than the template's end of turn
    ended (`wrote_end_of_turn` false, not cut at the token limit); None when a row does not
    record them."""
    path = chunk_file(out, stats["chunk"])
    if not path.exists():  # every row skipped
        return 0
    found = 0
    for line in gzip.decompress(path.read_bytes()).splitlines():
        row = json.loads(line)
        if WROTE_END_OF_TURN not in row:
            return None
        found += row[WROTE_END_OF_TURN].count(False) - row["truncated_turns"]
    return found


def _check_positions(cfg: GenerateConfig, inputs: Inputs, model_name: str) -> None:
    """Refuse, from the target's config alone (before its weights load), an attention backend
    it cannot run and settings that no row could fit in its positions. The openai backend's
    limit is the server's max_model_len, known once it answers (then checked in
    `stage1_generate/rows.py`); the server picks its own attention."""
    if cfg.run.backend != "local":
        return
    from stage1_extract.target import check_attn_implementation, load_target_config, max_positions

    if cfg.target.attn_implementation == "sdpa_gqa_decode":  # registers it with transformers
        from stage1_generate import gqa_decode  # noqa: F401

    target = cfg.target.as_target_config()
    config = load_target_config(target, model_name)
    check_attn_implementation(target, config)
    found = max_positions(config)
    if found is not None:
        prefix = len(special_prefix(inputs.tokenizer)) if inputs.fmt == "text" else 0
        check_settings(cfg, inputs.fmt, found.limit, f"the target's {found.source}", prefix)


def _manifest(cfg: GenerateConfig, inputs: Inputs, model_name: str) -> dict[str, Any]:
    """The run's manifest, its settings checked: before the output folder is made, so a run
    refused for its inputs leaves nothing in --out."""
    _check_positions(cfg, inputs, model_name)
    suffix = special_affixes(inputs.tokenizer)[1]
    eos = generation_eos(cfg.target.as_target_config())
    stops = stop_token_ids(inputs.tokenizer, eos, cfg.data.chat_template_kwargs)
    return build_manifest(cfg, inputs.raw, inputs.fmt, suffix, stops)


def _finalize(cfg: GenerateConfig) -> dict[str, Any]:
    out = Path(cfg.output.out).expanduser()
    manifest = read_manifest(out)
    assert manifest is not None
    chat = manifest["content"]["format"] in ("messages", "sharegpt")
    counts = summarize(out, manifest["num_chunks"], chat)
    final = finalize_output(out, counts)
    prompts, cut = counts.get("prompts", 0), counts.get("truncated", 0)
    # a text window is meant to run to text.new_tokens: "cut at the token limit", said of every
    # window of the pystd recipe, read as a fault; for replies it is one (a reply unfinished)
    if manifest["content"]["format"] == "text":
        ends = f"{cut} windows of text.new_tokens, {prompts - cut} ended sooner at the end of text"
    else:
        ends = f"{cut} replies cut at the token limit"
        if "other_stops" in counts:
            ends += f", {counts['other_stops']} ended by another stop than the end of turn"
    get_logger().info(
        "generated %s: %d rows from %d source rows (skipped: %s), %d prompts, %d new tokens, "
        "%s, %d empty replies",
        out,
        counts.get("rows_out", 0),
        counts.get("rows_in", 0),
        counts["skipped"] or "none",
        prompts,
        counts.get("new_tokens", 0),
        ends,
        counts.get("empty_replies", 0),
    )
    return final


def run_generate(cfg: GenerateConfig, model_name: str = "target.model") -> dict[str, Any] | None:
    """Generate (or resume generating) `cfg.output.out`; return its final manifest (None on
    the ranks other than 0 under torchrun). `model_name`: how the user gave the target, named
    in its errors: `--model` when the flag set it, else the config key."""
    devices = ["cpu"] if cfg.run.backend == "openai" else parse_devices(cfg.run.devices)
    with tempfile.TemporaryDirectory(prefix="dflash-generate-") as error_dir:
        if under_torchrun():
            _worker(cfg, devices, error_dir, False, None, model_name)
            return read_manifest(Path(cfg.output.out).expanduser())
        out = Path(cfg.output.out).expanduser()
        check_output_folder(out, cfg.output.overwrite, cfg.data.path)
        # checked and prepared here, so user errors stay ValueErrors of this process
        inputs = read_inputs(cfg, model_name)
        manifest = _manifest(cfg, inputs, model_name)
        with output_lock(out):
            prepare_output(out, manifest, cfg.output.overwrite)
            try:
                if len(devices) == 1:  # in this process: the inputs are read once
                    _worker(cfg, devices, error_dir, True, inputs, model_name)
                else:
                    launch(_worker, devices, cfg, devices, error_dir, True, None, model_name)
            except Exception as err:
                messages = sorted(Path(error_dir).glob("rank-*.txt"))
                if messages and not isinstance(err, ValueError):
                    raise ValueError("; ".join(p.read_text() for p in messages)) from err
                raise
            return _finalize(cfg)
