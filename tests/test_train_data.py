"""Stage-2 loader: the factory store against the contract, the epoch plan, items and batches,
and the input checks of `dflash train`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from store_factory import FactorySpec, build_store

from common.config import build_config
from common.store import DOCUMENT_ARRAYS, SEQUENCE_ARRAYS, StoreError, open_store
from stage2_train.attention import BlockAttention
from stage2_train.config import TrainConfig
from stage2_train.data import StoreSequences, collate, make_loader
from stage2_train.inputs import check_inputs
from stage2_train.masks import MaskTables, anchor_mask_tables, context_intervals
from stage2_train.plan import EpochPlan, HoldoutSampler, PlanSampler, split_store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("store") / "s", FactorySpec(num_sequences=12))


def _dataset(store: Path, **kw) -> StoreSequences:
    args = dict(
        num_anchors=8,
        per_document=False,
        block_size=4,
        label_target="argmax",
        distill=False,
        seed=0,
    )
    return StoreSequences(open_store(store), **{**args, **kw})


def test_factory_store_follows_the_contract(store: Path) -> None:
    info = open_store(store, require_complete=True)
    dims = {"num_tapped": 2, "hidden_size": 64, "topk": 4}
    for index in range(info.num_shards):
        group = zarr.open_group(store / "shards" / f"shard-{index:06d}", mode="r")
        n = group.attrs["dflash_shard"]["num_sequences"]
        for name, (dtype, trailing) in SEQUENCE_ARRAYS.items():
            assert group[name].dtype == np.dtype(dtype), name
            assert group[name].shape == (n, info.seq_len, *(dims[d] for d in trailing)), name
        for name, dtype in DOCUMENT_ARRAYS.items():
            assert group[name].dtype == np.dtype(dtype), name
        docs = group["document_ids"][...]
        for d, (seq, start, length) in enumerate(
            zip(
                group["doc_sequence"][...],
                group["doc_start"][...],
                group["doc_length"][...],
                strict=True,
            )
        ):
            assert (docs[seq, start : start + length] == d).all()
            assert (group["position_ids"][seq, start : start + length] == np.arange(length)).all()


@pytest.mark.parametrize("num_train", [7, 12])
@pytest.mark.parametrize(("world", "batch", "accum"), [(1, 1, 1), (2, 1, 1), (2, 2, 1), (3, 1, 2)])
def test_plan_covers_each_sequence_once_on_disjoint_ranks(
    num_train: int, world: int, batch: int, accum: int
) -> None:
    plans = [EpochPlan(num_train, world, r, batch, accum, seed=3) for r in range(world)]
    per_rank = [[key for mb in p.micro_batches(epoch=1) for key in mb] for p in plans]
    assert len({len(keys) for keys in per_rank}) == 1  # every rank runs the same steps
    real = [key[0] for keys in per_rank for key in keys if not key[2]]
    assert sorted(real) == list(range(num_train))  # each once, none dropped
    pads = sum(key[2] for keys in per_rank for key in keys)
    assert pads == plans[0].steps_per_epoch * world * batch * accum - num_train
    # resuming at a step yields exactly the tail of the epoch
    tail = list(plans[0].micro_batches(epoch=1, start_step=1))
    assert tail == list(plans[0].micro_batches(epoch=1))[accum:]


def test_epoch_orders_differ_and_repeat() -> None:
    plan = EpochPlan(50, 1, 0, 1, 1, seed=0)
    assert torch.equal(plan.order(2), EpochPlan(50, 1, 0, 1, 1, seed=0).order(2))
    assert not torch.equal(plan.order(0), plan.order(1))
    assert not torch.equal(plan.order(0), EpochPlan(50, 1, 0, 1, 1, seed=1).order(0))


def test_items_are_deterministic_and_labels_are_next_tokens(store: Path) -> None:
    a, b = _dataset(store), _dataset(store)
    x, y = a[(5, 2, False)], b[(5, 2, False)]
    assert torch.equal(x["anchors_A"], y["anchors_A"])
    assert not torch.equal(x["anchors_A"], a[(5, 3, False)]["anchors_A"])  # resampled per epoch
    # The factory's target argmax is the true next token, so after the shift by one the label
    # of slot k is the data token at anchor + k: an independent check of the shift.
    tokens_S = x["tokens_S"]
    for anchor, labels_B, weights_B in zip(
        x["anchors_A"], x["labels_AB"], x["weights_AB"], strict=True
    ):
        for k in range(1, 4):
            if weights_B[k] > 0:
                assert labels_B[k] == tokens_S[anchor + k]
    data = _dataset(store, label_target="data")[(5, 2, False)]
    assert torch.equal(
        data["labels_AB"][data["weights_AB"] > 0], x["labels_AB"][x["weights_AB"] > 0]
    )
    assert a[(5, 2, True)]["weights_AB"].sum() == 0  # padding items carry no loss


def test_distill_rows_are_shifted_like_labels(store: Path) -> None:
    item = _dataset(store, distill=True)[(3, 0, False)]
    valid = item["weights_AB"] > 0
    # factory: top-1 id = target argmax, so the top-1 of slot k is its label
    assert torch.equal(item["topk_ids_ABk"][..., 0][valid], item["labels_AB"][valid])
    assert (item["topk_logprobs_ABk"] < 0).all()


def test_collate_concatenates_without_crossing_sequences(store: Path) -> None:
    ds = _dataset(store)
    items = [ds[(1, 0, False)], ds[(7, 0, False)]]
    batch = collate(items)
    S = items[0]["tokens_S"].numel()
    valid = batch.anchors_A >= 0
    assert not (batch.anchors_A[valid.sum() :] >= 0).any()  # padding anchors at the end
    assert (batch.anchors_A[valid].diff() > 0).all()  # sorted
    ids0 = set(batch.document_ids_T[:S].tolist()) - {-1}
    ids1 = set(batch.document_ids_T[S:].tolist()) - {-1}
    assert ids0 and ids1 and not ids0 & ids1
    for a, labels_B, w_B in zip(batch.anchors_A, batch.labels_AB, batch.weights_AB, strict=True):
        for k in range(1, 4):
            if w_B[k] > 0:
                assert labels_B[k] == batch.tokens_T[a + k]
                assert batch.document_ids_T[a + k] == batch.document_ids_T[a]


def test_loader_batches_carry_the_mask_tables_of_their_anchors(store: Path) -> None:
    """A worker's collate builds the attention mask's tables (crossing the process boundary
    with the batch); they are those of the batch's own anchors and documents."""
    ds = _dataset(store)
    sampler = PlanSampler(EpochPlan(10, 1, 0, 2, 1, seed=0))
    loader = make_loader(ds, sampler, num_workers=1, prefetch=2, pin_memory=False)
    batch = next(iter(loader))
    assert isinstance(batch.mask_tables, MaskTables)
    lo_A, hi_A = context_intervals(batch.anchors_A, batch.document_ids_T)
    want = anchor_mask_tables(lo_A, hi_A, batch.document_ids_T.numel(), 4)
    for name, got, expected in zip(MaskTables._fields, batch.mask_tables, want, strict=True):
        assert torch.equal(got, expected), name


