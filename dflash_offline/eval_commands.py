"""`dflash evaluate` (online acceptance vs prompt lookup) and `dflash evaluate-offline`."""

from __future__ import annotations

import json
from typing import Any

import click

from common.errors import cli_errors
from common.logging import init_logger
from dflash_offline.options import (
    check_out_file,
    device_option,
    echo_json,
    exit_interrupted,
    plot_beside,
)

# what stays of an evaluation stopped with Ctrl-C: its figures come whole at the end
NOTHING_WRITTEN = "nothing was written: the figures (and --json-out) come once every {} is measured"


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise click.BadParameter(
            f"not JSON ({err}): pass an object such as '{{\"k\": 1}}'"
        ) from err
    if not isinstance(parsed, dict):
        raise click.BadParameter(f"{value!r} is not a JSON object: pass one such as '{{}}'")
    return parsed


@click.command(short_help="Online acceptance (tau) of a drafter vs prompt lookup.")
@click.option(
    "--target",
    "--model",
    "target",
    required=True,
    help="target model: local folder or hub id (the one the drafter was trained for)",
)
@click.option(
    "--data",
    required=True,
    help="JSON/JSONL(.gz) or Parquet file, or a folder of them (a `dflash generate` output): "
    "`text` documents (first tokens) or `messages` conversations (up to the last assistant turn)",
)
@click.option(
    "--drafter",
    default=None,
    help="exported drafter folder (RUN/export) [default: none: prompt lookup alone]",
)
@click.option(
    "--num-prompts",
    default=12,
    show_default=True,
    type=int,
    metavar="N",
    help="the first N rows of --data",
)
@click.option(
    "--prompt-tokens",
    default=256,
    show_default=True,
    type=int,
    help="tokens of each prompt: a text document's first, a conversation's last",
)
@click.option(
    "--new-tokens",
    default=128,
    show_default=True,
    type=int,
    help="tokens the target writes per prompt, at most",
)
@device_option
@click.option(
    "--dtype",
    default="float32",
    show_default=True,
    type=click.Choice(["float32", "bfloat16"]),
    help="dtype of the target and the drafter",
)
@click.option(
    "--stop-at-eos/--no-stop-at-eos",
    default=True,
    show_default=True,
    help="end each reply at the target's end of sequence (chat: end of turn), as a server "
    "does; a reply that is the end alone verifies no draft and is left out of tau. "
    "--no-stop-at-eos decodes --new-tokens past it (the shared harness's definition; this "
    "project's pystd figures)",
)
@click.option(
    "--chat-template-kwargs",
    default="{}",
    callback=lambda _ctx, _param, value: _json_object(value),
    help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}' for "
    "Qwen3: as `dflash generate` wrote the training replies (its data.chat_template_kwargs) "
    "[default: {}]",
)
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=float,
    help="0: the target's token at each position is its argmax (greedy verification). Above "
    "0: a draw from its distribution at this temperature, so a drafted token d is accepted "
    "with probability p(d), as a server verifies drafts when sampling; the text still "
    "follows the target's distribution",
)
@click.option(
    "--top-p",
    default=1.0,
    show_default=True,
    type=float,
    help="with --temperature: draw from the fewest most likely tokens holding this mass",
)
@click.option(
    "--top-k",
    default=0,
    show_default=True,
    type=int,
    help="with --temperature: draw from the K most likely tokens only, before --top-p (0: "
    "all). Servers apply the target's generation_config.json to what a request leaves out "
    "(Qwen3's: temperature 0.6, top-p 0.95, top-k 20): pass what your server applies",
)
@click.option(
    "--repetition-penalty",
    default=1.0,
    show_default=True,
    type=float,
    help="above 1: the logit of each token already in the prompt or reply divided by it "
    "(multiplied when negative) before sampling, greedy included: transformers' and vLLM's "
    "rule (Qwen2.5-Instruct's generation_config.json sets 1.05)",
)
@click.option(
    "--server-sampling",
    is_flag=True,
    help="sample as vLLM and SGLang serve a request that sets no sampling: --temperature, "
    "--top-p, --top-k and --repetition-penalty from the target's generation_config.json "
    "where it sets them, else the servers' defaults (temperature 1.0, every token, no "
    "penalty); those flags given here still win",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="with --temperature: the draws are keyed by (SEED, prompt, token index), so prompt "
    "lookup and the drafter meet the same sampled text",
)
@click.option(
    "--num-seeds",
    default=1,
    show_default=True,
    type=int,
    metavar="N",
    help="with --temperature: decode each prompt under seeds SEED .. SEED+N-1 and take the mean "
    "of its replies' tau (a sampled tau on a dozen prompts moves 10-30%% between seeds); the "
    "JSON's tau_per_seed gives the spread",
)
@click.option(
    "--json-out",
    default=None,
    callback=check_out_file,
    help="also write the figures to this JSON file",
)
@click.option(
    "--plot",
    default=None,
    callback=check_out_file,
    help="PNG of acceptance by draft position [default: beside --json-out, X.json -> X.png; "
    "none without it]",
)
@cli_errors
def evaluate(json_out: str | None, plot: str | None, server_sampling: bool, **kwargs: Any) -> None:
    """Online acceptance length (tau) of a drafter vs prompt lookup, under greedy
    verification (or sampled, --temperature or --server-sampling): tau, acceptance by draft
    position and the histogram of accepted tokens per forward."""

    from evaluation.online import EvaluateConfig, run_evaluate

    if plot is None and json_out:
        plot = plot_beside(json_out)
    init_logger()
    if server_sampling:
        _fill_served_sampling(kwargs)
    try:
        results = run_evaluate(EvaluateConfig(plot=plot, **kwargs))
    except KeyboardInterrupt:
        exit_interrupted(NOTHING_WRITTEN.format("prompt"))
    echo_json(results, json_out)


