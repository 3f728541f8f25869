import csv
import io
import json
import math

from gradshare.stats import COLUMNS, Statistics, StepRecord


def _rec(step, bucket, fmt="sparse", sent=100, dense=4000):
    return StepRecord(step=step, bucket=bucket, n=1000, tau=0.01, count=5, density=0.005, format=fmt,
                      bytes_sent=sent, dense_bytes=dense)


def test_totals_history_and_compression():
    s = Statistics(max_records=3)
    assert math.isnan(s.compression)
    for step in range(2):
        for b in range(2):
            s.add(_rec(step, b))
    s.add(_rec(2, 0, fmt="dense", sent=4000))
    assert (s.bytes_sent, s.dense_bytes, s.exchanges) == (4400, 20000, 5)
    assert s.compression == 20000 / 4400
    assert len(s.history) == 3 and s.history[0].step == 1          # oldest records dropped, totals kept
    assert s.format_counts["dense"] == 1 and s.format_counts["sparse"] == 4
    assert "4.5x" in str(s)


def test_csv_and_jsonl():
    s = Statistics()
    s.add(_rec(0, 0))
    s.add(_rec(0, 1, fmt="bitmap"))
    f = io.StringIO()
    s.to_csv(f)
    rows = list(csv.DictReader(io.StringIO(f.getvalue())))
    assert list(rows[0]) == COLUMNS and rows[1]["format"] == "bitmap"
    g = io.StringIO()
    s.to_jsonl(g)
    lines = [json.loads(x) for x in g.getvalue().splitlines()]
    assert lines[0]["bytes_sent"] == 100 and lines[1]["bucket"] == 1


def test_log_every_calls_back_once_per_due_step_with_its_records():
    seen = []
    s = Statistics(log_every=2, callback=seen.append)
    for step in range(5):
        for b in range(2):
            s.add(_rec(step, b))
        s.end_step()
    assert [[(r.step, r.bucket) for r in recs] for recs in seen] == [[(0, 0), (0, 1)], [(2, 0), (2, 1)],
                                                                     [(4, 0), (4, 1)]]


def test_state_round_trip_keeps_totals():
    s = Statistics()
    s.add(_rec(0, 0))
    t = Statistics()
    t.load_state_dict(s.state_dict())
    assert (t.bytes_sent, t.dense_bytes, t.exchanges, t.format_counts) == \
        (s.bytes_sent, s.dense_bytes, s.exchanges, s.format_counts)
    assert Statistics(norm_every=10).wants_norm(20) and not Statistics(norm_every=0).wants_norm(0)
