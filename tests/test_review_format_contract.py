"""FORMAT.md as a contract for the whole store: a reader written from its words alone (zarr,
numpy, json; the head file parsed by its safetensors header), run on tiny extracted stores (bf16
features with full logits on chat rows packed best-fit; fp8 features on text rows packed
next-fit), and its values checked twice: against the code's readers (`common.store.open_store`
and the training loader's `StoreSequences.read_row`), and against ground truth computed here
(the tokenizer's encoding of the rows, the ChatML assistant spans, the packing rules as written,
a fresh forward of each document alone through the tiny target).

Nothing of common/, stage1_extract/ or stage2_train/ is imported by the reader; the code's
readers are imported only in the comparison test.

Legend: n sequences of a shard, S tokens a sequence, K tapped layers, D hidden size, k top-k,
V vocabulary, L tokens of a document.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from test_extract import cli_extract, write_data
from test_review_nvfp4_contract import decode as nvfp4_rows_to_f32
from transformers import AutoModelForCausalLM, AutoTokenizer

F32 = np.float32
SMALL_TEXTS = [
    "the quick brown fox jumps over the lazy dog " * 4,  # 40-ish tokens
    "import os\nimport sys\n",
    "a prime number<|endoftext|>",  # an end the data hold: the pad id (0) inside a document
    "What is a prime number? " * 12,  # over 64 tokens: split
    "Blue.",
]
# a conversation with an empty assistant turn: kept, without loss tokens in that turn
EMPTY_TURN_ROW = {
    "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "Four."},
    ]
}


# ---------------------------------------------------------------------------------------------
# The reader: FORMAT.md's words, nothing else


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """FORMAT.md (HDF5 export): `bits.astype(uint32) << 16` viewed as float32."""
    return (bits.astype(np.uint32) << 16).view(F32)


def e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bits -> fp32: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, F32(-1), F32(1))
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * np.exp2(exp - 7.0))
    value = np.where((exp == 15) & (man == 7), np.nan, value)
    return (sign * value).astype(F32)


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A safetensors file by its own layout (8-byte header length, JSON header, data); bf16
    tensors come back decoded to fp32."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    metadata = header.pop("__metadata__", {})
    out = {}
    for name, entry in header.items():
        assert entry["dtype"] == "BF16", (name, entry["dtype"])  # FORMAT.md: bf16 tensors
        lo, hi = entry["data_offsets"]
        bits = np.frombuffer(raw[8 + size + lo : 8 + size + hi], dtype="<u2")
        out[name] = bf16_bits_to_f32(bits).reshape(entry["shape"])
    return out, metadata


@dataclass
class Shard:
    attrs: dict[str, Any]  # dflash_shard
    arrays: dict[str, np.ndarray]
    metas: dict[str, dict[str, Any]]  # each array's zarr.json


@dataclass
class Store:
    path: Path
    attrs: dict[str, Any]
    shards: list[Shard]
    head: dict[str, np.ndarray]
    head_metadata: dict[str, str]

    def sequence(self, g: int) -> tuple[Shard, int]:
        """FORMAT.md: shard i holds sequences [i * N, (i + 1) * N)."""
        per = self.attrs["sequences_per_shard"]
        return self.shards[g // per], g % per

    def hidden(self, shard: Shard) -> np.ndarray:
        """`hidden` decoded to fp32 [n, S, K, D] by "Hidden states"."""
        stored = shard.arrays["hidden"]
        if self.attrs["hidden_dtype"] == "bfloat16":
            return bf16_bits_to_f32(stored)
        if self.attrs["hidden_dtype"] == "nvfp4":  # rows of codes and block scales
            return nvfp4_rows_to_f32(stored, shard.arrays["hidden_scale"])
        assert self.attrs["hidden_dtype"] == "float8_e4m3fn"
        return e4m3_to_f32(stored) * shard.arrays["hidden_scale"][..., None]


def read_store(path: Path) -> Store:
    meta = json.loads((path / "zarr.json").read_text())
    assert meta["zarr_format"] == 3 and meta["node_type"] == "group"
    attrs = meta["attributes"]["dflash"]
    assert attrs["format"] == "dflash-offline-store"
    assert attrs["format_version"] in (1, 2)
    assert attrs["hidden_dtype"] in ("bfloat16", "float8_e4m3fn", "nvfp4")
    shards = []
    for i in range(attrs["num_shards"]):
        folder = path / "shards" / f"shard-{i:06d}"
        group = zarr.open_group(folder, mode="r")
        arrays = {name: array[...] for name, array in group.arrays()}
        metas = {name: json.loads((folder / name / "zarr.json").read_text()) for name in arrays}
        shards.append(Shard(dict(group.attrs["dflash_shard"]), arrays, metas))
    head, head_metadata = read_safetensors(path / "target_head.safetensors")
    return Store(path, attrs, shards, head, head_metadata)


def layout(store: Store, n: int, p: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """FORMAT.md's array tables: name -> (dtype, shape) of a shard of n sequences, p documents."""
    a = store.attrs
    S, K, D, k = a["seq_len"], len(a["tapped_layers"]), a["hidden_size"], a["topk"]
    out = {
        "tokens": ("int32", (n, S)),
        "loss_mask": ("uint8", (n, S)),
        "position_ids": ("int32", (n, S)),
        "document_ids": ("int32", (n, S)),
        "target_argmax": ("int32", (n, S)),
        "topk_ids": ("int32", (n, S, k)),
        "topk_logits": ("float32", (n, S, k)),
        "logsumexp": ("float32", (n, S)),
        "doc_source_index": ("int64", (p,)),
        "doc_piece": ("int32", (p,)),
        "doc_sequence": ("int32", (p,)),
        "doc_start": ("int32", (p,)),
        "doc_length": ("int32", (p,)),
    }
    if a["hidden_dtype"] == "bfloat16":
        out["hidden"] = ("uint16", (n, S, K, D))
    else:
        out["hidden"] = (
            "uint8",
            (n, S, K, D if a["hidden_dtype"] != "nvfp4" else D // 2 + D // 16),
        )
        out["hidden_scale"] = ("float32", (n, S, K))
    if a["full_logits"]:
        out["logits"] = ("uint16", (n, S, a["vocab_size"]))
    return out


# ---------------------------------------------------------------------------------------------
# Ground truth from the words of FORMAT.md and the data


def chat_document(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """FORMAT.md: the chat template's text tokenized without the tokenizer's defaults; loss on
    each assistant turn: its content and the template's end-of-turn text closing it (ChatML:
    `<|im_end|>`), not its header, nor the newline after the end of turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message["content"]:  # empty: no loss
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False) if i else ""
        start = len(before) + len("<|im_start|>assistant\n")
        end = start + len(message["content"]) + len("<|im_end|>")
        assert text[start:end] == message["content"] + "<|im_end|>"
        spans.append((start, end))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(lo < e and s < hi for s, e in spans)) for lo, hi in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def plan(lengths: list[int], seq_len: int, strategy: str) -> list[tuple[int, int, int, int]]:
    """FORMAT.md's packing: pieces (row, piece, sequence, start), sorted by (sequence, start).
    Documents over seq_len split into consecutive pieces of seq_len tokens, each placed as a
    document of its own, in dataset order; next_fit: into the current sequence when it fits,
    else a new one; best_fit: into the open sequence with the least free room that holds it
    (ties: the one that reached that room last), else a new one."""
    placed, room, reached = [], [], []  # room and last placement of each sequence
    for row, length in enumerate(lengths):
        for piece, lo in enumerate(range(0, length, seq_len)):
            size = min(seq_len, length - lo)
            if strategy == "next_fit":
                fits = [len(room) - 1] if room and room[-1] >= size else []
            else:
                fits = [s for s in range(len(room)) if room[s] >= size]
            if fits:
                least = min(room[s] for s in fits)
                seq = max((s for s in fits if room[s] == least), key=lambda s: reached[s])
            else:
                seq = len(room)
                room.append(seq_len)
                reached.append(-1)
            placed.append((row, piece, seq, seq_len - room[seq]))
            room[seq] -= size
            reached[seq] = len(placed)
    return sorted(placed, key=lambda p: (p[2], p[3]))


# ---------------------------------------------------------------------------------------------
# The stores


@pytest.fixture(scope="module")
def stores(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("format-contract")
    chat = write_data(folder)
    with chat.open("a") as f:
        f.write(json.dumps(EMPTY_TURN_ROW) + "\n")
    text = folder / "text.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in SMALL_TEXTS))
    sets = {
        "chat_bf16": (chat, ["store.hidden_dtype=bfloat16", "verifier.store_full_logits=true"]),
        "text_fp8": (text, ["packing.strategy=next_fit"]),
    }
    out = {}
    for name, (data, extra) in sets.items():
        layers = "target.tapped_layers=[0,1,3]"  # the last layer: after the final norm
        result = cli_extract(tiny_qwen3, data, folder / name, layers, *extra)
        assert result.exit_code == 0, result.output
        out[name] = folder / name
    return out


def rows_of(store: Store) -> list[dict[str, Any]]:
    path = Path(store.attrs["dataset"]["path"])
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def documents_of(store: Store, tokenizer) -> list[tuple[list[int], list[int]]]:
    """Every row's (token ids, loss mask) by "Tokens of a document"."""
    docs = []
    for row in rows_of(store):
        if "messages" in row:
            docs.append(chat_document(tokenizer, row["messages"]))
        else:  # the tiny tokenizer puts nothing before a text nor after it
            ids = tokenizer(row["text"])["input_ids"]
            docs.append((list(ids), [1] * len(ids)))
    return docs


@pytest.fixture(scope="module")
def target(tiny_qwen3: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_qwen3)


NAMES = ["chat_bf16", "text_fp8"]


# ---------------------------------------------------------------------------------------------
# The contract


@pytest.mark.parametrize("name", NAMES)
def test_layout_attributes_and_files(stores, name: str) -> None:
    store = read_store(stores[name])
    check_layout_attributes_and_files(store)
    # `skipped_rows`: without data.on_invalid=skip too, the empty assistant turns kept
    c = store.attrs["counts"]
    assert c.get("skipped_rows") == ({"empty_assistant_turn": 1} if name == "chat_bf16" else None)
    assert store.attrs["dataset"]["format"] == ("messages" if name == "chat_bf16" else "text")


def check_layout_attributes_and_files(store: Store) -> None:
    """Every store: the files, each shard's arrays (dtype, shape, codecs, `files`) and counts,
    and the root counts as their sums."""
    a = store.attrs
    assert a["complete"] is True
    assert (store.path / ".dflash-writer.lock").read_bytes() == b""  # released: emptied
    assert not list(store.path.glob(".tmp-*")) and not list(store.path.glob("shards/.tmp-*"))
    found = sorted(p.name for p in (store.path / "shards").iterdir())
    assert found == [f"shard-{i:06d}" for i in range(a["num_shards"])]
    per, totals = a["sequences_per_shard"], dict.fromkeys(["n", "p", "tok", "loss"], 0)
    for i, shard in enumerate(store.shards):
        s = shard.attrs
        n, p = s["num_sequences"], s["num_documents"]
        assert s["index"] == i
        assert n == (per if i < a["num_shards"] - 1 else n) and 1 <= n <= per
        want = layout(store, n, p)
        assert set(shard.arrays) == set(want)
        for array_name, (dtype, shape) in want.items():
            got = shard.arrays[array_name]
            assert (str(got.dtype), got.shape) == (dtype, shape), array_name
            meta = shard.metas[array_name]
            assert meta["data_type"] == dtype and tuple(meta["shape"]) == shape
            if len(shape) == 1:  # per-document: one plain chunk
                assert meta["chunk_grid"]["configuration"]["chunk_shape"] == list(shape)
                assert [c["name"] for c in meta["codecs"]][-1] in ("zstd", "crc32c")
            else:  # per-token: sharded, inner chunks (1, chunk_tokens, ...)
                (codec,) = meta["codecs"]
                assert codec["name"] == "sharding_indexed"
                inner = codec["configuration"]["chunk_shape"]
                chunk = a["extract_config"]["store"]["chunk_tokens"]
                assert inner == [1, min(chunk, shape[1]), *shape[2:]], array_name
                names = [c["name"] for c in codec["configuration"]["codecs"]]
                assert "crc32c" in names or any(
                    c["name"] == "zstd" and c["configuration"]["checksum"]
                    for c in codec["configuration"]["codecs"]
                ), names
        # `files`: every file of the shard but its own zarr.json, with its size
        folder = store.path / "shards" / f"shard-{i:06d}"
        on_disk = {
            str(f.relative_to(folder)): f.stat().st_size
            for f in folder.rglob("*")
            if f.is_file() and f != folder / "zarr.json"
        }
        assert s["files"] == on_disk
        for array_name, (_, shape) in want.items():  # per-document: none where all are 0
            chunks = [f for f in s["files"] if f.startswith(f"{array_name}/c/")]
            one = len(shape) > 1 or shard.arrays[array_name].any()
            assert len(chunks) == int(one), (array_name, chunks)
        real = shard.arrays["document_ids"] >= 0
        assert s["num_tokens"] == int(real.sum()) == int(shard.arrays["doc_length"].sum())
        assert s["num_loss_tokens"] == int(shard.arrays["loss_mask"].sum())
        totals["n"] += n
        totals["p"] += p
        totals["tok"] += s["num_tokens"]
        totals["loss"] += s["num_loss_tokens"]
    c = a["counts"]
    assert (c["sequences"], c["documents"]) == (totals["n"], totals["p"])
    assert (c["tokens"], c["loss_tokens"]) == (totals["tok"], totals["loss"])
    assert c["padding_tokens"] == totals["n"] * a["seq_len"] - totals["tok"]
    pieces = [(sh.arrays["doc_source_index"], sh.arrays["doc_piece"]) for sh in store.shards]
    sources = np.concatenate([src for src, _ in pieces])
    assert c["source_documents"] == len(np.unique(sources))
    assert c["split_documents"] == len(np.unique(np.concatenate([s[p > 0] for s, p in pieces])))
    assert a["dataset"]["num_rows"] == len(rows_of(store))


@pytest.mark.parametrize("name", NAMES)
def test_packing_tokens_and_loss_masks(stores, target, name: str) -> None:
    """Tokens, loss masks, positions and document ids against the tokenizer's encoding of the
    rows, placed by the documented packing rules; padding by its documented values."""
    _, tokenizer = target
    store = read_store(stores[name])
    check_packing(store, dict(enumerate(documents_of(store, tokenizer))), tokenizer)
    if name == "text_fp8":  # `<|endoftext|>` in a text is its id, which is also the pad id
        pad = store.attrs["tokenizer"]["pad_token_id"]
        assert any(
            (sh.arrays["tokens"][sh.arrays["document_ids"] >= 0] == pad).any()
            for sh in store.shards
        )


def check_packing(store: Store, docs: dict[int, tuple[list[int], list[int]]], tokenizer) -> None:
    """The stored pieces, tokens, loss masks, positions, document ids, padding, split or
    truncated counts and the documents' fingerprint against `docs`: source row -> (ids, loss
    mask) of every row that became a document, by "Tokens of a document"."""
    a, S = store.attrs, store.attrs["seq_len"]
    packing = a["extract_config"]["packing"]
    rows = sorted(docs)  # the documents in dataset order, skipped rows left out
    lengths = [len(docs[r][0]) for r in rows]
    if packing["overlong"] == "truncate":  # one piece of the first S tokens
        lengths = [min(n, S) for n in lengths]
    want_pieces = [
        (rows[i], piece, seq, start)
        for i, piece, seq, start in plan(lengths, S, packing["strategy"])
    ]
    got_pieces = []
    pad = a["tokenizer"]["pad_token_id"]
    assert pad == tokenizer.pad_token_id
    # reserved_token_id: the lowest added id named like a mask, declared as the mask or not
    added = sorted(tokenizer.get_added_vocab().items(), key=lambda item: item[1])
    masks = [i for token, i in added if "mask" in token.lower()]
    assert a["tokenizer"]["reserved_token_id"] == masks[0] == a["tokenizer"]["mask_token_id"]
    for i, shard in enumerate(store.shards):
        x = shard.arrays
        first = i * a["sequences_per_shard"]
        order = list(zip(x["doc_sequence"].tolist(), x["doc_start"].tolist(), strict=True))
        assert order == sorted(order)  # the per-document arrays: by (sequence, start)
        covered = np.zeros(x["tokens"].shape, bool)
        for d in range(len(x["doc_length"])):
            seq, start, length = (int(x[k][d]) for k in ("doc_sequence", "doc_start", "doc_length"))
            row, piece = int(x["doc_source_index"][d]), int(x["doc_piece"][d])
            got_pieces.append((row, piece, first + seq, start))
            ids, mask = docs[row]
            span = slice(start, start + length)
            lo = piece * S  # piece i: the document's tokens from i * seq_len
            assert x["tokens"][seq, span].tolist() == ids[lo : lo + length]
            assert x["loss_mask"][seq, span].tolist() == mask[lo : lo + length]
            assert x["position_ids"][seq, span].tolist() == list(range(length))
            assert (x["document_ids"][seq, span] == d).all()
            covered[seq, span] = True
        for seq in range(x["tokens"].shape[0]):  # documents back to back from 0, then padding
            used = int(covered[seq].sum())
            assert covered[seq, :used].all() and used > 0
        pad_ = ~covered
        assert (x["document_ids"][pad_] == -1).all() and (x["document_ids"][covered] >= 0).all()
        assert (x["tokens"][pad_] == pad).all() and not x["loss_mask"][pad_].any()
        assert not x["position_ids"][pad_].any()
        assert not x["hidden"][pad_].any()
        if "hidden_scale" in x:
            assert (x["hidden_scale"][pad_] == 1.0).all()
        for array_name in ("target_argmax", "topk_ids", "topk_logits", "logsumexp", "logits"):
            if array_name in x:  # the verifier arrays: zeros on padding
                assert not x[array_name][pad_].any(), array_name
    assert got_pieces == want_pieces
    split = packing["overlong"] == "split"
    for shard in store.shards:  # a split document is counted by the shard of its piece 0
        x = shard.arrays
        full = np.array([len(docs[r][0]) for r in x["doc_source_index"].tolist()], np.int64)
        over = full > S
        s = shard.attrs
        assert s["split_documents"] == (int((over & (x["doc_piece"] == 0)).sum()) if split else 0)
        assert s["truncated_documents"] == (0 if split else int(over.sum()))
        assert s["dropped_tokens"] == (0 if split else int((full - S)[over].sum()))
    c = a["counts"]
    for key in ("split_documents", "truncated_documents", "dropped_tokens"):
        assert c[key] == sum(shard.attrs[key] for shard in store.shards), key
    assert c["source_documents"] == len(docs)
    # fingerprints.documents_sha256: every row's ids (int32) then every row's masks (uint8),
    # whole (before splitting or truncation), skipped rows left out
    digest = hashlib.sha256(b"input_ids")
    for r in rows:
        digest.update(np.asarray(docs[r][0], np.int32).tobytes())
    digest.update(b"loss_mask")
    for r in rows:
        digest.update(np.asarray(docs[r][1], np.uint8).tobytes())
    assert a["fingerprints"]["documents_sha256"] == digest.hexdigest()


def assert_within_precision(
    hidden_dtype: str, got_LD: np.ndarray, want_LD: np.ndarray, what
) -> None:
    """Decoded features against a fresh forward's, within what "Hidden states" promises of
    `hidden_dtype`, plus the forward's own noise (1e-5 of the row's amax)."""
    amax = np.abs(want_LD).max(-1, keepdims=True)
    if hidden_dtype == "bfloat16":
        assert (np.abs(got_LD - want_LD) <= 2.0**-8 * np.abs(want_LD) + 1e-6).all(), what
    elif hidden_dtype == "float8_e4m3fn":  # 2^-4 |h| + 2^-18 amax(|h|)
        bound = 2.0**-4 * np.abs(want_LD) + 2.0**-18 * amax + 1e-5 * amax
        assert (np.abs(got_LD - want_LD) <= bound).all(), what
    else:
        # nvfp4: a block's squared error is at most c6's, under which each of its 16 values is
        # within 18% of the block's amax a, plus 6 * 2^-10 * scale where c6 is subnormal: the
        # block's error, as a vector, within 4 (sqrt 16) times that
        assert hidden_dtype == "nvfp4", hidden_dtype
        L, D = want_LD.shape
        scale = amax / (6 * 448)
        a = np.abs(want_LD).reshape(L, D // 16, 16).max(-1)
        error = np.sqrt(np.square(got_LD - want_LD).reshape(L, D // 16, 16).sum(-1))
        assert (error <= 4 * (0.18 * a + 6 * 2.0**-10 * scale + 1e-5 * amax)).all(), what


@pytest.mark.parametrize("name", NAMES)
def test_values_equal_a_fresh_forward_of_each_document(stores, target, name: str) -> None:
    model, _ = target
    store = read_store(stores[name])
    a, k = store.attrs, store.attrs["topk"]
    checked = 0
    for shard in store.shards:
        x, hidden_nSKD = shard.arrays, store.hidden(shard)
        for d in range(len(x["doc_length"])):
            seq, start, length = (
                int(x[k_][d]) for k_ in ("doc_sequence", "doc_start", "doc_length")
            )
            span = slice(start, start + length)
            ids = torch.from_numpy(x["tokens"][seq, span].astype(np.int64))[None]
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            logits_LV = out.logits[0].numpy()
            for j, layer in enumerate(a["tapped_layers"]):
                want = out.hidden_states[layer + 1][0].numpy()
                assert_within_precision(
                    a["hidden_dtype"], hidden_nSKD[seq, span, j], want, (name, layer)
                )
            top = torch.from_numpy(logits_LV).topk(k, dim=-1)
            np.testing.assert_allclose(x["topk_logits"][seq, span], top.values.numpy(), atol=1e-4)
            stored_ids = x["topk_ids"][seq, span]
            np.testing.assert_allclose(  # the ids' own logits (robust to near ties)
                np.take_along_axis(logits_LV, stored_ids.astype(np.int64), -1),
                x["topk_logits"][seq, span],
                atol=1e-4,
            )
            assert (np.diff(x["topk_logits"][seq, span], axis=-1) <= 0).all()
            assert (x["target_argmax"][seq, span] == logits_LV.argmax(-1)).all()
            assert (x["target_argmax"][seq, span] == stored_ids[:, 0]).all()
            lse = torch.logsumexp(torch.from_numpy(logits_LV), -1).numpy()
            np.testing.assert_allclose(x["logsumexp"][seq, span], lse, atol=1e-4)
            if a["full_logits"]:
                full = bf16_bits_to_f32(x["logits"][seq, span])
                assert (np.abs(full - logits_LV) <= 2.0**-8 * np.abs(logits_LV) + 1e-6).all()
            checked += 1
    assert checked == a["counts"]["documents"]


@pytest.mark.parametrize("name", NAMES)
def test_head_file_is_the_targets(stores, target, name: str) -> None:
    model, _ = target
    store = read_store(stores[name])
    a = store.attrs
    want = {
        "embed_tokens.weight": model.get_input_embeddings().weight,
        "norm.weight": model.model.norm.weight,
        "lm_head.weight": model.get_output_embeddings().weight,
    }
    assert set(store.head) == set(want)
    for key, weight in want.items():
        bf16 = weight.detach().to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(store.head[key], bf16, err_msg=key)
    D, V = a["hidden_size"], a["vocab_size"]
    assert store.head["lm_head.weight"].shape == (V, D)
    assert store.head["embed_tokens.weight"].shape[1] == D
    assert store.head["norm.weight"].shape == (D,)
    assert float(store.head_metadata["rms_norm_eps"]) == model.config.rms_norm_eps


@pytest.mark.parametrize("name", NAMES)
def test_the_codes_readers_read_the_same(stores, name: str) -> None:
    """The code's own reader of the root and the training loader's reading of each sequence
    give what the reader of the words gives."""
    from common.store import open_store
    from stage2_train.data import StoreSequences

    store = read_store(stores[name])
    info = open_store(stores[name], require_complete=True)
    assert info.attrs == store.attrs
    dataset = StoreSequences(
        info,
        num_anchors=4,
        per_document=False,
        block_size=4,
        label_target="argmax",
        distill=True,
        seed=0,
    )
    scaled = store.attrs["hidden_dtype"] != "bfloat16"
    for g in range(store.attrs["counts"]["sequences"]):
        shard, row = store.sequence(g)
        got = dataset.read_row(g)
        for array_name, value in got.items():
            want = shard.arrays[array_name][row]
            if array_name == "hidden" and not scaled:
                np.testing.assert_array_equal(value.float().numpy(), bf16_bits_to_f32(want))
            else:
                np.testing.assert_array_equal(value.numpy(), want, err_msg=array_name)
        if scaled:  # decoded as the words decode it
            from common.store import decode_scaled_hidden

            decoded = decode_scaled_hidden(
                got["hidden"], got["hidden_scale"], store.attrs["hidden_size"], torch.float32
            )
            np.testing.assert_array_equal(decoded.numpy(), store.hidden(shard)[row])
