"""The loader's batches, bit for bit, as the code before its speed-ups built them.

`tests/data/loader_reference.json` holds a SHA-256 of every tensor of every batch below (and
its dtype and shape), written by the loader as it was before rows were read straight from the
shard files into shared batch buffers and the narrow mask tables were built from the touched
tiles alone: factory stores (fp8 and bf16 features, two Zarr chunks a row, distillation on and
off, a store with a damaged chunk), batches collated without tables, with full and with narrow
ones, in this process and through the DataLoader's workers. Nothing here may change a bit of
what the trainer sees; a change that means to must rewrite the reference
(`python tests/test_loader_identity.py --write DIR`, from the commit whose batches are right).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from store_factory import FactorySpec, build_store

from common.store import open_store
from stage2_train.data import Batch, StoreSequences, collate, make_loader

REFERENCE = Path(__file__).parent / "data" / "loader_reference.json"
KEYS = [
    [(0, 0, False), (3, 0, False), (7, 1, False)],
    [(11, 2, True), (5, 0, False)],
    [(2, 0, False)],
    [(5, 3, False), (6, 3, False), (7, 3, False), (8, 3, False), (9, 3, False)],  # shard 1
    [(6, 0, False), (1, 0, False), (10, 1, True)],  # a damaged one first
    [(6, 0, False), (2, 0, False)],  # ... of two: its padding blocks swap with the real ones
]
COLLATES = {"none": {"mask_tables": False}, "full": {"narrow": False}, "narrow": {"narrow": True}}
CASES: dict[str, dict[str, Any]] = {
    "fp8": dict(store="fp8", label_target="target", distill=True, per_document=False),
    "bf16": dict(store="bf16", label_target="data", distill=False, per_document=True),
    "fp8_damaged": dict(store="fp8_damaged", label_target="target", distill=True),
    # more anchors than a sequence has: padding anchors in every item, moved behind the real
    "fp8_padded": dict(store="fp8", label_target="target", distill=True, num_anchors=40),
}


def build_stores(root: Path) -> dict[str, Path]:
    """The factory stores of the cases (deterministic: seeded), one with a damaged chunk."""
    fp8 = build_store(root / "fp8", FactorySpec(hidden_dtype="float8_e4m3fn"))
    bf16 = build_store(root / "bf16", FactorySpec())
    damaged = Path(shutil.copytree(fp8, root / "fp8_damaged"))
    (path,) = [p for p in (damaged / "shards/shard-000001/hidden/c").rglob("*") if p.is_file()]
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x10  # in the shard's index (checksummed: the factory's chunks are not)
    path.write_bytes(bytes(data))
    return {"fp8": fp8, "bf16": bf16, "fp8_damaged": damaged}


def dataset(store: Path, case: dict[str, Any]) -> StoreSequences:
    args = dict(num_anchors=8, per_document=False, block_size=4, seed=5)
    args |= {k: v for k, v in case.items() if k != "store"}
    return StoreSequences(open_store(store), **args)


def digests(batch: Batch) -> dict[str, Any]:
    """{field: [dtype, shape, sha256 of the bytes (16 hex digits)]} of every tensor of `batch`
    (top-k ids widened to int64 first); the number of damaged sequences (their lines name the
    store's folder)."""
    out: dict[str, Any] = {"damaged": len(batch.damaged)}
    for name, value in vars(batch).items():
        tensors = {name: value} if isinstance(value, torch.Tensor) else {}
        if name == "mask_tables" and value is not None:
            tensors = {f"{name}.{field}": t for field, t in value._asdict().items()}
        for key, t in tensors.items():
            if key == "topk_ids_ABk":
                # carried as the store's int32 since the reference was written (as int64):
                # hashed widened, so the digest still proves the same values
                assert t.dtype == torch.int32, t.dtype
                t = t.long()
            same_size = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            raw = same_size.numpy().tobytes()  # C order, whatever the strides
            out[key] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()[:16]]
    return out


def in_process(stores: dict[str, Path]) -> dict[str, Any]:
    """{case/collate/batch: digests} of every batch built in this process."""
    found = {}
    for name, case in CASES.items():
        data = dataset(stores[case["store"]], case)
        for b, keys in enumerate(KEYS):
            for how, kwargs in COLLATES.items():
                fetch = getattr(data, "__getitems__", None)
                items = fetch(keys) if callable(fetch) else [data[key] for key in keys]
                found[f"{name}/{how}/{b}"] = digests(collate(items, **kwargs))
    return found


def test_batches_equal_the_reference(tmp_path: Path) -> None:
    want = json.loads(REFERENCE.read_text())
    got = in_process(build_stores(tmp_path))
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == want[key], key
    assert want["fp8_damaged/narrow/3"]["damaged"] >= 1  # the damaged chunk was read
    assert want["fp8_damaged/narrow/4"]["damaged"] == 1


def test_worker_batches_equal_the_reference(tmp_path: Path) -> None:
    """Batches a DataLoader's workers build (in shared memory) and hand over, narrow tables."""
    want = json.loads(REFERENCE.read_text())
    stores = build_stores(tmp_path)
    for name in CASES:
        case = CASES[name]
        loader = make_loader(dataset(stores[case["store"]], case), KEYS, 2, 2, False, "skip")
        try:
            got = [digests(batch) for batch in loader]
        finally:
            loader.close()  # persistent workers: a failing test would otherwise hang at exit
        assert got == [want[f"{name}/narrow/{b}"] for b in range(len(KEYS))], name


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write the reference from this checkout")
    parser.add_argument("--write", type=Path, required=True, help="scratch folder for stores")
    args = parser.parse_args()
    REFERENCE.parent.mkdir(exist_ok=True)
    reference = in_process(build_stores(args.write))
    lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in reference.items()]
    REFERENCE.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one batch a line
    print(f"{len(reference)} batches -> {REFERENCE}")
