"""bench/quality.py's command line: the contenders it is given are the ones it runs."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
quality = pytest.importorskip("quality")


def test_contenders_split_on_commas_outside_brackets_or_on_semicolons():
    one = 'gs:{"optimizer":opt,"compression":TopK(0.01,chunk=4096,warmup_steps=0),"link":None}'
    assert quality.split_contenders(one) == [one]                 # the README's example: one contender
    assert quality.split_contenders(f"ddp,{one},gradshare") == ["ddp", one, "gradshare"]
    assert quality.split_contenders("ddp;la:{'frequency':4}") == ["ddp", "la:{'frequency':4}"]
    assert quality.split_contenders("ddp,,gradshare") == ["ddp", "gradshare"]
