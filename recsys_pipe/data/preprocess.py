"""Raw rows -> the inputs of an exported program, and the id and feature transforms training uses.

`recsys-export` copies this file into its output as `preprocess.py`, next to `features.json`
(the description of every input's transform, written from the run's data config), so a serving
process turns the rows it receives into the program's inputs with numpy and torch alone:

    import preprocess                      # the export's directory on sys.path
    inputs = preprocess.inputs(rows)       # rows: [{column: value}, ...] as the data files hold them
    scores = program(*inputs.values())

Training maps ids and transforms dense features with the same functions (`recsys_pipe.data`
imports them from this module: `splitmix64`, `fnv1a64`, `signed_log1p_into`, `map_ids`), so what
a served model receives cannot drift from what it trained on; a test runs both paths on the same
raw rows.

`features.json` (format `FORMAT`) holds:

* `program`: how rows become inputs: `tabular` (DLRM: `dense_features`, `sparse_ids`[,
  `list_ids`, `list_lengths`]), `sequence_ranking` (HSTU ranking: `items`, `actions`,
  `timestamps`, `lengths`, `num_candidates`[, `users`]) or `retrieval` (a user encoder: `items`,
  `timestamps`, `valid`; `item_rows`/`item_ids` map raw item ids to the item table's rows and back);
* `inputs`: per program input, the features in its columns, in order;
* `features`: per feature one record: its `column` in the rows, how a cell is read (`parse`:
  `int`, `float`, `hex`, `id`; `missing`: the value of an empty or absent cell), and its
  transform: `transform` for numbers (`none`, `signed_log1p`, `scaled_round` with `scale`) or
  `ids` for ids (`mapping`: `as_is`, `modulo`, `hash` with its `function`, `seed` and `strings`
  hash, `vocabulary` with its sorted raw `values`, or `managed` with its `input_hash_size`: the
  program remaps raw ids itself, so they pass as raw ids, string ids hashed into
  `[0, input_hash_size)` first; all with `num_embeddings`). A new mapping joins `ID_MAPPINGS`
  under its name with the parameters its record holds;
* `params`: the program's sizes (`max_seq_len`: its padded length; `history`: the most recent
  events a sample keeps; `num_candidates`) and the row keys it reads besides the features
  (`candidates_column`, `next_timestamp_column`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "FORMAT",
    "ID_MAPPINGS",
    "PROGRAMS",
    "fnv1a64",
    "inputs",
    "item_ids",
    "item_rows",
    "load_features",
    "map_ids",
    "parse_cells",
    "raw_id_message",
    "signed_log1p",
    "signed_log1p_into",
    "splitmix64",
    "splitmix64_inplace",
    "utf8",
]

FORMAT = "recsys-pipe/features/1"
#: the action id of a candidate: its real action is what the model predicts (`recsys_pipe.data.batch`)
MASKED_ACTION = 0
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_GOLDEN = 0x9E3779B97F4A7C15


# -- the kernels training shares ------------------------------------------------------------------


def splitmix64_inplace(words: np.ndarray, seed: int = 0) -> np.ndarray:
    """SplitMix64's output function of `words + seed` (uint64, in place, one scratch array);
    returns `words`. `seed` 0 is the hash training uses (`ids: hash`)."""
    scratch = np.empty_like(words)
    words += np.uint64((_GOLDEN + seed) & 0xFFFFFFFFFFFFFFFF)
    for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        np.right_shift(words, np.uint64(shift), out=scratch)
        words ^= scratch
        words *= np.uint64(multiplier)
    np.right_shift(words, np.uint64(31), out=scratch)
    words ^= scratch
    return words


def splitmix64(values: np.ndarray, seed: int = 0) -> np.ndarray:
    """SplitMix64 of integer `values` (viewed as uint64), as a new uint64 array."""
    return splitmix64_inplace(np.asarray(values).astype(np.int64).view(np.uint64), seed)


def fnv1a64(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """FNV-1a (64-bit) of each byte string `data[offsets[i]:offsets[i + 1]]` (uint8 bytes, int64
    offsets), column-wise: one numpy pass per byte position up to the longest string."""
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    n = len(lengths)
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    longest = int(lengths.max()) if n else 0
    with np.errstate(over="ignore"):
        for j in range(longest):
            live = lengths > j
            byte = np.zeros(n, dtype=np.uint64)
            byte[live] = data[starts[live] + j]
            h = np.where(live, (h ^ byte) * _FNV_PRIME, h)
    return h


def utf8(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The UTF-8 bytes of `strings`, joined, and their offsets (what `fnv1a64` reads)."""
    encoded = [s.encode() for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


def signed_log1p_into(raw: np.ndarray, out: np.ndarray, same: np.ndarray, wide: np.ndarray) -> None:
    """`sign(x) * log(1 + |x|)` of the 1-D `raw` (int64 or float64) into `out` (float32, any
    stride), through the scratch arrays `same` (`raw`'s shape and dtype) and `wide` (float64):
    no temporaries, so a decoder reuses its scratch window after window."""
    np.abs(raw, out=same)
    np.log1p(same, out=wide)
    np.sign(raw, out=same)
    np.multiply(same, wide, out=wide)
    out[...] = wide


def signed_log1p(raw: np.ndarray) -> np.ndarray:
    """`signed_log1p_into` of any shape, as float32 (bitwise what training computes)."""
    flat = np.ascontiguousarray(raw).reshape(-1)
    out = np.empty(flat.shape, dtype=np.float32)
    signed_log1p_into(flat, out, np.empty_like(flat), np.empty(flat.shape, dtype=np.float64))
    return out.reshape(np.shape(raw))


# -- one feature: cells, ids, values --------------------------------------------------------------


def parse_cells(values: Sequence[Any], parse: str, missing: Any = 0) -> Any:
    """A column's cells as an array: `int` (int64), `float` (float64), `hex` (an id written in
    hexadecimal, int64), or `id` (integer ids as int64, string ids as a list of str); an absent
    cell (None; for numbers also '', an empty field of a text file) is `missing`."""
    cells = [missing if v is None or (v == "" and parse != "id") else v for v in values]
    if parse == "hex":
        return np.array([int(v, 16) if isinstance(v, str) else int(v) for v in cells], dtype=np.int64)
    if parse == "int":
        return np.array([int(v) for v in cells], dtype=np.int64)
    if parse == "float":
        return np.array([float(v) for v in cells], dtype=np.float64)
    if parse == "id":
        if any(isinstance(v, str) for v in cells):
            return [str(v) for v in cells]
        return np.array([int(v) for v in cells], dtype=np.int64)
    raise ValueError(f"unknown parse {parse!r}")


def _bounded(raw: np.ndarray, ids: Mapping[str, Any], what: str) -> np.ndarray:
    if isinstance(raw, list):
        raise ValueError(f"string ids need ids mapping 'hash' or 'vocabulary', not {ids['mapping']!r}")
    n = ids["num_embeddings"]
    bad = (raw < 0) | (raw >= n) if what == "as_is" else raw < 0
    if raw.size and bad.any():
        raise ValueError(f"id {int(raw[np.flatnonzero(bad)[0]])} outside what ids mapping {what!r} takes")
    return raw


def _hash(raw: Any, ids: Mapping[str, Any]) -> np.ndarray:
    if isinstance(raw, list):  # strings: FNV-1a of their UTF-8 bytes first (ids['strings'])
        raw = fnv1a64(*utf8(raw)).view(np.int64)
    return (splitmix64(raw, ids.get("seed", 0)) % np.uint64(ids["num_embeddings"])).astype(np.int64)


def _vocabulary(raw: Any, ids: Mapping[str, Any]) -> np.ndarray:
    """Each raw id's place in the sorted `values` (-1: not in it)."""
    values = np.asarray(ids["values"])
    wanted = np.asarray(raw, dtype=values.dtype) if len(raw) else np.zeros(0, dtype=values.dtype)
    place = np.searchsorted(values, wanted)
    inside = place < len(values)
    inside[inside] = values[place[inside]] == wanted[inside]
    return np.where(inside, place, -1).astype(np.int64)


def raw_id_message(value: int, input_hash_size: int) -> str:
    """Why the integer raw id `value` is refused with `ids: managed`."""
    return (
        f"raw id {value} is outside [0, input_hash_size={input_hash_size}) with ids=managed (integer ids are "
        "taken as they are: raise managed.input_hash_size, or use string ids, which are hashed into it)"
    )


def _managed(raw: Any, ids: Mapping[str, Any]) -> np.ndarray:
    """Raw ids as a program that remaps them itself takes them (`ids: managed`): a string's
    FNV-1a hash reduced into `[0, input_hash_size)`, an integer as it is (refused outside it)."""
    size = ids["input_hash_size"]
    if isinstance(raw, list):
        return (fnv1a64(*utf8(raw)) % np.uint64(size)).astype(np.int64)
    bad = (raw < 0) | (raw >= size)
    if raw.size and bad.any():
        raise ValueError(raw_id_message(int(raw[np.flatnonzero(bad)[0]]), size))
    return raw


#: id mapping name -> `map(raw ids, its record) -> table rows` (int64; `managed`: raw ids)
ID_MAPPINGS: dict[str, Callable[[Any, Mapping[str, Any]], np.ndarray]] = {
    "as_is": lambda raw, ids: _bounded(raw, ids, "as_is"),
    "modulo": lambda raw, ids: _bounded(raw, ids, "modulo") % ids["num_embeddings"],
    "hash": _hash,
    "vocabulary": _vocabulary,
    "managed": _managed,
}
#: value transform name -> `transform(numbers, its record) -> numbers`
VALUE_TRANSFORMS: dict[str, Callable[[np.ndarray, Mapping[str, Any]], np.ndarray]] = {
    "none": lambda x, t: x,
    "signed_log1p": lambda x, t: signed_log1p(x),
    "scaled_round": lambda x, t: np.rint(t["scale"] * np.asarray(x, dtype=np.float64)).astype(np.int64),
}


def map_ids(raw: Any, ids: Mapping[str, Any]) -> np.ndarray:
    """The table rows of raw ids (int64 array, or a list of str) under the mapping record `ids`."""
    return ID_MAPPINGS[ids["mapping"]](raw, ids)


def _transform(values: np.ndarray, record: Mapping[str, Any]) -> np.ndarray:
    transform = record.get("transform") or {"kind": "none"}
    return VALUE_TRANSFORMS[transform["kind"]](values, transform)


def _column(rows: Sequence[Mapping[str, Any]], record: Mapping[str, Any]) -> Any:
    return parse_cells([row.get(record["column"]) for row in rows], record.get("parse", "id"), record.get("missing", 0))


def _mapped(values: Any, record: Mapping[str, Any]) -> np.ndarray:
    """A feature's cells as the program takes them: ids through their mapping, numbers through
    their transform; a ValueError names the column."""
    try:
        return map_ids(values, record["ids"]) if "ids" in record else _transform(values, record)
    except ValueError as exc:
        raise ValueError(f"column {record['column']!r}: {exc}") from None


# -- the programs ---------------------------------------------------------------------------------


def _tabular(rows: Sequence[Mapping[str, Any]], features: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """DLRM's inputs: a row per sample, one cell per feature (a list of ids for `list_ids`'s)."""
    records, slots, n = features["features"], features["inputs"], len(rows)
    dense = np.zeros((n, len(slots["dense_features"])), dtype=np.float32)
    for j, name in enumerate(slots["dense_features"]):
        dense[:, j] = _mapped(_column(rows, records[name]), records[name])
    ids = np.zeros((n, len(slots["sparse_ids"])), dtype=np.int64)
    for j, name in enumerate(slots["sparse_ids"]):
        ids[:, j] = _mapped(_column(rows, records[name]), records[name])
    out = {"dense_features": torch.from_numpy(dense), "sparse_ids": torch.from_numpy(ids)}
    multi = slots.get("list_ids", [])
    if multi:
        lists = [[_list(row, records[name]) for row in rows] for name in multi]
        lengths = np.array([[len(cells) for cells in per_feature] for per_feature in lists], dtype=np.int64).T
        padded = np.zeros((n, len(multi), max(2, int(lengths.max(initial=0)))), dtype=np.int64)
        for j, name in enumerate(multi):
            flat = parse_cells([v for cells in lists[j] for v in cells], records[name].get("parse", "id"))
            mapped = np.split(_mapped(flat, records[name]), np.cumsum(lengths[:, j])[:-1])
            for i, row_ids in enumerate(mapped):
                padded[i, j, : len(row_ids)] = row_ids
        out.update(list_ids=torch.from_numpy(padded), list_lengths=torch.from_numpy(lengths))
    return out


def _list(row: Mapping[str, Any], record: Mapping[str, Any]) -> list[Any]:
    cells = row.get(record["column"])
    return [] if cells is None else list(cells)


def _events(row: Mapping[str, Any], records: Mapping[str, Any], name: str, count: int) -> np.ndarray:
    """A sequence feature of one row: its list, transformed (or its positions in the row where
    the record says the data has no such column)."""
    record = records[name]
    if record.get("missing") == "position" and row.get(record["column"]) is None:
        return np.arange(count, dtype=np.int64)
    return _mapped(parse_cells(_list(row, record), record.get("parse", "id")), record)


def _sequence_ranking(rows: Sequence[Mapping[str, Any]], features: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """HSTU ranking's inputs: a row per sample, its events (history, then the candidates: its last
    `num_candidates`), right-padded to `max_seq_len`; a candidate's action is masked."""
    records, params, n = features["features"], features["params"], len(rows)
    length = params["max_seq_len"]
    out = {k: np.zeros((n, length), dtype=np.int64) for k in ("items", "actions", "timestamps")}
    lengths, candidates = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for i, row in enumerate(rows):
        items = _events(row, records, "item", 0)
        if (items < 0).any():
            unknown = row[records["item"]["column"]][int(np.flatnonzero(items < 0)[0])]
            raise ValueError(f"column {records['item']['column']!r}: item {unknown!r} is not in the vocabulary")
        count = len(items)
        keep = min(count, params.get("history", length), length)
        c = int(row.get(params["candidates_column"]) or params["num_candidates"])
        actions = np.full(count, MASKED_ACTION, dtype=np.int64)
        history = _events(row, records, "action", 0)[: count - c]
        actions[: len(history)] = history
        stamps = _events(row, records, "timestamp", count)
        for key, values in (("items", items), ("actions", actions), ("timestamps", stamps)):
            out[key][i, :keep] = values[count - keep :]
        lengths[i], candidates[i] = keep, c
    result = {k: torch.from_numpy(v) for k, v in out.items()}
    result.update(lengths=torch.from_numpy(lengths), num_candidates=torch.from_numpy(candidates))
    if "users" in features["inputs"]:
        result["users"] = torch.from_numpy(_mapped(_column(rows, records["user"]), records["user"]))
    return result


def _retrieval(rows: Sequence[Mapping[str, Any]], features: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A user encoder's inputs: a row per user, its history (oldest first), left-padded to
    `max_seq_len`; items not in the vocabulary are left out (the model has no vector for them);
    the time of the item to come is the row's `next_timestamp_column` (default: one after the
    last position where the data has no timestamps, else the last timestamp)."""
    records, params, n = features["features"], features["params"], len(rows)
    length = params["max_seq_len"]
    items, valid = np.zeros((n, length), dtype=np.int64), np.zeros((n, length), dtype=bool)
    stamps = np.zeros((n, length + 1), dtype=np.int64)
    for i, row in enumerate(rows):
        mapped = _events(row, records, "item", 0)
        times = _events(row, records, "timestamp", len(mapped))
        positions = (
            records["timestamp"].get("missing") == "position" and row.get(records["timestamp"]["column"]) is None
        )
        default = len(mapped) if positions else (int(times[-1]) if len(times) else 0)
        known, kept = mapped >= 0, min(params.get("history", length), length)
        mapped, times = mapped[known][-kept:], times[known][-kept:]
        keep = len(mapped)
        items[i, length - keep :], valid[i, length - keep :] = mapped, True
        stamps[i, length - keep : length] = times
        stamps[i, length] = int(row.get(params["next_timestamp_column"], default))
    return {"items": torch.from_numpy(items), "timestamps": torch.from_numpy(stamps), "valid": torch.from_numpy(valid)}


#: program name -> `inputs(rows, features) -> {input name: tensor}` (the program's order)
PROGRAMS: dict[str, Callable[[Sequence[Mapping[str, Any]], Mapping[str, Any]], dict[str, torch.Tensor]]] = {
    "tabular": _tabular,
    "sequence_ranking": _sequence_ranking,
    "retrieval": _retrieval,
}

_loaded: dict[str, Any] = {}


def load_features(path: str | Path | None = None) -> dict[str, Any]:
    """`features.json` (default: the one next to this file), read once."""
    file = str(Path(path) if path is not None else Path(__file__).with_name("features.json"))
    if file not in _loaded:
        features = json.loads(Path(file).read_text())
        if features.get("format") != FORMAT:
            raise ValueError(f"{file}: not a {FORMAT} description (format {features.get('format')!r})")
        _loaded[file] = features
    return _loaded[file]


def inputs(rows: Sequence[Mapping[str, Any]], features: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The program's inputs for raw `rows` (a list of `{column: value}`), by name, in the
    program's order: call `program(*inputs(rows).values())`."""
    features = features if features is not None else load_features()
    made = PROGRAMS[features["program"]](rows, features)
    return {name: made[name] for name in features["inputs"]}


def item_rows(raw_ids: Sequence[Any], features: Mapping[str, Any] | None = None) -> np.ndarray:
    """Retrieval: the item table's rows of raw item ids (-1: an item the model has no vector for;
    managed ids: the table holds the `catalogue`'s vectors, in its order)."""
    record = (features if features is not None else load_features())["features"]["item"]
    raw, ids = parse_cells(list(raw_ids), record.get("parse", "id")), record["ids"]
    if ids["mapping"] == "managed":
        return _vocabulary(raw, {"values": ids["catalogue"]})
    return map_ids(raw, ids)


def item_ids(rows: Any, features: Mapping[str, Any] | None = None) -> np.ndarray:
    """Retrieval: the raw item ids of item table rows (any shape: top-k rows per user, say)."""
    ids = (features if features is not None else load_features())["features"]["item"]["ids"]
    rows = np.asarray(rows)
    values = {"vocabulary": "values", "managed": "catalogue"}.get(ids["mapping"])
    return np.asarray(ids[values])[rows] if values is not None else rows
