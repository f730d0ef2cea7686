"""Online acceptance length: what a drafter really buys.

The target verifies each drafted block with one forward: the longest prefix equal to the
target's own tokens is accepted, then the target's next token is added. tau is the number of
tokens gained per target forward (accepted + 1), averaged over the forwards of a prompt, then
over prompts (the prefill forward, which drafts nothing, is not counted).

The target's token at each position is its argmax (greedy, the default), or a draw from its
distribution at a temperature (`Sampling`): then a drafted token d is accepted with
probability p(d), and at the first rejection the target's token is a draw from p without d.
That is rejection sampling of drafts given as tokens without draft probabilities (a one-hot
draft distribution), p cut by temperature, top-k and top-p before the test: vLLM's default (argmax
drafts, draft_sample_method 'greedy', rejection_sample_method 'standard') and SGLang's DFlash
verification (accept thresholds at their default 1). The text follows the target's own
distribution exactly, and each verification accepts as many drafted tokens as such a server's
would, in distribution. A server that samples its drafts and tests them with their
probabilities (vLLM 'probabilistic'), verifies a block jointly (vLLM 'block') or relaxes the
test (SGLang thresholds below 1) accepts more.
Drafters: prompt lookup (copy the continuation of the longest earlier n-gram match, n = 4..1,
no training) and DFlash (evaluation.dflash_draft).

The target keeps a KV cache: each verification forward runs only the last accepted token and
the draft, and the cache is cropped back to the accepted length afterwards. The tapped hidden
states of accepted tokens go into a running feature buffer, so the drafter's context is never
recomputed either. evaluation.reference recomputes everything; the tests check that both
accept the same tokens.

Run: `dflash evaluate --target MODEL --data dev.jsonl.gz [--drafter RUN/export]`.

Legend: T tokens with features (every token but the newest), J tokens of one verification
forward (the newest token + the draft), K tapped layers, D hidden.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm
from transformers import DynamicCache

# (token ids, target features [T, K, D] of tokens[:-1] or None) -> drafted ids
DraftFn = Callable[[list[int], torch.Tensor | None], list[int]]

# Attention kernels for decoding, cuDNN's left out: torch prefers it on Hopper, and it plans a
# graph for every new sequence length, which here grows every step. At Qwen3-8B shape on an
# H200 that cost ~2 ms of CPU per layer per step: 117 ms per verification instead of ~10.
DECODE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class Sampling:
    """How the target picks its token at each position: temperature 0 takes the argmax
    (greedy); above it, a draw from softmax(logits / temperature) cut to its `top_k` most likely
    tokens (0: all), then to the `top_p` nucleus of what is left (the fewest most likely tokens
    holding that mass), as `dflash generate`, transformers and vLLM sample."""

    temperature: float = 0.0
    top_p: float = 1.0
    # the draws of prompt i are keyed by (seed, i, the token's index): the same for every method
    seed: int = 0
    # each prompt decoded under seeds seed .. seed + num_seeds - 1, its tau their mean
    num_seeds: int = 1
    # last, so the positional (temperature, top_p, seed, num_seeds) of earlier callers holds
    top_k: int = 0
    # above 1: the logit of every token already in the sequence (prompt included) divided by
    # it when positive, multiplied when negative, before the temperature: transformers' and
    # vLLM's repetition penalty, which changes greedy decoding too
    repetition_penalty: float = 1.0

    def problems(self) -> list[str]:
        out = []
        if self.num_seeds < 1:
            out.append(f"--num-seeds must be >= 1, got {self.num_seeds}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            out.append(f"--temperature must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            out.append(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            out.append(f"--top-k must be >= 0 (0: every token), got {self.top_k}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            out.append(
                f"--repetition-penalty must be a number > 0 (1: none), got "
                f"{self.repetition_penalty}"
            )
        if not 0 <= self.seed < 2**63:
            out.append(f"--seed must be within [0, 2**63), got {self.seed}")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_json(self) -> dict:
        return asdict(self)


def nucleus(probs_JV: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs_JV` with every token outside each row's top-`top_p` nucleus zeroed, by the rule
    and in the order of transformers' TopPLogitsWarper (vLLM's top-p is the same): ranked from
    the least likely up, a token whose running mass is at most 1 - top_p is dropped; the most
    likely always stays. The edge is found from the tail's own mass: a float32 softmax row over
    a 150k vocabulary sums to 1 + ~2e-5, and counting from the top (the mass ranked above a
    token against top_p) took that excess as head mass, dropping edge tokens of a flat row
    (one to hundreds at top_p 0.95-0.999). Tokens tied at the edge (frequent with bf16 logits)
    are kept as generate keeps them: the same ascending sort."""
    sorted_JV, order_JV = probs_JV.sort(-1)
    dropped_JV = sorted_JV.cumsum(-1) <= 1 - top_p
    dropped_JV[..., -1] = False
    return probs_JV.masked_fill(dropped_JV.scatter(-1, order_JV, dropped_JV), 0.0)


