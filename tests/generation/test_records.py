"""A job's typed record and its stored form: what scoring writes is what the store reads back, and a store written
before the records were typed (``tests/generation/data/store_npz_keys.sqlite``) still resumes."""

from __future__ import annotations

import io
import shutil
import sqlite3
from pathlib import Path

import numpy as np

from spectr_audit.generation.engine_specs import audit_engine, load_generation_engine
from spectr_audit.generation.records import JobRecord

DATA = Path(__file__).parent / "data"
#: The settings the stored audit was written with.
OLD_STORE_SETTINGS = dict(seed=0, max_new_tokens=6, arms=("single", "equal"))


def _records(tmp_path, **settings) -> list:
    path = tmp_path / "audit.sqlite"
    audit_engine(load_generation_engine("toy"), store=str(path), **settings)
    with sqlite3.connect(path) as db:
        blobs = [blob for (blob,) in db.execute("SELECT payload FROM jobs ORDER BY job")]
    out = []
    for blob in blobs:
        with np.load(io.BytesIO(blob), allow_pickle=False) as data:
            out.append({k: data[k] for k in data.files})
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def test_the_stored_form_reads_back_to_the_same_arrays(tmp_path):
    # with a reference (reference columns and divergences) and a draft scorer (acceptance, the ratio order)
    for arrays in _records(tmp_path, seed=1, max_new_tokens=5, arms=("single", "repeated"), reference=True):
        record = JobRecord.from_stored(arrays)
        assert record.reference is not None and record.divergences is not None
        assert record.engine.tokens.accept is not None and "ratio" in record.engine.tokens.pit
        assert _same(record.to_stored(), arrays)


def test_the_fields_are_the_named_arrays(tmp_path):
    arrays = _records(tmp_path, seed=2, max_new_tokens=4, arms=("single",))[0]
    record = JobRecord.from_stored(arrays)
    assert record.reference is None and record.divergences is None
    assert np.array_equal(record.engine.tokens.mass, arrays["tok_mass"])
    assert np.array_equal(record.engine.tokens.variance, arrays["tok_var"])
    assert np.array_equal(record.engine.first_collision, arrays["cont_chance"], equal_nan=True)
    assert np.array_equal(record.engine.emitted, arrays["cont_tokens"])
    assert set(record.engine.tokens.pit) == {k[len("tok_pit_"):] for k in arrays if k.startswith("tok_pit_")}


def test_a_store_written_before_the_typed_records_resumes_to_the_same_result(tmp_path):
    old = tmp_path / "old.sqlite"
    shutil.copy(DATA / "store_npz_keys.sqlite", old)
    resumed = audit_engine(load_generation_engine("toy"), store=str(old), resume=True, **OLD_STORE_SETTINGS)
    fresh = audit_engine(load_generation_engine("toy"), **OLD_STORE_SETTINGS)
    a, b = resumed.to_dict(), fresh.to_dict()
    a.pop("seconds"), b.pop("seconds")
    assert a == b and resumed.num_jobs > 0
