"""``python -m vpce.bench --first-step``: each row in fresh processes, cold caches then the first process's."""

from __future__ import annotations

import json

import pytest

from vpce.bench.cli import main
from vpce.bench.first_step import CACHE_VARIABLES


def test_first_step_runs_each_row_in_fresh_processes(tmp_path, capsys):
    assert main(["--first-step", "--quick", "--device", "cpu", "--methods", "vpce-torch,liger", "--quiet",
                 "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "first-step.json").read_text())
    assert doc["schema"] == "vpce.bench.first_step/1"
    rows = {(r["method"], r["phase"]): r for r in doc["rows"]}
    assert set(rows) == {(m, p) for m in ("vpce-torch", "liger") for p in ("cold", "warm cache")}, rows
    for phase in ("cold", "warm cache"):
        r = rows["vpce-torch", phase]
        assert r["status"] == "ok", r
        assert (r["n"], r["d"], r["v"]) == (256, 64, 1024)
        assert 0 < r["first_s"] < r["process_s"], r
        assert 0 < r["startup_s"] < r["process_s"], r
        assert r["step_ms"] > 0, r
        assert rows["liger", phase]["status"].startswith("missing: "), rows["liger", phase]
    # every cache in a folder of its own per row, shared by that row's two processes
    cold, warm = rows["vpce-torch", "cold"]["caches"], rows["vpce-torch", "warm cache"]["caches"]
    other = rows["liger", "cold"]["caches"]
    assert set(cold) == set(CACHE_VARIABLES) and all(cold.values()), cold
    assert cold == warm, (cold, warm)
    assert all(cold[v] != other[v] for v in CACHE_VARIABLES), (cold, other)
    # Python's bytecode in one folder for every process, outside every row's kernel caches (a priming process per
    # row filled it before the row's cold process)
    pycache = {r["pycache"] for r in doc["rows"]}
    assert len(pycache) == 1 and None not in pycache, pycache
    prefix = pycache.pop()
    assert not any(v.startswith(prefix) for r in doc["rows"] for v in r["caches"].values()), doc["rows"]
    table = capsys.readouterr().out
    assert "| vpce torch | cold |" in table and "| vpce torch | warm cache |" in table, table


@pytest.mark.parametrize("extra", [["--tp"], ["--distill"], ["--profile"], ["--sweep", "N"]])
def test_first_step_refuses_other_modes(extra, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--first-step", "--quick", "--device", "cpu", *extra])
    assert e.value.code == 2
    assert "--first-step: expected without" in capsys.readouterr().err