def test_loader_for_the_sdpa_path_builds_no_tables(store: Path) -> None:
    """mask_tables=False (train's SDPA backend): no tables cross the worker boundary, and the
    dense mask the attention builds from the anchors is the one the tables' intervals give."""
    ds = _dataset(store)
    sampler = PlanSampler(EpochPlan(10, 1, 0, 2, 1, seed=0))
    plain = next(iter(make_loader(ds, sampler, 1, 2, False, mask_tables=False)))
    with_tables = next(iter(make_loader(ds, sampler, 1, 2, False)))
    assert plain.mask_tables is None and isinstance(with_tables.mask_tables, MaskTables)
    assert torch.equal(plain.anchors_A, with_tables.anchors_A)
    dense = BlockAttention(plain.anchors_A, plain.document_ids_T, 4, "sdpa")
    tabled = BlockAttention(
        plain.anchors_A, plain.document_ids_T, 4, "sdpa", tables=with_tables.mask_tables
    )
    assert dense.mask_1QK is not None and torch.equal(dense.mask_1QK, tabled.mask_1QK)


def test_loader_workers_open_shards_lazily_and_match(store: Path) -> None:
    ds = _dataset(store)
    sampler = PlanSampler(EpochPlan(10, 1, 0, 2, 1, seed=0))
    sampler.set_position(epoch=1, start_step=2)
    loader = make_loader(ds, sampler, num_workers=1, prefetch=2, pin_memory=False)
    assert ds._shards == {}  # nothing opened before the first batch
    with_workers = list(loader)
    inline = list(make_loader(ds, sampler, num_workers=0, prefetch=2, pin_memory=False))
    assert len(with_workers) == len(inline) == 3
    for x, y in zip(with_workers, inline, strict=True):
        assert torch.equal(x.indices, y.indices) and torch.equal(x.hidden_TKD, y.hidden_TKD)
        assert torch.equal(x.labels_AB, y.labels_AB)