def top_k_only(probs_JV: torch.Tensor, top_k: int) -> torch.Tensor:
    """`probs_JV` with every token less likely than each row's `top_k`-th zeroed (tokens tied
    with it stay), renormalized: transformers' TopKLogitsWarper and vLLM's top-k, which cut
    before top-p, so the nucleus is taken of what is left."""
    if top_k >= probs_JV.size(-1):
        return probs_JV
    kth_J1 = probs_JV.topk(top_k, -1).values[..., -1:]
    kept_JV = probs_JV.masked_fill(probs_JV < kth_J1, 0.0)
    return kept_JV / kept_JV.sum(-1, keepdim=True)


def penalize_repeats(
    logits_JV: torch.Tensor, context: Sequence[int], first_index: int, penalty: float
) -> torch.Tensor:
    """`logits_JV` with transformers' and vLLM's repetition penalty: row j picks the token at
    index `first_index` + j, so the tokens it penalizes are context[:first_index + j]."""
    num_rows = logits_JV.size(0)
    if len(context) < first_index + num_rows - 1:
        raise ValueError(
            f"a repetition penalty needs the tokens before each row: {len(context)} given, "
            f"{first_index + num_rows - 1} needed"
        )
    ids = torch.tensor(list(context[: first_index + num_rows - 1]), device=logits_JV.device)
    seen_JV = torch.zeros(logits_JV.shape, dtype=torch.bool, device=logits_JV.device)
    seen_JV[:, ids[:first_index]] = True
    for j in range(1, num_rows):
        seen_JV[j:, ids[first_index + j - 1]] = True
    logits_JV = logits_JV.float()
    penalized_JV = torch.where(logits_JV < 0, logits_JV * penalty, logits_JV / penalty)
    return torch.where(seen_JV, penalized_JV, logits_JV)