def _fill_served_sampling(kwargs: dict[str, Any]) -> None:
    """--server-sampling: the sampling flags left at their defaults take the served values."""
    from click.core import ParameterSource

    from common.served_sampling import log_served, served_sampling

    context = click.get_current_context()
    for key, value in served_sampling(kwargs["target"]).items():
        if context.get_parameter_source(key) is ParameterSource.DEFAULT:
            kwargs[key] = value
    log_served(kwargs)


@click.command(
    "evaluate-offline", short_help="Offline acceptance estimate of a drafter on a store."
)
@click.option("--drafter", required=True, help="exported drafter folder (RUN/export)")
@click.option(
    "--store",
    required=True,
    help="a store of the same target, holding the layers the drafter reads (all its tapped "
    "layers, or more)",
)
@device_option
@click.option(
    "--num-anchors", default=512, show_default=True, type=int, help="random anchors per sequence"
)
@click.option(
    "--max-sequences",
    default=None,
    type=int,
    metavar="N",
    help="only the first N sequences [default: all]",
)
@click.option(
    "--dtype",
    default="float32",
    show_default=True,
    type=click.Choice(["float32", "bfloat16"]),
    help="the drafter's compute dtype (as `dflash evaluate` runs it)",
)
@click.option(
    "--json-out",
    default=None,
    callback=check_out_file,
    help="also write the figures to this JSON file",
)
@cli_errors
def evaluate_offline(json_out: str | None, **kwargs: Any) -> None:
    """Offline acceptance estimate (per-slot accuracy vs the stored target argmax, implied
    tau) of an exported drafter over every sequence of a store, with random anchors, and
    `chained_tau`: anchors chained as online decoding chains them. On a store of the target's
    own continuation of the online prompts (`dflash generate` then `dflash extract`),
    chained_tau is the online tau computed from the store."""
    from evaluation.offline import OfflineEvalConfig, run_offline_eval

    init_logger()
    try:
        results = run_offline_eval(OfflineEvalConfig(**kwargs))
    except KeyboardInterrupt:
        exit_interrupted(NOTHING_WRITTEN.format("sequence"))
    echo_json(results, json_out)