def test_holdout_is_split_over_ranks(store: Path) -> None:
    split = split_store(open_store(store), 5)
    keys = [k for r in range(2) for mb in HoldoutSampler(split, 2, r, 2) for k in mb]
    assert sorted(k[0] for k in keys if not k[2]) == list(range(7, 12))
    assert len(keys) == 8 and sum(k[2] for k in keys) == 3


def _cfg(store: Path, tmp: Path, *sets: str) -> TrainConfig:
    base = [f"data.store={store}", f"run.out={tmp / 'run'}"]
    return build_config(TrainConfig, "configs/debug.yaml", "train", [*base, *sets])


def _rewrite_attrs(store: Path, **changes) -> None:
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["dflash"].update(changes)
    (store / "zarr.json").write_text(json.dumps(meta))


def test_input_checks_name_the_problem(store: Path, tmp_path: Path) -> None:
    info, shape = check_inputs(_cfg(store, tmp_path))
    assert shape.mask_token_id == 3 and shape.num_tapped == 2
    cases = {
        "drafter.mask_token_id=48": "mask_token_id 48",
        "drafter.hidden_size=32": "hidden_size=32",
        "drafter.num_attention_heads=3": "multiple of num_key_value_heads",
        "data.holdout_sequences=12": "cannot spare",
    }
    for override, message in cases.items():
        with pytest.raises(ValueError, match=message):
            check_inputs(_cfg(store, tmp_path, override))


@pytest.mark.parametrize(
    ("spec", "attrs", "message"),
    [
        (FactorySpec(format_version=99), {}, "format version 99 is not supported"),
        (FactorySpec(complete=False), {}, "extraction is not finished"),
        (FactorySpec(num_sequences=0), {}, "0 sequences"),
        (FactorySpec(), {"tapped_layers": [0, 1, 2]}, "3 tapped layers"),
    ],
)
def test_bad_stores_are_refused(
    spec: FactorySpec, attrs: dict, message: str, tmp_path: Path
) -> None:
    store = build_store(tmp_path / "bad", spec)
    if attrs:
        _rewrite_attrs(store, **attrs)
    with pytest.raises(StoreError if not attrs else ValueError, match=message):
        check_inputs(_cfg(store, tmp_path))


def test_an_unfinished_store_names_the_command_that_completes_it(tmp_path: Path) -> None:
    """An extracted store resumes by its `dflash extract`, an imported one (converted_from) by
    its `dflash convert`: the refusal named extract for both (helper-108's report)."""
    extracted = build_store(tmp_path / "extracted", FactorySpec(complete=False))
    with pytest.raises(StoreError, match="rerun the same `dflash extract` command"):
        open_store(extracted, require_complete=True)
    imported = build_store(tmp_path / "imported", FactorySpec(complete=False))
    _rewrite_attrs(imported, converted_from={"hdf5": "/data/in.h5", "verifier": "input"})
    with pytest.raises(StoreError, match="rerun the same `dflash convert` command"):
        open_store(imported, require_complete=True)


