"""What the Parquet statistics show is refused before the start (labels outside [0, 1], ids out
of range, in every row group at once); what they cannot show, `recsys-data inspect --scan`
finds: every bad row, with its file, row group, row and column, read by a pool of processes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_pipe.cli import data as data_cli
from recsys_pipe.config import ConfigError
from recsys_pipe.data.parquet.decode import item_vocab_metadata

pytestmark = pytest.mark.timeout(300)


def _clicks(path, bad: dict[int, tuple[str, object]], statistics: bool) -> str:
    rng = np.random.default_rng(0)
    n = 300
    cols = {"click": rng.integers(0, 2, n).tolist(), "shop": [f"s{i % 9}" for i in range(n)]}
    cols["tags"] = [rng.integers(0, 30, 3).tolist() for _ in range(n)]
    for row, (column, value) in bad.items():
        cols[column][row] = value
    table = pa.table({"click": pa.array(cols["click"], pa.int64()), "shop": cols["shop"], "tags": cols["tags"]})
    pq.write_table(table, path, row_group_size=100, write_statistics=statistics)
    return str(path)


COLUMNS = ["data.columns.labels=[click]", "data.columns.sparse.shop.num_embeddings=10"]
COLUMNS += ["data.columns.sparse.tags.num_embeddings=40", "data.columns.sparse.tags.ids=as_is"]


def test_statistics_refuse_labels_and_ids_of_every_row_group_before_the_start(tmp_path):
    from recsys_pipe.data import RankData
    from recsys_pipe.testing import load_run

    path = _clicks(tmp_path / "c.parquet", {5: ("click", 3), 150: ("tags", [1, 45, 2]), 260: ("click", -1)}, True)
    run = load_run("model=dlrm", "data=parquet", f"data.path={path}", *(f"++{c}" for c in COLUMNS))
    with pytest.raises(ConfigError) as info:
        RankData(run.data, 0, 1)
    assert [str(p) for p in info.value.problems] == [
        f"data.path: {path}, row group 0, column 'click': label 3 outside [0, 1] (its statistics)",
        f"data.path: {path}, row group 1, column 'tags': id 45 >= num_embeddings=40 with ids=as_is (set ids: hash "
        "or modulo)",
        f"data.path: {path}, row group 2, column 'click': label -1 outside [0, 1] (its statistics)",
    ]


def test_scan_lists_every_bad_row_with_file_row_group_row_and_column(tmp_path, capsys):
    bad = {5: ("click", 3), 6: ("tags", None), 150: ("tags", [1, 45, 2]), 151: ("click", 2), 260: ("click", -1)}
    path = _clicks(tmp_path / "c.parquet", bad, statistics=False)
    assert data_cli.main(["inspect", path, "--scan", "--workers", "2", "model=dlrm", *COLUMNS]) == 2
    out = capsys.readouterr().out.splitlines()
    found = [line for line in out if line.startswith(path)]
    assert found == [
        f"{path}, row 5 (row group 0), column 'click': label 3 outside [0, 1]",
        f"{path}, row 6 (row group 0), column 'tags': a null list",
        f"{path}, row 150 (row group 1), column 'tags': id 45 >= num_embeddings=40 with ids=as_is (set ids: hash or "
        "modulo)",
        f"{path}, row 151 (row group 1), column 'click': label 2 outside [0, 1]",
        f"{path}, row 260 (row group 2), column 'click': label -1 outside [0, 1]",
    ]
    assert out[-1] == "scanned 300 rows in 3 row group(s) of 1 file(s): 5 bad row(s)"


def test_scan_of_sequences_takes_their_layout_and_a_clean_file_passes(tmp_path, capsys):
    rows = [[i % 7, (i + 1) % 7, (i + 2) % 7] for i in range(40)]
    rows[33][1] = 99  # not in the vocabulary
    table = pa.table({"user_id": pa.array(range(40)), "item_ids": pa.array(rows, pa.list_(pa.int64()))})
    path = tmp_path / "s.parquet"
    pq.write_table(table.replace_schema_metadata(item_vocab_metadata(np.arange(7))), path, row_group_size=16)
    assert data_cli.main(["inspect", str(path), "--scan", "--workers", "1"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert f"{path}, row 33 (row group 2), column 'item_ids': item id 99 is not in the stored vocabulary " in out[-2]
    rows[33][1] = 3
    table = table.set_column(1, "item_ids", pa.array(rows, pa.list_(pa.int64())))
    pq.write_table(table.replace_schema_metadata(item_vocab_metadata(np.arange(7))), path, row_group_size=16)
    assert data_cli.main(["inspect", str(path), "--scan"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "scanned 40 rows in 3 row group(s) of 1 file(s): 0 bad row(s)"
