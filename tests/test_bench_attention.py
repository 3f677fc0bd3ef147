"""benchmarks/bench_attention.py on the CPU, its GPU parts stubbed: what a run writes (its rows,
the command and the UTC time it ran) and what ``--render`` makes of saved runs, older files
without those fields included."""

import json
import re
import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_attention as bench  # noqa: E402


def fake_shape(S):
    """A forward shape's rows as forward_shape returns them: ours at 600 TFLOP/s, cuDNN at 500."""
    shape = {"mode": "fwd", "B": 4, "H": 32, "D": 128, "causal": False, "dtype": "bfloat16"}
    impls = (("tilelang", True, 600.0), ("sdpa_cudnn", False, 500.0))
    return [
        {"impl": impl, "ours": ours, "tflops": tflops, "ms": 1.0, "S": S, **shape}
        for impl, ours, tflops in impls
    ]


def fake_rows(dims, dtypes, seqlens, build_only=False, save=lambda rows: None):
    """forward_rows with its GPU part stubbed: each S timed in turn (``fake_shape``)."""
    if build_only:
        return []
    return bench.timed_rows([(S,) for S in seqlens], fake_shape, save)


def test_run_records_command_and_time(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.harness, "require_gpu", lambda name: None)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "GPU X")
    monkeypatch.setattr(bench, "forward_rows", fake_rows)
    monkeypatch.setattr(bench, "plot", lambda *args: None)
    argv = ["--out", str(tmp_path), "--modes", "fwd", "--seqlens", "4096", "--tag", "_x"]
    bench.main(argv)
    record = json.loads((tmp_path / "fwd_x.json").read_text())
    command = "python benchmarks/bench_attention.py " + " ".join(argv)
    assert record["command"] == command and record["device"] == "GPU X"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"])
    assert re.fullmatch(r"\d\d:\d\d–\d\d:\d\d UTC", record["time"])
    table = (tmp_path / "fwd.md").read_text()
    assert f"`{command}`, one process, {record['date']} {record['time']}." in table
    assert "| 128 | False | bfloat16 | 4096 | 4×32 | 600 | 500 | 1.20 | 1.20 |" in table


def test_render_says_where_the_rows_come_from(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "plot", lambda *args: None)
    command = "python benchmarks/bench_attention.py --modes fwd --dims 128"
    new = {"device": "GPU X", "date": "2026-11-27", "time": "13:11–13:14 UTC", "command": command}
    new["rows"] = fake_rows([128], ["bfloat16"], [4096])
    old = {"device": "GPU X", "date": "2026-11-25", "rows": fake_rows([128], ["bfloat16"], [8192])}
    paths = [tmp_path / "new.json", tmp_path / "old.json"]
    for path, record in zip(paths, (new, old), strict=True):
        path.write_text(json.dumps(record))
    bench.main(["--render", *map(str, paths), "--out", str(tmp_path)])
    table = (tmp_path / "fwd.md").read_text()
    assert table.startswith("Forward, TFLOP/s (GPU X, 2026-11-27)\n\n")
    assert table.count("one process") == 1  # the older file records no command
    assert f"`{command}`, one process, 2026-11-27 13:11–13:14 UTC." in table
    assert "| 4096 | 4×32 | 600 |" in table and "| 8192 | 4×32 | 600 |" in table


def test_run_cut_short_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """A run stopped partway (a time limit, a failed check) leaves its JSON with every shape
    timed before the stop, stamped with the command."""
    monkeypatch.setattr(bench.harness, "require_gpu", lambda name: None)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "GPU X")

    def stopped(S):
        if S == 4096:
            raise KeyboardInterrupt  # as a timeout's signal would stop it
        return fake_shape(S)

    def rows(dims, dtypes, seqlens, build_only=False, save=lambda rows: None):
        return bench.timed_rows([(S,) for S in seqlens], stopped, save)

    monkeypatch.setattr(bench, "forward_rows", rows)
    argv = ["--out", str(tmp_path), "--modes", "fwd", "--seqlens", "1024", "2048", "4096"]
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    record = json.loads((tmp_path / "fwd.json").read_text())
    assert sorted({r["S"] for r in record["rows"]}) == [1024, 2048]
    assert record["command"] == "python benchmarks/bench_attention.py " + " ".join(argv)
