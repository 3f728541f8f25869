"""Every bad option of the `gradshare` command is refused with one line on stderr and exit status 2,
before anything starts; counts are read the way people write them."""
import json

import pytest

from gradshare.cli import main

PLAN = ["plan", "--params", "1000000", "--step-time", "10"]

BAD = [
    ["train", "--data", "mnist:/nonexistent"], ["train", "--data", "cifar"], ["train", "--lr", "nan"],
    ["train", "--lr", "0"], ["train", "--lr", "abc"], ["train", "--timeout", "nan"], ["train", "--timeout", "-1"],
    ["train", "--collective-timeout", "inf"], ["train", "--workers", "0"], ["train", "--epochs", "-3"],
    ["train", "--batch-size", "1.5"], ["train", "--frequency", "0"], ["train", "--averaging-frequency", "0"],
    ["train", "--max-restarts", "-1"],
    ["train", "--checkpoint-every", "-5"], ["train", "--seed", "-1"], ["train", "--compression", "topk:2"],
    ["train", "--compression", "fixed:abc"], ["train", "--threshold", "fixed"], ["train", "--mode", "async"],
    ["train", "--mode", "diloco", "--outer-lr", "nan"], ["train", "--mode", "diloco", "--outer-momentum", "1"],
    ["train", "--mode", "sparse_local", "--residual-decay", "0"], ["train", "--mode", "diloco", "--fragments", "0"],
    ["train", "--mode", "diloco", "--overlap", "-1"], ["train", "--mode", "sparse_local", "--error-feedback", "models"],
    PLAN + ["--bandwidth", "12xyz"], PLAN + ["--efficiency", "0"], PLAN + ["--efficiency", "1.5"],
    PLAN + ["--workers", "0"], ["plan", "--params", "-5", "--step-time", "10"],
    ["plan", "--params", "1e6x", "--step-time", "10"], ["plan", "--params", "0.5", "--step-time", "10"],
    ["plan", "--params", "1000000", "--step-time", "nan"], ["plan", "--params", "1000000", "--step-time", "0"],
    ["plan", "--params", "1000000"], PLAN + ["--density", "2"], PLAN + ["--overlap", "-0.1"],
    PLAN + ["--latency-ms", "nan"], ["plan", "--model", "nosuch:Thing", "--step-time", "5"],
    ["plan", "--model", "gradshare.models:SmallCNN", "--model-kwargs", "{bad", "--step-time", "5"],
    ["plan", "--model", "gradshare.models:SmallCNN", "--measure", "--input-shape", "1,x"],
    ["plan", "--model", "gradshare.models:SmallCNN", "--measure"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a) for a in BAD])
def test_bad_options_are_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() and err.strip().count("\n") == 0, err        # one line, no traceback
    assert "Traceback" not in err and err.startswith(f"gradshare {argv[0]}: error:")


@pytest.mark.parametrize("text,expected", [("25000000", 25_000_000), ("25_000_000", 25_000_000),
                                           ("25,000,000", 25_000_000), ("2.5e7", 25_000_000), ("1e6", 10**6),
                                           ("25M", 25_000_000), ("3.7k", 3700), ("1.2G", 1_200_000_000)])
def test_parameter_counts_as_people_write_them(text, expected, capsys):
    assert main(["plan", "--params", text, "--step-time", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == expected


def test_version_is_the_package_version(capsys):
    import gradshare

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"gradshare {gradshare.__version__}"
    assert main(["info"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == gradshare.__version__


def test_a_reader_that_goes_away_gets_no_traceback():
    """``gradshare info | head -1``: the pipe closes before gradshare writes; it ends quietly (status 141, as a
    shell reports SIGPIPE) instead of printing BrokenPipeError tracebacks."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "gradshare", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                     # before the interpreter has even imported gradshare
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert p.returncode == 141, (p.returncode, err)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