class TokenPicker:
    """The target's token after each row of logits [J, V]: argmax, or a draw (`Sampling`).

    A draw is exact (the exponential race: argmax of p(x) / E_x, E_x ~ Exp(1) iid, picks x
    with probability p(x)), and its noise is keyed by the seed, the prompt (`start`) and the
    index in the sequence of the token drawn, not by how many draws came before. So every
    drafter meets the same sampled text (the token at index t depends on the text before it and
    the key alone, whatever was drafted), and their taus differ by the drafters, not by the
    text each happened to draw; the cached path and the recompute reference draw alike too.
    """

    def __init__(self, sampling: Sampling | None = None) -> None:
        self.sampling = sampling or Sampling()
        self._prompt_index = 0
        self._seed = self.sampling.seed

    def start(self, prompt_index: int, seed_offset: int = 0) -> None:
        """Key the draws of prompt `prompt_index` under seed + `seed_offset`: its text depends
        on no other prompt's or seed's."""
        self._prompt_index = prompt_index
        self._seed = self.sampling.seed + seed_offset

    def _noise(self, index: int, size: int, device: torch.device) -> torch.Tensor:
        """Exp(1) noise [size] for the token at `index` of the current prompt."""
        key = struct.pack("<QQQ", self._seed, self._prompt_index, index)
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        generator = torch.Generator(device).manual_seed(seed)
        noise = torch.empty(size, device=device).exponential_(generator=generator)
        # exponential_ may return 0: p / 0 would pick a token of any probability, zero included
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def __call__(
        self, logits_JV: torch.Tensor, first_index: int, context: Sequence[int] = ()
    ) -> list[int]:
        """Row j picks the token at index `first_index` + j of the sequence; `context`: the
        sequence's tokens (at least those before the last row's; read by a repetition
        penalty alone)."""
        if self.sampling.repetition_penalty != 1:
            logits_JV = penalize_repeats(
                logits_JV, context, first_index, self.sampling.repetition_penalty
            )
        if self.sampling.greedy:
            return logits_JV.argmax(-1).tolist()
        probs_JV = torch.softmax(logits_JV.float() / self.sampling.temperature, -1)
        if self.sampling.top_k:
            probs_JV = top_k_only(probs_JV, self.sampling.top_k)
        if self.sampling.top_p < 1:
            probs_JV = nucleus(probs_JV, self.sampling.top_p)
        size, device = probs_JV.size(-1), probs_JV.device
        noise_JV = torch.stack(
            [self._noise(first_index + j, size, device) for j in range(probs_JV.size(0))]
        )
        return (probs_JV / noise_JV).argmax(-1).tolist()


@dataclass
class AcceptanceResult:
    tau_per_prompt: list[float]
    forwards: int
    new_tokens: int
    # accepted_histogram[a]: verification forwards that gained exactly a drafted tokens
    # (a = 0..num_draft): a forward's accepted count as tau counts it, so a forward cut by the
    # budget or at a stop token counts only the drafted tokens it kept, not matching drafts
    # past the cut.
    accepted_histogram: list[int] = field(default_factory=list)
    seconds: float = 0.0
    stopped_at_eos: int = 0  # replies (prompt x seed) that ended at a stop token
    # the prompts (indices) whose reply was the stop token alone under every seed: not in
    # tau_per_prompt, which then lists the other prompts in order
    ended_at_prefill: list[int] = field(default_factory=list)
    # the mean over prompts of each seed's replies (one entry when greedy): the spread a
    # sampled tau has between seeds
    tau_per_seed: list[float] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return sum(self.tau_per_prompt) / max(len(self.tau_per_prompt), 1)

    @property
    def acceptance_by_position(self) -> list[float]:
        """For k = 1..num_draft: the fraction of forwards that accepted at least k drafted
        tokens (pooled over every forward of every prompt)."""
        total = max(sum(self.accepted_histogram), 1)
        tail = [sum(self.accepted_histogram[k:]) for k in range(len(self.accepted_histogram))]
        return [n / total for n in tail[1:]]

    def to_json(self) -> dict:
        return {
            "tau": self.tau,
            "tau_per_prompt": self.tau_per_prompt,
            "forwards": self.forwards,
            "new_tokens": self.new_tokens,
            "acceptance_by_position": self.acceptance_by_position,
            "accepted_histogram": self.accepted_histogram,
            "seconds": self.seconds,
            "stopped_at_eos": self.stopped_at_eos,
            "ended_at_prefill": self.ended_at_prefill,
            "tau_per_seed": self.tau_per_seed,
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds else None,
        }


