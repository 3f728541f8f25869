"""What `gradshare ... --help` prints: plain words, readable lists, each default said once."""
import re

import pytest

from gradshare.cli import main

COMMANDS = [[], ["train"], ["plan"], ["info"]]


def _help(argv, capsys, monkeypatch, columns=80):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(argv + ["--help"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def _option_entries(text):
    """Each option's help as one string: from its '  --name' line to the next option or section."""
    entries, current = [], None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            current = [line]
            entries.append(current)
        elif current is not None and line.startswith("    "):
            current.append(line)
        else:
            current = None
    return [" ".join(e) for e in entries]


@pytest.mark.parametrize("argv", COMMANDS, ids=["gradshare"] + [c[0] for c in COMMANDS[1:]])
def test_help_is_plain_words(argv, capsys, monkeypatch):
    text = _help(argv, capsys, monkeypatch)
    for markup in ("``", ":func:", ":class:", ":meth:", ":mod:"):
        assert markup not in text, f"{markup!r} in gradshare {' '.join(argv)} --help"
    assert all(len(line) <= 80 for line in text.splitlines())


@pytest.mark.parametrize("argv", COMMANDS, ids=["gradshare"] + [c[0] for c in COMMANDS[1:]])
def test_each_default_is_said_once(argv, capsys, monkeypatch):
    entries = _option_entries(_help(argv, capsys, monkeypatch))
    assert entries
    for entry in entries:
        assert entry.lower().count("default") <= 1, entry


def test_lists_print_one_item_a_line(capsys, monkeypatch):
    text = _help(["train"], capsys, monkeypatch, columns=100)
    for item in ("- local (the default)", "- torchrun:", "- spark:"):          # the launchers
        assert any(line.startswith(item) for line in text.splitlines()), item
    for mode in ("shared_gradients:", "averaging:", "diloco:", "sparse_local:"):   # --mode's choices
        assert any(line.strip().startswith(mode) for line in text.splitlines()), mode
    assert "(default: shared_gradients)" in text and "(default: 2)" in text      # argparse's own defaults
    plan = _help(["plan"], capsys, monkeypatch, columns=100)
    assert "\n    gradshare plan --params 25M --workers 2" in plan                      # examples as written
    assert "(default: 0.1)" in plan and "(default: None)" not in plan


def test_former_option_names_are_hidden_but_work(capsys, monkeypatch):
    from gradshare import plan, train

    text = _help(["train"], capsys, monkeypatch)
    assert "--frequency" in text and "--averaging-frequency" not in text and "--threshold" not in text
    assert "--averaging-period" not in _help(["plan"], capsys, monkeypatch)
    assert main(["plan", "--params", "1M", "--step-time", "10", "--averaging-period", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    assert '"modelled_frequency": 3' in out and "--averaging-period is deprecated: use --frequency" in err
    import argparse

    p = argparse.ArgumentParser(prog="gradshare train")
    train.add_arguments(p)
    args = p.parse_args(["--averaging-frequency", "7", "--threshold", "topk"])
    assert args.frequency == 7 and args.compression == "topk"
    assert "--averaging-frequency is deprecated: use --frequency" in capsys.readouterr().err
    q = argparse.ArgumentParser()
    plan.add_arguments(q)
    assert q.parse_args(["--params", "5", "--frequency", "4"]).frequency == 4