def _pick_mask(explicit, embed_rows, zero_rows=(), **tok):
    from types import SimpleNamespace

    from stage2_train.inputs import resolve_mask_token

    cfg = SimpleNamespace(drafter=SimpleNamespace(mask_token_id=explicit))
    info = SimpleNamespace(attrs={"tokenizer": {"vocab_size": 100, **tok}})
    embed_VD = torch.randn(embed_rows, 8, generator=torch.Generator().manual_seed(0))
    embed_VD[list(zero_rows)] = 0
    return resolve_mask_token(cfg, info, embed_VD.bfloat16())


def test_mask_token_fallbacks_in_order() -> None:
    """explicit > tokenizer mask > first row past the vocabulary > reserved token > pad."""
    pick = _pick_mask
    assert pick(7, 128, mask_token_id=5) == 7
    assert pick(None, 128, mask_token_id=5, reserved_token_id=90, pad_token_id=0) == 5
    assert pick(None, 128, reserved_token_id=90, pad_token_id=0) == 100  # Qwen3: spare rows
    assert pick(None, 100, reserved_token_id=90, pad_token_id=0) == 90  # Llama-3: reserved
    assert pick(None, 100, pad_token_id=0) == 0


def test_mask_token_skips_zero_embedding_rows() -> None:
    """A zero mask row makes every mask slot's first query zero (pystd-28m's pad row is):
    automatic candidates with such rows are skipped, an explicit one is refused."""
    pick = _pick_mask
    assert pick(None, 128, zero_rows=[100], reserved_token_id=90, pad_token_id=0) == 90
    assert pick(None, 100, zero_rows=[0], reserved_token_id=3, pad_token_id=0) == 3
    with pytest.raises(ValueError, match=r"mask_token_id 5: its embedding row is \(near\) zero"):
        pick(5, 100, zero_rows=[5], pad_token_id=0)
    with pytest.raises(ValueError, match="the pad token 0 have .* zero embedding rows"):
        pick(None, 100, zero_rows=[0], pad_token_id=0)
    with pytest.raises(ValueError, match="outside the embedding's 100 rows"):
        pick(100, 100)


def test_resume_check_takes_defaults_for_fields_an_older_checkpoint_lacks(tmp_path: Path) -> None:
    import dataclasses

    from stage2_train.config import TrainConfig
    from stage2_train.resume import check_same_run

    current = dataclasses.asdict(TrainConfig())
    older = dataclasses.asdict(TrainConfig())
    block_size = current["drafter"]["block_size"]
    del older["loss"]["weighting"], older["drafter"]["block_size"]
    del older["drafter"]["init_norm_from_target"]
    meta = {"config": older, "world_size": 1, "store_content_key": "k"}
    check_same_run(meta, current, 1, tmp_path, "k")  # the defaults: the same run
    current["loss"]["weighting"] = "dpace"
    with pytest.raises(ValueError, match=r"other settings: loss.weighting: 'decay' -> 'dpace'"):
        check_same_run(meta, current, 1, tmp_path, "k")
    current["loss"]["weighting"] = "decay"
    current["drafter"]["block_size"] = block_size // 2
    with pytest.raises(
        ValueError, match=rf"cannot change: drafter.block_size: {block_size} -> {block_size // 2}"
    ):
        check_same_run(meta, current, 1, tmp_path, "k")
    # the initial weights only, which the checkpoint replaces: free (7dfda8a)
    current["drafter"]["block_size"] = block_size
    current["drafter"]["init_norm_from_target"] = False
    check_same_run(meta, current, 1, tmp_path, "k")