def prompt_lookup_draft(tokens: list[int], num_draft: int, max_ngram: int = 4) -> list[int]:
    """Continuation of the most recent earlier occurrence of the longest suffix n-gram."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        pattern = tokens[-n:]
        # Search right to left among starts whose match ends before the current suffix.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                follow = tokens[start + n : start + n + num_draft]
                if follow:
                    return follow
    return []


class CachedTarget:
    """Target forwards over a KV cache, with a running buffer of tapped features; `picker`
    turns each forward's logits into the target's tokens (default: greedy).

    `prefill(prompt)` starts a sequence; `verify(token, draft)` runs the newest token and a
    draft on top of the cache; `commit(n)` keeps the first n of those inputs (cache and
    features) and drops the rest. `features` is then the tapped hidden states of every
    token the target has run and kept: all tokens but the newest.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tapped_layers: list[int] | None,
        picker: TokenPicker | None = None,
    ) -> None:
        self.model = model
        self.tapped_layers = tapped_layers
        self.picker = picker or TokenPicker()
        self.device = next(model.parameters()).device
        # transformers 5 renamed `past_key_values` to `cache` (the old name still warns).
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache = DynamicCache()
        self.num_kept = 0
        # the kept tokens, then the last forward's inputs: a repetition penalty reads them
        self._ids: list[int] = []
        self._feats_TKD: torch.Tensor | None = None
        self._pending_JKD: torch.Tensor | None = None

    @torch.inference_mode()
    @sdpa_kernel(DECODE_SDPA)
    def _forward(self, ids: list[int], **kwargs) -> list[int]:
        ids_1J = torch.tensor([ids], device=self.device)
        out = self.model(
            ids_1J,
            use_cache=True,
            output_hidden_states=self.tapped_layers is not None,
            **{self._cache_arg: self.cache},
            **kwargs,
        )
        if self.tapped_layers is not None:
            # layer i = output of decoder layer i = hidden_states[i + 1]
            self._pending_JKD = torch.stack(
                [out.hidden_states[i + 1][0] for i in self.tapped_layers], 1
            )
        logits_JV = out.logits[0]
        del self._ids[self.num_kept :]
        self._ids += ids
        # row j picks the token after input j; the last input's index is num_kept + len - 1
        first_index = self.num_kept + len(ids) - logits_JV.size(0) + 1
        return self.picker(logits_JV, first_index, self._ids)

    def prefill(self, prompt: list[int], capacity: int) -> int:
        """Run the prompt on a fresh cache; returns the target's next token. `capacity`:
        the most tokens the sequence will hold (sizes the feature buffer once)."""
        self.cache = DynamicCache()
        self.num_kept = 0
        self._ids = []
        (next_token,) = self._forward(prompt, logits_to_keep=1)
        if self._pending_JKD is not None:
            shape = (capacity, *self._pending_JKD.shape[1:])
            self._feats_TKD = self._pending_JKD.new_empty(shape)
        self.commit(len(prompt))
        return next_token

    def verify(self, token: int, draft: list[int]) -> list[int]:
        """The target's tokens [J] after each prefix of [token, *draft] (J = 1 + len(draft))."""
        return self._forward([token, *draft])

    def commit(self, num_inputs: int) -> None:
        """Keep the first `num_inputs` tokens of the last forward: the rest were rejected."""
        self.num_kept += num_inputs
        surplus = self.cache.get_seq_length() - self.num_kept
        assert surplus >= 0, (surplus, self.num_kept)
        if surplus:
            # A negative count removes that many tokens in every transformers version.
            self.cache.crop(-surplus)
        if self._pending_JKD is not None:
            assert self._feats_TKD is not None
            start = self.num_kept - num_inputs
            self._feats_TKD[start : self.num_kept] = self._pending_JKD[:num_inputs]
            self._pending_JKD = None

    @property
    def features(self) -> torch.Tensor | None:
        """Tapped features [T, K, D] of the kept tokens (a view into the buffer)."""
        return None if self._feats_TKD is None else self._feats_TKD[: self.num_kept]


def speculative_generate(
    target: CachedTarget,
    prompt: list[int],
    draft_fn: DraftFn,
    num_new: int,
    progress: tqdm | None = None,
    stop_ids: frozenset[int] = frozenset(),
    max_positions: int | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Speculative decoding; returns (generated tokens, tokens gained per forward,
    drafted tokens accepted per forward among those gained: a forward cut by the budget or at a
    stop token counts only the drafted tokens it kept).
    Decoding ends after `num_new` tokens, or at the first of `stop_ids` the target writes (kept,
    as a server keeps the end of sequence; drafted tokens accepted past it are dropped).
    `max_positions`: the target's limit (len(prompt) + num_new within it, checked by the
    caller); a draft that would run the target past it is cut to fit, as a server cuts drafts
    at its max length."""
    tokens = [*prompt, target.prefill(prompt, len(prompt) + num_new)]
    if progress is not None:
        progress.update(1)
    gains: list[int] = []
    accepted_counts: list[int] = []
    stopped = tokens[-1] in stop_ids
    while len(tokens) - len(prompt) < num_new and not stopped:
        draft = draft_fn(tokens, target.features)
        if max_positions is not None:
            # the newest token runs at position len(tokens) - 1, the draft after it
            draft = draft[: max(max_positions - len(tokens), 0)]
        # target_J[j]: the target's token after draft[:j]; the first j where it differs from
        # draft[j] ends the accepted prefix (under sampling: d kept with probability p(d))
        target_J = target.verify(tokens[-1], draft)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target_J[accepted]:
            accepted += 1
        room = num_new - (len(tokens) - len(prompt))
        gained = [*draft[:accepted], target_J[accepted]][:room]
        ends = [i for i, token in enumerate(gained) if token in stop_ids]
        if ends:
            gained, stopped = gained[: ends[0] + 1], True
        # The newest token and the accepted draft are now context; the bonus is the newest.
        target.commit(len(gained))
        tokens += gained
        gains.append(len(gained))
        # what tau counts of this forward: the drafted tokens among its gains, not the drafts
        # that matched past the budget or the stop token
        accepted_counts.append(min(accepted, len(gained)))
        if progress is not None:
            progress.update(len(gained))
    return tokens[len(prompt) :], gains, accepted_counts


def measure_acceptance(
    target: CachedTarget,
    prompts: list[list[int]],
    make_draft: Callable[[], DraftFn],
    num_new: int,
    num_draft: int,
    desc: str = "decode",
    stop_ids: frozenset[int] = frozenset(),
    max_positions: int | None = None,
) -> AcceptanceResult:
    """tau and acceptance by draft position over `prompts`; `make_draft` gives a fresh
    draft function per prompt (a drafter may cache its context), `num_draft` its block.
    Sampled with num_seeds > 1 (target.picker), each prompt is decoded once per seed and its
    tau is the mean of those replies'. With `stop_ids`, a reply whose first token (the
    prefill's) is one of them verified no draft: it is left out of tau, and a prompt whose
    every reply was that is listed in `ended_at_prefill`. `max_positions`: see
    speculative_generate."""
    import time

    sampling = target.picker.sampling
    num_seeds = 1 if sampling.greedy else sampling.num_seeds
    runs: list[list[float]] = [[] for _ in prompts]  # per prompt: its replies' taus
    per_seed: list[list[float]] = [[] for _ in range(num_seeds)]
    histogram = [0] * (num_draft + 1)
    forwards = new = stopped = 0
    start = time.perf_counter()
    total = len(prompts) * num_new * num_seeds
    with tqdm(total=total, desc=desc, unit="tok", dynamic_ncols=True) as bar:
        for index, prompt in enumerate(prompts):
            for offset in range(num_seeds):
                target.picker.start(index, offset)
                generated, gains, accepted_counts = speculative_generate(
                    target, prompt, make_draft(), num_new, bar, stop_ids, max_positions
                )
                bar.update(num_new - len(generated))  # what a stopped reply left of its budget
                stopped += generated[-1] in stop_ids
                if not gains:  # the target ended at once: there was nothing to draft
                    continue
                runs[index].append(sum(gains) / len(gains))
                per_seed[offset].append(runs[index][-1])
                forwards += len(gains)
                new += len(generated)
                for accepted in accepted_counts:
                    histogram[accepted] += 1
            taus = [sum(r) / len(r) for r in runs[: index + 1] if r]
            if taus:
                bar.set_postfix(tau=f"{sum(taus) / len(taus):.2f}")
    seconds = time.perf_counter() - start
    return AcceptanceResult(
        [sum(r) / len(r) for r in runs if r],
        forwards,
        new,
        histogram,
        seconds,
        stopped,
        [index for index, r in enumerate(runs) if not r],
        [sum(t) / len(t) for t in per_seed if t],
    )
